"""CPU tests of the deferral plumbing: pending updates, materialization points, hooks, fallbacks.

On the CPU the real guards decline, so these tests stand in for the CUDA kernel with `fake_launch`,
the eager chain over the same row segments. The model must then (a) send every site through the
fused entry point and (b) still equal diffusers / its own eager path bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from flux2_fused.models.deferral import Fusion, PendingConcat, PendingGatedResidual, materialize
from flux2_fused.models.flux2 import HOST, Flux2Config, Flux2Transformer, blocks
from flux2_fused.ops import gated_resnorm

from .flux2.test_model import TINY, image_ids, text_ids


def make_inputs(config: Flux2Config, batch: int, img_tokens: int, txt_tokens: int) -> dict:
    """Fresh random inputs (fp32, with guidance) for `img_tokens` image and `txt_tokens` text tokens."""
    return {
        "hidden_states": torch.randn(batch, img_tokens, config.in_channels),
        "encoder_hidden_states": torch.randn(batch, txt_tokens, config.joint_attention_dim),
        "timestep": torch.rand(batch),
        "img_ids": image_ids(img_tokens),
        "txt_ids": text_ids(txt_tokens),
        "guidance": torch.rand(batch) * 4 + 1,
    }


_modnorm = gated_resnorm.modnorm_reference  # the unpatched eager norm, for the fake kernel


def fake_launch(segments, scale, shift, eps, *, write_residual, addcmul=False, words=None):
    """The kernel's contract, computed eagerly: rows of each segment, gated, concatenated, normed
    (FLUX.2's rows: one modulation row a batch, so no uniform_rows words to honour)."""
    parts = [s.residual if s.update is None else s.residual + s.gate * s.update for s in segments]
    residual = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0].contiguous()
    return _modnorm(residual, scale, shift, eps, addcmul), residual if write_residual else None


@pytest.fixture
def fused_cpu(monkeypatch):
    """Guards accept everything and the 'kernel' is fake_launch; counts launches and eager norms."""
    calls = {"launch": 0, "eager_norm": 0, "segments": []}

    def launch(segments, *args, **kwargs):
        calls["launch"] += 1
        calls["segments"].append(len(segments))
        return fake_launch(segments, *args, **kwargs)

    def counted_norm(*args, **kwargs):
        calls["eager_norm"] += 1
        return _modnorm(*args, **kwargs)

    for name in ("gated", "defer", "plain"):
        monkeypatch.setattr(gated_resnorm.guards, name, lambda *a: True)
    monkeypatch.setattr(gated_resnorm, "launch", launch)
    monkeypatch.setattr(gated_resnorm.reference, "modnorm", counted_norm)
    monkeypatch.setattr(gated_resnorm, "modnorm_reference", counted_norm)
    return calls


def _model(config: Flux2Config, fused: bool = True) -> Flux2Transformer:
    return Flux2Transformer.random(config, seed=3, fused=fused)


@pytest.mark.parametrize("batch", [1, 2])
def test_every_site_fused_and_output_unchanged(fused_cpu, batch):
    model = _model(TINY)
    inputs = make_inputs(TINY, batch=batch, img_tokens=37, txt_tokens=11)
    with torch.no_grad():
        fused = model(**inputs)
        model.fused = False
        eager = model(**inputs)
    assert torch.equal(fused, eager)
    # 4 norms a double block, 1 a single block, 1 output norm; the concat boundary is one 2-segment launch.
    expected = 4 * TINY.num_layers + TINY.num_single_layers + 1
    assert fused_cpu["launch"] == expected
    assert fused_cpu["segments"].count(2) == 1
    assert fused_cpu["eager_norm"] == expected  # all of them from the eager run, none from the fused one


def test_declined_guards_run_eager(fused_cpu, monkeypatch):
    monkeypatch.setattr(gated_resnorm.guards, "gated", lambda *a: False)
    model = _model(TINY)
    inputs = make_inputs(TINY, batch=2, img_tokens=9, txt_tokens=5)
    with torch.no_grad():
        fused = model(**inputs)
        model.fused = False
        eager = model(**inputs)
    assert torch.equal(fused, eager)
    # Pending updates were materialized, then the no-residual variant ran (first norms fuse too).
    assert fused_cpu["launch"] > 0


def test_hooks_see_real_tensors(fused_cpu):
    model = _model(TINY)
    seen = []

    def hook(module, args, output):
        seen.append((type(module).__name__, all(isinstance(t, torch.Tensor) for t in (*args[:2], *output))))

    model.transformer_blocks[1].register_forward_hook(hook)
    model.single_transformer_blocks[0].register_forward_hook(
        lambda m, a, o: seen.append(("single", isinstance(o, torch.Tensor)))
    )
    inputs = make_inputs(TINY, batch=1, img_tokens=16, txt_tokens=4)
    with torch.no_grad():
        hooked = model(**inputs)
        model.fused = False
        eager = model(**inputs)
    assert torch.equal(hooked, eager)
    assert ("Flux2DoubleBlock", True) in seen and ("single", True) in seen


def test_block_public_forward_returns_tensors(fused_cpu):
    model = _model(TINY)
    block = model.transformer_blocks[0]
    x, c = torch.randn(1, 8, TINY.inner_dim), torch.randn(1, 3, TINY.inner_dim)
    mod = torch.randn(1, 6 * TINY.inner_dim)
    rope = blocks.joint_rope(model.pos_embed, HOST, torch.zeros(8, 4), torch.zeros(3, 4), x.device)
    c_out, x_out = block(x, c, mod, mod, rope)  # diffusers' order: text, then image
    assert isinstance(x_out, torch.Tensor) and isinstance(c_out, torch.Tensor)
    x_p, c_p = blocks.double_block_body(block, HOST, model.fusion, x, c, mod, mod, rope)
    assert isinstance(x_p, PendingGatedResidual)
    assert torch.equal(materialize(x_p), x_out) and torch.equal(materialize(c_p), c_out)


def test_fp16_clip_sites_are_materialized(fused_cpu):
    fusion = Fusion()
    x = torch.full((1, 4, 8), 60000.0, dtype=torch.float16)
    gate = torch.ones(1, 1, 8, dtype=torch.float16)
    update = torch.full((1, 4, 8), 60000.0, dtype=torch.float16)
    clipped = fusion.add(x, update, gate, clip_fp16=True)
    assert isinstance(clipped, torch.Tensor) and clipped.max().item() == 65504.0
    assert isinstance(fusion.add(x, update, gate), PendingGatedResidual)


def test_disabled_fusion_never_defers(fused_cpu):
    fusion = Fusion(fused=False)
    x, gate, update = torch.randn(1, 4, 8), torch.randn(1, 1, 8), torch.randn(1, 4, 8)
    assert isinstance(fusion.add(x, update, gate), torch.Tensor)
    fusion.norm(x, gate, gate, 1e-6)
    assert fused_cpu["launch"] == 0


def test_pending_concat_and_rows_materialize_like_eager():
    a = PendingGatedResidual(torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.randn(2, 1, 8))
    b = PendingGatedResidual(torch.randn(2, 5, 8), torch.randn(2, 5, 8), torch.randn(2, 1, 8))
    joint = PendingConcat(a, b)
    expected = torch.cat([a.residual + a.gate * a.update, b.residual + b.gate * b.update], dim=1)
    assert torch.equal(materialize(joint), expected)
    assert torch.equal(materialize(b.rows(2)), expected[:, 5:])


def test_real_guards_decline_on_cpu():
    """Without monkeypatching, nothing is deferred on the CPU: the model is plain eager."""
    fusion = Fusion()
    x, gate, update = torch.randn(1, 4, 8), torch.randn(1, 1, 8), torch.randn(1, 4, 8)
    assert isinstance(fusion.add(x, update, gate), torch.Tensor)
    assert gated_resnorm.defer_decline_reason(x, update, gate) is not None


def test_a_tensor_parallel_update_reaches_the_fused_sites_waited(fused_cpu, monkeypatch):
    """A row-wise tensor-parallel projection returns its all-reduced output as an
    AsyncCollectiveTensor (no memory of its own until waited): the deferral holds the waited tensor,
    so a kernel never reads the wrapper, and the stream equals eager's."""
    seen = []
    monkeypatch.setattr(
        gated_resnorm.guards, "defer", lambda x, update, gate: seen.append(type(update)) or True
    )
    x, gate, update = torch.randn(1, 4, 8), torch.randn(1, 1, 8), torch.randn(1, 4, 8)
    pending = Fusion().add(x, AsyncCollectiveTensor(update.clone()), gate)
    assert seen == [torch.Tensor] and type(pending.update) is torch.Tensor
    assert torch.equal(materialize(pending), x + gate * update)
