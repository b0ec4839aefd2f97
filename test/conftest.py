"""Shared test configuration: tests marked `gpu` skip cleanly where CUDA is absent; counting which
route a block took (the family's block code, or the host's own call)."""

from types import ModuleType
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


def count_block_code(monkeypatch: pytest.MonkeyPatch, name: str, family: ModuleType = blocks) -> list[int]:
    """One entry each time a block body (`double_block_body`, `single_block_body`) of a family's
    block code (`family`, default FLUX.2's) runs, from the loop or from a block's fused forward under
    a hook or a cache (both call it through the module)."""
    calls: list[int] = []
    real = getattr(family, name)

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(family, name, counting)
    return calls


@pytest.fixture
def double_blocks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry each time a double block runs the family's block code."""
    return count_block_code(monkeypatch, "double_block_body")
