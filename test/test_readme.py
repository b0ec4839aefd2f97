"""The README's "Use it" snippet runs as written (on the CPU with the tiny config it selects there)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_use_it_snippet_runs() -> None:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Use it") :]
    snippet = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert snippet is not None
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(snippet.group(1), str(README), "exec"), {})
    assert printed.getvalue().strip() == "torch.Size([1, 256, 32])"
