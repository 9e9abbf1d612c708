"""The loop engine: trace size independent of depth, gradients through a quantized cache, one protocol."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rq_jax.cache import Dense, default_calib, get_format, init_cache
from rq_jax.cache.base import fake_quant_loops
from rq_jax.config import preset
from rq_jax.models import init_model
from rq_jax.nn import common
from rq_jax.sampling import Sampler, SamplingConfig


def decode_jaxpr(config, fmt):
    """The jaxpr of one cached decode step."""
    model = init_model(config)
    graphdef, params = nnx.split(model)
    cache = init_cache(config, 1, 8, fmt)
    calib = default_calib(cache)

    def step(params, cache):
        return nnx.merge(graphdef, params)(jnp.zeros((1, 1), jnp.int32), cache, calib=calib).logits

    return jax.make_jaxpr(step)(params, cache).jaxpr


def equations(jaxpr, inside=()):
    """Every equation of `jaxpr`, nested jaxprs included, with the primitives of the equations it sits in."""
    for e in jaxpr.eqns:
        yield e, inside
        for p in e.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
                    yield from equations(getattr(sub, "jaxpr", sub), inside + (e.primitive.name,))


def decode_jaxpr_size(config, fmt) -> int:
    """Equations in the jaxpr of one cached decode step (nested jaxprs included)."""
    return sum(1 for _ in equations(decode_jaxpr(config, fmt)))


@pytest.mark.parametrize("name", ["dense", "residual"])
def test_trace_does_not_grow_with_depth(name):
    """Doubling layers, loops (Ouro) or recurrence steps (Huginn) leaves the decode-step jaxpr the same size."""
    fmt = get_format(name, group_size=8) if name == "residual" else Dense()
    ouro, huginn = preset("ouro-tiny"), preset("huginn-tiny")
    assert decode_jaxpr_size(ouro, fmt) == decode_jaxpr_size(ouro.replace(num_layers=4), fmt)
    assert decode_jaxpr_size(ouro.replace(num_loops=8), fmt) == decode_jaxpr_size(ouro, fmt)
    assert decode_jaxpr_size(huginn, fmt) == decode_jaxpr_size(
        huginn.replace(num_layers=4, num_prelude=2, num_coda=2, num_loops=16), fmt)


@pytest.mark.parametrize("family", ["ouro-tiny", "huginn-tiny"])
def test_rope_sines_are_taken_once_a_call(family):
    """A decode step takes RoPE's sines and cosines once, outside the layers and loops that read them
    (`layers.rope_table`), not in every layer of every loop."""
    found = [(e.primitive.name, inside) for e, inside in equations(decode_jaxpr(preset(family), Dense()))
             if e.primitive.name in ("sin", "cos")]
    assert sorted(name for name, _ in found) == ["cos", "sin"]
    assert not any({"scan", "while", "cond"} & set(inside) for _, inside in found), found


def test_gradient_through_a_fake_quantized_residual_cache(ouro):
    """Cross-entropy of a continuation scored through a cache holding the prefix's K/V as `residual`
    would reconstruct them (straight-through estimators): the gradient is finite, non-zero, reaches
    the layers through the prefix's K/V, and differs from the dense cache's."""
    model, ref = ouro
    ids = jnp.asarray(ref["input_ids"])
    fmt = get_format("residual", group_size=8)
    graphdef, params = nnx.split(model)

    def loss(params, quantize: bool):
        m = nnx.merge(graphdef, params)
        prefix = m(ids[:, :6], init_cache(m.config, 2, 10, Dense("float32"))).cache
        if quantize:
            k, v = fake_quant_loops(fmt, *prefix.dense_kv(), default_calib(init_cache(m.config, 1, 1, fmt)).looped)
            ((slot,),) = prefix.looped
            prefix = prefix.replace(looped=((slot._replace(k=k, v=v),),))
        logits = m(ids[:, 6:-1], prefix).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 7:]).mean()

    @jax.jit
    def both(params):
        return jax.value_and_grad(loss)(params, True), jax.value_and_grad(loss)(params, False)

    (loss_q, grads), (loss_d, dense) = both(params)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(grads))
    k_grad = grads["layers"]["self_attn"]["k_proj"]["kernel"][...]
    assert float(jnp.max(jnp.abs(k_grad))) > 0  # keys only reach the loss through the cached prefix
    assert not np.allclose(k_grad, dense["layers"]["self_attn"]["k_proj"]["kernel"][...])
    assert float(loss_q) != float(loss_d)


def test_layers_are_stacked_params(ouro):
    model, _ = ouro
    kernel = model.layers.self_attn.q_proj.kernel[...]
    assert kernel.shape == (model.config.num_layers, model.config.hidden_size,
                            model.config.num_heads * model.config.head_dim)


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_per_layer_weights_compute_what_the_stacks_do(family, request):
    """`per_layer` (each layer's arrays its own, picked by a switch): a prompt then a decode step through a
    residual cache give the stacked model's logits, to float32 rounding (XLA fuses a branch's products and
    sums apart from the scanned body's: ~1e-6 here), and the given model keeps its stacks."""
    model, _ = request.getfixturevalue(family)
    split = common.per_layer(model)
    for name in model.stacks:
        stack, layers = getattr(model, name), getattr(split, name)
        assert not isinstance(stack, nnx.List)
        assert isinstance(layers, nnx.List) and len(layers) == jax.tree_util.tree_leaves(nnx.state(stack))[0].shape[0]
    fmt = get_format("residual", group_size=8)
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, model.config.vocab_size)
    outs = []
    for m in (model, split):
        cache = init_cache(model.config, 2, 16, fmt)
        calib = default_calib(cache)
        first = nnx.jit(lambda m, t, c: m(t, c, num_new=jnp.asarray([9, 6]), calib=calib))(m, tokens, cache)
        step = nnx.jit(lambda m, t, c: m(t, c, calib=calib))(m, tokens[:, :1], first.cache)
        outs.append((first.logits, step.logits))
    for a, b in zip(*outs):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["dense", "uniform", "rotated", "residual", "kivi", "residual_vq"])
def test_one_state_layout(name):
    """Every format's state: segments of group positions, every leaf [G, N, B, K, S, ...]."""
    fmt = get_format(name, **({} if name in ("dense", "residual_vq") else dict(group_size=8)))
    cache = init_cache(preset("huginn-tiny"), 2, 16, fmt, num_loops=6)
    segs = cache.schedule("looped")[1]
    assert len(cache.looped) == len(segs)
    for seg, state in zip(segs, cache.looped):
        assert len(state) == seg.size
        for leaf in jax.tree_util.tree_leaves(state):
            assert leaf.shape[:3] == (seg.groups, 2, 2) and leaf.shape[3] == 4  # G, N, B, K
    if name == "residual":
        assert [(s.groups, s.size) for s in segs] == [(1, 4), (1, 2)]


def test_calibration_is_checked_before_tracing(ouro):
    model, ref = ouro
    ids = jnp.asarray(ref["input_ids"][:, :4])
    residual = model.init_cache(2, 8, get_format("residual", group_size=8))
    with pytest.raises(ValueError, match="needs calib=CacheCalib.*default_calib"):
        model(ids, residual)
    vq = model.init_cache(2, 8, get_format("residual_vq"))
    with pytest.raises(ValueError, match="residual_vq.*fit_calib"):
        model(ids, vq)
    with pytest.raises(ValueError, match="no data-free default"):
        default_calib(vq)


def test_attend_impl_falls_back_to_xla_with_a_logged_reason(monkeypatch, caplog):
    """An implementation that does not cover a slot raises NotImplementedError; XLA answers instead."""
    from rq_jax.cache import attention
    from rq_jax.cache.base import Segment

    def declines(q_rot, ops, lengths, table=None):
        raise NotImplementedError("head dim 16 not covered")

    monkeypatch.setitem(attention.IMPLEMENTATIONS, "declining", None)
    monkeypatch.setitem(attention.PACKED.impls, "declining", declines)
    with pytest.raises(ValueError, match="unknown attend_impl 'missing'"):
        get_format("residual", attend_impl="missing")
    fmt = get_format("residual", group_size=8, attend_impl="declining")
    xla = get_format("residual", group_size=8, attend_impl="xla")
    seg = Segment(0, 1, 4)
    rng = np.random.default_rng(0)
    kv = [jnp.asarray(rng.normal(size=(1, 4, 1, 2, 2, 5, 16)), jnp.float32) for _ in range(2)]
    calib = xla.default_calib(seg, 1, 2, 16)
    lengths = jnp.array([5, 3])
    state = xla.write(xla.init(seg, 1, 2, 8, 2, 16), *kv, jnp.zeros(2, jnp.int32), lengths, calib).state
    q = jnp.asarray(rng.normal(size=(2, 1, 2, 16)), jnp.float32)
    with caplog.at_level("WARNING"):
        got = fmt.attend(state, (0, 0), 1, q, lengths, calib)
    assert "attend_impl='declining' does not cover this slot (head dim 16 not covered); using xla" in caplog.text
    for a, b in zip(got, xla.attend(state, (0, 0), 1, q, lengths, calib)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_pallas_kernel_generates_the_xla_tokens(family, caplog):
    """Greedy generation through the Pallas kernel (interpret mode on CPU) equals the XLA path's. The
    fixtures' head dims (16, 24) are outside the kernel's (64, 96, 128), so the tiny presets run with
    head dim 64 and random weights; Ouro with GQA (2 query heads per kv head), Huginn (whose q/k bias
    needs one kv head per query head) with two heads and one group of 4 steps (the last reads the
    anchor alone)."""
    config = preset(f"{family}-tiny").replace(head_dim=64, num_heads=2, num_kv_heads=1 if family == "ouro" else 2,
                                              hidden_size=128)
    model = init_model(config, 3)
    tokens = {}
    for impl in ("xla", "pallas"):
        fmt = get_format("residual", group_size=16, attend_impl=impl)
        with caplog.at_level("WARNING"):
            sampler = Sampler(model, SamplingConfig(max_new_tokens=3), fmt, plain_fmt=Dense(), num_loops=4)
            tokens[impl] = sampler([[5, 9, 2, 7, 7], [1, 4, 4]]).tokens
    assert "does not cover" not in caplog.text  # the kernel ran, no fallback
    np.testing.assert_array_equal(tokens["pallas"], tokens["xla"])
