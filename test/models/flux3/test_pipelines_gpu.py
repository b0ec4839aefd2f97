"""diffusers' FLUX.3 modular pipelines on the GPU with `enable(pipe)`: text-to-image with CFG, with a
reference image, and the step-distilled flow-map pipeline, built as the pipeline benchmark builds them
(`bench.flux3.pipeline`, random prompt embeddings: `bench.pipeline.prompt_embeddings`) around the
`flux3-small` transformer (the smallest size at which every fused op runs) in bf16. Latents and images
equal the pipeline alone bit for bit, and every transformer call of the patched pipeline launches our
kernels at every site (`support.fused_sites`)."""

from __future__ import annotations

import pytest
import torch

from flux2_fused.bench import flux3
from flux2_fused.bench.pipeline import prompt_embeddings
from flux2_fused.integrations.diffusers import enable

from ...conftest import fused_launches
from . import support

pytestmark = pytest.mark.gpu
pytest.importorskip("diffusers.modular_pipelines.flux3")
pytest.importorskip("transformers")  # the FLUX.3 modular pipelines' classes need it

WORKFLOWS = {  # name: (flow-map transformer, reference image)
    "text-to-image": (False, False),
    "reference": (False, True),
    "flow-map": (True, False),
    "flow-map-reference": (True, True),
}


@pytest.fixture(autouse=True)
def free_gpu_memory():
    yield
    torch.cuda.empty_cache()


@pytest.mark.parametrize("workflow", WORKFLOWS)
def test_pipeline_is_the_same_with_enable_and_fused(workflow: str) -> None:
    """64 x 64 without a reference (4 x 4 tokens), else the reference's canvas; PIPELINE_STEPS steps,
    two transformer calls a step under CFG, one for the flow map."""
    flow_map, reference = WORKFLOWS[workflow]
    transformer = flux3.random_transformer(
        "flux3-small", torch.device("cuda"), torch.bfloat16, flow_map=flow_map
    )
    pipe = flux3.pipeline(transformer)
    assert pipe.requires_unconditional_embeds != flow_map  # CFG for the base model only
    kwargs = {**prompt_embeddings(pipe, 7), **({"image": support.reference_image()} if reference else {})}
    if not reference:
        kwargs.update(height=64, width=64)
    expected = support.run_pipeline(pipe, **kwargs)
    handle = enable(pipe)
    try:
        patched = support.run_pipeline(pipe, **kwargs)
        launches = fused_launches(lambda: support.run_pipeline(pipe, **kwargs))
    finally:
        handle.disable()
    for name in ("latents", "images"):
        assert torch.equal(patched[name], expected[name]), name
    calls = support.PIPELINE_STEPS * (1 if flow_map else 2)
    assert launches == calls * support.fused_sites(transformer, reference)
