"""The command line's ground floor: a parser whose --help shows every default and whose errors are one
line, and argument types (each parses one option or raises `argparse.ArgumentTypeError` naming what was
wrong, and argparse then names the option). `rq_jax.cli` hands these on to the scripts; the package's
own command builders (`rq_jax.train.commands`) use them here, below everything they configure."""

from __future__ import annotations

import argparse
import math
import shlex
import textwrap


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help keeps the docstring's layout and ends every option's help with its default (none for
    options without one, flags, or a help that already names it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if not action.option_strings or default is None or default is False or default == argparse.SUPPRESS \
                or "(default" in text:
            return text
        if isinstance(default, (tuple, list)):  # as it is typed: `--context 1024 2048`, `--bits 2,2,2,4`
            quote = shlex.quote if action.nargs else str
            shown = (" " if action.nargs else ",").join(quote(str(x)) for x in default)
        else:
            shown = str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"

    def _split_lines(self, text: str, width: int) -> list[str]:
        """Wrapped at spaces only: paths and names such as checkpoints/ouro-small-qat stay whole."""
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class ArgumentParser(argparse.ArgumentParser):
    """The scripts' parser: `HelpFormatter`, and an error is one line `PROG: error: MESSAGE` with exit
    status 2 (argparse's own shape, without the usage block)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


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


def nonnegative_float(text: str) -> float:
    """A finite float ≥ 0."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be ≥ 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """A finite float > 0."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def probability(text: str) -> float:
    """A number in (0, 1]."""
    value = finite_float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must lie in (0, 1], got {text}")
    return value


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated integers, e.g. bit widths 2,2,2,4."""
    try:
        return tuple(int(b) for b in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers such as 2,2,2,4, got {text!r}") from None


def divisors(n: int) -> str:
    """The divisors of n, comma-separated (what a group size of head_dim n may be)."""
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


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
