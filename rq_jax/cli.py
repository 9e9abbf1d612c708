"""Argument types shared by the command-line scripts: each parses one option or raises
`argparse.ArgumentTypeError` naming what was wrong (argparse then names the option)."""

from __future__ import annotations

import argparse
import math
import shlex


def positive_int(text: str) -> int:
    """An integer ≥ 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def nonnegative_int(text: str) -> int:
    """An integer ≥ 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be ≥ 0, got {text}")
    return value


def finite_float(text: str) -> float:
    """A finite float (no nan or inf)."""
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated integers, e.g. bit widths 2,2,2,4."""
    try:
        return tuple(int(b) for b in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers such as 2,2,2,4, got {text!r}") from None


def spelled_command(words: list[str], group: argparse._ArgumentGroup, args: argparse.Namespace) -> str:
    """`words` (the script and its fixed arguments) plus every option of `group` that `args` sets,
    spelled out and shell-quoted: the command that reproduces a run (for model cards)."""
    words = list(words)
    for action in group._group_actions:
        value = getattr(args, action.dest)
        if isinstance(action, argparse._StoreTrueAction):
            words += [action.option_strings[0]] if value else []
        elif value is not None:
            words += [action.option_strings[0], str(value)]
    return " ".join(shlex.quote(w) for w in words)
