"""The cache formats' calibration for a whole cache: one entry per loop segment of the looped and the
plain (prelude/coda) layers, built once outside jit (`default_calib`) or fitted on a dense cache's
K/V (`fit_calib`), checked against the cache before a model call traces (`check_calib`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from rq_jax.cache import base
from rq_jax.cache.kv import Group, KVCache


class CacheCalib(NamedTuple):
    """Static calibration of the looped and the plain (prelude/coda) layers: one entry per segment.

    A part is None when its format needs no calibration (e.g. dense).
    """

    looped: tuple[Any, ...] | None = None
    plain: tuple[Any, ...] | None = None

    def part(self, group: Group) -> tuple[Any, ...] | None:
        """The looped or plain layers' entries."""
        return self.looped if group == "looped" else self.plain


def default_calib(cache: KVCache) -> CacheCalib:
    """The formats' data-free calibration for `cache`, built once outside jit.

    Raises ValueError for a format that cannot run without data (fit it with `fit_calib`).
    """

    def part(group: Group):
        fmt, segs = cache.schedule(group)
        if cache.stack(group) is None or not fmt.needs_calib:
            return None
        return tuple(fmt.default_calib(seg, *cache.slot_dims(group)) for seg in segs)

    return CacheCalib(part("looped"), part("plain"))


def fit_calib(dense: KVCache, fmt: base.CacheFormat, plain_fmt: base.CacheFormat | None = None) -> CacheCalib:
    """Fit `fmt` (and `plain_fmt`, default `fmt`) on the K/V stored in a dense cache."""
    plain_fmt = plain_fmt or fmt

    def part(f: base.CacheFormat, group: Group, num_loops: int):
        if dense.stack(group) is None or not f.needs_calib:
            return None
        k, v = dense.dense_kv(group)
        return tuple(f.calibrate(seg, base.split_loops(k, seg), base.split_loops(v, seg), dense.lengths)
                     for seg in base.segments(num_loops, f.group_len))

    return CacheCalib(part(fmt, "looped", dense.num_loops), part(plain_fmt, "plain", 1))


def check_calib(cache: KVCache, calib: CacheCalib) -> None:
    """Raise ValueError unless every format of `cache` that reads a calibration has one per segment, of
    the type its `default_calib` builds (where it has one)."""
    for group in ("looped", "plain"):
        fmt, segs = cache.schedule(group)
        if cache.stack(group) is None or not fmt.needs_calib:
            continue
        given = calib.part(group)
        if given is None:
            how = ("fit one with rq_jax.cache.fit_calib" if fmt.needs_data else
                   "build it once with rq_jax.cache.default_calib(cache)")
            raise ValueError(f"the {fmt.name!r} cache format of the {group} layers needs calib=CacheCalib(...): {how}")
        if not isinstance(given, tuple) or len(given) != len(segs):
            raise ValueError(f"the {group} calibration must be a tuple with one entry per loop segment "
                             f"({len(segs)}), got {type(given).__name__}")
        if not fmt.needs_data:
            want = type(jax.eval_shape(lambda: fmt.default_calib(segs[0], *cache.slot_dims(group))))
            bad = [type(c).__name__ for c in given if type(c) is not want]
            if bad:
                raise ValueError(f"the {fmt.name!r} format of the {group} layers needs {want.__name__} "
                                 f"calibration, got {bad[0]}")
