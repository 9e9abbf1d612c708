"""Every cache format against its reference, the one-path dataflow, compile-once, and exact bytes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rq_jax.cache import CacheCalib, Dense, LoopQuant, RotationCalib, base, cache_nbytes, default_calib, get_format
from rq_jax.cache import loop_quant
from rq_jax.cache.base import segments, split_loops
from rq_jax.cache.kv import init_cache
from rq_jax.config import preset
from rq_jax.cache.kv_error import dense_kv, reconstruction_error
from rq_jax.sampling import Sampler, SamplingConfig

# Policies small enough for the fixtures' head dims (Ouro 16, Huginn 24): channel groups of 8.
LOOP_POLICIES = {
    "uniform": dict(group_size=8),
    "rotated": dict(group_size=8),
    "rotated-random": dict(group_size=8, rotation="random"),
    "direct-2224": dict(group_size=8, bits=(2, 2, 2, 4), rotation="identity", residual=False),
    "residual": dict(group_size=8),
    "residual-alpha1": dict(group_size=8, least_squares=False),
    "residual-previous": dict(group_size=8, bits=(4, 2, 2, 2), reference="previous"),
    "residual-next": dict(group_size=8, reference="next"),
    "residual-first": dict(group_size=(8, 8, 8, 8), bits=(4, 2, 2, 2), reference="first"),
    "residual-kv": dict(group_size=8, bits=(2, 2, 2, 4), bits_v=(4, 2, 2, 2), group_size_v=(4, 8, 8, 8)),
    "direct-kv": dict(group_size=8, bits=(2, 2, 2, 4), bits_v=(2, 2, 2, 2), rotation="identity", residual=False),
    "residual-0bit": dict(group_size=8, bits=(2, 0, 0, 4), bits_v=(0, 2, 0, 4)),
}


def loop_format(key):
    name = key.split("-")[0]
    name = "uniform" if name == "direct" else name
    return get_format(name, **LOOP_POLICIES[key])


def random_kv(rng, loops, layers, batch, heads, seq, dim):
    shape = (loops, layers, batch, heads, seq, dim)
    shared = rng.normal(size=shape[1:]) * 2  # loops share structure, as in looped models
    k = shared + 0.3 * rng.normal(size=shape)
    return jnp.asarray(k, jnp.float32), jnp.asarray(rng.normal(size=shape), jnp.float32)


def write_stack(fmt, num_loops, k, v, lengths, num_new, states=None, calibs=None):
    """Write per-loop K/V [L, N, B, K, T, D] into every segment of a format's stack (built if None)."""
    segs = segments(num_loops, fmt.group_len)
    _, layers, batch, heads, _, dim = k.shape
    states = states or [fmt.init(seg, layers, batch, 12, heads, dim) for seg in segs]
    calibs = calibs or [fmt.default_calib(seg, layers, heads, dim) for seg in segs]
    states = [fmt.write(st, split_loops(k, seg), split_loops(v, seg), lengths, num_new, c).state
              for seg, st, c in zip(segs, states, calibs)]
    return segs, states, calibs


@pytest.mark.parametrize("key", sorted(LOOP_POLICIES))
def test_fused_attend_equals_dequantize_then_dense(key, num_loops=6):
    """attend (fused, rotated space) == reconstruct + dense attention, after two ragged writes. Six loops
    in groups of four: a full group and a partial one.

    Both sides are float32 sums of the same ≤ 16·D products; 2e-5 bounds their rounding difference.
    """
    rng = np.random.default_rng(0)
    fmt = loop_format(key)
    dims = dict(loops=num_loops, layers=2, batch=2, heads=2, dim=16)
    segs = segments(num_loops, fmt.group_len)
    calibs = [fmt.default_calib(seg, 2, 2, 16) for seg in segs]
    if fmt.residual:  # exercise key means too
        calibs = [c._replace(key_mean=jnp.asarray(rng.normal(size=(seg.groups, 2, seg.size, 2, 16)), jnp.float32))
                  for seg, c in zip(segs, calibs)]
    lengths, states = jnp.zeros(2, jnp.int32), None
    for num_new in ([5, 3], [4, 6]):
        k, v = random_kv(rng, seq=6, **dims)
        _, states, _ = write_stack(fmt, num_loops, k, v, lengths, jnp.asarray(num_new), states, calibs)
        lengths = lengths + jnp.asarray(num_new)
    q = jnp.asarray(rng.normal(size=(2, 3, 4, 16)), jnp.float32)  # GQA: 4 query heads on 2 kv heads
    for seg, state, calib in zip(segs, states, calibs):
        for g in range(seg.groups):
            for r in range(seg.size):
                fused = base.finalize(fmt.attend(state, (g, 1), r, q, lengths, calib))
                ref = base.finalize(base.reference_attend(fmt, state, (g, 1), r, q, lengths, calib))
                np.testing.assert_allclose(fused, ref, atol=2e-5)


def test_a_prompt_over_rows_with_no_past_gets_the_partial_over_no_key():
    """A prompt call (T > 1) whose rows hold no past gets the reference's partial over no key (m = −∞, l = 0,
    acc 0) from `LoopQuant.attend`'s skipped read (that it is skipped: the next test's log)."""
    rng = np.random.default_rng(0)
    fmt = loop_format("residual")
    seg = segments(4, fmt.group_len)[0]
    state, calib = fmt.init(seg, 2, 2, 12, 2, 16), fmt.default_calib(seg, 2, 2, 16)
    q = jnp.asarray(rng.normal(size=(2, 3, 4, 16)), jnp.float32)
    empty = jnp.zeros(2, jnp.int32)
    got = jax.jit(lambda state: fmt.attend(state, (0, 1), 0, q, empty, calib))(state)
    for x, y in zip(got, base.reference_attend(fmt, state, (0, 1), 0, q, empty, calib)):
        np.testing.assert_array_equal(x, y)


class Spy(LoopQuant):
    """Logs, while the compiled program runs, the stored lengths every read of the past (`_attend`, which
    `attend` skips in a prompt call over rows that hold none) and every write sees."""

    def __init__(self, log, **policy):
        super().__init__(**policy)
        object.__setattr__(self, "log", log)

    def __hash__(self):
        return id(self)

    def _attend(self, state, index, loop, q, lengths, calib, visible, table):
        jax.debug.callback(lambda n: self.log.append(("attend", np.asarray(n).tolist())), lengths)
        return super()._attend(state, index, loop, q, lengths, calib, visible, table)

    def write(self, state, k, v, lengths, num_new, calib, table=None):
        jax.debug.callback(lambda n: self.log.append(("write", np.asarray(n).tolist())), lengths)
        return super().write(state, k, v, lengths, num_new, calib, table)


def test_current_tokens_are_never_read_back_during_their_loops(ouro):
    model, ref = ouro
    log = []
    fmt = Spy(log, group_size=8)
    ids = jnp.asarray(ref["input_ids"])
    cache = model.init_cache(2, 12, fmt)
    calib = default_calib(cache)
    first = model(ids[:, :6], cache, calib=calib)
    # An empty cache: every loop attended to the prompt's own full-precision K/V only.
    np.testing.assert_allclose(first.logits, model(ids).logits[:, :6], atol=1e-5)
    second = model(ids[:, 6:], first.cache, calib=calib)  # a second prompt turn
    jax.block_until_ready(model(ids[:, :1], second.cache, calib=calib))
    jax.effects_barrier()
    attends = [lens for op, lens in log if op == "attend"]
    writes = [lens for op, lens in log if op == "write"]
    assert writes == [[0, 0], [6, 6], [10, 10]]  # one write per call, after all loops
    # 4 loops × 2 layers, only already-stored tokens; the first prompt, with none stored, reads nothing.
    assert attends == [[6, 6]] * 8 + [[10, 10]] * 8


@pytest.mark.parametrize("family,name,policy", [("ouro", "uniform", dict(group_size=8)),
                                                ("ouro", "residual", dict(group_size=8)),
                                                ("huginn", "residual", dict(group_size=8))])
def test_decode_compiles_once_per_shape(family, name, policy, request):
    model, ref = request.getfixturevalue(family)
    kw = {} if family == "ouro" else dict(num_loops=4)
    sampler = Sampler(model, SamplingConfig(max_new_tokens=3), get_format(name, **policy), **kw)
    first = sampler(ref["input_ids"].tolist())
    sampler(ref["input_ids"][::-1].tolist())
    assert sampler.num_compiled() == 2
    assert first.tokens.shape == (2, 3) and np.all(first.num_generated == 3)


@pytest.mark.parametrize("key", ["uniform", "rotated", "direct-2224", "residual", "residual-previous", "residual-kv",
                                 "direct-kv", "residual-0bit"])
@pytest.mark.parametrize("num_loops", [4, 8, 6])
def test_bytes_equal_the_toolbox_accounting(key, num_loops):
    fmt = loop_format(key)
    config = preset("ouro-tiny").replace(num_layers=3)  # 4 kv heads of 16
    cache = init_cache(config, 2, 32, fmt, num_loops=num_loops)
    elements = 2 * num_loops * 3 * 2 * 4 * 32 * 16  # K and V
    assert cache_nbytes(cache) == fmt.bits_per_element(num_loops, 16) * elements / 8


def test_paper_accounting_for_ouro_and_huginn():
    residual = get_format("residual")  # [2,2,2,4], g32, FP8 metadata, BF16 α
    assert residual.bits_per_element(4, 128) == 3.09375
    assert get_format("residual", bits=(2, 2, 2, 2)).bits_per_element(4, 128) == 2.59375
    assert residual.bits_per_element(32, 96) == 3.125  # Huginn 8×[2,2,2,4] g32
    assert get_format("uniform", group_size=32).bits_per_element(4, 128) == 2.5


def test_a_0_bit_residual_reads_its_reference_scaled():
    """A 0-bit loop stores only its least-squares α: it reconstructs as α·(the anchor's reconstruction)
    exactly, is 16/D bits per element (the α), and no anchor or direct loop may be 0 bits."""
    rng = np.random.default_rng(3)
    fmt = get_format("residual", bits=(0, 2, 0, 4), group_size=8, rotation="identity")
    k, v = random_kv(rng, loops=4, layers=1, batch=1, heads=2, seq=5, dim=16)
    lengths = jnp.asarray([5])
    _, (state,), (calib,) = write_stack(fmt, 4, k, v, jnp.zeros(1, jnp.int32), lengths)
    anchor_k, _ = fmt.reconstruct(state, (0, 0), 3, lengths, calib)
    for r in (0, 2):
        got, _ = fmt.reconstruct(state, (0, 0), r, lengths, calib)
        alpha = state[r].k_alpha[0, 0].astype(jnp.float32)[..., None]  # [B, K, S, 1]
        np.testing.assert_array_equal(got, alpha * anchor_k)
    # Per loop: 0, INT2 + 16 metadata bits per 8 channels, 0, INT4 + the same; three α of 16 bits per 16.
    assert fmt.bits_per_element(4, 16) == (0 + (2 + 2) + 0 + (4 + 2)) / 4 + 3 * 16 / (4 * 16)
    for policy in (dict(bits=(2, 2, 2, 0)), dict(bits=(0, 2, 2, 4), residual=False)):
        with pytest.raises(ValueError, match="0 bits|0-bit loop"):
            get_format("residual", group_size=8, **policy)


def test_huginn_partial_last_group_keeps_its_int4_anchor():
    fmt = get_format("residual", group_size=8)
    assert segments(6, fmt.group_len) == (base.Segment(0, 1, 4), base.Segment(4, 1, 2))
    assert fmt.group_config(2).bits == (2, 4)
    cache = init_cache(preset("huginn-tiny").replace(head_dim=16, hidden_size=64), 1, 4, fmt, num_loops=6)
    assert [[slot.k.codes.shape[-1] for slot in seg] for seg in cache.looped] == [[4, 4, 4, 8], [4, 8]]
    assert [[slot.k.bits for slot in seg] for seg in cache.looped] == [[2, 2, 2, 4], [2, 4]]


def test_dense_and_8bit_formats_track_dense_logits(ouro):
    """Prefill + decode through each format stays close to the dense-cache logits.

    INT8 with FP8 metadata: the fp8 offset/scale (3 mantissa bits) can clip a group's extremes by
    up to ~6%, which moves the tiny random model's logits (|logits| ~ 10) by < 0.5.
    """
    model, ref = ouro
    ids = jnp.asarray(ref["input_ids"])
    full = model(ids).logits
    for fmt, tol in ((Dense("float32"), 1e-4), (get_format("uniform", bits=(8,), group_size=8), 0.5),
                     (get_format("residual", bits=(8, 8, 8, 8), group_size=8), 0.5)):
        cache = model.init_cache(2, 10, fmt)
        calib = default_calib(cache)
        out = model(ids[:, :8], cache, calib=calib)
        out = model(ids[:, 8:], out.cache, calib=calib)
        assert float(jnp.max(jnp.abs(out.logits - full[:, 8:]))) <= tol, fmt


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_residual_reconstructs_better_than_uniform_and_rotated(family, request):
    """K/V NMSE on the fixtures' real K/V (8 Huginn steps = two groups of 4), channel groups of 8.

    Measured (K / V): Ouro uniform INT2 0.055/0.054, rotated INT2 0.055/0.054, residual [2,2,2,4]
    0.029/0.028; Huginn uniform 0.055/0.054, rotated 0.055/0.053, residual 0.011/0.012.
    """
    model, ref = request.getfixturevalue(family)
    loops = 4 if family == "ouro" else 8
    k, v = dense_kv(model, jnp.asarray(ref["input_ids"]), loops)
    err = {name: reconstruction_error(get_format(name, group_size=8), k, v) for name in
           ("uniform", "rotated", "residual")}
    for kind in ("k", "v"):
        assert err["residual"][kind].mean() < 0.6 * err["uniform"][kind].mean()
        assert err["residual"][kind].mean() < 0.6 * err["rotated"][kind].mean()


def test_calibrated_rotations_and_means_are_used():
    fmt = get_format("residual", group_size=8)
    rng = np.random.default_rng(1)
    k, v = random_kv(rng, loops=4, layers=1, batch=1, heads=2, seq=8, dim=16)
    default = reconstruction_error(fmt, k, v)
    identity = jnp.broadcast_to(jnp.eye(16), (1, 1, 2, 16, 16))
    calib = (RotationCalib(identity, identity, key_mean=jnp.zeros((1, 1, 4, 2, 16))),)
    assert not np.allclose(reconstruction_error(fmt, k, v, calib)["k"], default["k"])
    np.testing.assert_allclose(reconstruction_error(fmt, k, v, calib)["k"],
                               reconstruction_error(dataclasses.replace(fmt, rotation="identity"), k, v)["k"])
    # Data-fitted key means (keys only): subtracting each channel's mean shrinks the INT2 ranges.
    fitted = dataclasses.replace(fmt, key_means=True)
    means = fitted.calibrate(base.Segment(0, 1, 4), k[None], v[None], jnp.array([8]))
    assert means.key_mean.shape == (1, 1, 4, 2, 16) and float(jnp.max(jnp.abs(means.key_mean))) > 0.1
    assert reconstruction_error(fitted, k, v)["k"].mean() < default["k"].mean()


@pytest.mark.parametrize("rows,tokens", [(1, 1), (3, 1), (2, 9)], ids=["one row", "a step", "a prompt"])
def test_the_writes_rotation_is_z_equals_u_x_in_either_operand_order(rows, tokens):
    """`_rotate` puts U first below D vectors a head (4 and 12 of 16 here) and x first above (72): both give
    z = U x in the encoder's [G, N, K, p, B, T, E] to float32 rounding (sums of 16 products of unit-scale values)."""
    rng = np.random.default_rng(rows * 10 + tokens)
    x = rng.normal(size=(2, 4, 1, rows, 2, tokens, 16)).astype(np.float32)  # [G, p, N, B, K, T, D]
    u = rng.normal(size=(2, 1, 2, 16, 16)).astype(np.float32)  # [G, N, K, E, D]
    want = np.einsum("gpnbktd,gnked->gnkpbte", x.astype(np.float64), u.astype(np.float64))
    np.testing.assert_allclose(loop_quant._rotate(jnp.asarray(x), jnp.asarray(u)), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy,match", [
    (dict(group_size=32), "do not divide head_dim 16"),
    (dict(rotation="learned"), "unknown rotation"),
    (dict(bits=(2, 5)), "invalid bit width"),
    (dict(reference="middle"), "unknown reference policy"),
])
def test_bad_policies_are_rejected(policy, match):
    with pytest.raises(ValueError, match=match):
        get_format("residual", **policy).init(base.Segment(0, 1, 4), 1, 1, 4, 1, 16)


def test_kernel_chains_name_each_loops_reads():
    """What the decode kernel is asked for, per group position (key chain, value chain; loop first, anchor
    last): the last-loop reference reads one residual and the anchor, a K/V-split schedule differs only
    in the values, a partial group adds nothing new, the previous-loop reference reads down the chain."""
    g2, g4 = (2, 32), (4, 32)
    split = get_format("residual", bits=(2, 2, 2, 4), bits_v=(4, 2, 2, 4))
    want = (((g2, g4), (g4, g4)), ((g2, g4), (g2, g4)), ((g4,), (g4,)))
    assert split.kernel_chains(4) == want and split.kernel_chains(6) == want
    previous = get_format("residual", bits=(4, 2, 2, 2), reference="previous")
    assert [k for k, v in previous.kernel_chains(4)] == [(g4,), (g2, g4), (g2, g2, g4), (g2, g2, g2, g4)]
    assert get_format("uniform", bits=2).kernel_chains(4) == (((g2,), (g2,)),)


def test_cache_calib_reaches_the_format(ouro):
    model, ref = ouro
    fmt = get_format("rotated", group_size=8)
    ids = jnp.asarray(ref["input_ids"][:, :6])
    cache = model.init_cache(2, 8, fmt)
    calib = default_calib(cache)
    flipped = CacheCalib(tuple(c._replace(key_rot=-c.key_rot) for c in calib.looped))  # orthogonal, other codes
    a = model(ids, cache, calib=calib).cache
    b = model(ids, cache, calib=flipped).cache
    assert not np.array_equal(a.looped[0][0].k.codes, b.looped[0][0].k.codes)


def test_16_bit_identity_settings_reproduce_dense(ouro):
    """bits=16 stores bfloat16 values with no metadata: `uniform` then stores exactly the dense bf16
    cache's values, and its logits equal dense bf16's up to float32 re-association in the compiled
    attention (1e-4); with rotation and LS residuals the only extra error is bf16 rounding of the
    rotated residuals (relative 2⁻⁹ per element), far below 1% of the logits' scale."""
    model, ref = ouro
    ids = jnp.asarray(ref["input_ids"])

    def run(fmt):
        cache = model.init_cache(2, 10, fmt)
        out = model(ids[:, :8], cache, calib=default_calib(cache))
        return model(ids[:, 8:], out.cache, calib=default_calib(cache))

    dense16, dense32 = run(Dense("bfloat16")), ref["logits"][:, 8:]  # the dense float32 cache matches ref
    np.testing.assert_allclose(run(get_format("uniform", bits=(16,), group_size=8)).logits, dense16.logits, atol=1e-4)
    k, v = random_kv(np.random.default_rng(0), loops=4, layers=1, batch=2, heads=2, seq=5, dim=16)
    lengths, num_new = jnp.zeros(2, jnp.int32), jnp.array([5, 3])
    uniform16 = get_format("uniform", bits=(16,), group_size=8)
    _, (dense_state,), _ = write_stack(Dense("bfloat16"), 4, k, v, lengths, num_new)
    _, (uniform_state,), (uniform_calib,) = write_stack(uniform16, 4, k, v, lengths, num_new)
    for loop in range(4):  # bit for bit the same stored values
        np.testing.assert_array_equal(uniform16.reconstruct(uniform_state, (loop, 0), 0, num_new, uniform_calib),
                                      Dense("bfloat16").reconstruct(dense_state, (loop, 0), 0, num_new, None))
    scale = float(jnp.max(jnp.abs(dense32)))
    for name in ("rotated", "residual"):
        fmt = get_format(name, bits=(16,) * (4 if name == "residual" else 1), group_size=8)
        assert float(jnp.max(jnp.abs(run(fmt).logits - dense32))) < 0.01 * scale
