"""The scheme catalog: every cache format the comparisons run, by label, in one place.

A `Scheme` is a table row: a label, the format, what it stores (`CacheFormat.describe`), the ablation
ladder it belongs to and the rotation's calibration method. The eval table (`table_schemes`), the
rotation comparison (`calibrated_schemes`), the benchmarks (`BENCH_DECODE`, `BENCH_ATTENTION`) and the
K/V error report (`kv_error_labels`) all take their rows from `catalog`, and the generation benchmarks
(`scripts/eval_benchmarks.py`) from `table2_rows`, which keeps the catalog's label wherever it holds the
same format, so a label means one format everywhere.

    catalog((32, 16))     baselines at the first group size (dense bf16, uniform INT4, rotated INT2,
                          kivi INT2, residual_vq), then per group size g the paper's ladder — direct
                          INT2 g → +residual α=1 → +LS → +rotation → [2,2,2,4] — and the direct and
                          rotated [2,2,2,4] ablations, then the rivals (`rival_schemes`)
    rival_schemes(32)     loop KV sharing (Ouro's last / mean / first loop, bf16 or INT4/INT8 anchors, and
                          across all of Huginn's steps), the Huginn reference's compress strategies and
                          vLLM's turboquant presets
    table2_rows()         the paper's Table 2: BF16, then per setting (INT2 g32, INT2 g16, INT2/4 g32,
                          INT2/4 g16) the methods Direct, OptR-H, RQ and RQ+OptR-H
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

from rq_jax.cache.base import CacheFormat, get_format
from rq_jax.cache.dense import Dense


@dataclasses.dataclass(frozen=True)
class Scheme:
    """A row: its label, the format, the ladder it belongs to ("" for baselines), and the rotation's
    calibration method ("": the format's default rotation, Hadamard)."""

    label: str
    fmt: CacheFormat
    ladder: str = ""
    method: str = ""

    @property
    def stored(self) -> str:
        """What the format stores, in a few words."""
        return self.fmt.describe()


def _ladder(g: int) -> list[Scheme]:
    ladder = f"g{g}"
    residual2 = dict(bits=(2, 2, 2, 2), group_size=g)
    return [Scheme(f"direct INT2 g{g}", get_format("uniform", bits=2, group_size=g), ladder),
            Scheme(f"+residual α=1 g{g}", get_format("residual", **residual2, least_squares=False,
                                                      rotation="identity"), ladder),
            Scheme(f"+LS g{g}", get_format("residual", **residual2, rotation="identity"), ladder),
            Scheme(f"+rotation g{g}", get_format("residual", **residual2), ladder),
            Scheme(f"[2,2,2,4] g{g}", get_format("residual", group_size=g), ladder)]


def _mixed_direct(g: int) -> list[Scheme]:
    return [Scheme(f"direct [2,2,2,4] g{g}", get_format("uniform", bits=(2, 2, 2, 4), group_size=g)),
            Scheme(f"rotated [2,2,2,4] g{g}", get_format("rotated", bits=(2, 2, 2, 4), group_size=g))]


def table_schemes(group_sizes: Sequence[int] = (32, 16)) -> list[Scheme]:
    """The eval table's rows: the baselines at the first group size, then the ladder at each."""
    g0 = group_sizes[0]
    rows = [Scheme("dense bf16", Dense("bfloat16")),
            Scheme("uniform INT4", get_format("uniform", bits=4, group_size=g0)),
            Scheme("rotated INT2", get_format("rotated", bits=2, group_size=g0)),
            Scheme("kivi INT2", get_format("kivi", bits=2)),
            Scheme("residual_vq", get_format("residual_vq"))]
    for g in group_sizes:
        rows += _ladder(g)
    return rows


def rival_schemes(g: int = 32) -> list[Scheme]:
    """The rivals that store fewer loops instead of compressing each: loop KV sharing (`share`), the last
    loop's, the mean's and the first loop's K/V read by every loop of a group of 4 (Ouro's decode-time
    sharing; Huginn's groups of 4 steps), with a bf16 anchor or an INT4 / INT8 one at group size g, one
    K/V shared by up to 32 loops (all of Huginn's steps); then the Huginn reference's memory-bounding
    strategies (`compress`): slots reused modulo 2 and 4 recurrences ("compress-s{N}" at N = 2, 4 times
    the core layers) and the first 2 recurrences kept ("compress-anchor", which keeps 8 of 32); then vLLM's
    shipped low-bit caches (`turboquant`), every loop stored on its own."""
    rows = [Scheme(f"share {source} bf16", get_format("share", source=source)) for source in ("last", "mean", "first")]
    for bits in (4, 8):
        rows += [Scheme(f"share last INT{bits} g{g}", get_format("share", bits=bits, group_size=g)),
                 Scheme(f"share last rotated INT{bits} g{g}",
                        get_format("share", bits=bits, group_size=g, rotation="hadamard"))]
    rows += [Scheme(f"share mean rotated INT4 g{g}", get_format("share", source="mean", bits=4, group_size=g,
                                                                 rotation="hadamard")),
             Scheme("share last bf16 ×32", get_format("share", loops=32))]
    rows += [Scheme(f"compress modulo {n} bf16", get_format("compress", slots=n)) for n in (2, 4)]
    rows += [Scheme("compress anchor 2 bf16", get_format("compress", strategy="anchor", slots=2))]
    rows += [Scheme(f"vLLM turboquant_{name}", get_format("turboquant", preset=name))
             for name in ("k8v4", "4bit_nc", "k3v4_nc", "3bit_nc")]
    return rows


def catalog(group_sizes: Sequence[int] = (32, 16)) -> list[Scheme]:
    """Every scheme: the table's rows, the direct and rotated [2,2,2,4] ablations at each group size, then
    the rivals at the first (`rival_schemes`)."""
    return (table_schemes(group_sizes) + [s for g in group_sizes for s in _mixed_direct(g)]
            + rival_schemes(group_sizes[0]))


def calibrated_schemes(group_sizes: Sequence[int], methods: Sequence[str]) -> list[Scheme]:
    """Rows of the rotation comparison: direct rotated INT2, residual INT2 and residual [2,2,2,4] at each
    group size, with each calibration `method` ("oscar", "optr-h") instead of the default Hadamard.
    OptR-H rows also fit key means (App. G.1)."""
    rows = []
    for method in methods:
        for g in group_sizes:
            means = dict(key_means=method == "optr-h")
            rows += [Scheme(f"rotated INT2 g{g} {method}", get_format("rotated", bits=2, group_size=g, **means),
                            f"g{g}", method),
                     Scheme(f"+rotation g{g} {method}", get_format("residual", bits=(2, 2, 2, 2), group_size=g,
                                                                    **means), f"g{g}", method),
                     Scheme(f"[2,2,2,4] g{g} {method}", get_format("residual", group_size=g, **means), f"g{g}", method)]
    return rows


def pick(labels: Sequence[str], group_sizes: Sequence[int] = (32, 16)) -> list[Scheme]:
    """The catalog's schemes with these labels, in the order given. Raises ValueError naming an unknown
    label and the known ones."""
    known = {s.label: s for s in catalog(group_sizes)}
    bad = [label for label in labels if label not in known]
    if bad:
        raise ValueError(f"unknown scheme {bad[0]!r}; the catalog at group sizes {list(group_sizes)} has: "
                         f"{', '.join(known)}")
    return [known[label] for label in labels]


class PaperRow(NamedTuple):
    """A row of the paper's Table 2: its setting heading ("" for BF16), method ("—" for BF16) and scheme."""

    setting: str
    method: str
    scheme: Scheme


#: Table 2's settings: heading -> (bits per loop of a group, group size per loop). In the INT2/4 rows g is
#: the INT2 group size; the INT4 anchor keeps g32 (App. A.2).
TABLE2_SETTINGS = {"INT2 g32": ((2, 2, 2, 2), (32, 32, 32, 32)), "INT2 g16": ((2, 2, 2, 2), (16, 16, 16, 16)),
                   "INT2/4 g32": ((2, 2, 2, 4), (32, 32, 32, 32)), "INT2/4 g16": ((2, 2, 2, 4), (16, 16, 16, 32))}
#: Table 2's methods: Direct (per-loop INTn, no rotation), OptR-H (rotated by a fitted OptR-H rotation,
#: key means), RQ (residuals against the last loop, least squares, no rotation) and RQ+OptR-H (ResidualQuant).
TABLE2_METHODS = ("Direct", "OptR-H", "RQ", "RQ+OptR-H")


def _table2_setting(bits: tuple[int, ...], sizes: tuple[int, ...]) -> list[Scheme]:
    """Direct, OptR-H, RQ and RQ+OptR-H at one setting, labelled as the catalog labels the same format."""
    means = dict(key_means=True)
    if bits == (2, 2, 2, 2):
        g = sizes[0]
        return [Scheme(f"direct INT2 g{g}", get_format("uniform", bits=2, group_size=g), f"g{g}"),
                Scheme(f"rotated INT2 g{g} optr-h", get_format("rotated", bits=2, group_size=g, **means), f"g{g}",
                       "optr-h"),
                Scheme(f"+LS g{g}", get_format("residual", bits=bits, group_size=g, rotation="identity"), f"g{g}"),
                Scheme(f"+rotation g{g} optr-h", get_format("residual", bits=bits, group_size=g, **means), f"g{g}",
                       "optr-h")]
    g = "/".join(str(x) for x in sorted(set(sizes)))
    ladder = f"g{sizes[0]}"
    return [Scheme(f"direct [2,2,2,4] g{g}", get_format("uniform", bits=bits, group_size=sizes), ladder),
            Scheme(f"rotated [2,2,2,4] g{g} optr-h", get_format("rotated", bits=bits, group_size=sizes, **means),
                   ladder, "optr-h"),
            Scheme(f"+LS [2,2,2,4] g{g}", get_format("residual", bits=bits, group_size=sizes, rotation="identity"),
                   ladder),
            Scheme(f"[2,2,2,4] g{g} optr-h", get_format("residual", bits=bits, group_size=sizes, **means), ladder,
                   "optr-h")]


def table2_rows() -> list[PaperRow]:
    """The rows of the paper's Table 2 in its order: BF16, then each setting's four methods. Formats the
    catalog already has keep its labels ("direct INT2 g32", "+LS g32", "[2,2,2,4] g32 optr-h", ...); an
    OptR-H row (`method` "optr-h") needs its fitted rotations (`rq_jax.calibrate`)."""
    rows = [PaperRow("", "—", Scheme("dense bf16", Dense("bfloat16")))]
    for setting, (bits, sizes) in TABLE2_SETTINGS.items():
        rows += [PaperRow(setting, m, s) for m, s in zip(TABLE2_METHODS, _table2_setting(bits, sizes))]
    return rows


#: The decode benchmark's rows (`scripts/bench_decode.py`), at group size 32.
BENCH_DECODE = ("dense bf16", "direct INT2 g32", "rotated INT2", "kivi INT2", "[2,2,2,4] g32")
#: The attention benchmark's rows (`scripts/bench_attention.py`): the formats with a fused kernel.
BENCH_ATTENTION = ("dense bf16", "direct INT2 g32", "rotated INT2", "[2,2,2,4] g32")


def kv_error_labels(g: int) -> tuple[str, ...]:
    """The K/V error report's rows at group size g (`scripts/kv_error.py`; the catalog at (g,)): the
    ladder and its baselines, then the rivals (loop sharing, vLLM's TurboQuant)."""
    return (f"direct INT2 g{g}", "rotated INT2", f"direct [2,2,2,4] g{g}", f"rotated [2,2,2,4] g{g}",
            f"+residual α=1 g{g}", f"+rotation g{g}", f"[2,2,2,4] g{g}", "residual_vq", "share last bf16",
            "share mean bf16", "share first bf16", "vLLM turboquant_4bit_nc", "vLLM turboquant_3bit_nc")
