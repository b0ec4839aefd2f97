"""FLUX.2's architecture as data: diffusers' `Flux2Transformer2DModel` arguments, the published sizes,
and the position ids FLUX.2 pipelines feed the model."""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch


@dataclasses.dataclass(frozen=True)
class Flux2Config:
    """Architecture hyper-parameters; field names are diffusers' `Flux2Transformer2DModel` arguments.

    Defaults are diffusers' defaults (the dev model), so a `config.json` that omits a key means what it
    means to diffusers.
    """

    patch_size: int = 1
    in_channels: int = 128
    out_channels: int | None = None
    num_layers: int = 8
    num_single_layers: int = 48
    attention_head_dim: int = 128
    num_attention_heads: int = 48
    joint_attention_dim: int = 15360
    timestep_guidance_channels: int = 256
    mlp_ratio: float = 3.0
    axes_dims_rope: tuple[int, ...] = (32, 32, 32, 32)
    rope_theta: float = 2000
    eps: float = 1e-6
    guidance_embeds: bool = True

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "dev": {},
        "klein-4b": {
            "num_layers": 5,
            "num_single_layers": 20,
            "num_attention_heads": 24,
            "joint_attention_dim": 7680,
            "guidance_embeds": False,
        },
        "klein-9b": {
            "num_layers": 8,
            "num_single_layers": 24,
            "num_attention_heads": 32,
            "joint_attention_dim": 12288,
            "guidance_embeds": False,
        },
        # For CPU tests: every structural feature of the real models (several blocks of each kind,
        # 4 RoPE axes, guidance), at a size that runs in milliseconds.
        "tiny": {
            "in_channels": 32,
            "num_layers": 2,
            "num_single_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 4,
            "joint_attention_dim": 48,
            "timestep_guidance_channels": 32,
            "axes_dims_rope": (4, 4, 4, 4),
        },
    }

    def __post_init__(self) -> None:
        """Reject configurations that would only fail (or silently misbehave) deep inside the forward."""
        object.__setattr__(self, "axes_dims_rope", tuple(self.axes_dims_rope))
        if self.out_channels is None:
            object.__setattr__(self, "out_channels", self.in_channels)
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "guidance_embeds":
                ok = isinstance(value, bool)
            elif field.name in ("mlp_ratio", "rope_theta", "eps"):
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
            elif field.name == "axes_dims_rope":
                ok = bool(value) and all(isinstance(a, int) and a > 0 and a % 2 == 0 for a in value)
            else:
                ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
            if not ok:
                raise ValueError(f"invalid {field.name}: {value!r}")
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError(
                f"axes_dims_rope {list(self.axes_dims_rope)} must sum to attention_head_dim "
                f"{self.attention_head_dim} (RoPE rotates every channel of a head)"
            )

    @property
    def inner_dim(self) -> int:
        """D, the width of both residual streams."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mlp_hidden_dim(self) -> int:
        """H, the SwiGLU hidden width (diffusers truncates D * mlp_ratio the same way)."""
        return int(self.inner_dim * self.mlp_ratio)

    @classmethod
    def preset(cls, name: str) -> "Flux2Config":
        """A named configuration: dev, klein-4b, klein-9b (the published FLUX.2 sizes), or tiny (tests)."""
        if name not in cls.PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(cls.PRESETS)}")
        return cls(**cls.PRESETS[name])

    @classmethod
    def from_diffusers(cls, config: Mapping[str, Any]) -> "Flux2Config":
        """From a diffusers `config.json` dict; its bookkeeping keys (`_class_name`, ...) are ignored."""
        names = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(key for key in config if key not in names and not key.startswith("_"))
        if unknown:
            raise ValueError(f"unknown config keys {unknown}")
        return cls(**{key: value for key, value in config.items() if key in names})

    def to_diffusers(self) -> dict[str, Any]:
        """The keyword arguments of diffusers' `Flux2Transformer2DModel` (JSON-serialisable)."""
        config = dataclasses.asdict(self)
        config["axes_dims_rope"] = list(self.axes_dims_rope)
        return config


def image_ids(tokens: int, width: int | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """FLUX.2 pipeline position ids (0, row, col, 0) of `tokens` latent tokens laid out row by row,
    `width` tokens a row (default: the smallest square grid that holds them)."""
    width = width or math.isqrt(max(tokens - 1, 0)) + 1
    index = torch.arange(tokens, device=device)
    zeros = torch.zeros_like(index)
    return torch.stack([zeros, index // width, index % width, zeros], dim=-1)


def text_ids(tokens: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """FLUX.2 pipeline position ids (0, 0, 0, i) of text token i."""
    index = torch.arange(tokens, device=device)
    zeros = torch.zeros_like(index)
    return torch.stack([zeros, zeros, zeros, index], dim=-1)
