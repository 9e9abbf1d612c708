"""Loop KV sharing (`share`): what every loop reads, Ouro's definition end to end, and its bytes."""

import jax.numpy as jnp
import numpy as np
import pytest

from rq_jax.cache import Dense, base, cache_nbytes, default_calib, get_format
from rq_jax.cache.kv import init_cache
from rq_jax.config import preset

from tests.cache.test_formats import random_kv, write_stack


@pytest.mark.parametrize("source", ["last", "mean", "first"])
def test_every_loop_reads_the_groups_shared_kv(source):
    """Six loops in groups of four (a full group and a partial one): each loop of a group reconstructs
    the group's last / mean / first K/V, rounded to bf16 (relative 2⁻⁸)."""
    rng = np.random.default_rng(0)
    fmt = get_format("share", source=source)
    k, v = random_kv(rng, loops=6, layers=2, batch=2, heads=2, seq=5, dim=16)
    lengths = jnp.asarray([5, 3])
    segs, states, calibs = write_stack(fmt, 6, k, v, jnp.zeros(2, jnp.int32), lengths)
    pick = {"last": lambda x: x[-1], "first": lambda x: x[0], "mean": lambda x: x.mean(0)}[source]
    for seg, state in zip(segs, states):
        want = pick(k[seg.start : seg.start + seg.size])  # [N, B, K, S, D]
        for r in range(seg.size):
            got, _ = fmt.reconstruct(state, (0, 1), r, lengths, None)
            valid = np.asarray(base.valid_tokens(lengths, 12))[:, None, :, None]
            np.testing.assert_allclose(np.where(valid[:, :, :5], got[:, :, :5], 0),
                                       np.where(valid[:, :, :5], want[1], 0), rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("source", ["last", "mean"])
def test_ouro_sharing_is_the_papers_definition(ouro, source):
    """A prompt prefilled and one token decoded through `share` equal, by hand: a dense bf16 cache of the
    same prefill whose every loop's K/V was replaced by the last loop's (the mean over loops), the
    decode then run on it. The prefill itself is exact (its tokens attend in full precision)."""
    model, ref = ouro
    ids = jnp.asarray(ref["input_ids"])
    prompt, nxt = ids[:, :8], ids[:, 8:9]
    share = get_format("share", source=source)
    cache = model.init_cache(2, 10, share)
    out = model(prompt, cache, calib=default_calib(cache))
    dense = model(prompt, model.init_cache(2, 10, Dense("float32")))
    np.testing.assert_array_equal(out.logits, dense.logits)
    (slot,), = dense.cache.looped  # K/V [L, N, B, K, S, D]: Ouro's loops are the groups of a dense cache
    shared = [slot.k[-1:], slot.v[-1:]] if source == "last" else [slot.k.mean(0, keepdims=True),
                                                                  slot.v.mean(0, keepdims=True)]
    by_hand = slot._replace(**{name: jnp.broadcast_to(x, slot.k.shape).astype(jnp.bfloat16)
                               for name, x in zip(("k", "v"), shared)})
    hand = dense.cache.replace(looped=((by_hand,),), fmt=Dense("bfloat16"))
    want = model(nxt, hand).logits
    got = model(nxt, out.cache, calib=default_calib(cache)).logits
    np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.parametrize("policy,loops,bits", [
    (dict(), 4, 4), (dict(bits=4, group_size=8, rotation="hadamard"), 4, 1.5),
    (dict(loops=4), 6, 16 / 3), (dict(loops=32, bits=4, group_size=16), 32, 5 / 32)])
def test_bytes_equal_the_accounting(policy, loops, bits):
    """Bits per element: the anchor's once per group of loops (a bf16 anchor over 4 loops: 4; INT4 g8 with
    two fp8 metadata bytes per 8 channels: 6 / 4; six loops in groups of 4: two stored of six; INT4 g16
    over 32 loops: 5 / 32), and the arrays hold exactly that."""
    fmt = get_format("share", **policy)
    assert fmt.bits_per_element(loops, 16) == pytest.approx(bits)
    cache = init_cache(preset("ouro-tiny").replace(num_layers=3), 2, 32, fmt, num_loops=loops)
    assert cache_nbytes(cache) == fmt.bits_per_element(loops, 16) * 2 * loops * 3 * 2 * 4 * 32 * 16 / 8


@pytest.mark.parametrize("name,policy,match", [
    ("share", dict(source="middle"), "unknown source"), ("share", dict(bits=(2, 4)), "one width"),
    ("share", dict(loops=0), "loops must be positive"), ("share", dict(bits=4, rotation="learned"), "unknown rotation"),
    ("compress", dict(strategy="r4"), "unknown strategy"), ("compress", dict(slots=0), "slots must be positive"),
    ("compress", dict(bits=(4, 4)), "one width")])
def test_bad_policies_are_named(name, policy, match):
    with pytest.raises(ValueError, match=match):
        get_format(name, **policy)


def reference_slot(step_idx: int, strategy: str) -> int:
    """The Huginn reference's write slot (seal-rg/recurrent-pretraining, recpre/raven_modeling_minimal.py,
    `HuginnDynamicCache.update`), transcribed: core step indices (> 1) are remapped, prelude ones are not."""
    if step_idx > 1:
        if strategy.startswith("compress-s"):
            return (step_idx - 2) % int(strategy[len("compress-s"):]) + 2
        if strategy == "compress-anchor":
            return step_idx if step_idx - 2 < 4 * 8 else 34 + (step_idx - 34) % 4
    return step_idx


@pytest.mark.parametrize("strategy,policy", [("compress-s4", dict(slots=1)), ("compress-s16", dict(slots=4)),
                                             ("compress-s12", dict(slots=3)),
                                             ("compress-anchor", dict(strategy="anchor", slots=8))])
def test_compress_takes_the_reference_slots(strategy, policy):
    """At Huginn-0125's layout (2 prelude layers, 4 core layers, 32 recurrences; step index 2 + 4r + j):
    recurrence r reads the slot the reference writes it to, and that slot holds the last recurrence the
    reference writes there (its writes overwrite)."""
    fmt = get_format("compress", **policy)
    writers = fmt.writers(32)
    last = {}
    for r in range(32):
        for j in range(4):
            last[reference_slot(2 + 4 * r + j, strategy)] = r  # the reference's writes in order
    for r in range(32):
        for j in range(4):
            slot = reference_slot(2 + 4 * r + j, strategy)
            assert slot == 2 + 4 * fmt.slot_of(r) + j
            assert writers[fmt.slot_of(r)] == (last[slot],)
    assert len(writers) == len(last) // 4  # as many slots as the reference fills


@pytest.mark.parametrize("policy", [dict(slots=4), dict(strategy="anchor", slots=2)])
@pytest.mark.parametrize("adaptive", [False, True])
def test_compress_reads_what_the_reference_keeps(huginn, policy, adaptive):
    """Six recurrences: after a prefill, a decoded token through `compress` equals a dense bf16 cache of the
    same prefill in which recurrence r's K/V were replaced by those of the recurrence its slot ends up
    holding (modulo 4: 4, 5, 2, 3, 4, 5; anchor 2: 0, 1, 5, 5, 5, 5) — also under adaptive exit
    (latest-m4: an exited token's later steps hold its last computed step's K/V)."""
    from rq_jax.nn.huginn import AdaptiveExit

    model, ref = huginn
    fmt = get_format("compress", **policy)
    steps = 6
    kw = dict(num_steps=steps, adaptive=AdaptiveExit("kl", 0.1, lookup="latest-m4") if adaptive else None)
    ids = jnp.asarray(ref["input_ids"])
    cache = model.init_cache(2, 10, fmt, num_loops=steps)
    out = model(ids[:, :8], cache, calib=default_calib(cache), **kw)
    dense = model(ids[:, :8], model.init_cache(2, 10, Dense("float32"), num_loops=steps), **kw)
    np.testing.assert_allclose(out.logits, dense.logits, atol=1e-5)  # the same sums, compiled apart
    (slot,), = dense.cache.looped
    read = [fmt.writers(steps)[fmt.slot_of(r)][0] for r in range(steps)]
    by_hand = slot._replace(k=slot.k[jnp.asarray(read)].astype(jnp.bfloat16),
                            v=slot.v[jnp.asarray(read)].astype(jnp.bfloat16))
    (plain,), = dense.cache.plain
    plain = plain._replace(k=plain.k.astype(jnp.bfloat16), v=plain.v.astype(jnp.bfloat16))
    hand = dense.cache.replace(looped=((by_hand,),), plain=((plain,),), fmt=Dense("bfloat16"),
                               plain_fmt=Dense("bfloat16"))
    want = model(ids[:, 8:9], hand, **kw).logits
    got = model(ids[:, 8:9], out.cache, calib=default_calib(cache), **kw).logits
    np.testing.assert_allclose(got, want, atol=2e-5)
