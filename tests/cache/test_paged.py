"""A paged cache (a pool of pages read and written through per-row block tables) computes what a contiguous
cache does: the model's logits through a prompt and decode steps, every format that pages, on the XLA path
and the native kernels, dense and residual through the Pallas (Triton) kernels and dense through the Mosaic
(TPU) kernel, both in interpret mode; the
pool's pages no row holds are never touched; kivi pages whole rows."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels
from rq_jax.cache import base, default_calib, get_format, init_cache
from rq_jax.cache.kv import init_paged_cache
from rq_jax.config import preset
from rq_jax.models import init_model

CONFIG = preset("ouro-tiny")
PAGE, PAGES_PER_ROW, POOL = 4, 8, 40
FORMATS = {"dense": get_format("dense", dtype="float32"), "residual": get_format("residual", group_size=8),
           "uniform INT4": get_format("uniform", bits=4, group_size=8),
           "turboquant": get_format("turboquant", preset="k8v4"), "share last": get_format("share")}
IMPLS = ["xla"] + (["native"] if cpu_kernels.available() else [])
#: (format, implementation) pairs: every format on every CPU implementation, and the formats the Pallas kernels
#: cover at the tiny model's head dim 16 (metadata groups of 16 at least; the TPU kernel's planes need 8
#: bytes, so dense only) through them.
CASES = [(name, impl) for name in FORMATS for impl in IMPLS] + [("dense", "pallas"), ("residual g16", "pallas"),
                                                               ("dense", "pallas-tpu")]
FORMATS["residual g16"] = get_format("residual", group_size=16)


def with_impl(fmt, impl):
    fields = {f.name for f in dataclasses.fields(fmt)}
    return dataclasses.replace(fmt, **{k: impl for k in ("attend_impl", "write_impl") if k in fields})


def tables(rows: int, seed: int = 0) -> np.ndarray:
    """Each row's logical pages scattered over the pool (POOL > rows × PAGES_PER_ROW: some pages unused)."""
    return np.random.default_rng(seed).permutation(POOL)[: rows * PAGES_PER_ROW].reshape(rows, PAGES_PER_ROW)


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=0)


ROWS = 3
TOKENS = jax.random.randint(jax.random.key(1), (ROWS, 7), 0, CONFIG.vocab_size)
#: A prompt of 7, 3 and 5 tokens, then decode steps and a second prompt chunk: (tokens, num_new) per step.
STEPS = [(TOKENS, jnp.array([7, 3, 5])), (TOKENS[:, :1], jnp.array([1, 1, 1])),
         (TOKENS[:, 1:3], jnp.array([2, 1, 2])), (TOKENS[:, 3:4], jnp.array([1, 1, 1]))]
_REFERENCES = {}


def contiguous_run(model, name):
    """`name`'s format through STEPS on a contiguous cache, on the native kernels where they are built (the
    cheapest to compile; the paged runs of every implementation are checked against it): per step the logits
    and lengths, and the prompt's K/V as each loop reads them back. Computed once per format."""
    if name not in _REFERENCES:
        fmt = with_impl(FORMATS[name], IMPLS[-1])
        cache = init_cache(CONFIG, ROWS, PAGE * PAGES_PER_ROW, fmt)
        calib = default_calib(cache)
        step = jax.jit(lambda toks, cache, n: model(toks, cache, num_new=n, calib=calib))
        outs = []
        for toks, n in STEPS:
            out = step(toks, cache, n)
            cache = out.cache
            outs.append((np.asarray(out.logits), np.asarray(cache.lengths)))
            if len(outs) == 1:
                prompt = [[np.asarray(x) for x in cache.read("looped", loop, 1, calib)]
                          for loop in range(CONFIG.num_loops)]
        _REFERENCES[name] = outs, prompt
    return _REFERENCES[name]


@pytest.mark.parametrize("name,impl", CASES)
def test_paged_cache_computes_what_a_contiguous_one_does(model, name, impl, caplog):
    fmt = with_impl(FORMATS[name], impl)
    paged = init_paged_cache(CONFIG, ROWS, POOL, PAGE, PAGES_PER_ROW, fmt)
    table = jnp.asarray(tables(ROWS), jnp.int32)
    paged = paged.replace(block_table=table)
    # The pages no row holds: filled with a marker the rows must never read or overwrite.
    unused = np.setdiff1d(np.arange(POOL), np.asarray(table))
    paged = paged.replace(looped=jax.tree_util.tree_map(
        lambda x: x.at[:, :, unused].set(jnp.asarray(7, x.dtype)), paged.looped))
    calib = default_calib(paged)
    want, prompt = contiguous_run(model, name)
    step = jax.jit(lambda toks, cache, n: model(toks, cache, num_new=n, calib=calib))
    for i, ((toks, n), (logits, lengths)) in enumerate(zip(STEPS, want)):
        out = step(toks, paged, n)
        paged = out.cache
        # Float32 rounding apart: tiles of a page against a row's tile merge the softmax in another order, and
        # the implementations sum in theirs.
        np.testing.assert_allclose(np.asarray(out.logits), logits, rtol=2e-5, atol=2e-5)
        np.testing.assert_array_equal(np.asarray(paged.lengths), lengths)
        if i == 0:  # the prompt's K/V (no past yet, so the same bits): each row's pages, in its order, hold
            for loop in range(CONFIG.num_loops):  # what its contiguous row holds
                for w, g in zip(prompt[loop], paged.read("looped", loop, 1, calib)):
                    np.testing.assert_array_equal(np.asarray(g), w)
    for leaf in jax.tree_util.tree_leaves(paged.looped):
        np.testing.assert_array_equal(base.bits_of(leaf[:, :, unused]),
                                      base.bits_of(jnp.full_like(leaf[:, :, unused], 7)))
    assert "does not cover" not in caplog.text  # the implementation ran, no fallback to XLA


def test_kivi_pages_whole_rows(model):
    """kivi's windows of full-precision tokens are per row, so its pages are whole rows (one page of max_len a
    row). Rows scattered over a pool, and a padding row (no tokens) on a page a real row holds, as the
    engine pads its calls: the logits are the contiguous cache's through 11 tokens (past the 8-token window:
    keys and values quantized), the prompt's stored bits equal, the unheld pages untouched; more pages a row
    refused."""
    fmt = get_format("kivi", key_group=4, value_group=8, residual_length=8)
    contiguous = init_cache(CONFIG, 4, 32, fmt)  # its row 3 a padding row too: the same shapes, the same bits
    paged = init_paged_cache(CONFIG, 4, 5, 32, 1, fmt).replace(block_table=jnp.array([[3], [0], [4], [0]]))
    paged = paged.replace(looped=jax.tree_util.tree_map(lambda x: x.at[:, :, 1:3].set(jnp.asarray(7, x.dtype)),
                                                        paged.looped))
    tokens = jax.random.randint(jax.random.key(1), (4, 7), 0, CONFIG.vocab_size)
    steps = [(tokens, [7, 3, 5]), (tokens[:, :1], [1, 1, 1]), (tokens[:, 1:3], [2, 1, 2]), (tokens[:, 3:4], [1, 1, 1])]
    step = jax.jit(lambda toks, cache, n: model(toks, cache, num_new=n))
    for i, (toks, n) in enumerate(steps):
        a, b = step(toks, contiguous, jnp.array([*n, 0])), step(toks, paged, jnp.array([*n, 0]))
        np.testing.assert_allclose(np.asarray(b.logits[:3]), np.asarray(a.logits[:3]), rtol=2e-5, atol=2e-5)
        contiguous, paged = a.cache, b.cache
        for want, got in zip(jax.tree_util.tree_leaves(contiguous.looped), jax.tree_util.tree_leaves(paged.looped)):
            if i == 0:  # the prompt's state (no past yet, so the same bits) in each row's page
                np.testing.assert_array_equal(base.bits_of(got[:, :, jnp.array([3, 0, 4])]),
                                              base.bits_of(want[:, :, :3]))
            np.testing.assert_array_equal(base.bits_of(got[:, :, 1:3]), base.bits_of(jnp.full_like(got[:, :, 1:3], 7)))
    with pytest.raises(ValueError, match="'kivi' cache format pages whole rows only"):
        init_paged_cache(CONFIG, 2, 8, 4, 4, fmt)
