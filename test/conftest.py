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


def count_calls(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[int]:
    """One entry each time `owner.name` is called (it still runs)."""
    calls: list[int] = []
    real = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.fixture
def double_blocks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry each time a double block runs the family's block code."""
    return count_calls(monkeypatch, blocks, "double_block_body")
