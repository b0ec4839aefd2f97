"""The errors the `flux2-fused` commands report as one line, each with the exit status it means.

Kept apart from the commands and the benchmarks so that both can raise them without importing each
other.
"""

from __future__ import annotations


class CommandError(Exception):
    """A failure the user can act on, reported as one line; `exit_code` is the process's exit status."""

    exit_code = 1


class BadValue(CommandError):
    """The command line asks for something that cannot be done here: exit status 2, as argparse gives
    for its own usage errors, so scripts tell "fix the arguments" from "it failed while running"."""

    exit_code = 2


class NeedsCuda(BadValue):
    """The command needs a CUDA GPU and this machine has none."""
