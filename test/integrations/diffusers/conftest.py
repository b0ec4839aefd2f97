"""diffusers' `set_attention_backend` also sets the process-wide active backend: every test here
gets the backend it started with back, so no test changes another's attention."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _restore_attention_backend() -> Iterator[None]:
    try:
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry
    except ImportError:
        yield
        return
    active = _AttentionBackendRegistry._active_backend
    yield
    _AttentionBackendRegistry._active_backend = active
