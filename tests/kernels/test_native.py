"""The native CPU kernels (`cpu_kernels`, XLA FFI) against the Pallas kernels' jnp references, and the
formats' attention and generation through them.

Tolerance: the native kernels compute in float32 (codes exact, metadata decoded exactly, products and
sums in float32 in another order than the HIGHEST-precision reference, exp by a polynomial of ~1e-7
relative error over 64-token chunks with an online max); measured at most 3.5e-6 of the largest |output|
on these cases. The bound, 2e-5, leaves
a 5x margin and still catches a wrong scale, offset, α, plane or mask (>= 1e-3, `_base`'s notes).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels
from pallas_kernels import dense_attention as da, residual_attention as ra
from rq_jax.cache import base, get_format
from rq_jax.cache.dense import Dense
from rq_jax.quant import rotation

from . import test_dense_attention as dense_cases, test_residual_attention as quant_cases
from ._base import assert_partial_close, paged_case, seeded

TOL = 2e-5
pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason=f"native kernels: {cpu_kernels.unavailable_reason()}")
Q = quant_cases.Case

#: Beyond the Pallas cases: every code width (1/2/4/8) and group size (16/32/64, and 8 on the channel-by-
#: channel path) at head dims 64/96/128 and the fixtures' 16/24, every metadata dtype, lengths at the
#: 64-token chunk and 512-token context split ± 1, 0, 1 and the full capacity.
NATIVE_CASES = (
    Q("d128-int1-g64-f16meta", 128, 1, ((1, 64), (4, 64)), lengths=(63, 64, 65), s=70, meta="float16"),
    Q("d64-int1-g16", 64, 2, ((1, 16),), lengths=(1, 0, 30), s=30, q_dtype="bfloat16"),
    Q("d96-int4-g32-splits", 96, 1, ((2, 32), (4, 32)), lengths=(511, 512, 513, 1030), s=1030, heads=1),
    Q("d128-chain4-g64", 128, 4, ((2, 64),) * 3 + ((4, 64),), lengths=(600, 1), s=600, means=(True, False, True, True)),
    Q("d24-fixture-g8", 24, 2, ((2, 8), (4, 8)), lengths=(9, 16), s=16, meta="bfloat16", means=(True, True)),
    Q("d16-int8-g16", 16, 3, ((8, 16), (2, 8)), v_links=((4, 16),) * 2, lengths=(5, 2), s=7, meta="float32"),
    Q("d256-rows70", 256, 70, ((2, 32), (4, 32)), lengths=(40, 3), s=40),
)


@pytest.mark.parametrize("cfg", quant_cases.CASES + quant_cases.ALLOCATED_CASES + NATIVE_CASES, ids=lambda c: c.name)
def test_packed_chains_match_the_reference(cfg):
    args, kw = quant_cases.make_inputs(cfg, seeded(cfg.name))
    out = jax.jit(lambda *a: cpu_kernels.residual_decode_attention(*a, **kw))(*args)
    assert_partial_close(out, ra.residual_decode_attention_reference(*args, **kw), cfg.lengths, TOL)


#: Head dims 16 to 256 (1 to 16 AVX-512 registers, up to 64 of the portable build's four lanes: whole and partial
#: blocks of 8 registers), 24 (channel by channel on AVX-512); key means; 70 rows in two blocks; a bfloat16 query;
#: rows split into 512-token slices (each slice rotates its query).
ROTATION_CASES = (NATIVE_CASES[5], NATIVE_CASES[4], Q("d32-gqa", 32, 4, ((2, 16), (4, 16)), lengths=(33, 5), s=40),
                  NATIVE_CASES[1], NATIVE_CASES[3], NATIVE_CASES[6], NATIVE_CASES[2])


@pytest.mark.parametrize("cfg", ROTATION_CASES, ids=lambda c: c.name)
def test_packed_chains_rotate_themselves(cfg):
    """Given the rotations of every slot [M, K, D, D], the kernel takes the queries in the original basis, rotates
    them by its slot's and returns acc there: the reference on rotated queries, its acc un-rotated."""
    (q, *rest), kw = quant_cases.make_inputs(cfg, seeded(cfg.name))
    heads, d, slot = q.shape[1], q.shape[3], rest[-1]
    keys = jax.random.split(jax.random.key(len(cfg.name)), 2 * cfg.slots * heads)
    key_rot, value_rot = (jnp.stack([rotation.random_orthogonal(k, d) for k in half]).reshape(cfg.slots, heads, d, d)
                          for half in (keys[: cfg.slots * heads], keys[cfg.slots * heads:]))
    out = jax.jit(lambda *a: cpu_kernels.residual_decode_attention(*a, **kw, key_rot=key_rot, value_rot=value_rot))(
        q, *rest)
    hi = jax.lax.Precision.HIGHEST
    acc, m, l = ra.residual_decode_attention_reference(
        jnp.einsum("bkrd,ked->bkre", q.astype(jnp.float32), key_rot[slot], precision=hi), *rest, **kw)
    want = (jnp.einsum("bkre,ked->bkrd", acc, value_rot[slot], precision=hi), m, l)
    assert_partial_close(out, want, cfg.lengths, TOL)


DENSE_CASES = dense_cases.CASES + (
    dense_cases.Case("d16-f32kv", 16, 2, lengths=(0, 1, 9), s=9, kv_dtype="float32"),
    dense_cases.Case("d128-bf16-splits", 128, 1, lengths=(513, 64, 1100), s=1100, heads=1, q_dtype="bfloat16"),
    dense_cases.Case("d24-gqa", 24, 4, lengths=(30, 65), s=65),
    dense_cases.Case("d64-rows6", 64, 6, lengths=(17, 40), s=40),  # four rows at a time, then the last four again
)


@pytest.mark.parametrize("cfg", DENSE_CASES, ids=lambda c: c.name)
def test_dense_matches_the_reference(cfg):
    args, _ = dense_cases.make_inputs(cfg, seeded(cfg.name))
    out = jax.jit(cpu_kernels.dense_decode_attention)(*args)
    assert_partial_close(out, da.dense_decode_attention_reference(*args), cfg.lengths, TOL)


PAGED_CASES = (  # (case, page size): pages inside a 64-token chunk, across it, and one page per row
    (Q("d128-loop-g32-paged", 128, 1, ((2, 32), (4, 32)), lengths=(37, 0, 160), s=192), 16),
    (Q("d96-int2-g16-paged", 96, 2, ((2, 16), (4, 32)), lengths=(130, 1), s=256, means=(True, False)), 128),
    (Q("d64-anchor-paged-bf16", 64, 1, ((4, 32),), lengths=(64, 63), s=64, meta="bfloat16"), 64),
)


@pytest.mark.parametrize("cfg,page", PAGED_CASES, ids=lambda c: getattr(c, "name", str(c)))
def test_packed_chains_through_a_block_table(cfg, page):
    """Rows read through a block table from a shuffled pool of pages equal the reference over the contiguous
    rows; pages no row's length reaches (NaN-filled, or named by garbage table entries) are never read."""
    (q, keys, values, k_alpha, v_alpha, means, lengths, slot), kw = quant_cases.make_inputs(cfg, seeded(cfg.name))
    (pk, pv, pka, pva), table = paged_case((keys, values, k_alpha, v_alpha), cfg.lengths, page, cfg.name)
    out = jax.jit(lambda *a: cpu_kernels.residual_decode_attention(*a, **kw))(
        q, pk, pv, pka, pva, means, lengths, slot, table)
    want = ra.residual_decode_attention_reference(q, keys, values, k_alpha, v_alpha, means, lengths, slot, **kw)
    assert_partial_close(out, want, cfg.lengths, TOL)


def test_dense_through_a_block_table():
    cfg = dense_cases.Case("d128-paged", 128, 1, lengths=(100, 0, 257), s=320)
    q, k, v, lengths, slot = dense_cases.make_inputs(cfg, seeded(cfg.name))[0]
    (pk, pv), table = paged_case((k, v), cfg.lengths, 32, cfg.name)
    out = jax.jit(cpu_kernels.dense_decode_attention)(q, pk, pv, lengths, slot, table)
    assert_partial_close(out, da.dense_decode_attention_reference(q, k, v, lengths, slot), cfg.lengths, TOL)


def test_a_page_outside_the_pool_is_named():
    cfg = dense_cases.Case("d64-bad-page", 64, 1, lengths=(40, 8), s=64)
    q, k, v, lengths, slot = dense_cases.make_inputs(cfg, seeded(cfg.name))[0]
    (pk, pv), table = paged_case((k, v), cfg.lengths, 16, cfg.name)
    with pytest.raises(Exception, match="block table names page 99 of a pool of 16 .row 1, page 0."):
        jax.block_until_ready(cpu_kernels.dense_decode_attention(q, pk, pv, lengths, slot, table.at[1, 0].set(99)))
    with pytest.raises(ValueError, match="block_table must be integer"):
        cpu_kernels.dense_decode_attention(q, pk, pv, lengths, slot, table[:1])
    with pytest.raises(ValueError, match="a paged pool needs a block_table"):
        cpu_kernels.dense_decode_attention(q, pk, pv, lengths, slot)


def test_same_bits_at_any_thread_count(monkeypatch):
    """Work items merge in a fixed order: one thread and two (a helper woken whatever the work) give the same
    bits."""
    case = NATIVE_CASES[2]
    args, kw = quant_cases.make_inputs(case, seeded(case.name))
    run = jax.jit(lambda *a: cpu_kernels.residual_decode_attention(*a, **kw))
    monkeypatch.setenv("RQ_CPU_HELPER_NS", "0")
    two = [np.asarray(x) for x in run(*args)]
    monkeypatch.setenv("RQ_CPU_THREADS", "1")
    one = [np.asarray(x) for x in run(*args)]
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a, b)


def test_portable_build_matches_the_reference():
    """The baseline x86-64 kernels (RQ_CPU_ISA=generic, chosen at load time) give the reference's partials
    (rotating themselves too), and their encoder (its own floor, four lanes) XLA's bits."""
    code = ("import jax, numpy as np, cpu_kernels;"
            "from tests.kernels import test_native as t, test_residual_attention as qc;"
            "from tests.kernels._base import seeded, assert_partial_close;"
            "from pallas_kernels import residual_attention as ra;"
            "assert cpu_kernels.isa() == 'generic', cpu_kernels.isa();"
            "[assert_partial_close(cpu_kernels.residual_decode_attention(*a, **k),"
            " ra.residual_decode_attention_reference(*a, **k), c.lengths, t.TOL)"
            " for c in t.NATIVE_CASES[:3] for a, k in [qc.make_inputs(c, seeded(c.name))]];"
            "[t.test_packed_chains_rotate_themselves(c) for c in t.ROTATION_CASES[:2]];"
            "[t.test_native_write_equals_the_xla_write_bit_for_bit(label) for label in list(t.WRITE_FORMATS)[:4]];"
            "print('ok')")
    env = dict(os.environ, RQ_CPU_ISA="generic")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_vmap_over_a_leading_axis():
    case = NATIVE_CASES[0]
    args, kw = quant_cases.make_inputs(case, seeded(case.name))
    qs = jnp.stack([args[0], 2 * args[0]])
    batched = jax.vmap(lambda q: cpu_kernels.residual_decode_attention(q, *args[1:], **kw))(qs)
    for i in range(2):
        single = cpu_kernels.residual_decode_attention(qs[i], *args[1:], **kw)
        for a, b in zip(batched, single):
            np.testing.assert_array_equal(np.asarray(a[i]), np.asarray(b))


FORMATS = {
    "dense bf16": Dense("bfloat16"), "dense f32": Dense("float32"),
    "uniform INT4 g16": get_format("uniform", bits=4, group_size=16),
    "rotated INT2 g8": get_format("rotated", bits=2, group_size=8),
    "residual [2,2,2,4] g8 means": get_format("residual", group_size=8, key_means=True),
    "residual [2,4,2,4] super-scale bf16 meta": get_format("residual", bits=(2, 4, 2, 4), group_size=(8, 16, 8, 16),
                                                           meta_dtype="bfloat16", super_scale=True),
    "residual previous-loop reference": get_format("residual", group_size=8, reference="previous"),
}


@pytest.mark.parametrize("label", FORMATS)
def test_formats_attend_natively_as_the_reference(label, caplog):
    """Each format's `attend` through the native op equals `reference_attend` (decode, then dense), for
    every group position, with no fallback logged."""
    fmt = dataclasses.replace(FORMATS[label], attend_impl="native")
    seg = base.Segment(0, 1, fmt.group_len)
    rng = seeded(label)
    b, heads, kv_heads, d, s = 3, 4, 2, 16, 40
    kv = [jnp.asarray(rng.normal(size=(1, seg.size, 1, b, kv_heads, s, d)), jnp.float32) for _ in range(2)]
    lengths = jnp.array([40, 0, 17])
    calib = fmt.calibrate(seg, *kv, lengths)
    state = fmt.write(fmt.init(seg, 1, b, s, kv_heads, d), *kv, jnp.zeros(b, jnp.int32), lengths, calib).state
    q = jnp.asarray(rng.normal(size=(b, 1, heads, d)), jnp.float32)
    with caplog.at_level("WARNING"):
        for loop in range(seg.size):
            got = jax.jit(lambda st, q: fmt.attend(st, (0, 0), loop, q, lengths, calib))(state, q)
            want = base.reference_attend(fmt, state, (0, 0), loop, q, lengths, calib)
            for a, w in zip(got, want):
                np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-4, atol=1e-4)
    assert "attend_impl='native' does not cover" not in caplog.text


def test_generation_equals_xla():
    """Greedy tokens through the native residual attention equal XLA's (the shipped Huginn)."""
    from rq_jax import TextGenerator

    out = {impl: TextGenerator("checkpoints/huginn-small", cache="residual", max_new_tokens=7, attend_impl=impl)(
        ["62217+89000=", "21000+43000="]) for impl in ("native", "xla")}
    assert out["native"] == out["xla"] == ["423170", "640000"]


def test_without_the_library_everything_runs_on_xla():
    """RQ_JAX_NATIVE=0 (as where no compiler exists): the kernels say why, the formats fall back to XLA
    with one logged line, and generation gives the same answer."""
    code = ("import logging, cpu_kernels; logging.basicConfig(level=logging.WARNING);"
            "from rq_jax import generate; assert not cpu_kernels.available();"
            "print(cpu_kernels.unavailable_reason()); print(generate('62217+89000='))")
    done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, RQ_JAX_NATIVE="0"), capture_output=True,
                          text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["turned off (RQ_JAX_NATIVE=0)", "423170"]
    assert "attend_impl='native' does not cover this slot (native CPU kernels turned off" in done.stderr


def test_bad_input_is_named():
    """Shapes that disagree raise ValueError naming them; what the kernels do not cover raises
    NotImplementedError (the op then falls back to XLA)."""
    cfg = NATIVE_CASES[0]
    args, kw = quant_cases.make_inputs(cfg, seeded(cfg.name))
    with pytest.raises(ValueError, match="lengths must be"):
        cpu_kernels.residual_decode_attention(*args[:6], args[6][:1], args[7], **kw)
    with pytest.raises(NotImplementedError, match="query dtype float16"):
        cpu_kernels.residual_decode_attention(args[0].astype(jnp.float16), *args[1:], **kw)
    with pytest.raises(NotImplementedError, match="3-bit codes"):
        cpu_kernels.residual_decode_attention(*args, **{**kw, "k_bits": (3, 4)})
    u = jnp.eye(args[0].shape[3])
    with pytest.raises(ValueError, match="key_rot and value_rot come together"):
        cpu_kernels.residual_decode_attention(*args, **kw, key_rot=jnp.stack([u, u]))
    with pytest.raises(ValueError, match=r"rotations must be float32 \[2, 2, 128, 128\] \(the links' slot axes, "
                                         r"then \[K, D, D\]\), got float32\[2, 128, 128\]"):
        cpu_kernels.residual_decode_attention(*args, **kw, key_rot=jnp.stack([u, u]), value_rot=jnp.stack([u, u]))
    q, k, v, lengths, slot = dense_cases.make_inputs(DENSE_CASES[0], seeded("bad"))[0]
    with pytest.raises(ValueError, match="want k = v"):
        cpu_kernels.dense_decode_attention(q, k, v[..., :8], lengths, slot)


# ---- the write's encoder ---------------------------------------------------------------------------------


#: Schedules the bit allocator emitted for the shipped models: per-link groups with K and V apart, 0-bit loops
#: between stored ones, a 0-bit pair before a 2-bit anchor, g16 throughout.
SCHEDULES = ("huginn-3.6875", "huginn-share-2.6875", "ouro-share-1.6875", "ouro-answers-3.6875")


def _schedules() -> dict:
    from rq_jax.calibrate.allocate import load_schedule

    from ._base import ALLOCATION
    return {name: load_schedule(str(ALLOCATION / f"{name}.json")) for name in SCHEDULES}


WRITE_FORMATS = {
    "residual [2,2,2,4] g32": get_format("residual"),
    "residual [2,2,2,4] g16 bf16 meta, key means": get_format("residual", group_size=16, meta_dtype="bfloat16",
                                                             key_means=True),
    "residual previous-loop reference, no LS": get_format("residual", reference="previous", least_squares=False),
    "residual next-loop reference, INT1/INT8": get_format("residual", bits=(1, 8, 2, 4), group_size=(64, 16, 32, 32),
                                                          reference="next"),
    "uniform INT4 g16": get_format("uniform", bits=4, group_size=16),
    "rotated INT2 [2,2,2,4] direct": get_format("rotated", bits=(2, 2, 2, 4)),
    **{f"allocated {name}": fmt for name, fmt in _schedules().items()},
}


@pytest.mark.parametrize("label", WRITE_FORMATS)
def test_native_write_equals_the_xla_write_bit_for_bit(label):
    """The native encoder's codes, metadata, α and out-of-range counts equal XLA's bit for bit (a full group
    of 4 loops and a partial one of 3, as Huginn's last group; keys far outside FP8's range and non-finite
    entries among them), and every other row and position of a state full of random bytes is untouched."""
    fmt = WRITE_FORMATS[label]
    rng = seeded(label)
    b, kv_heads, d, s, t = 3, 2, 64, 24, 5
    partial = (base.Segment(0, 1, fmt.group_len - 1),) if fmt.group_len > 1 else ()
    for seg in (base.Segment(0, 2, fmt.group_len), *partial):
        k, v = (rng.normal(size=(seg.groups, seg.size, 2, b, kv_heads, t, d)) * scale for scale in (3.0, 1.0))
        k[0, 0, 0, 1, 0, 2, :8] *= 1e4  # metadata saturating at 448
        k[-1, -1, 1, 2, 1, 0, 5] = np.nan
        v[0, -1, 0, 0, 0, 4, 9] = np.inf
        k, v = jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32)
        calib = fmt.calibrate(seg, k, v, jnp.full((b,), t))
        empty = fmt.init(seg, 2, b, s, kv_heads, d)
        state = jax.tree_util.tree_map(lambda x: base.values_of(jnp.asarray(
            rng.integers(0, 256, x.shape * np.array([1] * (x.ndim - 1) + [x.dtype.itemsize])), jnp.uint8)
            .view(f"uint{8 * x.dtype.itemsize}"), x.dtype) if x.size else x, empty)
        lengths, num_new = jnp.array([0, 19, 7]), jnp.array([5, 3, 0])
        out = {impl: jax.jit(lambda st, k, v, f=dataclasses.replace(fmt, write_impl=impl): f.write(
            st, k, v, lengths, num_new, calib))(state, k, v) for impl in ("xla", "native")}
        assert int(out["xla"].out_of_range.sum()) > 0
        np.testing.assert_array_equal(out["native"].out_of_range, out["xla"].out_of_range)
        untouched = np.ones((b, s), bool)
        for row, (start, n) in enumerate(zip(lengths.tolist(), num_new.tolist())):
            untouched[row, start : start + n] = False
        for old, x, n in zip(*(jax.tree_util.tree_leaves(t) for t in (state, out["xla"].state, out["native"].state))):
            np.testing.assert_array_equal(base.bits_of(n), base.bits_of(x))
            keep = np.broadcast_to(untouched.reshape((1, 1, b, 1, s) + (1,) * (old.ndim - 5)), old.shape)
            np.testing.assert_array_equal(np.asarray(base.bits_of(n))[keep], np.asarray(base.bits_of(old))[keep])


def test_native_encoder_declines_by_name(caplog):
    """Super-scaled metadata is XLA's alone: the write falls back with its reason logged, and stores XLA's bits."""
    fmt = get_format("residual", super_scale=True, write_impl="native")
    seg = base.Segment(0, 1, 4)
    k = jnp.asarray(seeded("decline").normal(size=(1, 4, 1, 2, 1, 3, 32)), jnp.float32)
    calib = fmt.default_calib(seg, 1, 1, 32)
    with caplog.at_level("WARNING"):
        out = fmt.write(fmt.init(seg, 1, 2, 4, 1, 32), k, k, jnp.zeros(2, jnp.int32), jnp.full(2, 3), calib)
    assert "write_impl='native' does not cover this slot (super-scaled metadata" in caplog.text
    want = dataclasses.replace(fmt, write_impl="xla").write(fmt.init(seg, 1, 2, 4, 1, 32), k, k,
                                                            jnp.zeros(2, jnp.int32), jnp.full(2, 3), calib)
    for a, w in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(base.bits_of(a), base.bits_of(w))


def test_native_encoder_codes_only_each_rows_new_tokens():
    """With num_new, a row's tokens t < num_new[b] get the results of coding every token (they do not depend
    on one another), and the rest, a call's padding, are zeros: codes, metadata, α and lost counts."""
    z = jnp.asarray(seeded("num_new").normal(size=(2, 4, 3, 5, 64)), jnp.float32)  # [K, L, B, T, D]
    kw = dict(bits=(2, 2, 2, 4), group_sizes=(32,) * 4, clips=(0.9, 0.9, 0.9, 1.0), parents=(3, 3, 3, -1),
              order=(3, 0, 1, 2), least_squares=True, meta_dtype=jnp.float8_e4m3fn)
    num_new = jnp.array([5, 2, 0], jnp.int32)
    new = (np.arange(5)[None, :] < np.asarray(num_new)[:, None])[:, None, :]  # [B, 1, T] against lead [B, K, T]
    every, some = (jax.tree_util.tree_leaves(cpu_kernels.residual_encode(z, num_new=n, **kw)) for n in (None, num_new))
    assert len(every) == len(some) == 4 * 3 + 2
    skipped = 0
    for a, b in zip(every, some):
        a, b = np.asarray(base.bits_of(a)), np.asarray(base.bits_of(b))
        at = 1 if a.shape[1:] == (3, 2, 5) else 0  # α: rows of vectors; the rest: vectors first
        keep = np.broadcast_to(new.reshape((1,) * at + new.shape + (1,) * (a.ndim - at - 3)), a.shape)
        np.testing.assert_array_equal(b[keep], a[keep])
        assert not b[~keep].any()
        skipped += int(a[~keep].any())
    assert skipped == 4 * 3 + 1  # every result but the lost counts (none here) held something there


def test_native_encoder_bad_input_is_named():
    z = jnp.zeros((1, 2, 1, 3, 32), jnp.float32)  # [K, L, B, T, D]
    kw = dict(bits=(2, 4), group_sizes=(32, 32), clips=(0.9, 1.0), parents=(1, -1), order=(1, 0), least_squares=True,
              meta_dtype=jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="need one entry each"):
        cpu_kernels.residual_encode(z, **{**kw, "bits": (2,)})
    with pytest.raises(ValueError, match="in groups of 24 do not divide head dim 32"):
        cpu_kernels.residual_encode(z, **{**kw, "group_sizes": (24, 32)})
    with pytest.raises(NotImplementedError, match="3-bit codes"):
        cpu_kernels.residual_encode(z, **{**kw, "bits": (3, 4)})
    with pytest.raises(NotImplementedError, match="metadata dtype float16"):
        cpu_kernels.residual_encode(z, **{**kw, "meta_dtype": jnp.float16})
    with pytest.raises(ValueError, match=r"z must be \[\.\.\., K, L, B, T, D\], got shape \(2, 3, 32\)"):
        cpu_kernels.residual_encode(z[0, :, 0], **kw)
    with pytest.raises(ValueError, match=r"num_new must be \[B\] = \[1\]"):
        cpu_kernels.residual_encode(z, num_new=jnp.ones(3, jnp.int32), **kw)


# ---- the write's store -----------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [1, 9], ids=["decode", "chunk"])
def test_store_equals_xla_page_by_page_write(tokens):
    """The native store (every leaf in one call) leaves a pool of random bytes as XLA's page-by-page write
    (`base._write_pages`) does, bit for bit: leaves of every stored dtype and trailing shape, rows whose
    tokens cross a page, end at the table's last page (the rest dropped), or add none; and it aliases the
    pool (updated in place)."""
    rng = seeded(f"store{tokens}")
    pages, page, cols, rows = 12, 4, 3, 4
    lengths = jnp.array([0, 6, 10, 2], jnp.int32)  # row 2 reaches past its 3 pages
    num_new = jnp.array([tokens, tokens, tokens, 0], jnp.int32)
    table = jnp.asarray(rng.permutation(pages)[: rows * cols].reshape(rows, cols), jnp.int32)
    shapes = [((2, 3), (5,), jnp.uint8), ((2, 3), (2,), jnp.float8_e4m3fn), ((2, 3), (), jnp.bfloat16),
              ((1, 4), (16,), jnp.float32), ((2, 3), (), jnp.int32)]

    def random(shape, dtype):
        width = jnp.dtype(dtype).itemsize
        raw = rng.integers(0, 256, (*shape[:-1], shape[-1] * width) if shape else (width,), dtype=np.uint8)
        return base.values_of(jnp.asarray(raw.view(f"uint{8 * width}").reshape(shape)), dtype)

    pool = [random((*lead, pages, 2, page, *tail), dt) for lead, tail, dt in shapes]
    new = [random((*lead, rows, 2, tokens, *tail), dt) for lead, tail, dt in shapes]
    want = [base._write_pages(x, y, lengths, num_new, table) for x, y in zip(pool, new)]
    store = jax.jit(cpu_kernels.store_tokens, donate_argnums=0)
    text = store.lower(pool, new, lengths, num_new, table).as_text()
    assert "output_operand_alias" in text  # the FFI call's own aliasing, not only the jit's donation
    got = store(pool, new, lengths, num_new, table)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(base.bits_of(g), base.bits_of(w))


def test_store_bad_input_is_named():
    pool = [jnp.zeros((1, 1, 4, 1, 4, 8), jnp.uint8)]
    new = [jnp.ones((1, 1, 2, 1, 1, 8), jnp.uint8)]
    lengths, num_new, table = jnp.array([0, 3]), jnp.array([1, 1]), jnp.array([[0], [9]])
    with pytest.raises(Exception, match="block table names page 9 of a pool of 4 .row 1, page 0."):
        jax.block_until_ready(cpu_kernels.store_tokens(pool, new, lengths, num_new, table))
    with pytest.raises(ValueError, match=r"does not fit pool leaf"):
        cpu_kernels.store_tokens(pool, [new[0][..., :4]], lengths, num_new, table)
    with pytest.raises(ValueError, match=r"want lengths, num_new \[B\]"):
        cpu_kernels.store_tokens(pool, new, lengths, num_new[:1], table)
