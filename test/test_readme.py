"""The README's code runs as written: the package's own model snippet (on the CPU with the tiny config
it selects there) and the diffusers snippet (on a tiny random Klein pipeline in place of the Hub
model). Its first screen leads a newcomer from a correct install (CPU torch first) to the main job
and `enable(pipe)`; its test command is the one CI runs; its links resolve."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import count_block_code

README = Path(__file__).resolve().parents[1] / "README.md"
MODEL_ID = "black-forest-labs/FLUX.2-klein-4B"


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.DOTALL)


def test_own_model_snippet_runs() -> None:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## The package's own model") :]
    snippet = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert snippet is not None
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(snippet.group(1), str(README), "exec"), {})
    assert printed.getvalue().strip() == "torch.Size([1, 256, 32])"


def test_diffusers_snippet_runs_and_matches_the_pipeline_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snippet's text is executed unchanged. Only what the CPU lacks is patched around it:
    `Flux2KleinPipeline.from_pretrained` returns the tiny random pipeline of the integration tests
    (checked to be asked for the README's model id in bf16), whose `to("cuda")` goes to the CPU in
    fp32 when there is no GPU, whose prompt encoder returns fixed random embeddings (the tiny pipeline
    has no text encoder) and whose default size is 64x64 px. The snippet runs twice: as written, then
    with `enable` replaced by a stub, i.e. the pipeline alone; the latents it decodes and the images
    are equal, and only the first run went through the fused block code."""
    diffusers = pytest.importorskip("diffusers")
    from flux2_fused.integrations import diffusers as integration

    from .integrations.diffusers.test_pipelines import _pipeline

    snippets = [s for s in _python_blocks(README.read_text(encoding="utf-8")) if "from_pretrained(" in s]
    snippets = [s for s in snippets if "Flux2KleinPipeline" in s]
    assert len(snippets) == 1, "expected one README snippet loading a Flux2KleinPipeline"
    code = compile(snippets[0], str(README), "exec")

    cuda = torch.cuda.is_available()
    pipe = _pipeline(diffusers.Flux2KleinPipeline)
    pipe.set_progress_bar_config(disable=True)
    pipe.default_sample_size = 32  # 64x64 px with the tiny VAE (scale factor 2)
    requested: list[tuple[str, torch.dtype | None]] = []

    def from_pretrained(model_id: str, torch_dtype: torch.dtype | None = None, **kwargs: Any) -> Any:
        requested.append((model_id, torch_dtype))
        return pipe.to(torch_dtype) if cuda and torch_dtype is not None else pipe

    def to(*args: Any, **kwargs: Any) -> Any:
        if not cuda:
            args = tuple("cpu" if str(a).startswith("cuda") else a for a in args)
            kwargs = {k: "cpu" if str(v).startswith("cuda") else v for k, v in kwargs.items()}
        return type(pipe).to(pipe, *args, **kwargs)

    def prompt_embeds(text_encoder: Any, tokenizer: Any, prompt: list[str], **kwargs: Any) -> torch.Tensor:
        gen = torch.Generator().manual_seed(3)
        width = pipe.transformer.config.joint_attention_dim
        embeddings = torch.randn(len(prompt), 12, width, generator=gen)
        return embeddings.to(pipe.transformer.device, pipe.transformer.dtype)

    decoded: list[torch.Tensor] = []
    decode = pipe.vae.decode

    def recording_decode(latents: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        decoded.append(latents.clone())
        return decode(latents, *args, **kwargs)

    blocks = count_block_code(monkeypatch, "double_block_body")
    monkeypatch.setattr(diffusers.Flux2KleinPipeline, "from_pretrained", from_pretrained)
    monkeypatch.setattr(pipe, "to", to)
    monkeypatch.setattr(pipe, "_get_qwen3_prompt_embeds", prompt_embeds)
    monkeypatch.setattr(pipe.vae, "decode", recording_decode)
    monkeypatch.chdir(tmp_path)  # the snippet may save its image

    fused: dict[str, Any] = {}
    exec(code, fused)
    fused_blocks = len(blocks)

    class _Handle:
        def disable(self) -> None:
            pass

    monkeypatch.setattr(integration, "enable", lambda target: _Handle())
    alone: dict[str, Any] = {}
    exec(code, alone)

    assert requested == [(MODEL_ID, torch.bfloat16)] * 2
    assert fused["pipe"] is pipe and getattr(pipe.transformer, "_flux2_fused_handle", None) is None
    assert fused_blocks > 0 and len(blocks) == fused_blocks  # only the enabled run used the block code
    assert fused["image"].size == (64, 64)
    assert len(decoded) == 2 and torch.equal(decoded[0], decoded[1])
    assert fused["image"].tobytes() == alone["image"].tobytes()


def _headings(text: str) -> list[str]:
    return re.findall(r"^## (.+)$", text, re.MULTILINE)


def test_the_first_screen_installs_then_runs_the_main_job_then_enable() -> None:
    """A newcomer's order: what it is, install, the main job, `enable(pipe)`, what is supported; the
    CPU build of torch before the first `pip install .`, so a machine without a GPU never fetches the
    CUDA build; build internals (auditwheel, the wheel's contents) only in docs/install.md."""
    text = README.read_text(encoding="utf-8")
    headings = _headings(text)
    order = ["Install", "The main job: `flux2-fused bench`", "diffusers: `enable(pipe)`", "Supported"]
    assert [h for h in headings if h in order] == order and headings[0] == "Install"
    cpu_torch = text.index("pip install torch --index-url https://download.pytorch.org/whl/cpu")
    assert cpu_torch < text.index("pip install .") < text.index("flux2-fused bench")
    assert text.count("\n", 0, text.index("handle = enable(pipe)")) < 100
    for internal in ("auditwheel", "libtvm_ffi", "libcudart", "R580"):
        assert internal not in text, internal


def test_the_test_command_is_the_one_ci_runs() -> None:
    """CI (.ci/run) installs the test extra and runs `python -m pytest -q test`: the README says so,
    with how long it takes and what it leaves behind."""
    text = README.read_text(encoding="utf-8")
    assert "pip install -e '.[test]' && python -m pytest -q test" in text
    ci = (README.parent / ".ci" / "run").read_text(encoding="utf-8")
    assert "pip install -q -e '.[test]'" in ci and "\npython -m pytest -q test\n" in ci
    flat = " ".join(text.split())
    assert "about 10 minutes on 2 CPU cores" in flat
    assert "about 44 MB of bundled `.so` files under `build/` (git-ignored; `rm -rf build` to clean)" in flat


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize(
    "page", [README, *sorted((README.parent / "docs").glob("*.md"))], ids=lambda page: page.name
)
def test_relative_links_resolve(page: Path) -> None:
    """Every link to a file of the repository names one that exists, and its #anchor a heading there."""
    text = page.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: {target}"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", file.read_text(encoding="utf-8"), re.MULTILINE)
            assert anchor in {_slug(h) for h in headings}, f"{page.name}: {target}"
