"""Argument types shared by the command-line scripts: each parses one option or raises
`argparse.ArgumentTypeError` naming what was wrong (argparse then names the option)."""

from __future__ import annotations

import argparse
import math


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
