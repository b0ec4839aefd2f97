"""Tests of the benchmarks, and what several of them check alike."""

from __future__ import annotations

from collections.abc import Callable

import pytest


def one_line_error(
    main: Callable[[list[str]], int], argv: list[str], capsys: pytest.CaptureFixture[str]
) -> str:
    """What a `python -m flux2_fused.bench.<tool>` main writes for bad arguments: exit status 2 and
    exactly one line on stderr, returned."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1
    return err
