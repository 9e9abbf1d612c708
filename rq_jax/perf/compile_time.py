"""Compile time of one jitted decode step at a preset's depth and a reduced width, behind
`scripts/bench_compile.py`: the scan engine's trace should not grow with depth, so a full-depth model
compiles about as fast as a half-depth one.

For a preset's depth (Ouro-1.4B: 24 layers × 4 loops; Huginn-0125: 2 prelude + 4 core + 2 coda blocks,
32 recurrence steps), at full and half depth, a randomly initialised model of reduced width decodes one
token against a cache of `context` tokens. "first call" is trace + compile + one run of a fresh
`jax.jit`; "step" the median of later calls. `BEFORE` is the unrolled engine's first call measured on a
2-core CPU when the scan engine was proposed (issue 7).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from rq_jax.cache import default_calib, get_format
from rq_jax.config import ModelConfig, preset
from rq_jax.models import init_model
from rq_jax.sampling import decode_step

#: First-call seconds of the unrolled engine (issue 7), full depth, by (model, format).
BEFORE = {("ouro-1.4b", "dense"): 28.0, ("ouro-1.4b", "residual"): 46.0,
          ("huginn-0125", "dense"): 37.0, ("huginn-0125", "residual"): 32.0}


def depth_config(name: str, half: bool, width: int, head_dim: int) -> ModelConfig:
    """Preset `name`'s depth (halved with `half`: layers and plain blocks, and Huginn's recurrence steps)
    at a reduced width of `width` = heads · head_dim, MLP 2·width and a 512-token vocabulary."""
    c, div = preset(name), 2 if half else 1
    heads = width // head_dim
    loops = c.num_loops // div if c.family == "huginn" else c.num_loops
    return c.replace(vocab_size=512, hidden_size=width, num_heads=heads, num_kv_heads=heads, head_dim=head_dim,
                     intermediate_size=2 * width, max_position_embeddings=4096, num_layers=c.num_layers // div,
                     num_prelude=c.num_prelude // div, num_coda=c.num_coda // div, num_loops=loops)


def measure(config: ModelConfig, fmt_name: str, context: int, repeats: int) -> dict:
    """First-call seconds (trace + compile + run) and steady-state milliseconds (median of `repeats`) of
    one decode step (batch 1) against a cache already holding `context` tokens."""
    model = init_model(config)
    graphdef, params = nnx.split(model)
    fmt = get_format(fmt_name)
    cache = model.init_cache(1, context + 1, fmt)
    cache = cache.replace(lengths=jnp.full((1,), context, jnp.int32))
    calib = default_calib(cache)

    def step(params, tok, cache, calib):
        return decode_step(nnx.merge(graphdef, params), tok, cache, calib=calib).logits

    tok = jnp.zeros((1,), jnp.int32)
    fn = jax.jit(step)
    start = time.perf_counter()
    jax.block_until_ready(fn(params, tok, cache, calib))
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(params, tok, cache, calib))
        times.append(time.perf_counter() - start)
    return dict(first_s=first, step_ms=1e3 * statistics.median(times))


def depth_rows(models: list[str], formats: list[str], width: int, head_dim: int, context: int, repeats: int,
               log=print) -> list[dict]:
    """`measure` of every (model, format) at half then full depth: rows of model, depth, format, layers
    (looped + plain), loops, first_s, step_ms, and on the full-depth row full_over_half (its first call
    over the half-depth one's). `log` gets the table as it fills, `BEFORE` beside the full-depth rows."""
    log(f"width {width} (head dim {head_dim}), context {context}, float32, {jax.devices()[0].platform}, "
        f"jax {jax.__version__}")
    log(f"{'model':12s} {'depth':>6s} {'format':9s} {'first call s':>13s} {'step ms':>8s} {'before s':>9s} "
        f"{'full/half':>10s}")
    rows = []
    for name in models:
        for fmt_name in formats:
            pair = {}
            for half in (True, False):
                config = depth_config(name, half, width, head_dim)
                row = dict(model=name, depth="half" if half else "full", format=fmt_name,
                           layers=config.num_layers + config.num_plain_layers, loops=config.num_loops,
                           **measure(config, fmt_name, context, repeats))
                pair[row["depth"]] = row
                rows.append(row)
            pair["full"]["full_over_half"] = pair["full"]["first_s"] / pair["half"]["first_s"]
            for depth in ("half", "full"):
                r = pair[depth]
                before = BEFORE.get((name, fmt_name)) if depth == "full" else None
                ratio = f"{r['full_over_half']:10.2f}" if depth == "full" else f"{'':10s}"
                log(f"{name:12s} {depth:>6s} {fmt_name:9s} {r['first_s']:13.2f} {r['step_ms']:8.2f} "
                    f"{before if before else '':>9} {ratio}")
    return rows


def result(settings: dict, rows: list[dict]) -> dict:
    """The run's JSON: its settings (`args`), `BEFORE` as rows of model, format, first_s, and its rows."""
    return dict(args=settings, before=[dict(model=m, format=f, first_s=s) for (m, f), s in BEFORE.items()],
                rows=rows)
