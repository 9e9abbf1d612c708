"""vLLM's TurboQuant presets (`turboquant`): vLLM's own codes and dequantized values on a fixture made by
vLLM's kernels (tests/fixtures/vllm-turboquant/README.md), and vLLM's slot bytes."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rq_jax.cache import cache_nbytes, get_format
from rq_jax.cache.kv import init_cache
from rq_jax.cache.turboquant import PRESETS, centroids
from rq_jax.config import preset

FIXTURE = pathlib.Path(__file__).parents[1] / "fixtures" / "vllm-turboquant" / "turboquant.npz"


@pytest.fixture(scope="module")
def vllm():
    return dict(np.load(FIXTURE))


def little_endian(x):
    """A float16 array's bytes, low byte first (vLLM's order): [..., 2]."""
    return np.asarray(x).view(np.uint8).reshape(*x.shape, 2)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_codes_are_vllms(vllm, name):
    """Every byte of every slot vLLM's store kernel wrote: key codes (packed Lloyd-Max indices, or FP8),
    the key norm, value codes, scale and zero; the Lloyd-Max centroids bit for bit."""
    fmt = get_format("turboquant", preset=name)
    k, v = jnp.asarray(vllm["key"]), jnp.asarray(vllm["value"])
    key, norm = jax.jit(fmt.encode_keys)(k)
    codes, scale, zero = jax.jit(fmt.encode_values)(v)
    if norm is None:  # FP8 keys: against torch's E4M3 cast (the interpreter's drops carries, see the README)
        np.testing.assert_array_equal(np.asarray(key).view(np.uint8), vllm["k8v4/key_fp8_torch"])
        keys = [np.asarray(key).view(np.uint8)]
    else:
        np.testing.assert_array_equal(centroids(64, fmt.key_bits), vllm[f"{name}/centroids"])
        keys = [np.asarray(key), little_endian(norm)]
    slot = vllm[f"{name}/slots"]
    ours = np.concatenate(keys + [np.asarray(codes), little_endian(scale), little_endian(zero)], axis=-1)
    if norm is not None:
        np.testing.assert_array_equal(ours, slot[..., : ours.shape[-1]])
    else:
        np.testing.assert_array_equal(ours[..., 64:], slot[..., 64 : ours.shape[-1]])
    assert slot.shape[-1] == ours.shape[-1] + ours.shape[-1] % 2  # vLLM's slot: ours, rounded up to even


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_dequantized_values_are_vllms(vllm, name):
    """vLLM's full dequant (fp16 outputs): the norm-corrected keys in the rotated basis and the values,
    equal to ours rounded to fp16; the keys in the model's basis are those taken back by the Hadamard."""
    fmt = get_format("turboquant", preset=name)
    k, v = jnp.asarray(vllm["key"]), jnp.asarray(vllm["value"])
    key, norm = fmt.encode_keys(k)
    values = fmt.decode_values(*fmt.encode_values(v), 64)
    np.testing.assert_array_equal(np.asarray(values.astype(jnp.float16), np.float32), vllm[f"{name}/value"])
    if norm is not None:
        rotated = fmt.rotated_keys(key, norm, 64)
        np.testing.assert_array_equal(np.asarray(rotated.astype(jnp.float16), np.float32), vllm[f"{name}/key_rotated"])
        err = jnp.sum((fmt.decode_keys(key, norm, 64) - k) ** 2) / jnp.sum(k**2)
        assert float(err) < {4: 0.02, 3: 0.06}[fmt.key_bits]  # Lloyd-Max at 4 / 3 bits: ~0.009 / ~0.03


@pytest.mark.parametrize("name,ratio", [("k8v4", 2.61), ("4bit_nc", 3.82), ("k3v4_nc", 4.34), ("3bit_nc", 5.02)])
def test_bytes_are_vllms_slot(name, ratio):
    """At D = 128 the bits are vLLM's slot sizes (196, 134, 118, 102 bytes per token and head against bf16's
    512); the cache's arrays hold exactly the accounting."""
    fmt = get_format("turboquant", preset=name)
    assert 16 / float(fmt.bits_per_element(4, 128)) == pytest.approx(ratio, abs=0.005)
    cache = init_cache(preset("ouro-tiny").replace(num_layers=3), 2, 32, fmt, num_loops=4)
    assert cache_nbytes(cache) == fmt.bits_per_element(4, 16) * 2 * 4 * 3 * 2 * 4 * 32 * 16 / 8


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="unknown preset"):
        get_format("turboquant", preset="2bit")
    with pytest.raises(ValueError, match="head_dim 24 must be a power of 2"):
        init_cache(preset("huginn-tiny"), 1, 4, get_format("turboquant"))
