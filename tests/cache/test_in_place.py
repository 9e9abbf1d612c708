"""In place, by the compiled programs' own memory analysis: every jitted entry that takes a cache and
returns one (the Sampler's prefill and decode loop, the benchmark's step) aliases the output cache to
the donated input and holds no second copy of it among its temporaries; the eval loop's caches (built
inside its program) are not copied either; and a step with bf16 weights makes no float32 copy of them.

Context tiles are cut to 4096 float32 elements (32 tokens here): at the default size one tile would
cover these tiny caches whole, and its float32 decode would outweigh the packed cache it came from."""

import os

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from rq_jax.cache import base, cache_nbytes, default_calib, get_format, init_cache
from rq_jax.config import preset
from rq_jax.eval.loops import CacheScorer
from rq_jax.models import init_model
from rq_jax.perf.decode import greedy_step
from rq_jax.sampling import Sampler, SamplingConfig

MAX_LEN = 2048  # long enough that the cache dwarfs every other buffer of these tiny models
CONFIG = preset("ouro-tiny").replace(max_position_embeddings=MAX_LEN)
FORMATS = [("dense", {}), ("residual", dict(group_size=8)),
           ("kivi", dict(key_group=4, value_group=8, residual_length=8))]  # kivi's windows (O(R)) kept small


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(base, "TILE_ELEMENTS", 2**12)


def analysis(jitted, *args):
    return jitted.lower(*args).compile().memory_analysis()


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, 0)


#: Known gap (issue 22, open): `base._write_rows` loops over rows on the values' bits, and XLA:CPU's
#: MLIR fusion emitters (its default) materialise that bitcast as one copy of each narrow-float leaf per
#: write. Looping on the float dtype instead is in place but copies the leaf once per *row* (measured,
#: 128 rows into a 33 MB leaf: bf16 616 ms vs 35 ms, fp8 21.8 s vs 16 ms), so the fast form stays. The
#: classic emitters (--xla_cpu_use_fusion_emitters=false, which tests/conftest.py sets) keep it in
#: place, so these tests are expected to fail only under the fusion emitters.
FUSION_EMITTERS = "--xla_cpu_use_fusion_emitters=false" not in os.environ.get("XLA_FLAGS", "")
WRITE_COPIES = pytest.mark.xfail(FUSION_EMITTERS, strict=True,
                                 reason="XLA:CPU's fusion emitters copy each narrow leaf a row write touches")


@WRITE_COPIES
@pytest.mark.parametrize("name,policy", FORMATS)
def test_sampler_updates_its_cache_in_place(model, name, policy):
    fmt = get_format(name, **policy)
    sampler = Sampler(model, SamplingConfig(max_new_tokens=4), fmt)
    cache = jax.eval_shape(lambda: sampler._empty_cache(2, MAX_LEN))
    nbytes = base.tree_nbytes((cache.looped, cache.plain))
    tokens, lengths = jax.ShapeDtypeStruct((2, 8), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32)
    args = (sampler.params, sampler.calib, tokens, lengths, cache, jax.random.key(0))
    prefill = analysis(sampler._prefill, *args)
    state = jax.eval_shape(sampler._prefill_fn, *args)
    decode = analysis(sampler._decode, sampler.params, sampler.calib, state)
    for m in (prefill, decode):
        assert m.alias_size_in_bytes >= nbytes  # the output cache is the donated input's buffers
        assert m.temp_size_in_bytes < nbytes / 2  # and no copy of it is made on the way
    # A fresh cache holds every array once (donating one buffer twice is an error), and generation runs.
    leaves = jax.tree_util.tree_leaves(sampler._empty_cache(2, 16))
    assert len({x.unsafe_buffer_pointer() for x in leaves}) == len(leaves)
    out = sampler([[5, 9, 2], [1, 4]])
    assert out.tokens.shape == (2, 4)


@WRITE_COPIES
@pytest.mark.parametrize("batch", [1, 2])  # one row: the write loop XLA would unroll (and then copy)
@pytest.mark.parametrize("name,policy", FORMATS)
def test_benchmark_step_updates_its_cache_in_place(model, name, policy, batch):
    fmt = get_format(name, **policy)
    graphdef, params = nnx.split(model)
    cache = jax.eval_shape(lambda: init_cache(CONFIG, batch, MAX_LEN, fmt))
    m = analysis(greedy_step(graphdef), params, jax.ShapeDtypeStruct((batch, 1), jnp.int32), cache,
                 default_calib(cache), jax.random.key(0))
    nbytes = base.tree_nbytes((cache.looped, cache.plain))
    assert m.alias_size_in_bytes >= nbytes and m.temp_size_in_bytes < nbytes / 2


def test_eval_loop_keeps_one_copy_of_its_caches(model):
    """The scoring program builds both caches inside itself (temporaries), prefills them, then decodes
    through them in a while loop: its temporaries are the prefill's own plus each cache once."""
    scorer = CacheScorer(model, get_format("residual", group_size=8))
    b, t = 2, MAX_LEN
    caches = [jax.eval_shape(lambda f=f: init_cache(CONFIG, b, t, f)) for f in (scorer.fmt, scorer.reference)]
    nbytes = sum(cache_nbytes(c) for c in caches)
    tokens, ints = jax.ShapeDtypeStruct((b, t), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32)

    def prefill(params, calib, tokens, prefix):  # the scoring program's first part, its caches returned
        empty = [init_cache(CONFIG, b, t, f) for f in (scorer.fmt, scorer.reference)]
        return [scorer._call(params, tokens, c, prefix, cal, 0).cache
                for c, cal in zip(empty, (calib, scorer.ref_calib))]

    first = analysis(jax.jit(prefill), scorer.params, scorer.calib, tokens, ints)
    m = analysis(scorer._score, scorer.params, scorer.calib, tokens, ints, ints)
    assert m.temp_size_in_bytes < first.temp_size_in_bytes + 1.5 * nbytes


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_step_makes_no_float32_copy_of_bf16_weights(batch, dtype):
    """A bf16 output head of 64 × 16384 (2 MiB) used by float32 or bf16 compute: the step's temporaries
    stay below the head's float32 copy (4 MiB), also for one row (a product XLA:CPU would widen)."""
    config = preset("ouro-tiny").replace(vocab_size=16384, tie_word_embeddings=False)
    def make():
        return init_model(config, dtype=dtype, param_dtype=jnp.bfloat16)

    graphdef, params = nnx.split(nnx.eval_shape(make))
    cache = jax.eval_shape(lambda: init_cache(config, batch, 64, get_format("residual", group_size=8)))
    m = analysis(greedy_step(graphdef), params, jax.ShapeDtypeStruct((batch, 1), jnp.int32), cache,
                 default_calib(cache), jax.random.key(0))
    head = config.hidden_size * config.vocab_size * 4
    assert m.temp_size_in_bytes < head, m.temp_size_in_bytes
