"""Bit allocation: choose per-loop, per-K/V widths and group sizes of a ResidualQuant cache under a
bits-per-element budget, by what each choice does to the model's next-token distributions.

The paper fixes one rule (INT4 for each group's anchor, INT2 elsewhere, the same for keys and values).
Here every *slot* — a (group position, K or V) pair — picks an option (bits, channel group size) from
`OPTIONS`, and the allocator measures, on the data's calib split, the KL from the dense model's
next-token distribution through the cache (`rq_jax.scoring.CacheScorer`: a prefill, then token by
token, every token reading its past from the packed cache), averaged over every scored position or over
a mask's (the tasks' answer tokens: the positions their accuracy scores):

1. reference: every slot at the richest option (INT4 g16 by default);
2. each slot's cost of each cheaper option, the others at the reference: ΔKL(slot, option);
3. the schedule minimising Σ ΔKL under the budget, by exhaustive search over all combinations
   (|OPTIONS|^(2p): 65,536 for p = 4 positions and 4 options — the sum is additive, the bits known
   exactly, so this is exact for the first-order model in a few seconds);
4. validation: the chosen schedule measured end to end, beside the paper's rule at the same budget.

An option may be 0 bits (`0g32`; any group size): the slot stores only its α and reads its reference
scaled — loop sharing for that slot, the "0-bit residual" end of the ladder, so one schedule can mix
sharing and residuals under one budget. The anchor (the group's last position) is never given 0 bits.

Why a separable first-order model rather than greedy joint search: a slot's damage is measured with
the residual chain real (a degraded anchor degrades the residuals coded against it), each compile of
a format costs tens of seconds on a CPU, and the first-order sum needs 1 + Σ(|OPTIONS| − 1)·2p
measurements against greedy's several per step; step 4 says how good the approximation was.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from fractions import Fraction
from typing import Callable, Sequence

import numpy as np

from rq_jax import report
from rq_jax.cache.base import get_format
from rq_jax.cache.loop_quant import LoopQuant
from rq_jax import scoring

#: (bits, channel group size) a slot may take, cheapest first.
OPTIONS: tuple[tuple[int, int], ...] = ((2, 32), (2, 16), (4, 32), (4, 16))
SLOT_KINDS = ("k", "v")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Per group position, keys' and values' (bits, group size)."""

    k: tuple[tuple[int, int], ...]
    v: tuple[tuple[int, int], ...]

    def format(self, **policy) -> LoopQuant:
        """The residual format storing this schedule (`policy`: the other LoopQuant fields)."""
        return get_format("residual", bits=tuple(b for b, _ in self.k), group_size=tuple(g for _, g in self.k),
                          bits_v=tuple(b for b, _ in self.v), group_size_v=tuple(g for _, g in self.v), **policy)

    def label(self) -> str:
        """E.g. "K 2g32 2g32 2g32 4g32 | V 2g32 2g32 2g32 2g32"."""
        def side(xs):
            return " ".join(f"{b}g{g}" for b, g in xs)

        return f"K {side(self.k)} | V {side(self.v)}"

    def to_json(self) -> dict:
        return dict(k=[list(x) for x in self.k], v=[list(x) for x in self.v])

    @classmethod
    def from_json(cls, raw: dict) -> "Schedule":
        return cls(tuple(tuple(x) for x in raw["k"]), tuple(tuple(x) for x in raw["v"]))

    @classmethod
    def uniform(cls, positions: int, option: tuple[int, int]) -> "Schedule":
        return cls((option,) * positions, (option,) * positions)

    def replace(self, kind: str, position: int, option: tuple[int, int]) -> "Schedule":
        side = list(getattr(self, kind))
        side[position] = option
        return dataclasses.replace(self, **{kind: tuple(side)})


def schedule_bits(schedule: Schedule, num_loops: int, head_dim: int, **policy) -> Fraction:
    """Stored bits per element of `schedule` (codes, metadata, α; K and V averaged)."""
    return schedule.format(**policy).bits_per_element(num_loops, head_dim)


@dataclasses.dataclass
class Allocation:
    """The allocator's result at one budget: the chosen schedule, its bits and measured KL, the
    reference, every single-slot cost measured, the predicted KL of the choice and the seconds of its
    measurements (the shared single-slot ones included)."""

    budget: float
    schedule: Schedule
    bits: float
    kl: float
    predicted_kl: float
    reference: Schedule
    reference_kl: float
    costs: dict[str, float]
    seconds: float

    def to_json(self) -> dict:
        return dict(budget=self.budget, schedule=self.schedule.to_json(), label=self.schedule.label(), bits=self.bits,
                    kl=self.kl, predicted_kl=self.predicted_kl, reference=self.reference.to_json(),
                    reference_kl=self.reference_kl, costs=self.costs, seconds=self.seconds)


def measure_kl(model, fmt, tokens: np.ndarray, prefix: int, batch: int, calib=None,
               mask: np.ndarray | None = None, **model_kwargs) -> float:
    """Mean KL(dense ‖ cache) of next-token distributions at the scored positions of rows tokens [N, T]
    (a prefill of `prefix` tokens, then one token per call), through a cache of `fmt`: every one, or
    those where `mask` [N, T] bool is True (e.g. `CalibrationSet.answers`)."""
    keep = np.ones(tokens.shape, bool) if mask is None else np.asarray(mask, bool)
    if keep.shape != tokens.shape or not keep[:, prefix:].any():
        raise ValueError(f"a mask {keep.shape} selects no token past the {prefix}-token prefix of rows {tokens.shape}")
    scorer = scoring.CacheScorer(model, fmt, calib=calib, **model_kwargs)
    scores = scoring.score_windows(scorer, tokens, prefix, batch)
    return float(np.mean(scores.kl[scores.scored & keep]))


def allowed(position: int, positions: int, option: tuple[int, int]) -> bool:
    """Whether a slot at group `position` may take `option`: anything but 0 bits at the anchor (the
    group's last position, the residual format's "last" reference)."""
    return option[0] > 0 or position != positions - 1


def best_schedule(costs: dict[tuple[str, int, tuple[int, int]], float], positions: int,
                  bits: Callable[[Schedule], Fraction], budget: float,
                  options: Sequence[tuple[int, int]] = OPTIONS) -> tuple[Schedule | None, float]:
    """The schedule with the least Σ costs[(kind, position, option)] whose `bits` ≤ `budget`, by
    exhaustive search over the `allowed` options (a slot at an option without a cost costs 0), and
    that sum; (None, inf) when nothing fits. `bits` is a sum over slots (the format's accounting is), so
    every combination's bits come from one measured delta per (slot, option); the winner's are checked
    against `bits` itself."""
    slots = [(kind, p) for kind in SLOT_KINDS for p in range(positions)]
    base = Schedule.uniform(positions, next(o for o in options if o[0] > 0))
    base_bits = bits(base)
    delta = np.array([[float(bits(base.replace(kind, p, o)) - base_bits) if allowed(p, positions, o) else 0.0
                       for o in options] for kind, p in slots])
    cost = np.array([[costs.get((kind, p, o), 0.0) if allowed(p, positions, o) else np.inf for o in options]
                     for kind, p in slots])
    grid = np.array(list(itertools.product(range(len(options)), repeat=len(slots))))  # [C, slots]
    rows = np.arange(len(slots))
    total_bits = float(base_bits) + delta[rows, grid].sum(axis=1)
    total_cost = np.where(total_bits <= budget + 1e-9, cost[rows, grid].sum(axis=1), np.inf)  # inf: not allowed
    best = int(np.argmin(total_cost))
    if not np.isfinite(total_cost[best]):
        return None, float("inf")
    pick = [options[i] for i in grid[best]]
    schedule = Schedule(tuple(pick[:positions]), tuple(pick[positions:]))
    if bits(schedule) > budget + Fraction(1, 10**9):
        raise AssertionError(f"bits are not additive over slots: {schedule.label()}")
    return schedule, float(total_cost[best])


def allocate(model, tokens: np.ndarray, budgets: Sequence[float], *, num_loops: int, prefix: int = 32,
             batch: int = 16, positions: int = 4, options: Sequence[tuple[int, int]] = OPTIONS,
             reference: tuple[int, int] | None = None, policy: dict | None = None, mask: np.ndarray | None = None,
             measured: dict[str, float] | None = None, progress: Callable[[str, float], None] = lambda *_: None,
             **model_kwargs) -> list[Allocation]:
    """Allocate a `positions`-loop group's K/V slots under each of `budgets` bits per element (see the
    module docstring) on calib rows tokens [N, T]; the single-slot costs are measured once for all
    budgets. `policy`: the other residual fields (rotation, LS, ...). `mask` [N, T] bool: the
    positions whose KL counts (`measure_kl`; default every one). `measured` maps a schedule's label
    to its KL: labels found there are not measured again, new ones are added (a run can resume), and
    `progress(label, kl)` is called after each new measurement. Raises ValueError when no schedule of
    `options` fits a budget."""
    measured = {} if measured is None else measured
    policy = dict(policy or {})
    head_dim = model.config.head_dim
    reference = reference or options[-1]

    def bits(schedule: Schedule) -> Fraction:
        return schedule_bits(schedule, num_loops, head_dim, **policy)

    def kl(schedule: Schedule) -> float:
        label = schedule.label()
        if label not in measured:
            measured[label] = measure_kl(model, schedule.format(**policy), tokens, prefix, batch, mask=mask,
                                         num_loops=num_loops, **model_kwargs)
            progress(label, measured[label])
        return measured[label]

    if reference[0] == 0:
        raise ValueError(f"the reference option {reference[0]}g{reference[1]} must store bits (it is every slot's)")
    ref = Schedule.uniform(positions, reference)

    def cheapest(kind: str, p: int) -> tuple[int, int]:  # bits are a sum over slots: each slot's fewest
        return min((o for o in options if allowed(p, positions, o)), key=lambda o: bits(ref.replace(kind, p, o)))

    fewest = bits(Schedule(*(tuple(cheapest(kind, p) for p in range(positions)) for kind in SLOT_KINDS)))
    if fewest > min(budgets):
        raise ValueError(f"a budget of {min(budgets)} bits per element is below the cheapest schedule's "
                         f"{float(fewest):.4f}")
    start = time.perf_counter()
    ref_kl = kl(ref)
    costs = {}
    for kind in SLOT_KINDS:
        for p in range(positions):
            for option in options:
                if option != reference and allowed(p, positions, option):
                    costs[kind, p, option] = max(kl(ref.replace(kind, p, option)) - ref_kl, 0.0)
    shared = time.perf_counter() - start
    named = {f"{kind}{p}:{b}g{g}": c for (kind, p, (b, g)), c in costs.items()}
    out = []
    for budget in budgets:
        start = time.perf_counter()
        choice, predicted = best_schedule(costs, positions, bits, budget, options)
        chosen_kl = kl(choice)
        out.append(Allocation(budget, choice, float(bits(choice)), chosen_kl, ref_kl + predicted, ref, ref_kl, named,
                              shared + time.perf_counter() - start))
    return out


class MeasuredKL(dict):
    """Every KL measured for a run's settings, by schedule label, kept in a JSON record at `path`
    ({"settings": ..., "kl": {label: KL}}) that `add` rewrites after each measurement, so a rerun with
    the same settings measures only what is missing. Raises `report.SettingsMismatch` when the record
    holds measurements of other settings. `log(line)` hears of each measurement."""

    def __init__(self, path: str, settings: dict, log: Callable[[str], None] = lambda line: None):
        super().__init__()
        self.path, self.settings, self.log = path, settings, log
        if os.path.exists(path):
            with open(path) as f:
                saved = json.load(f)
            if saved.get("settings") != settings:
                raise report.SettingsMismatch(f"{path} holds measurements of other settings "
                                              f"({saved.get('settings')}); use another --out or delete it")
            self.update(saved["kl"])

    def add(self, label: str, kl: float) -> None:
        """Record (and log) a measurement: `allocate`'s `progress`, which has already stored it in `self`."""
        self[label] = kl
        report.write_text(self.path, json.dumps(dict(settings=self.settings, kl=dict(self)), indent=1))
        self.log(f"  measured {label}: KL {kl:.3e} ({len(self)} so far)")


def paper_rule(budget: float) -> LoopQuant:
    """The paper's fixed rule at about `budget` bits, beside which an allocation is measured: [2,2,2,4]
    g32 from its 3.09 bits (at 4 loops) up, residual INT2 g32 below."""
    side = ((2, 32),) * 3 + ((4 if budget >= 3.09375 else 2, 32),)
    return Schedule(side, side).format()


def save_schedule(path: str, schedule: Schedule, policy: dict, meta: dict) -> None:
    """Write `schedule` as a JSON artifact: the residual format's policy (the schedule's fields
    included) that `load_schedule` turns back into the format, and `meta` (what it was measured on,
    `Allocation.to_json()`)."""
    fields = schedule.format(**policy)
    spec = {f.name: getattr(fields, f.name) for f in dataclasses.fields(fields) if f.init and f.name != "name"}
    with open(path, "w") as f:
        json.dump(dict(format="residual", label=schedule.label(), policy=spec, **meta), f, indent=1)


def load_schedule(path: str, **overrides) -> LoopQuant:
    """The residual format a `save_schedule` artifact describes, with `overrides` of its other policy
    fields (rotation, super_scale, ...; not the schedule's own bits and group sizes). Raises ValueError
    for a file that is not one."""
    fixed = sorted(set(overrides) & {"bits", "group_size", "bits_v", "group_size_v"})
    if fixed:
        raise ValueError(f"the schedule {path} fixes {', '.join(fixed)}")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        policy = {k: tuple(v) if isinstance(v, list) else v for k, v in raw["policy"].items()}
        return get_format(raw["format"], **{**policy, **overrides})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{path} is not a bit-allocation schedule (scripts/allocate.py): {err}") from None
