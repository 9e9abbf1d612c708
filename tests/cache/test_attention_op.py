"""The decode-attention op's "auto": it follows the platform the program is lowered for, not the host's
default backend — only that platform's chain is lowered, and a TPU program compiled on this CPU host
inlines the TPU kernel (skipped without libtpu). The formats' "pallas-tpu" implementation (TPU interpret
mode here) equals XLA's."""


import cpu_kernels
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_kernels import tpu_deviceless as td

from rq_jax import setup
from rq_jax.cache import attention, get_format
from rq_jax.cache.base import Segment

needs_libtpu = pytest.mark.skipif(not td.libtpu_available(),
                                  reason="libtpu not installed: pip install 'jax[tpu]' pinned to the jaxlib in use")


def written_attend(fmt, b=2, s=256, heads=4, kv_heads=2, d=128, loop=0, seed=0):
    """(attend of loop `loop` over a slot of `fmt` holding random K/V of every loop of one group, as a
    function of (state, q, lengths); those arguments, lengths ragged up to s)."""
    seg = Segment(0, 1, fmt.group_len)
    rng = np.random.default_rng(seed)
    kv = [jnp.asarray(rng.normal(size=(1, seg.size, 1, b, kv_heads, s, d)), jnp.float32) for _ in range(2)]
    lengths = jnp.asarray(np.linspace(s, 1, b).astype(np.int32))
    calib = fmt.calibrate(seg, *kv, lengths)
    state = fmt.write(fmt.init(seg, 1, b, s, kv_heads, d), *kv, jnp.zeros(b, jnp.int32), lengths, calib).state

    def attend(state, q, lengths):
        return fmt.attend(state, (0, 0), loop, q, lengths, calib)

    return attend, (state, jnp.asarray(rng.normal(size=(b, 1, heads, d)), jnp.float32), lengths)


def test_auto_lowers_only_the_hosts_chain():
    attend, args = written_attend(get_format("dense"))
    hlo = jax.jit(attend).lower(*args).as_text()
    assert attention.order("auto", "cpu") == ("native", "xla") and attention.order("auto", "tpu") == ("pallas-tpu",
                                                                                                        "xla")
    assert "tpu_custom_call" not in hlo and "triton" not in hlo  # the other chains are traced, never lowered
    native = cpu_kernels.available()
    assert ("rq_cpu_dense" in hlo) == native  # the CPU chain: the native kernel where it is built, else XLA


def test_a_program_for_this_host_traces_only_the_hosts_chain():
    """`setup.jit` (the Sampler's, the eval loops' and the runner's programs) traces "auto" for this host's
    platform alone: no platform switch, and the same result; a plain jit keeps every platform's chain."""
    attend, args = written_attend(get_format("residual"))

    def platform_switches(fn):
        return str(jax.make_jaxpr(fn)(*args)).count("platform_index")

    assert platform_switches(attend) > 0 and platform_switches(attention.for_host(attend)) == 0
    for a, b in zip(jax.jit(attend)(*args), setup.jit(attend)(*args)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("impl", ["auto", "pallas-tpu"])
@pytest.mark.parametrize("name, loop", [("dense", 0), ("residual", 0), ("residual", 3)])
def test_an_implementation_agrees_with_xla(name, loop, impl, caplog):
    """Dense, a residual loop (the chain of four links) and the anchor: "auto" (this host's kernel) and the
    Mosaic kernels in TPU interpret mode equal XLA, with no fallback logged. Tolerance: float32 accumulation
    in another order, and the kernels' split-bf16 dots (~2^-16 relative, `decode_common.split_bf16`)."""
    got_fn, args = written_attend(get_format(name, attend_impl=impl), loop=loop)
    want_fn, _ = written_attend(get_format(name, attend_impl="xla"), loop=loop)
    with caplog.at_level("WARNING"):
        got = jax.jit(got_fn)(*args)
    assert "does not cover" not in caplog.text
    want = jax.jit(want_fn)(*args)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(want.acc))))


@needs_libtpu
@pytest.mark.parametrize("generation", ["v5e", "v6e"])
@pytest.mark.parametrize("name, kernel", [("dense", "tpu_dense_decode_attention"),
                                          ("residual", "tpu_residual_decode_attention")])
def test_a_tpu_compile_from_this_host_inlines_the_tpu_kernel(generation, name, kernel):
    attend, args = written_attend(get_format(name))
    got = td.compile_for(attend, args, generation)
    assert got.ok, got.error
    targets = {target for _, target in got.custom_calls}
    assert (f"{kernel}.1", td.MOSAIC_CALL) in got.custom_calls, got.custom_calls
    assert not any(t.startswith("rq_cpu") for t in targets)  # the CPU chain was not lowered
