"""Shared base of the decode-kernel tests.

A subclass names its kernel and reference (same signature), its configurations (`CASES`, run and
compared; `LOWER_CASES`, lowered to Triton IR) and how to build inputs for one. The base then checks

* `test_matches_reference`: the kernel against the plain-jnp reference on fresh random inputs (a seed
  per case name), in interpret mode on CPU; with RQ_PALLAS_INTERPRET=0 (scripts/gpu_check.sh) the same
  comparison runs the compiled kernel on a GPU.
* `test_skips_tiles_past_each_length` (`SKIP_CASE`): the kernel folds ceil(lengths[b] / block_s) tiles
  per (row, kv head) and no more, whatever the capacity S and the splits (interpret mode, counted).
* `test_lowers_to_triton`: `jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))` on abstract
  inputs, which runs the whole Pallas -> Triton lowering on a CPU machine and catches what Triton does
  not support (non-power-of-two tiles, small dots, value slicing, unsupported casts).

Tolerances: every kernel splits a float32 operand x into bfloat16 hi + lo before a tensor-core dot,
which represents x to 2^-16 relative, and drops only the lo·lo product; products accumulate in float32.
Key codes are exact in bfloat16 and bf16 cache entries too, so scores carry ~2^-16 relative error
(float32 queries; exact with bfloat16 queries, whose hi half is the query itself), and exp turns a score
error into the same relative error of p. Values see the split of p and of the reconstructed value tile
(offset + scale · code, α-chained, or float32 cache entries: 2^-16 each) and summation-order
differences (~D·2^-24). Measured on these cases (interpret mode): at most 1.0e-5 of the largest |output|
with float32 queries (dense float32 K/V; 8e-6 for the quantized kernel) and 2.2e-6 with bfloat16
queries. The bounds, 2e-4 and 1e-4 of the largest |output|, leave a >= 20x margin (room for GPU
exp/accumulation-order differences) while still catching a wrong scale, offset, α, mask, slot or plane: a
1% change of one link's value offsets already moves acc by 1e-3 of its scale, a missing α or key mean by
1e-2..3e-1.
"""

from __future__ import annotations

import functools
import os
import pathlib
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import configs, decode_common as dc

#: Interpret mode unless RQ_PALLAS_INTERPRET=0 (then the kernels run compiled, on a GPU).
INTERPRET = os.environ.get("RQ_PALLAS_INTERPRET", "1") != "0"
TRITON_CALL = getattr(dc.pltriton, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton")
TOL = {"float32": 2e-4, "bfloat16": 1e-4}
ALLOCATION = pathlib.Path(__file__).resolve().parents[2] / "docs" / "results" / "allocation"


#: RQ_KERNEL_COMPILE=all: every allocated schedule's chains (`allocated_configs`) and, in test_compile.py, the
#: whole configuration matrix; otherwise a covering set of each.
EVERY = os.environ.get("RQ_KERNEL_COMPILE") == "all"


def allocated_configs(every: bool = EVERY) -> dict[str, configs.KernelConfig]:
    """The decode-kernel calls of every schedule the bit allocator emitted for the shipped models
    (docs/results/allocation/MODEL-BUDGET.json): their chains at head dim 64, one query row per kv head
    (both models' shapes), by name; a chain two schedules share appears once. Chains with a 0-bit link
    (a slot that stores only its α) are left out: the kernels decline them and the format's attention
    takes them on XLA (tests/cache/test_formats.py).

    Unless `every`, only the calls that cover them (`covering`): each (bits, group) link of keys and of
    values as an anchor and as a residual, and each chain length, in at least one call (9 of 36 today)."""
    from rq_jax.calibrate.allocate import load_schedule

    out = {}
    for path in sorted(ALLOCATION.glob("*.json")):
        if not path.stem.endswith("-measured"):
            chains = load_schedule(str(path)).kernel_chains(4)
            out.update((c.name, c) for c in configs.schedule_configs(chains, 64, 1, "allocated")
                       if all(bits for bits, _ in c.links + (c.v_links or ())))
    return out if every else {name: out[name] for name in covering(out)}


def covering(cfgs: dict[str, configs.KernelConfig]) -> list[str]:
    """Names of `cfgs` (sorted, greedily: each the one adding the most features not yet covered) whose calls
    together hold every feature of all of them: per role (keys, values), each link (bits, group) as the
    anchor (the chain's last link) and as a residual, and each chain length."""
    def features(cfg):
        out = set()
        for role, links in (("k", cfg.links), ("v", cfg.v_links or ())):
            out |= {(role, i == len(links) - 1, link) for i, link in enumerate(links)} | {(role, len(links))}
        return out

    held = {name: features(cfgs[name]) for name in sorted(cfgs)}
    left, chosen = set().union(*held.values()), []
    while left:
        name = max(held, key=lambda n: len(held[n] & left))
        chosen.append(name)
        left -= held[name]
    return sorted(chosen)


def has_gpu() -> bool:
    return any(d.platform == "gpu" for d in jax.devices())


def seeded(name: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(name.encode()))


def array(rng: np.random.Generator | None, shape, dtype, draw):
    """`draw(rng, shape)` as a jnp array of `dtype`, or its ShapeDtypeStruct when rng is None."""
    if rng is None:
        return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))
    return jnp.asarray(np.asarray(draw(rng, tuple(shape)), np.float32 if dtype != "uint8" else np.uint8)).astype(dtype)


def normal(scale=1.0):
    return lambda rng, shape: scale * rng.standard_normal(shape)


def uniform(lo, hi):
    return lambda rng, shape: rng.uniform(lo, hi, shape)


def random_bytes(rng, shape):
    return rng.integers(0, 256, shape, dtype=np.uint8)


def to_pool(x: jax.Array, page: int, table: np.ndarray, pool_pages: int, fill) -> jax.Array:
    """Contiguous leaves x [M, B, K, S, ...] as a pool [M, NP, K, P, ...] (P = `page`): row b's logical page n
    stored at page table[b, n], every other page filled with `fill`."""
    m, b, k, s = x.shape[:4]
    n, rest = s // page, x.shape[4:]
    pages = x.reshape(m, b, k, n, page, *rest).swapaxes(2, 3).reshape(m, b * n, k, page, *rest)
    pool = jnp.full((m, pool_pages, k, page, *rest), fill, x.dtype)
    return pool.at[:, table.reshape(-1)].set(pages)


def paged_case(cache, lengths: tuple, page: int, seed: str):
    """(`cache`, a pytree of contiguous leaves [M, B, K, S, ...], as pools; block table [B, S/P]): a random
    placement of each row's pages among twice as many pages, NaN (metadata, α, K/V) or 0xff (codes) in the
    pages no row holds, and the table past each row's length pointing nowhere (-1 or past the pool: a kernel
    must not read there)."""
    rng = seeded(seed)
    leaves, tree = jax.tree.flatten(cache)
    b, s = leaves[0].shape[1], leaves[0].shape[3]
    n = s // page
    placed = rng.permutation(2 * b * n)[: b * n].reshape(b, n).astype(np.int32)
    pools = [to_pool(x, page, placed, 2 * b * n, 0xFF if x.dtype == jnp.uint8 else jnp.nan) for x in leaves]
    table = placed.copy()
    for row, length in enumerate(lengths):
        table[row, -(-length // page):] = rng.choice([-1, 10**6])
    return jax.tree.unflatten(tree, pools), jnp.asarray(table)


def assert_partial_close(out, ref, lengths, tol: float):
    """Compare partials (acc [B, K, R, D], m, l [B, K, R]): exact empty rows, relative elsewhere."""
    acc, m, l = (np.asarray(x, np.float64) for x in out)
    racc, rm, rl = (np.asarray(x, np.float64) for x in ref)
    assert acc.shape == racc.shape and m.shape == rm.shape and l.shape == rl.shape
    assert np.isfinite(acc).all() and np.isfinite(m).all() and np.isfinite(l).all()
    empty = np.asarray(lengths) == 0
    if empty.any():
        assert (acc[empty] == 0).all() and (l[empty] == 0).all() and (m[empty] == np.float32(dc.NEG)).all()
    full = ~empty
    if full.any():
        for name, got, want in (("acc", acc, racc), ("l", l, rl), ("m", m, rm)):
            got, want = got[full], want[full]
            scale = max(1.0, float(np.abs(want).max()))
            err = float(np.abs(got - want).max())
            assert err <= tol * scale, f"{name}: max error {err:.3g} > {tol:g} x {scale:.3g}"


class DecodeKernelTestBase:
    """Subclasses set `kernel`, `reference` (staticmethods), `CASES`, `LOWER_CASES` and `make`."""

    CASES: tuple = ()
    LOWER_CASES: tuple = ()
    #: (case, page size) pairs: the case's cache as a shuffled pool of pages read through a block table.
    PAGED_CASES: tuple = ()
    #: The positions of the kernel's cache operands among its arguments (the block table comes last).
    CACHE_ARGS = slice(1, 3)
    #: A case with block_s 16, at most 16 query rows (one row block) and lengths far below S; its shapes
    #: are its own, so its trace (with the counting step below) is not one another test has cached.
    SKIP_CASE = None
    kernel = None
    reference = None

    def make(self, case, rng):
        """(args, static kwargs) for `case`; arrays from `rng`, or ShapeDtypeStructs when rng is None."""
        raise NotImplementedError

    def test_matches_reference(self, case):
        if not INTERPRET and not has_gpu():
            pytest.skip("RQ_PALLAS_INTERPRET=0 needs a GPU")
        args, kw = self.make(case, seeded(case.name))
        out = type(self).kernel(*args, **kw, interpret=INTERPRET)
        ref = type(self).reference(*args, **kw)
        assert_partial_close(out, ref, case.lengths, TOL[case.q_dtype])

    def test_paged_matches_reference(self, paged):
        """Rows read through a block table from a shuffled pool (pages of any size, tiles spanning pages or
        inside one) equal the reference over the contiguous rows; pages no row's length reaches (NaN-filled,
        or named by garbage table entries) are never read."""
        if not INTERPRET and not has_gpu():
            pytest.skip("RQ_PALLAS_INTERPRET=0 needs a GPU")
        case, page = paged
        args, kw = self.make(case, seeded(case.name))
        at = self.CACHE_ARGS
        pools, table = paged_case(args[at], case.lengths, page, case.name)
        out = type(self).kernel(*args[:at.start], *pools, *args[at.stop:], table, **kw, interpret=INTERPRET)
        ref = type(self).reference(*args, **kw)
        assert_partial_close(out, ref, case.lengths, TOL[case.q_dtype])

    def test_skips_tiles_past_each_length(self, monkeypatch):
        """Every online-softmax step the kernel runs (one per tile it folds) is counted with a host
        callback: per row and kv head, the tiles up to the row's length, none past it."""
        case = self.SKIP_CASE
        seen = []
        step = dc.online_softmax

        def counted(scores, m_prev, l_prev):
            jax.debug.callback(lambda: seen.append(1))
            return step(scores, m_prev, l_prev)

        monkeypatch.setattr(dc, "online_softmax", counted)
        args, kw = self.make(case, seeded(case.name))
        jax.block_until_ready(type(self).kernel(*args, **kw, interpret=True))
        assert case.block_s == 16 and case.rows <= 16 and max(case.lengths) < case.s
        assert len(seen) == case.heads * sum(-(-n // 16) for n in case.lengths)

    def test_lowers_to_triton(self, lower_case):
        args, kw = self.make(lower_case, None)
        f = functools.partial(type(self).kernel, **kw)
        lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
        assert TRITON_CALL in lowered.as_text()
