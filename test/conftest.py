"""Shared test configuration: tests marked `gpu` skip cleanly where CUDA is absent; counting which
route a block took (the family's block code, or the host's own call)."""

from typing import Any

import pytest
import torch

from flux2_fused.models.flux2 import blocks


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def count_block_code(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """One entry each time a block body (`double_block_body`, `single_block_body`) runs, from the
    loop or from a block's fused forward under a hook or a cache (both call it through `blocks`)."""
    calls: list[int] = []
    real = getattr(blocks, name)

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(blocks, name, counting)
    return calls


@pytest.fixture
def double_blocks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry each time a double block runs the family's block code."""
    return count_block_code(monkeypatch, "double_block_body")
