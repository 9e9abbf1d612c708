"""In place, by the compiled programs' own memory analysis: every jitted entry that takes a cache and
returns one (the Sampler's prefill and decode loop, the benchmark's step, the serving engine's programs)
aliases the output cache to the donated input and holds no second copy of it among its temporaries; the
eval loop's caches (built inside its program) are not copied either; a step with bf16 weights makes no
float32 copy of them, and a decode step copies no layer's weights out of their stack.

Context tiles are cut to 4096 float32 elements (32 tokens here): at the default size one tile would
cover these tiny caches whole, and its float32 decode would outweigh the packed cache it came from."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rq_jax.cache import base, cache_nbytes, default_calib, get_format, init_cache
from rq_jax.config import preset
from rq_jax.scoring import CacheScorer
from rq_jax.models import init_model
from rq_jax.perf.decode import greedy_step
from rq_jax.sampling import Sampler, SamplingConfig
from rq_jax.serve.model_runner import ModelRunner, padding

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


@pytest.mark.parametrize("name,policy", FORMATS)
def test_sampler_updates_its_cache_in_place(model, name, policy):
    fmt = get_format(name, **policy)
    sampler = Sampler(model, SamplingConfig(max_new_tokens=4), fmt)
    cache = jax.eval_shape(lambda: sampler._empty_cache(2, MAX_LEN).held())  # as __call__ passes it
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


@pytest.mark.parametrize("batch", [1, 2])  # one row: the write loop XLA would unroll (and then copy)
@pytest.mark.parametrize("name,policy", FORMATS)
def test_benchmark_step_updates_its_cache_in_place(model, name, policy, batch):
    fmt = get_format(name, **policy)
    graphdef, params = nnx.split(model)
    cache = jax.eval_shape(lambda: init_cache(CONFIG, batch, MAX_LEN, fmt).as_bits())
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


@pytest.mark.parametrize("name,policy", FORMATS[:2])
def test_the_serving_programs_update_the_pool_in_place(model, name, policy):
    """The model runner's decode and prompt programs alias the page pool to the donated input and hold no
    copy of any of its leaves (a tenth of the pool: residual's anchor codes alone are ~40% of it): a copy
    would cost every step the whole pool, whatever the step's rows. (With the layers unrolled, XLA copied
    the anchor's leaves: the writes no longer waited for the reads.)"""
    runner = ModelRunner(model, get_format(name, **policy), pages=2048, page_size=16, max_len=256, max_rows=4,
                         chunk=32, token_budget=64)
    nbytes = base.tree_nbytes(runner.state)
    for rows, width, prefill in ((4, 1, False), (2, 32, True)):
        args = (*runner._fixed, runner.state, *padding(rows, width, runner.pages_per_row))
        m = runner._call.lower(*args, prefill=prefill, echo=False).compile().memory_analysis()
        assert m.alias_size_in_bytes >= nbytes and m.temp_size_in_bytes < nbytes / 10, (rows, m)


@pytest.mark.parametrize("name", ["dense", "residual"])
def test_a_decode_step_copies_no_layer_out_of_its_stack(name):
    """The Sampler's decode loop (weights `per_layer` on a CPU) holds less than one layer's weights in
    temporaries; the same step over the stacked weights copies a layer out of the stack (what it avoids)."""
    config = preset("ouro-tiny").replace(hidden_size=256, head_dim=64, intermediate_size=2048)
    model = init_model(config, 0)
    layer = sum(x.nbytes for x in jax.tree_util.tree_leaves(nnx.state(model.layers))) // config.num_layers
    fmt = get_format(name, **({} if name == "dense" else dict(group_size=8)))
    sampler = Sampler(model, SamplingConfig(max_new_tokens=4), fmt)
    cache = jax.eval_shape(lambda: sampler._empty_cache(1, 64))
    args = (sampler.params, sampler.calib, jax.ShapeDtypeStruct((1, 8), jnp.int32),
            jax.ShapeDtypeStruct((1,), jnp.int32), cache, jax.random.key(0))
    decode = analysis(sampler._decode, sampler.params, sampler.calib, jax.eval_shape(sampler._prefill_fn, *args))
    assert decode.temp_size_in_bytes < layer / 4, (decode.temp_size_in_bytes, layer)
    graphdef, params = nnx.split(model)
    bits = jax.eval_shape(lambda: init_cache(config, 1, 64, fmt).as_bits())
    stacked = analysis(greedy_step(graphdef), params, jax.ShapeDtypeStruct((1, 1), jnp.int32), bits,
                       default_calib(bits), jax.random.key(0))
    assert stacked.temp_size_in_bytes > layer, (stacked.temp_size_in_bytes, layer)


#: Run under XLA's default code generator (the suite runs the classic emitters, tests/conftest.py), so in a
#: process of its own: the benchmark step over a cache held as bits, its temporaries over the cache's bytes.
_FUSION_EMITTERS = """
import jax, jax.numpy as jnp
from flax import nnx
from rq_jax.cache import base, default_calib, get_format, init_cache
from rq_jax.config import preset
from rq_jax.models import init_model
from rq_jax.perf.decode import greedy_step
base.TILE_ELEMENTS = 2**12
config = preset("ouro-tiny").replace(max_position_embeddings=2048)
graphdef, params = nnx.split(init_model(config, 0))
for name, policy in {formats}:
    for held in ("values", "bits"):
        cache = jax.eval_shape(lambda: getattr(init_cache(config, 2, 2048, get_format(name, **policy)), "as_" + held)())
        m = greedy_step(graphdef).lower(params, jax.ShapeDtypeStruct((2, 1), jnp.int32), cache, default_calib(cache),
                                        jax.random.key(0)).compile().memory_analysis()
        print(name, held, m.temp_size_in_bytes / base.tree_nbytes((cache.looped, cache.plain)))
"""


def test_a_cache_held_as_bits_is_written_in_place_by_the_fusion_emitters():
    """XLA:CPU's default (MLIR fusion) emitters make the writes' bitcasts (`base.on_bits`) a copy of every
    narrow-float leaf when the cache holds values; held as bits (`KVCache.as_bits`) the step keeps none."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", _FUSION_EMITTERS.format(formats=FORMATS)], env=env, check=True,
                         capture_output=True, text=True, timeout=600).stdout.split("\n")
    ratios = {tuple(line.split()[:2]): float(line.split()[2]) for line in out if line}
    assert len(ratios) == 2 * len(FORMATS)
    for name, _ in FORMATS:
        assert ratios[name, "bits"] < 0.1, ratios
    assert ratios["dense", "values"] > 0.9, ratios  # what holding as bits avoids (if XLA stops copying, drop it)


@pytest.mark.parametrize("name,policy", FORMATS)
def test_a_cache_held_as_bits_computes_what_one_holding_values_does(model, name, policy):
    fmt = get_format(name, **policy)
    cache = init_cache(CONFIG, 2, 48, fmt)
    calib = default_calib(cache)
    tokens = jax.random.randint(jax.random.key(1), (2, 20), 0, CONFIG.vocab_size)
    steps = [(tokens, jnp.asarray([20, 13])), (tokens[:, :1], jnp.asarray([1, 1]))]
    plain, bits = cache, cache.as_bits()
    assert {str(x.dtype) for x in jax.tree_util.tree_leaves(bits.looped)} <= {"uint8", "uint16", "uint32"}
    for toks, n in steps:
        a, b = model(toks, plain, num_new=n, calib=calib), model(toks, bits, num_new=n, calib=calib)
        assert b.cache.bit_dtypes is not None
        np.testing.assert_array_equal(np.asarray(a.logits), np.asarray(b.logits))
        plain, bits = a.cache, b.cache
    for x, y in zip(jax.tree_util.tree_leaves(plain), jax.tree_util.tree_leaves(bits.as_values())):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
