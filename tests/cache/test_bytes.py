"""Bytes in one place: every byte and bits-per-element figure in rq_jax is `cache_bytes`'s, which is the
bytes of a real allocated cache, for every format of the catalog, at Ouro's shape and at Huginn's
(plain prelude/coda layers)."""

from fractions import Fraction

import jax
import numpy as np
import pytest

from rq_jax import memory
from rq_jax.cache import Dense, available_formats, cache_bytes, cache_nbytes, init_cache, schemes
from rq_jax.config import preset
from rq_jax.eval.benchmark_run import bits_and_bytes
from rq_jax.perf.attention import bytes_read
from rq_jax.sampling import Generation

B, L = 2, 136  # past kivi's 128-token window: some keys and values quantized, the window partly full
CONFIGS = {"ouro": preset("ouro-tiny", head_dim=128),  # D = 128: every catalog group size, turboquant's power of 2
           "huginn": preset("huginn-tiny", head_dim=128, num_heads=2, num_kv_heads=2, hidden_size=256)}


def allocated(tree) -> int:
    """Bytes of an allocated pytree's arrays, as the device holds them."""
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))


def printed_by_generate(config, cache) -> str:
    """What scripts/generate.py prints about a generation's cache (`Generation.cache_report`)."""
    out = Generation(tokens=np.zeros((B, 1), np.int32), num_generated=np.ones(B, np.int32), logits=None, cache=cache,
                     prefill_seconds=0.0, decode_seconds=0.0)
    return "\n".join(out.cache_report(config))


def test_the_catalog_holds_every_format():
    assert {s.fmt.name for s in schemes.catalog()} == set(available_formats())


@pytest.mark.parametrize("model", sorted(CONFIGS))
def test_every_caller_agrees_with_cache_bytes_and_the_allocated_cache(model):
    config = CONFIGS[model]
    loops, d = config.num_loops, config.head_dim
    slot = 2 * B * config.num_kv_heads * L * d  # K and V elements of one (loop, layer) slot
    looped_slots, plain_slots = config.num_layers * loops, config.num_plain_layers
    dense = allocated(init_cache(config, B, L, Dense("bfloat16")).dense_kv())
    assert dense == 2 * slot * looped_slots  # bf16: 2 bytes an element
    for scheme in schemes.catalog():
        fmt, label = scheme.fmt, scheme.label
        cache = init_cache(config, B, L, fmt)
        total, looped = allocated((cache.looped, cache.plain)), allocated(cache.looped)
        row = cache_bytes(config, fmt, L, batch=B)
        assert (row.total, row.looped, row.plain, row.dense_looped) == (total, looped, total - looped, dense), label
        assert row.dense == 2 * slot * (looped_slots + plain_slots) and row.tokens == B * L, label
        assert cache_nbytes(cache) == cache_nbytes(jax.eval_shape(cache.as_bits)) == total, label  # perf.decode's
        assert cache_bytes(config, fmt, L).total * B == total, label  # one slot: the engine's
        assert row.bits_per_element == Fraction(16 * looped, dense), label
        # The format's own accounting: the arrays' bits, except where a full-precision window is allocated
        # whole (kivi); the bytes read follow its re-reads (a residual loop reads its anchor, a shared slot
        # is read by every loop).
        stored = fmt.bits_per_element(loops, d, L)
        read = looped_slots * fmt.read_bits_per_element(loops, d, L) + plain_slots * fmt.read_bits_per_element(1, d, L)
        if fmt.full_precision_part:
            assert row.bits_per_element > stored and row.read == total, label
        else:
            assert row.bits_per_element == stored and row.read == int(read * slot / 8), label
        assert bytes_read(fmt, config, B, L) == row.read, label
        limits = memory.byte_limits(fmt, config, L)
        assert limits == dict(storage_bits=16 * total / row.dense, read_bits=16 * row.read / row.dense,
                              storage_limit=row.dense / total, read_limit=row.dense / row.read), label
        need = memory.generation_bytes(config, fmt, batch=B, prompt_len=8, max_len=L, num_loops=loops, param_bytes=0)
        assert need["cache"] == memory.CACHE_COPIES * total, label
        assert bits_and_bytes(scheme, config, loops, L) == dict(
            bits_per_element=float(row.bits_per_element), bytes_per_token=total / (B * L),
            dense_bytes_per_token=row.dense / (B * L)), label
        line = printed_by_generate(config, cache).splitlines()[0]
        assert (f"looped layers at {float(row.bits_per_element):.4g} bits/element, metadata included; {total:,} bytes "
                f"for {L} positions (dense bf16 would take {row.dense:,}: {total / row.dense:.1%})") in line, label
