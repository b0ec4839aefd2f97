"""sglang's FLUX.2 DiT next to diffusers' with the same weights, in one process: the bit check and the
step times of sglang's own forward, sglang with `enable()`, diffusers eager and diffusers + `enable()`.

    python -m flux2_fused.bench.sglang [--configs klein-4b dev] [--pairs N] [--json FILE]

sglang's DiT needs its runtime around it even outside its server: a one-rank distributed group, the
global server arguments (attention backend torch_sdpa, so its attention is diffusers' native SDPA),
and a forward context around each call (`prepare_runtime`, `call`). Where this environment lacks a
package sglang imports on this path but never calls into here (torchvision without a build matching
torch; sgl-kernel, whose wheels pin another torch), `prepare_runtime` puts a stub in its place that
raises if anything of it is used, until `release_runtime` takes the stubs away. sglang's pipeline
passes the timestep already x1000 and the RoPE tables of the joint text-then-image ids;
`sglang_inputs` does the same from diffusers' arguments, with the scaled timestep computed as
diffusers' forward computes it (so both models see the same values).
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import os
import socket
import statistics
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..models.flux2 import Flux2Config
from ..ops.bits import bits_equal
from . import hosts
from .timing import pipelined_ms, rotated_order

SERVER_ARGS = {
    "attention_backend": "torch_sdpa",
    "comfyui_mode": False,
    "kv_gather_degree": 1,
    "sp_split_auto": False,
    "enable_torch_compile": False,
    "enable_breakable_cuda_graph": False,
    "attention_backend_config": None,
    "enable_layerwise_nvtx_marker": False,
    "disable_autocast": False,
    "enable_cfg_parallel": False,
    "component_precisions": {},
    "model_loaded": {"transformer": True},
    "model_paths": {},
}
# The rendezvous variables prepare_runtime set, with the values they had before (None: unset).
_SAVED_ENVIRONMENT: dict[str, str | None] = {}
PATHS = ("sglang", "sglang + enable()", "diffusers", "diffusers + enable()")


class _Stubbed:
    """Whatever a stubbed package's module is asked for: usable in import-time definitions
    (attributes, base classes), raising if called."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stubbed(f"{self._name}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ImportError(f"{self._name}: a stub of a package this environment lacks was called")

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of a stubbed package and any of its submodules give stub modules."""

    def __init__(self, package: str) -> None:
        self.package = package

    def covers(self, name: str) -> bool:
        """`name` is the stubbed package or one of its submodules."""
        return name == self.package or name.startswith(f"{self.package}.")

    def find_spec(
        self, name: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not self.covers(name):
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _Stubbed(spec.name).__getattr__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


# The stub finders `_stub` put on sys.meta_path, for `release_runtime` to take away.
_STUB_FINDERS: list[_StubFinder] = []


def _stub(package: str) -> None:
    finder = _StubFinder(package)
    for name in [name for name in sys.modules if finder.covers(name)]:
        del sys.modules[name]  # a half-imported real package
    sys.meta_path.insert(0, finder)
    _STUB_FINDERS.append(finder)


def _remove_stubs() -> None:
    """Take every stub finder off sys.meta_path and the stub modules it made out of sys.modules, so
    a later import of those names reaches the real package again (or fails, as it did before)."""
    for finder in _STUB_FINDERS:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
        for name in [name for name in sys.modules if finder.covers(name)]:
            spec = getattr(sys.modules[name], "__spec__", None)
            if spec is not None and spec.loader is finder:
                del sys.modules[name]
    _STUB_FINDERS.clear()


def _importable(package: str) -> bool:
    try:
        __import__(package)
    except Exception:
        return False
    return True


def _stub_missing(device: torch.device, packages: Sequence[str] = ()) -> None:
    """Stubs for what sglang imports on this path but this environment cannot import (see the module
    docstring): torchvision, sgl-kernel on CUDA, and `packages`."""
    import transformers.utils

    transformers.utils.is_torchvision_available()  # decided (and cached) before any stub exists
    wanted = ("torchvision", *(("sgl_kernel",) if device.type == "cuda" else ()), *packages)
    for package in wanted:
        if not _importable(package):
            _stub(package)


def _one_rank_group() -> None:
    """sglang's distributed state for one process: a one-rank group (gloo on the CPU, NCCL on CUDA)
    on a free port, with the torchrun-style variables it reads, saved for `release_runtime`."""
    from sglang.multimodal_gen.runtime.distributed import parallel_state

    if not torch.distributed.is_initialized():
        with socket.socket() as probe:  # a free port: another process (a test's child) may hold one
            probe.bind(("127.0.0.1", 0))
            port = str(probe.getsockname()[1])
        rendezvous = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
        for key, value in {**rendezvous, "MASTER_PORT": port}.items():
            _SAVED_ENVIRONMENT.setdefault(key, os.environ.get(key))
            os.environ[key] = value
    parallel_state.maybe_init_distributed_environment_and_model_parallel(tp_size=1, sp_size=1)


def prepare_runtime(device: torch.device) -> None:
    """sglang's runtime for one process on `device` (idempotent): stubs for missing packages, the
    one-rank group, the server arguments its DiT reads."""
    _stub_missing(device)
    from sglang.multimodal_gen.runtime.server_args import set_global_server_args

    _one_rank_group()
    set_global_server_args(argparse.Namespace(**SERVER_ARGS))


def sglang_pipeline(model_path: Path, device: torch.device, precision: str = "fp32") -> tuple[Any, Any]:
    """sglang's own pipeline for a diffusers-format folder, built in this process the way one of its
    GPU workers builds it: the platform, the diffusion plugins (ours among them, unless
    SGLANG_PLUGINS leaves it out) and their hooks, the server arguments (attention torch_sdpa, the
    models in `precision`), the one-rank group, `build_pipeline`; no scheduler process. Returns
    (pipeline, server arguments). sglang picks the pipeline by the folder's name (FLUX.2 klein's
    where the path says "flux2-klein")."""
    _stub_missing(device, ("imageio_ffmpeg",))  # sglang's entry points import it for video output
    from sglang.multimodal_gen.runtime.pipelines_core import build_pipeline
    from sglang.multimodal_gen.runtime.platforms import initialize_current_platform
    from sglang.multimodal_gen.runtime.platforms.plugins import apply_plugin_hooks, load_plugins
    from sglang.multimodal_gen.runtime.server_args import ServerArgs, set_global_server_args

    initialize_current_platform()
    load_plugins()
    apply_plugin_hooks()
    server_args = ServerArgs.from_kwargs(
        model_path=str(model_path),
        num_gpus=1,
        attention_backend="torch_sdpa",
        dit_precision=precision,
        vae_precision=precision,
        text_encoder_precisions=[precision],
    )
    set_global_server_args(server_args)
    _one_rank_group()
    return build_pipeline(server_args), server_args


def generate(
    pipeline: Any,
    server_args: Any,
    prompt: str,
    size: tuple[int, int],
    steps: int,
    guidance: float,
    seed: int = 0,
) -> torch.Tensor:
    """One image of sglang's pipeline, as its offline generator requests it: [1, 3, H, W] in [0, 1]."""
    from sglang.multimodal_gen.configs.sample.sampling_params import SamplingParams
    from sglang.multimodal_gen.runtime.entrypoints.utils import prepare_request

    width, height = size
    params = SamplingParams.from_user_sampling_params_args(
        server_args.model_path,
        server_args=server_args,
        prompt=prompt,
        height=height,
        width=width,
        num_inference_steps=steps,
        guidance_scale=guidance,
        seed=seed,
        save_output=False,
    )
    output = pipeline.forward(prepare_request(server_args, params), server_args)
    if output.error:
        raise RuntimeError(f"sglang's pipeline failed: {output.error}")
    return output.output


def release_runtime() -> None:
    """Undo `prepare_runtime` (and `sglang_pipeline`): the one-rank group, its torchrun-style
    environment and the stubs. A process that goes on, such as a test run, must not look like a
    distributed job afterwards, nor get a stub where it imports torchvision. sglang's group exists
    only where `_one_rank_group` imported its parallel state, so a runtime that failed before that
    (sglang not importable) still has its stubs taken away."""
    parallel_state = sys.modules.get("sglang.multimodal_gen.runtime.distributed.parallel_state")
    if parallel_state is not None:
        parallel_state.cleanup_dist_env_and_memory()
    for key, value in _SAVED_ENVIRONMENT.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _SAVED_ENVIRONMENT.clear()
    _remove_stubs()


def sglang_dit(reference: nn.Module) -> nn.Module:
    """sglang's Flux2Transformer2DModel of diffusers' `reference`'s config, holding the same weight
    tensors (no copy), in eval mode."""
    from sglang.multimodal_gen.configs.models.dits.flux import FluxConfig
    from sglang.multimodal_gen.runtime.models.dits.flux_2 import Flux2Transformer2DModel

    arch = {key: value for key, value in reference.config.items() if not key.startswith("_")}
    config = FluxConfig()
    config.update_model_arch(arch)
    with torch.device("meta"):
        model = Flux2Transformer2DModel(config, hf_config=arch)
    model.load_state_dict(reference.state_dict(), strict=True, assign=True)
    return model.eval()


def sglang_inputs(model: nn.Module, inputs: dict) -> dict:
    """sglang's forward arguments for diffusers' `inputs` (see the module docstring)."""
    hidden_states = inputs["hidden_states"]
    ids = torch.cat([inputs["txt_ids"], inputs["img_ids"]], dim=0)
    return {
        "hidden_states": hidden_states,
        "encoder_hidden_states": inputs["encoder_hidden_states"],
        "timestep": inputs["timestep"].to(hidden_states.dtype) * 1000,
        "guidance": inputs.get("guidance"),
        "freqs_cis": model.rotary_emb(ids),
    }


def call(model: nn.Module, inputs: dict) -> torch.Tensor:
    """One forward of sglang's DiT inside its forward context."""
    from sglang.multimodal_gen.runtime.managers.forward_context import set_forward_context

    with set_forward_context(current_timestep=0, attn_metadata=None):
        return model(**inputs)


def runners(reference: nn.Module, inputs: dict) -> dict[str, Callable[[], torch.Tensor]]:
    """The four paths (PATHS) on one set of weights: each a call of one step."""
    from ..integrations.sglang import enable

    dit = sglang_dit(reference)
    handle = enable(dit)
    sg_inputs = sglang_inputs(dit, inputs)

    def on_sglang(active: bool) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            handle.active = active
            return call(dit, sg_inputs)

        return run

    def on_diffusers(fused: bool) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            hosts.use_fused(reference, fused)
            return reference(**inputs, return_dict=False)[0]

        return run

    return dict(
        zip(PATHS, (on_sglang(False), on_sglang(True), on_diffusers(False), on_diffusers(True)), strict=True)
    )


def compare(reference: nn.Module, inputs: dict, rounds: int) -> dict[str, Any]:
    """The four paths' outputs against diffusers eager (bit-identical, or the share of elements that
    differ) and, on a GPU, their pipelined step times (median ms)."""
    runs = runners(reference, inputs)
    with torch.inference_mode():
        outputs = {name: run() for name, run in runs.items()}
        expected = outputs["diffusers"]
        result: dict[str, Any] = {
            name: {
                "bit_exact": bits_equal(out, expected),
                "differing": float((out != expected).float().mean()),
            }
            for name, out in outputs.items()
        }
        if expected.is_cuda and rounds > 0:
            for run in runs.values():  # each path's first call (self-checks, builds), untimed
                run()
            for name, times in pipelined_ms(
                lambda name: runs[name](), rotated_order(list(runs), rounds)
            ).items():
                result[name]["ms"] = statistics.median(times)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flux2_fused.bench.sglang", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--configs", nargs="+", default=["klein-4b", "dev"], choices=["klein-4b", "klein-9b", "dev"]
    )
    parser.add_argument("--rounds", type=int, default=7, help="timed steps per path (default 7)")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    from .step import step_inputs

    device = torch.device("cuda")
    prepare_runtime(device)
    results = {}
    for name in args.configs:
        config = Flux2Config.preset(name)
        reference = hosts.diffusers_host(config, device, torch.bfloat16)
        inputs = step_inputs(config, 1, 4096, 512, torch.bfloat16)
        results[name] = compare(reference, inputs, args.rounds)
        print(f"{name}, 1024x1024, bf16, pipelined:")
        for path, row in results[name].items():
            exact = (
                "bit-identical to diffusers"
                if row["bit_exact"]
                else f"{row['differing']:.1%} of elements differ"
            )
            print(f"  {path:<22} {row.get('ms', float('nan')):8.2f} ms   {exact}")
        del reference
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if all(r["sglang + enable()"]["bit_exact"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
