"""The FLUX.2 transformer (DiT), eager PyTorch, bit-identical to diffusers' `Flux2Transformer2DModel`.

Parameter names and shapes are diffusers' own, so a diffusers state dict loads here with strict=True and
ours loads into diffusers. The forward runs the same aten ops, in the same dtypes and tensor layouts, as
diffusers 0.42.1 with its "native" attention backend, so the two agree bit for bit on one device
(`torch.equal`, CPU and CUDA, fp32/bf16/fp16). Anything that looks redundant below (the fp64 RoPE
tables, the permuted SDPA inputs, the fp16 clips) is there because dropping it would change bits.

Every gated residual update goes through `Fusion.add`, every LayerNorm + adaLN modulation through
`Fusion.norm`, and every q/k RMSNorm + RoPE through `Fusion.qk_norm_rope` (models/deferral.py): on a
CUDA GPU, where the guards prove it exact, an update is left pending and the next norm consumes it in
one fused kernel, and the attention prologue writes q and k in one launch each; everywhere else the
same calls run diffusers' eager ops. Blocks' public `forward` always returns materialized tensors, so
hooks and callers never see a pending update; the model's own loop passes pending streams between
blocks.
"""

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from flux2_fused.models.blocks import (
    Rope,
    conditioning,
    double_attention,
    double_block,
    feed_forward,
    has_hooks,
    joint_rope,
    output_norm,
    parallel_attention,
    single_block,
    transformer,
)
from flux2_fused.models.deferral import Fusion, Stream, materialize, stream_dtype
from flux2_fused.models.weights import (
    CONFIG_NAME,
    WeightsError,
    read_config,
    save_folder,
    shard_files,
    stream_into,
)

# Devices without fp64, where diffusers builds its RoPE tables in fp32 instead.
_NO_FP64_DEVICES = frozenset({"mps", "npu", "neuron"})


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


def timestep_sinusoid(t: torch.Tensor, channels: int, max_period: float = 10000.0) -> torch.Tensor:
    """[B] -> [B, channels] fp32 embedding `[cos(t * f), sin(t * f)]`, f = max_period ** (-k / (channels/2)).

    The exponent is formed as a product, then divided, in fp32, the same two steps diffusers takes.
    """
    half = channels // 2
    exponent = -math.log(max_period) * torch.arange(0, half, dtype=torch.float32, device=t.device)
    freqs = torch.exp(exponent / half)
    angles = t[:, None].float() * freqs[None, :]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


class Flux2PosEmbed(nn.Module):
    """RoPE tables from integer position ids, one band of channels per id axis.

    Built in fp64 (diffusers does; fp32 tables would differ in the last bits) and cast to fp32.
    """

    def __init__(self, theta: float, axes_dim: tuple[int, ...]) -> None:
        super().__init__()
        self.theta = float(theta)
        self.axes_dim = axes_dim

    def forward(self, ids: torch.Tensor) -> Rope:
        """ids [S, n_axes] -> (cos, sin), each [S, sum(axes_dim)] fp32, every frequency repeated twice."""
        pos = ids.float()
        freqs_dtype = torch.float32 if ids.device.type in _NO_FP64_DEVICES else torch.float64
        cos_parts, sin_parts = [], []
        for axis, dim in enumerate(self.axes_dim):
            exponents = torch.arange(0, dim, 2, dtype=freqs_dtype, device=ids.device) / dim
            inv_freq = 1.0 / (self.theta**exponents)
            angles = torch.outer(pos[..., axis], inv_freq)
            cos_parts.append(angles.cos().repeat_interleave(2, dim=1).float())
            sin_parts.append(angles.sin().repeat_interleave(2, dim=1).float())
        return torch.cat(cos_parts, dim=-1), torch.cat(sin_parts, dim=-1)


class Flux2TimestepEmbedding(nn.Module):
    """Sinusoid features -> Linear, SiLU, Linear (no biases)."""

    def __init__(self, channels: int, dim: int) -> None:
        super().__init__()
        self.channels = channels
        self.linear_1 = nn.Linear(channels, dim, bias=False)
        self.linear_2 = nn.Linear(dim, dim, bias=False)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """t [B] (already x1000, in the model dtype) -> [B, D]; the fp32 sinusoid is cast to t's dtype."""
        features = timestep_sinusoid(t, self.channels).to(t.dtype)
        return self.linear_2(F.silu(self.linear_1(features)))


class Flux2TimestepGuidanceEmbedding(nn.Module):
    """temb = embed(timestep) [+ embed(guidance) for guidance-distilled models such as dev]."""

    def __init__(self, channels: int, dim: int, guidance_embeds: bool) -> None:
        super().__init__()
        self.timestep_embedder = Flux2TimestepEmbedding(channels, dim)
        self.guidance_embedder = Flux2TimestepEmbedding(channels, dim) if guidance_embeds else None

    def forward(self, timestep: torch.Tensor, guidance: torch.Tensor | None) -> torch.Tensor:
        """A guidance value given to a model without a guidance embedder is ignored, as in diffusers."""
        temb = self.timestep_embedder(timestep)
        if guidance is not None and self.guidance_embedder is not None:
            temb = temb + self.guidance_embedder(guidance)
        return temb


class Flux2Modulation(nn.Module):
    """silu(temb) -> Linear -> [B, 3 * sets * D] adaLN parameters, computed once per forward."""

    def __init__(self, dim: int, sets: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 3 * sets * dim, bias=False)

    def forward(self, temb: torch.Tensor) -> torch.Tensor:
        return self.linear(F.silu(temb))


class Flux2FeedForward(nn.Module):
    """SwiGLU MLP: linear_in D -> 2H, silu(a) * b, linear_out H -> D."""

    def __init__(self, dim: int, hidden: int, *, fusion: Fusion) -> None:
        super().__init__()
        self.linear_in = nn.Linear(dim, 2 * hidden, bias=False)
        self.linear_out = nn.Linear(hidden, dim, bias=False)
        self.fusion = fusion

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return feed_forward(self, self.fusion, x)


class Flux2DoubleAttention(nn.Module):
    """Joint attention of the double-stream block: each stream projects its own q/k/v and output.

    The text rows come first in the joint sequence (and in the RoPE tables).
    """

    def __init__(self, dim: int, heads: int, head_dim: int, eps: float, *, fusion: Fusion) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.fusion = fusion
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.norm_q = nn.RMSNorm(head_dim, eps=eps)
        self.norm_k = nn.RMSNorm(head_dim, eps=eps)
        # A list so the key is diffusers' `to_out.0` (diffusers keeps a parameter-free Dropout at index 1).
        self.to_out = nn.ModuleList([nn.Linear(inner, dim, bias=False)])
        self.norm_added_q = nn.RMSNorm(head_dim, eps=eps)
        self.norm_added_k = nn.RMSNorm(head_dim, eps=eps)
        self.add_q_proj = nn.Linear(dim, inner, bias=False)
        self.add_k_proj = nn.Linear(dim, inner, bias=False)
        self.add_v_proj = nn.Linear(dim, inner, bias=False)
        self.to_add_out = nn.Linear(inner, dim, bias=False)

    def forward(self, x: torch.Tensor, c: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, N, D] image rows, c [B, L, D] text rows -> (image update, text update)."""
        return double_attention(self, self.fusion, x, c, rope)


class Flux2ParallelAttention(nn.Module):
    """Single-stream "parallel" block body: one Linear gives q, k, v and the MLP input; one Linear maps
    the concatenated attention output and MLP activation back to D."""

    def __init__(
        self, dim: int, heads: int, head_dim: int, mlp_hidden: int, eps: float, *, fusion: Fusion
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.fusion = fusion
        # diffusers' attribute names: the shared block code splits the projection with them.
        self.inner_dim = heads * head_dim
        self.mlp_hidden_dim = mlp_hidden
        self.mlp_mult_factor = 2
        self.to_qkv_mlp_proj = nn.Linear(dim, 3 * self.inner_dim + 2 * mlp_hidden, bias=False)
        self.norm_q = nn.RMSNorm(head_dim, eps=eps)
        self.norm_k = nn.RMSNorm(head_dim, eps=eps)
        self.to_out = nn.Linear(heads * head_dim + mlp_hidden, dim, bias=False)

    def forward(self, h: torch.Tensor, rope: Rope) -> torch.Tensor:
        """h [B, S, D] (normalised, modulated) -> the block's update [B, S, D]."""
        return parallel_attention(self, self.fusion, h, rope)


class Flux2DoubleBlock(nn.Module):
    """Double-stream block: image stream x and text stream c, each with its own weights and modulation,
    meeting only inside the joint attention.

    The norm modules hold no parameters; they are kept so module paths (and their eps) match diffusers,
    while the computation goes through the model's `Fusion`, handed in as `fusion`.
    """

    def __init__(
        self, dim: int, heads: int, head_dim: int, mlp_hidden: int, eps: float, *, fusion: Fusion
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.norm1_context = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.attn = Flux2DoubleAttention(dim, heads, head_dim, eps, fusion=fusion)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.ff = Flux2FeedForward(dim, mlp_hidden, fusion=fusion)
        self.norm2_context = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.ff_context = Flux2FeedForward(dim, mlp_hidden, fusion=fusion)
        self.fusion = fusion

    def forward(
        self, x: torch.Tensor, c: torch.Tensor, mod_img: torch.Tensor, mod_txt: torch.Tensor, rope: Rope
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x [B, N, D], c [B, L, D], mod_img [B, 6D], mod_txt [B, 6D], rope) -> (x, c), materialized."""
        x_out, c_out = self.forward_streams(x, c, mod_img, mod_txt, rope)
        return materialize(x_out), materialize(c_out)

    def forward_streams(
        self, x: Stream, c: Stream, mod_img: torch.Tensor, mod_txt: torch.Tensor, rope: Rope
    ) -> tuple[Stream, Stream]:
        """The block on possibly-pending streams; returns the FFN updates of both streams pending.

        Stream by stream in diffusers' order: image attention residual, norm2, FFN residual; then the
        same for text, whose result is clipped in fp16.
        """
        return double_block(self, self.fusion, x, c, mod_img, mod_txt, rope, attend=_attend, mlp=_mlp)


class Flux2SingleBlock(nn.Module):
    """Single-stream block over the joint [text; image] sequence; fp16 results are clipped."""

    def __init__(
        self, dim: int, heads: int, head_dim: int, mlp_hidden: int, eps: float, *, fusion: Fusion
    ) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.attn = Flux2ParallelAttention(dim, heads, head_dim, mlp_hidden, eps, fusion=fusion)
        self.fusion = fusion

    def forward(self, h: torch.Tensor, mod: torch.Tensor, rope: Rope) -> torch.Tensor:
        """(h [B, L + N, D], mod [B, 3D], rope) -> h, materialized."""
        return materialize(self.forward_streams(h, mod, rope))

    def forward_streams(self, h: Stream, mod: torch.Tensor, rope: Rope) -> Stream:
        """The block on a possibly-pending stream; returns its parallel attention+MLP update pending."""
        return single_block(self, self.fusion, h, mod, rope, attend=_attend)


class Flux2OutputNorm(nn.Module):
    """diffusers' AdaLayerNormContinuous as FLUX.2 uses it: its own Linear on silu(temb) gives
    (scale, shift) - scale FIRST, unlike the blocks' (shift, scale, gate) - around an affine-free
    LayerNorm."""

    def __init__(self, dim: int, eps: float, *, fusion: Fusion) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim, bias=False)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.fusion = fusion

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        return self.forward_streams(x, temb)

    def forward_streams(self, x: Stream, temb: torch.Tensor) -> torch.Tensor:
        """The output norm of a possibly-pending stream that nothing reads afterwards."""
        return output_norm(self, self.fusion, x, temb, stream_dtype(x))


def _attend(attn: nn.Module, fusion: Fusion, *args: Any) -> Any:
    """The attention of one of our blocks through its module call, so hooks on it see it run."""
    return attn(*args)


def _mlp(ff: nn.Module, fusion: Fusion, x: torch.Tensor) -> torch.Tensor:
    return ff(x)


def _run_double(
    index: int, block: nn.Module, fusion: Fusion, x: Stream, c: Stream, *args: Any
) -> tuple[Stream, Stream]:
    return _call(block, (x, c), *args)


def _run_single(index: int, block: nn.Module, fusion: Fusion, h: Stream, *args: Any) -> Stream:
    return _call(block, (h,), *args)


def _run_output(norm_out: nn.Module, fusion: Fusion, rows: Stream, temb: torch.Tensor) -> torch.Tensor:
    return _call(norm_out, (rows,), temb)


def _call(module: nn.Module, streams: tuple[Stream, ...], *args: Any) -> Any:
    """`module.forward_streams(*streams, *args)`; where hooks are attached, the module's public call
    on the streams materialized instead, so hooks see real tensors and may replace them."""
    if has_hooks(module):
        return module(*(materialize(s) for s in streams), *args)
    return module.forward_streams(*streams, *args)


class Flux2Transformer(nn.Module):
    """The FLUX.2 DiT with diffusers' parameter names and diffusers' eager numerics.

    Construct with a `Flux2Config`, then get weights from `from_pretrained` (a diffusers folder),
    `random` (on-device random init) or `load_state_dict` (a diffusers state dict, strict).
    """

    def __init__(self, config: Flux2Config, fused: bool = True) -> None:
        super().__init__()
        self.config = config
        dim, heads, head_dim = config.inner_dim, config.num_attention_heads, config.attention_head_dim
        # One switch for every site: the blocks share the model's Fusion.
        self.fusion = Fusion(fused=fused)
        block_args = (dim, heads, head_dim, config.mlp_hidden_dim, config.eps)
        self.pos_embed = Flux2PosEmbed(config.rope_theta, config.axes_dims_rope)
        self.time_guidance_embed = Flux2TimestepGuidanceEmbedding(
            config.timestep_guidance_channels, dim, config.guidance_embeds
        )
        self.double_stream_modulation_img = Flux2Modulation(dim, sets=2)
        self.double_stream_modulation_txt = Flux2Modulation(dim, sets=2)
        self.single_stream_modulation = Flux2Modulation(dim, sets=1)
        self.x_embedder = nn.Linear(config.in_channels, dim, bias=False)
        self.context_embedder = nn.Linear(config.joint_attention_dim, dim, bias=False)
        self.transformer_blocks = nn.ModuleList(
            [Flux2DoubleBlock(*block_args, fusion=self.fusion) for _ in range(config.num_layers)]
        )
        self.single_transformer_blocks = nn.ModuleList(
            [Flux2SingleBlock(*block_args, fusion=self.fusion) for _ in range(config.num_single_layers)]
        )
        self.norm_out = Flux2OutputNorm(dim, config.eps, fusion=self.fusion)
        self.proj_out = nn.Linear(dim, config.patch_size**2 * config.out_channels, bias=False)

    @property
    def fused(self) -> bool:
        """Whether the fused CUDA path may run (it still declines wherever it is not proven exact).

        On by default; `Flux2Transformer(config, fused=False)`, `model.fused = False` or the environment
        variable FLUX2_FUSED_DISABLE=1 turn it off. Outputs are bit-identical either way.
        """
        return self.fusion.fused

    @fused.setter
    def fused(self, value: bool) -> None:
        self.fusion.fused = bool(value)

    def rope(self, img_ids: torch.Tensor, txt_ids: torch.Tensor, device: torch.device) -> Rope:
        """Joint RoPE tables, text rows first, built where the ids live and then moved to `device`.

        Batched ids [B, S, n_axes] use the first batch element's ids, as diffusers does.
        """
        return joint_rope(self.pos_embed, img_ids, txt_ids, device)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        img_ids: torch.Tensor,
        txt_ids: torch.Tensor,
        guidance: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Denoiser output [B, N, patch_size**2 * out_channels] for image tokens [B, N, in_channels].

        encoder_hidden_states [B, L, joint_attention_dim]; timestep [B] in [0, 1] and guidance [B]
        (both cast to the input dtype, then x1000); img_ids [N, n_axes] or [B, N, n_axes], txt_ids alike.
        """
        cond = conditioning(self, hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids, guidance)
        return transformer(
            self,
            self.fusion,
            cond,
            run_double=_run_double,
            run_single=_run_single,
            run_output=_run_output,
            leading_rows=encoder_hidden_states.shape[1],
        )

    @classmethod
    def _on_meta(cls, config: Flux2Config, fused: bool) -> "Flux2Transformer":
        """The module without storage, so loading or initialising never holds a throw-away copy."""
        with torch.device("meta"):
            return cls(config, fused=fused)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        fused: bool = True,
    ) -> "Flux2Transformer":
        """Load a local diffusers-format folder, streaming shard by shard onto `device`.

        `dtype=None` keeps the stored dtype. Raises `WeightsError` naming the file and keys at fault.
        """
        folder = Path(path)
        raw = read_config(folder)
        try:
            config = Flux2Config.from_diffusers(raw)
        except (TypeError, ValueError) as err:
            raise WeightsError(f"{folder / CONFIG_NAME}: {err}") from err
        files = shard_files(folder)
        model = cls._on_meta(config, fused)
        stream_into(model, files, device=device, dtype=dtype)
        return model

    @classmethod
    @torch.no_grad()
    def random(
        cls,
        config: Flux2Config,
        seed: int = 0,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        fused: bool = True,
    ) -> "Flux2Transformer":
        """Random weights made directly on `device` (no host copy), reproducible from `seed`.

        Every Linear weight is N(0, 1/fan_in), so each Linear roughly preserves the variance of its
        input; RMSNorm weights are 1. Every block update is computed from a LayerNorm'd stream, so its
        size does not grow with the stream, and the gates (a Linear of silu(temb)) have std 0.2-0.3:
        the residual streams grow only like the square root of the block count, so even dev's 56
        blocks stay far inside fp16's range and the output's std stays near 1.
        """
        model = cls._on_meta(config, fused).to(dtype=dtype).to_empty(device=device)
        generator = torch.Generator(device=device).manual_seed(seed)
        for param in model.parameters():
            if param.ndim == 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, param.shape[1] ** -0.5, generator=generator)
        return model

    def save_pretrained(self, path: str | Path, max_shard_bytes: int | None = None) -> None:
        """Write a diffusers-format folder (diffusers' `from_pretrained` reads it too).

        With `max_shard_bytes`, weights go to numbered shards plus an index.
        """
        config = {"_class_name": "Flux2Transformer2DModel", **self.config.to_diffusers()}
        save_folder(self.state_dict(), config, Path(path), max_shard_bytes)
