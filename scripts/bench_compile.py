"""Compile time of one jitted decode step at real depth and reduced width; prints a table, writes JSON.

    python scripts/bench_compile.py [--json out.json]

For Ouro-1.4B's depth (24 layers × 4 loops) and Huginn-0125's (2 prelude + 4 core + 2 coda blocks,
32 recurrence steps), at full and half depth, a randomly initialised model of reduced width decodes one
token against a `--context`-token cache, with the `dense` and `residual` formats. "first call" is trace
+ compile + one run of a fresh `jax.jit`; "step" the median of later calls. The "before" column is the
unrolled engine's first call measured on this 2-core
CPU when the scan engine was proposed (issue 7); the scan engine's trace does not grow with depth.
"""

import json
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from rq_jax import cli
from rq_jax.cache import available_formats, default_calib, get_format
from rq_jax.compilation import quiet_xla
from rq_jax.config import PRESETS, ModelConfig, preset
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
    """First-call seconds (trace + compile + run) and steady-state milliseconds of one decode step."""
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


def main(argv=None):
    p = cli.ArgumentParser(description=__doc__)
    p.add_argument("--width", type=cli.positive_int, default=256, help="hidden size (heads x head dim)")
    p.add_argument("--head-dim", type=cli.positive_int, default=128, help="head dim (divides --width)")
    p.add_argument("--context", type=cli.positive_int, default=64, help="tokens cached")
    p.add_argument("--repeats", type=cli.positive_int, default=5, help="timed calls after the first (median)")
    p.add_argument("--models", default="ouro-1.4b,huginn-0125", help="comma-separated presets")
    p.add_argument("--formats", default="dense,residual", help="comma-separated cache formats")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if args.width % args.head_dim:
        p.error(f"argument --head-dim: {args.head_dim} does not divide --width {args.width}")
    bad = [m for m in args.models.split(",") if m not in PRESETS]
    if bad:
        p.error(f"argument --models: {', '.join(bad)}; the presets are {', '.join(sorted(PRESETS))}")
    bad = [f for f in args.formats.split(",") if f not in available_formats()]
    if bad:
        p.error(f"argument --formats: {', '.join(bad)}; the formats are {', '.join(available_formats())}")
    if args.json:
        cli.output_file(p, "--json", args.json)
    quiet_xla()  # and no persistent compile cache: this script measures compilation
    print(f"width {args.width} (head dim {args.head_dim}), context {args.context}, float32, "
          f"{jax.devices()[0].platform}, jax {jax.__version__}")
    print(f"{'model':12s} {'depth':>6s} {'format':9s} {'first call s':>13s} {'step ms':>8s} {'before s':>9s} "
          f"{'full/half':>10s}")
    rows = []
    for name in args.models.split(","):
        for fmt_name in args.formats.split(","):
            pair = {}
            for half in (True, False):
                config = depth_config(name, half, args.width, args.head_dim)
                row = dict(model=name, depth="half" if half else "full", format=fmt_name,
                           layers=config.num_layers + config.num_plain_layers, loops=config.num_loops,
                           **measure(config, fmt_name, args.context, args.repeats))
                pair[row["depth"]] = row
                rows.append(row)
            pair["full"]["full_over_half"] = pair["full"]["first_s"] / pair["half"]["first_s"]
            for depth in ("half", "full"):
                r = pair[depth]
                before = BEFORE.get((name, fmt_name)) if depth == "full" else None
                ratio = f"{r['full_over_half']:10.2f}" if depth == "full" else f"{'':10s}"
                print(f"{name:12s} {depth:>6s} {fmt_name:9s} {r['first_s']:13.2f} {r['step_ms']:8.2f} "
                      f"{before if before else '':>9} {ratio}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), before=[dict(model=m, format=f, first_s=s) for (m, f), s in BEFORE.items()],
                           rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
