"""Byte-level Python source from the running interpreter's own standard library, split by module.

A *module* is a top-level name of `Lib/`: `json` covers `Lib/json/**.py`, `heapq` covers `Lib/heapq.py`.
`EVAL_MODULES` and `CALIB_MODULES` are fixed held-out lists; every other module (minus `EXCLUDED`:
tests, GUI demos, vendored packages) is training text. Documents (files, in sorted path order) are
joined with EOS. The library differs slightly between Python versions: results record
`StdlibText.python_version`.
"""

from __future__ import annotations

import functools
import os
import platform
import sysconfig

import numpy as np

from rq_jax.data.common import BYTE_OFFSET, EOS, check_split, encode

#: Held-out evaluation modules (all present in CPython 3.11–3.13).
EVAL_MODULES = ("bisect", "calendar", "colorsys", "csv", "difflib", "fractions", "heapq", "json", "shlex",
                "statistics", "textwrap")
#: Calibration modules (for data-driven cache formats); disjoint from the above and from training.
CALIB_MODULES = ("argparse", "dataclasses", "gettext", "pprint", "tarfile")
#: Never used: tests, demos, vendored or generated code.
EXCLUDED = ("test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "dist-packages",
            "__pycache__", "__phello__", "this")


def stdlib_root() -> str:
    """The running interpreter's standard-library folder (`Lib/`)."""
    return sysconfig.get_paths()["stdlib"]


def module_files(root: str | None = None) -> dict[str, list[str]]:
    """Top-level module name → its .py files (sorted), excluding `EXCLUDED` anywhere in the path."""
    root = root or stdlib_root()
    modules: dict[str, list[str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        parts = [] if rel == "." else rel.split(os.sep)
        if any(p in EXCLUDED for p in parts):
            dirnames[:] = []
            continue
        for f in filenames:
            if not f.endswith(".py"):
                continue
            name = parts[0] if parts else f[:-3]
            if name in EXCLUDED:
                continue
            modules.setdefault(name, []).append(os.path.join(dirpath, f))
    return {k: sorted(v) for k, v in sorted(modules.items())}


class StdlibText:
    """The stdlib corpus as one token array per split.

    `tokens(split)` is [N] int32: the split's files, each followed by EOS. `window(rng, length)` draws a
    training window [length] at a uniform offset; `eval_windows(split, length, n)` gives n fixed
    non-overlapping windows [n, length] spread over the split (for bits-per-byte).
    """

    def __init__(self, root: str | None = None, eval_modules=EVAL_MODULES, calib_modules=CALIB_MODULES):
        self.root = root or stdlib_root()
        self.python_version = platform.python_version()
        files = module_files(self.root)
        self.modules = {
            "eval": [m for m in eval_modules if m in files],
            "calib": [m for m in calib_modules if m in files],
        }
        held = set(self.modules["eval"]) | set(self.modules["calib"])
        if set(self.modules["eval"]) & set(self.modules["calib"]):
            raise ValueError("eval and calib module lists overlap")
        self.modules["train"] = [m for m in files if m not in held]
        self._files = files

    def files(self, split: str) -> list[str]:
        """The .py files of `split`, sorted by module then path."""
        return [f for m in self.modules[check_split(split)] for f in self._files[m]]

    @functools.lru_cache(maxsize=None)
    def tokens(self, split: str) -> np.ndarray:
        """All of `split`'s text as token ids [N] int32, each file followed by EOS."""
        parts = []
        for path in self.files(split):
            with open(path, "rb") as f:
                parts += [encode(f.read()), np.array([EOS], np.int32)]
        return np.concatenate(parts) if parts else np.zeros((0,), np.int32)

    def window(self, rng: np.random.Generator, length: int, split: str = "train") -> np.ndarray:
        """A window [length] int32 at a uniform random offset of `split`'s text."""
        data = self.tokens(split)
        start = int(rng.integers(0, len(data) - length + 1))
        return data[start : start + length]

    def eval_windows(self, length: int, n: int, split: str = "eval") -> np.ndarray:
        """`n` non-overlapping windows [n, length] at evenly spaced offsets of `split`'s text."""
        data = self.tokens(split)
        count = len(data) // length
        if n > count:
            raise ValueError(f"{split} text has only {count} windows of {length} tokens, asked for {n}")
        starts = (np.arange(n) * (count // n)) * length
        return np.stack([data[s : s + length] for s in starts])

    def num_bytes(self, split: str) -> int:
        """Bytes of source text in `split` (EOS separators not counted)."""
        return int(np.sum(self.tokens(split) >= BYTE_OFFSET))

    def describe(self) -> dict:
        """Python version, module lists and sizes per split (for results and model cards)."""
        return {"python_version": self.python_version,
                "eval_modules": self.modules["eval"], "calib_modules": self.modules["calib"],
                "bytes": {s: self.num_bytes(s) for s in ("train", "calib", "eval")},
                "train_modules": len(self.modules["train"])}
