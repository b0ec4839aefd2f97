"""sglang's own FLUX.2 klein pipeline (its text encoder, scheduler, DiT and VAE, built from a
diffusers-format folder as its workers build it) generating one image on the CPU with the installed
plugin, against the same pipeline with the plugin left out: every DiT call runs the block code and the
images are equal bit for bit. Each run is a subprocess: sglang's plugins patch its class for the whole
process. (sglang's pipeline and diffusers' differ outside the DiT: see docs/sglang.md.)"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed", allow_module_level=True)

from .checkpoint import make_checkpoint

STEPS = 3
# One generation; prints what the plugin did and saves the image.
GENERATE = textwrap.dedent(
    f"""
    import sys, torch
    from pathlib import Path
    from flux2_fused.bench import sglang as harness
    from flux2_fused.models.flux2 import sglang as binding

    calls = []
    forward = binding.forward
    def counted(*args, **kwargs):
        out = forward(*args, **kwargs)
        calls.append(out is not None)  # None: the call ran sglang's own forward
        return out
    binding.forward = counted
    pipeline, server_args = harness.sglang_pipeline(Path(sys.argv[1]), torch.device("cpu"))
    image = harness.generate(pipeline, server_args, "a photo of a cat", (128, 128), {STEPS}, 1.0, seed=0)
    from sglang.multimodal_gen.runtime.platforms.plugins import HookRegistry
    from flux2_fused.integrations.sglang.patch import TRANSFORMER
    torch.save(image, sys.argv[2])
    print("PATCHED", TRANSFORMER + ".forward" in HookRegistry._patched, "FUSED", sum(calls), "OF", len(calls))
    harness.release_runtime()
    """
)


def _generate(folder: Path, image: Path, plugins: str | None) -> str:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU, where sglang's own DiT is diffusers' too
    if plugins is not None:
        env["SGLANG_PLUGINS"] = plugins  # sglang's allow list of plugin names
    done = subprocess.run(
        [sys.executable, "-c", GENERATE, str(folder), str(image)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.strip().splitlines()[-1]


def test_sglangs_pipeline_with_the_plugin_fuses_every_dit_call_and_keeps_its_image(tmp_path: Path) -> None:
    folder = make_checkpoint(tmp_path)
    with_plugin, without = tmp_path / "with.pt", tmp_path / "without.pt"
    assert _generate(folder, with_plugin, None) == f"PATCHED True FUSED {STEPS} OF {STEPS}"
    assert _generate(folder, without, "another-plugin") == "PATCHED False FUSED 0 OF 0"
    image = torch.load(with_plugin)
    assert image.shape == (1, 3, 128, 128) and torch.isfinite(image).all()
    assert torch.equal(image, torch.load(without))
