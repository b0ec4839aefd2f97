"""The FLUX.2 transformer (DiT), eager PyTorch, bit-identical to diffusers' `Flux2Transformer2DModel`.

Parameter names and shapes are diffusers' own, so a diffusers state dict loads here with strict=True and
ours loads into diffusers; the blocks take diffusers' keyword arguments and return what diffusers'
return, so a caller or a hook written for diffusers' blocks works here too. The forward runs the same
aten ops, in the same dtypes and tensor layouts, as diffusers 0.42.1 with its "native" attention
backend, so the two agree bit for bit on one device (`torch.equal`, CPU and CUDA, fp32/bf16/fp16).
Anything that looks redundant below (the fp64 RoPE tables, the permuted SDPA inputs, the fp16 clips)
is there because dropping it would change bits.

The computation is the family's block code (`blocks.py`), which this model runs as its own host
(`HOST`, plain PyTorch modules): on a CUDA GPU each fusable site goes to its fused op where the guards
prove it exact (a residual update left pending and consumed by the next norm in one kernel, the
attention prologue in one launch a block), everywhere else the same calls run diffusers' eager ops.
Blocks' public `forward` always returns materialized tensors, so hooks and callers never see a
pending update; the model's own loop passes pending streams between plain blocks.
"""

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ...host import ModuleHost, sdpa
from ..common import Options, Rope, mlp, output_norm_body
from ..deferral import Fusion
from ..weights import CONFIG_NAME, WeightsError, read_config, save_folder, shard_files, stream_into
from .blocks import (
    conditioning,
    double_attention,
    double_block_call,
    parallel_attention,
    single_block_call,
    transformer,
)
from .config import Flux2Config

# Devices without fp64, where diffusers builds its RoPE tables in fp32 instead.
_NO_FP64_DEVICES = frozenset({"mps", "npu", "neuron"})


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
        return mlp(self, HOST, self.fusion, x)


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

    def forward(
        self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, image_rotary_emb: Rope
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """image rows [B, N, D], text rows [B, L, D] -> (image update, text update)."""
        return double_attention(
            self, HOST, self.fusion, hidden_states, encoder_hidden_states, image_rotary_emb, sdpa
        )


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

    def forward(self, hidden_states: torch.Tensor, image_rotary_emb: Rope) -> torch.Tensor:
        """[B, S, D] (normalised, modulated) -> the block's update [B, S, D]."""
        return parallel_attention(self, HOST, self.fusion, hidden_states, image_rotary_emb, sdpa)


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
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb_mod_img: torch.Tensor,
        temb_mod_txt: torch.Tensor,
        image_rotary_emb: Rope,
        joint_attention_kwargs: Options = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(image [B, N, D], text [B, L, D], modulations [B, 6D] each, rope) -> (text, image), as
        diffusers' block returns them, materialized."""
        return double_block_call(
            self,
            HOST,
            self.fusion,
            hidden_states,
            encoder_hidden_states,
            temb_mod_img,
            temb_mod_txt,
            image_rotary_emb,
            joint_attention_kwargs,
        )


class Flux2SingleBlock(nn.Module):
    """Single-stream block over the joint [text; image] sequence; fp16 results are clipped."""

    def __init__(
        self, dim: int, heads: int, head_dim: int, mlp_hidden: int, eps: float, *, fusion: Fusion
    ) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.attn = Flux2ParallelAttention(dim, heads, head_dim, mlp_hidden, eps, fusion=fusion)
        self.fusion = fusion

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
        temb_mod: torch.Tensor,
        image_rotary_emb: Rope,
        joint_attention_kwargs: Options = None,
        split_hidden_states: bool = False,
        text_seq_len: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """(joint rows [B, L + N, D], None, modulation [B, 3D], rope) -> joint rows, materialized;
        diffusers' arguments mean what they mean there (text rows given apart, a split output)."""
        return single_block_call(
            self,
            HOST,
            self.fusion,
            hidden_states,
            encoder_hidden_states,
            temb_mod,
            image_rotary_emb,
            joint_attention_kwargs,
            split_hidden_states,
            text_seq_len,
        )


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
        return output_norm_body(self, HOST, self.fusion, x, temb)


# The model's own host: its modules are plain where they are of these classes and nothing hooks them.
HOST = ModuleHost(
    frozenset(
        {
            Flux2FeedForward,
            Flux2DoubleAttention,
            Flux2ParallelAttention,
            Flux2DoubleBlock,
            Flux2SingleBlock,
            Flux2OutputNorm,
            nn.LayerNorm,
            nn.RMSNorm,
        }
    )
)


PIPELINE_INDEX = "model_index.json"  # marks a diffusers pipeline folder, one subfolder a component
TRANSFORMER_CLASS = "Flux2Transformer2DModel"  # config.json's _class_name in a FLUX.2 transformer folder


def folder_config(folder: Path) -> Flux2Config:
    """The architecture a diffusers-format FLUX.2 transformer folder declares, read before anything
    heavy so a bad folder fails first (WeightsError naming the file and, for the usual mix-ups, the
    folder to pass instead); the weights files are only checked to be there."""
    if (folder / PIPELINE_INDEX).is_file() and (folder / "transformer").is_dir():
        raise WeightsError(f"{folder} is a pipeline folder; pass {folder / 'transformer'}")
    raw = read_config(folder)
    declared = raw.get("_class_name", TRANSFORMER_CLASS)
    if declared != TRANSFORMER_CLASS:
        raise WeightsError(
            f"{folder / CONFIG_NAME} describes {declared}, not a FLUX.2 transformer ({TRANSFORMER_CLASS})"
        )
    try:
        config = Flux2Config.from_diffusers(raw)
    except (TypeError, ValueError) as err:
        raise WeightsError(f"{folder / CONFIG_NAME}: {err}") from err
    shard_files(folder)  # only checks that the weights files are there
    return config


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
        cond = conditioning(
            self, HOST, hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids, guidance
        )
        return transformer(self, HOST, self.fusion, cond, leading_rows=encoder_hidden_states.shape[1])

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
        config = folder_config(folder)
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
