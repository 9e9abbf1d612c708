"""The `kivi` cache format: KIVI's bookkeeping against a numpy re-statement of KIVI's code, fast attention
vs the reference, prefill = decode, half-even ties, accounting, end to end on the fixture models, policy
validation, and no retracing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rq_jax.cache import Kivi, base, cache_nbytes, get_format
from rq_jax.cache.base import Segment
from rq_jax.sampling import Sampler, SamplingConfig

L, N, B, K, D = 2, 2, 3, 2, 16


def random_kv(rng, t, scale=1.0):
    shape = (L, N, B, K, t, D)
    return (jnp.asarray(rng.normal(size=shape) * scale, jnp.float32),
            jnp.asarray(rng.normal(size=shape), jnp.float32))


_reference = jax.jit(base.reference_attend, static_argnums=(0, 2, 3))  # one compile, not op by op
_reconstruct = jax.jit(lambda fmt, state, lengths: fmt.reconstruct(state, (1, 0), 0, lengths, None), static_argnums=0)


def init(fmt, max_len):
    """An empty stack of L loops (one segment of L one-loop groups) × N layers."""
    return fmt.init(Segment(0, L, 1), N, B, max_len, K, D)


def write_all(fmt, state, lengths, kvs, num_news):
    """Write each (k, v) [L, N, B, K, T, D] with its per-row num_new; returns the state and lengths."""
    cap = state[0].v_codes.shape[4] + state[0].v_full.shape[4]  # max_len
    for (k, v), n in zip(kvs, num_news):
        n = jnp.asarray(n, jnp.int32)
        state = fmt.write(state, k[:, None], v[:, None], lengths, n, None).state  # jitted inside, once per shape
        lengths = lengths + jnp.minimum(n, cap - lengths)
    return state, lengths


# ---- KIVI's code, re-stated in numpy (quant/new_pack.py, models/llama_kivi.py), one row, float32 ----

def kivi_quant(x, bits):
    """Min/max quantize-dequantize of x [..., G, g] along the last axis, KIVI's arithmetic: scale =
    (max − min)/(2^b − 1), code = round_half_even(clamp((x − min)/scale, 0, 2^b − 1)),
    x̂ = code·scale + min."""
    mn, mx = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
    scale = (mx - mn) / np.float32(2**bits - 1)
    code = np.round(np.clip((x - mn) / scale, 0, 2**bits - 1))
    return (code * scale + mn).astype(np.float32)


class KiviRow:
    """One row's cache as llama_kivi.py keeps it: quantized keys (dequantized here) and a key buffer of
    < R full-precision tokens, flushed R at a time; values quantized once they leave a window of R."""

    def __init__(self, bits, group, r):
        self.bits, self.g, self.r = bits, group, r
        self.kq, self.kf, self.vq, self.vf = [], [], [], []  # lists of [D] vectors, position order

    def _qk(self, keys):  # [n·G, D]: per channel over groups of G tokens
        x = np.stack(keys).reshape(-1, self.g, D).swapaxes(1, 2)
        return list(kivi_quant(x, self.bits).swapaxes(1, 2).reshape(-1, D))

    def _qv(self, values):  # per token, groups of G channels along D
        x = np.stack(values).reshape(len(values), D // self.g, self.g)
        return list(kivi_quant(x, self.bits).reshape(-1, D))

    def prefill(self, k, v):  # k, v [T, D]
        t, r = len(k), self.r
        nq = t - t % r
        self.kq, self.kf = (self._qk(list(k[:nq])) if nq else []), list(k[nq:])
        self.vq, self.vf = (self._qv(list(v[: t - r])) if t > r else []), list(v[max(t - r, 0):])

    def decode(self, k, v):  # one token
        self.kf.append(k)
        if len(self.kf) == self.r:
            self.kq += self._qk(self.kf)
            self.kf = []
        self.vf.append(v)
        if len(self.vf) > self.r:
            self.vq += self._qv(self.vf[:1])
            self.vf = self.vf[1:]

    def keys(self):
        return np.array(self.kq + self.kf).reshape(-1, D), len(self.kq)

    def values(self):
        return np.array(self.vq + self.vf).reshape(-1, D), len(self.vq)

    def stored_bits(self, meta_bits=32, full_bits=32):
        """Bits KIVI's tensors hold for this row (codes + scale + min per group; full-precision tokens)."""
        def quant(n):
            return n * D * (self.bits + 2 * meta_bits / self.g)
        return quant(len(self.kq)) + quant(len(self.vq)) + (len(self.kf) + len(self.vf)) * D * full_bits


def faithful(**kw):
    return Kivi(**{**dict(key_group=4, value_group=4, residual_length=8, meta_dtype="float32",
                          residual_dtype="float32"), **kw})


def check_against_kivi(fmt, state, lengths, rows, k_in, v_in):
    """reconstruct() of slot (1, 0) holds exactly KIVI's full-precision tokens (bit for bit) and every
    quantized one within float32 rounding of KIVI's; returns how many quantized keys and values were seen."""
    rk, rv = (np.asarray(x) for x in _reconstruct(fmt, state, lengths))
    seen = np.zeros(2, int)
    for b, row in enumerate(rows):
        n = int(lengths[b])
        for which, (want, nq), got, src in ((0, row.keys(), rk, k_in), (1, row.values(), rv, v_in)):
            assert want.shape == (n, D)
            got, src = got[b, 0, :n], src[b, :n, 0]  # kv head 0: [n, D]
            np.testing.assert_array_equal(got[nq:], src[nq:], err_msg=f"row {b} {'kv'[which]} full precision")
            np.testing.assert_allclose(got[:nq], want[:nq], rtol=0, atol=2e-6 * max(1.0, np.abs(src).max()),
                                       err_msg=f"row {b} {'kv'[which]} quantized")
            assert not np.any(np.all(got[:nq] == src[:nq], axis=-1)), "a quantized token came back exact"
            np.testing.assert_array_equal(got[n:], 0)
            seen[which] += nq
    return seen


@pytest.mark.parametrize("bits", [2, 4])
def test_windows_are_kivis_over_prefill_and_decode(bits):
    """Prefill below, at and above R (ragged rows of 5, 8 and 19 tokens, R = 8, G = 4), then 12 decode
    steps across flush boundaries: after every call the cache holds KIVI's full-precision tokens and
    reconstructs KIVI's quantized ones."""
    fmt, r = faithful(bits=bits), 8
    rng = np.random.default_rng(bits)
    prompt, steps = np.array([5, 8, 19]), 12
    total = 19 + steps
    kk = rng.normal(size=(L, N, B, K, total, D)).astype(np.float32) * 3
    vv = rng.normal(size=(L, N, B, K, total, D)).astype(np.float32)
    k_in, v_in = kk[1, 0].transpose(0, 2, 1, 3), vv[1, 0].transpose(0, 2, 1, 3)  # slot (1, 0), [B, S, K, D]
    rows = [KiviRow(bits, 4, r) for _ in range(B)]
    for b, row in enumerate(rows):
        row.prefill(k_in[b, : prompt[b], 0], v_in[b, : prompt[b], 0])
    state, lengths = init(fmt, 32), jnp.zeros((B,), jnp.int32)
    state, lengths = write_all(fmt, state, lengths, [(jnp.asarray(kk[..., :19, :]), jnp.asarray(vv[..., :19, :]))],
                               [prompt])
    seen = check_against_kivi(fmt, state, lengths, rows, k_in, v_in)
    for _ in range(steps):
        pos = np.asarray(lengths)
        one = [np.take_along_axis(x, pos[None, None, :, None, None, None], axis=4) for x in (kk, vv)]
        for b, row in enumerate(rows):
            row.decode(k_in[b, pos[b], 0], v_in[b, pos[b], 0])
        state, lengths = write_all(fmt, state, lengths, [tuple(map(jnp.asarray, one))], [[1, 1, 1]])
        seen += check_against_kivi(fmt, state, lengths, rows, k_in, v_in)
        for b, row in enumerate(rows):  # KIVI's bookkeeping, also at the end: L mod R keys, min(L, R) values
            assert len(row.kf) == int(lengths[b]) % r and len(row.vf) == min(int(lengths[b]), r)
    assert seen.min() > 0


@pytest.mark.parametrize("fmt,max_len", [
    (Kivi(key_group=4, value_group=8, residual_length=4, meta_dtype="float8_e4m3fn"), 16),  # R = G
    (Kivi(bits=4, key_group=4, value_group=4, residual_length=8, rounding="half_down"), 15),  # S % R != 0
    (Kivi(bits=3, key_group=8, value_group=16, residual_length=8, meta_dtype="bfloat16"), 6),  # S < R: all exact
    (Kivi(key_group=1, value_group=8, residual_length=1), 9),  # R = 1: no key buffer, a window of one value
])
def test_attend_equals_reference(fmt, max_len):
    rng = np.random.default_rng(0)
    state, lengths = init(fmt, max_len), jnp.zeros((B,), jnp.int32)
    # Ragged writes: a prefill that completes several blocks in one row, decode steps, a second turn
    # that runs past the end of the cache in short caches (those tokens are dropped).
    kvs = [random_kv(rng, 7, 3.0), random_kv(rng, 1, 3.0), random_kv(rng, 1, 3.0), random_kv(rng, 7, 3.0)]
    state, lengths = write_all(fmt, state, lengths, kvs, [[7, 2, 0], [1, 1, 1], [0, 1, 1], [5, 3, 5]])
    q = jnp.asarray(rng.normal(size=(B, 3, 4, D)), jnp.float32)  # GQA: 4 query heads on 2 kv heads
    for index in [(1, 0)]:  # one slot: (1, 0) catches swapped or wrong slot indexing
        got = fmt.attend(state, index, 0, q, lengths, None)
        want = _reference(fmt, state, index, 0, q, lengths, None)
        # Same float32 quantities summed in a different order (scale folded into q / into p instead of
        # multiplied into k̂ / v̂ first): errors are a few ulps of the O(10) scores and O(1) outputs.
        np.testing.assert_allclose(got.m, want.m, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got.l, want.l, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got.acc, want.acc, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(base.finalize(got), base.finalize(want), atol=1e-5)


@pytest.mark.parametrize("fmt", [Kivi(key_group=4, value_group=8, residual_length=8),
                                 Kivi(bits=4, key_group=3, value_group=16, residual_length=3)])
def test_one_call_prefill_equals_token_by_token(fmt):
    rng = np.random.default_rng(2)
    k, v = random_kv(rng, 11, 2.0)
    num_new = np.array([11, 7, 9])
    empty, zero = init(fmt, 12), jnp.zeros((B,), jnp.int32)
    one, len_one = write_all(fmt, empty, zero, [(k, v)], [num_new])
    steps = [(k[..., t : t + 1, :], v[..., t : t + 1, :]) for t in range(11)]
    many, len_many = write_all(fmt, empty, zero, steps, [(t < num_new).astype(np.int32) for t in range(11)])
    np.testing.assert_array_equal(len_one, num_new)
    np.testing.assert_array_equal(len_many, num_new)
    for name, a, b in zip(one[0]._fields, one[0], many[0]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)


@pytest.mark.parametrize("rounding,key,value", [("half_even", 25.0, 2.0), ("half_down", 17.5, 1.0)])
def test_exact_ties_round_half_even_by_default(rounding, key, value):
    """A key channel [10, 32.5, 21.25, 10] over G = 4 tokens (scale 7.5, u = 1.5) and a value group
    [0, 3, 1.5, 0] (scale 1, u = 1.5): KIVI (torch.round) gives code 2, the spec's half-down code 1."""
    fmt = faithful(rounding=rounding, residual_length=4)
    k = np.zeros((L, N, B, K, 8, D), np.float32)
    k[..., :4, 0] = [10, 32.5, 21.25, 10]
    v = np.zeros_like(k)
    v[..., 0, :4] = [0, 3, 1.5, 0]
    state, lengths = write_all(fmt, init(fmt, 8), jnp.zeros((B,), jnp.int32), [(jnp.asarray(k), jnp.asarray(v))],
                               [[8, 8, 8]])
    rk, rv = _reconstruct(fmt, state, lengths)
    assert float(rk[0, 0, 2, 0]) == key  # 10 + 7.5·code
    assert float(rv[0, 0, 0, 2]) == value
    assert Kivi().rounding == "half_even"


def test_accounting_at_several_context_lengths():
    """bits_per_element(context_len=L) equals the bits KIVI's own tensors hold at L tokens (the numpy
    re-statement's counts: quantized tokens at b + 2·meta/G, full-precision ones at 32 bits), and
    cache_nbytes the arrays' capacity."""
    fmt, r = faithful(), 8
    for n in (1, 7, 8, 9, 16, 19, 40):
        row = KiviRow(2, 4, r)
        row.prefill(*np.random.default_rng(n).normal(size=(2, n, D)).astype(np.float32))
        assert fmt.bits_per_element(4, D, context_len=n) * 2 * n * D == row.stored_bits(), n
    assert fmt.bits_per_element(4, D) == 2 + 2 * 32 / 4  # long-context limit: codes and metadata only
    default = Kivi()  # KIVI-2, G = 32, R = 128, fp16 metadata and residual
    assert default.bits_per_element(4, 128) == 3
    assert default.bits_per_element(4, 128, context_len=127) == 16  # everything still in fp16
    assert default.bits_per_element(4, 128, context_len=128) == (3 + 16) / 2  # keys flushed, values kept
    assert default.bits_per_element(4, 128, context_len=4096) == (3 * 4096 + 3 * 3968 + 16 * 128) / 8192
    for max_len in (6, 8, 21, 32):
        cache = init(fmt, max_len)
        sq, sv = max_len // r * r, max(max_len - r, 0)
        per_slot = (sq * D * 2 / 8 + 2 * sq / 4 * D * 4  # key codes, scale + offset per (4 tokens, channel)
                    + sv * D * 2 / 8 + 2 * sv * D / 4 * 4  # value codes, scale + offset per (token, 4 channels)
                    + (min(r - 1, max_len) + min(r, max_len)) * D * 4)  # the full-precision key and value buffers
        assert base.tree_nbytes(cache) == L * N * B * K * per_slot, max_len


def run_three_calls(model, fmt, ids, kw):
    """Prefill ids[:, :-2], then decode the last two tokens; logits of the three calls [B, T, V]."""
    cache = model.init_cache(ids.shape[0], 16, fmt, num_loops=4)
    out = model(ids[:, :-2], cache, **kw)
    logits = [out.logits]
    for t in (-2, -1):
        out = model(ids[:, t:][:, :1], out.cache, **kw)
        logits.append(out.logits)
    return jnp.concatenate(logits, axis=1), out.cache


# The reference is the PyTorch full forward at 4 loops, which the dense cache path matches to 1e-4
# (test_cache.py). R = 4, so most of the 10 tokens are quantized. Max |logit error| measured
# (ouro / huginn): 8-bit with fp16 metadata and residual (KIVI's dtypes) 5.6e-3 / 7.6e-3, close to the
# bf16 rounding of a dense cache (4.4e-3 on both); KIVI-2 0.45 / 0.37. The 8-bit bound leaves ~3× margin.
@pytest.mark.parametrize("family,bits", [("ouro", (8, 2)), ("huginn", (8,))])
def test_end_to_end_close_to_dense(family, bits, request):
    model, ref = request.getfixturevalue(family)
    kw = dict(num_loops=4)
    ids = jnp.asarray(ref["input_ids"])
    dense = ref["logits"] if family == "ouro" else ref["logits_r4"]
    errs = {}
    for b in bits:
        logits, cache = run_three_calls(model, Kivi(bits=b, key_group=4, value_group=8, residual_length=4), ids, kw)
        assert bool(jnp.all(jnp.isfinite(logits)))
        np.testing.assert_array_equal(cache.lengths, [ids.shape[1]] * ids.shape[0])
        errs[b] = float(jnp.max(jnp.abs(logits - dense)))
    assert errs[8] <= 2.5e-2
    assert errs.get(2, 1.0) > errs[8]


@pytest.mark.parametrize("policy,field", [
    (dict(bits=5), "bits"), (dict(key_group=0), "key_group"), (dict(value_group=2.0), "value_group"),
    (dict(residual_length=0), "residual_length"), (dict(residual_length=48), "residual_length 48 must be a multiple"),
    (dict(group_size=-4), "group_size"), (dict(meta_dtype="int8"), "meta_dtype"),
    (dict(residual_dtype="float8_e4m3fn"), "residual_dtype"), (dict(rounding="up"), "rounding"),
    (dict(clip=0.0), "clip"),
])
def test_bad_policy_raises(policy, field):
    with pytest.raises(ValueError, match=f"kivi {field}"):
        Kivi(**policy)


def test_policy_surface():
    fmt = get_format("kivi", bits=4, group_size=8, residual_length=16, meta_dtype="float32",
                     residual_dtype="bfloat16", rounding="half_down")
    assert fmt == Kivi(bits=4, key_group=8, value_group=8, residual_length=16, meta_dtype="float32",
                       residual_dtype="bfloat16", rounding="half_down")
    d = Kivi()
    assert (d.bits, d.key_group, d.value_group, d.residual_length) == (2, 32, 32, 128)
    assert (d.meta_dtype, d.residual_dtype, d.rounding, d.clip) == ("float16", "float16", "half_even", 1.0)
    with pytest.raises(ValueError, match="does not take"):
        get_format("kivi", window=8)  # the old superset window is gone: residual_length is KIVI's
    with pytest.raises(ValueError, match="context_len"):
        d.bits_per_element(4, 128, context_len=0)


def test_head_dim_checks():
    with pytest.raises(ValueError, match="value_group 32 must divide head_dim 16"):
        Kivi().init(Segment(0, 1, 1), 1, 1, 8, 1, 16)
    with pytest.raises(ValueError, match="bits=3 cannot pack head_dim 12"):
        Kivi(bits=3, value_group=4, key_group=4, residual_length=4).init(Segment(0, 1, 1), 1, 1, 8, 1, 12)


def test_jitted_decode_does_not_retrace(ouro):
    model, ref = ouro
    fmt = Kivi(key_group=4, value_group=8, residual_length=4)
    sampler = Sampler(model, SamplingConfig(max_new_tokens=4), fmt, return_logits=True)
    first = sampler(ref["input_ids"].tolist())
    assert np.all(np.isfinite(first.logits))
    assert sampler.num_compiled() == 2
    sampler(ref["input_ids"][::-1].tolist())
    assert sampler.num_compiled() == 2
    assert first.tokens.shape == (ref["input_ids"].shape[0], 4)
    assert cache_nbytes(first.cache) > 0
