"""The decode-attention op's "auto": it follows the platform the program is lowered for, not the host's
default backend — only that platform's chain is lowered, and a TPU program compiled on this CPU host
inlines the TPU kernel (skipped without libtpu)."""

import cpu_kernels
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_kernels import tpu_deviceless as td

from rq_jax.cache import attention, get_format
from rq_jax.cache.base import Segment


def dense_attend(fmt, b=2, s=256, heads=4, kv_heads=2, d=128):
    """(attend over a dense slot of `fmt` as a function of its arrays, those arrays) at these shapes."""
    seg = Segment(0, 1, 1)
    state = fmt.init(seg, 1, b, s, kv_heads, d)

    def attend(state, q, lengths):
        return fmt.attend(state, (0, 0), 0, q, lengths, None)

    return attend, (state, jnp.zeros((b, 1, heads, d), jnp.float32), jnp.full((b,), s // 2, jnp.int32))


def test_auto_lowers_only_the_hosts_chain():
    attend, args = dense_attend(get_format("dense"))
    hlo = jax.jit(attend).lower(*args).as_text()
    assert attention.order("auto", "cpu") == ("native", "xla") and attention.order("auto", "tpu") == ("pallas-tpu",
                                                                                                        "xla")
    assert "tpu_custom_call" not in hlo and "triton" not in hlo  # the other chains are traced, never lowered
    native = cpu_kernels.available()
    assert ("rq_cpu_dense" in hlo) == native  # the CPU chain: the native kernel where it is built, else XLA


def test_auto_and_xla_agree_on_this_host():
    rng = np.random.default_rng(0)
    auto, args = dense_attend(get_format("dense"))
    state = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), args[0])
    q = jnp.asarray(rng.normal(size=args[1].shape), jnp.float32)
    xla, _ = dense_attend(get_format("dense", attend_impl="xla"))
    for a, b in zip(jax.jit(auto)(state, q, args[2]), jax.jit(xla)(state, q, args[2])):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)  # float32 accumulations in another order


@pytest.mark.skipif(not td.libtpu_available(), reason="libtpu not installed: pip install 'jax[tpu]' pinned to the "
                    "jaxlib in use")
@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_a_tpu_compile_from_this_host_inlines_the_tpu_kernel(generation):
    attend, args = dense_attend(get_format("dense"))
    got = td.compile_for(attend, args, generation)
    assert got.ok, got.error
    targets = {target for _, target in got.custom_calls}
    assert ("tpu_dense_decode_attention.1", td.MOSAIC_CALL) in got.custom_calls, got.custom_calls
    assert not any(t.startswith("rq_cpu") for t in targets)  # the CPU chain was not lowered
