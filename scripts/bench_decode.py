"""End-to-end decode throughput per cache format at Ouro-1.4B / Huginn-0125 shapes, and the largest batch
a memory budget holds; prints Markdown tables and writes PREFIX.md + PREFIX.json.

    python scripts/bench_decode.py --out bench_decode      # CPU default (below): ~8 min on 2 shared cores
    python scripts/bench_decode.py --models ouro-1.4b huginn-0125 --context 1024 2048 4096 8192 16384 \\
        --batch 1 4 16 --memory-gb 32 --out sweep          # the full sweep (the default on a GPU)
    python scripts/bench_decode.py --tpu v5e:2x2 --no-run --out tpu   # a v5e's capacity, compiled here (libtpu)
    python scripts/bench_decode.py --tpu v5e --engine-chunk 256      # and the serving engine's programs

Defaults on a CPU: Ouro-1.4B's widths, heads and vocabulary at 2 of its 24 layers, context 4096, batch 1,
float32 compute, a 2.5 GiB budget. On a GPU: both models as released, contexts 1k-16k, batches 1/4/16,
bf16 compute, 32 GiB. With `--tpu GEN` (v4, v5e, v5p, v6e; `v5e:2x2` names the same chip) every program is
compiled for that TPU by libtpu on this host and nothing runs: both models as released, contexts 4k and 16k,
bf16 compute, the chip's HBM as the budget, the decode-attention op's Mosaic kernels (`--no-run` implied).
`--models NAME[:field=value,...]` takes a preset of `rq_jax.config` with
`ModelConfig` fields changed (Huginn at a CPU's scale: `CPU_HUGINN`) and `--layers N` sets every model's
looped layers; the tables name every change. Huginn's positions are raised past its 4096 when a context
needs it (shapes only: the trained model never saw them).

What is timed and measured, the columns, the budget search and the ratios: `rq_jax.perf.decode_report`.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax

from pallas_kernels import tpu_deviceless
from rq_jax import cli, report
from rq_jax.cache.schemes import BENCH_DECODE, catalog
from rq_jax.perf import attention as pa
from rq_jax.perf import decode_report
from rq_jax.sampling import PREFILL_CHUNK


def tpu_generation(text: str) -> str:
    """A TPU generation (`tpu_deviceless.TOPOLOGIES`), also spelled as its topology ("v5e:2x2")."""
    generation = text.split(":")[0]
    if generation not in tpu_deviceless.TOPOLOGIES or text not in (generation, tpu_deviceless.TOPOLOGIES[generation]):
        choices = ", ".join(f"{g} ({t})" for g, t in tpu_deviceless.TOPOLOGIES.items())
        raise argparse.ArgumentTypeError(f"unknown TPU {text!r}: choose from {choices}")
    return generation


def main(argv=None):
    first = argparse.ArgumentParser(add_help=False)  # --tpu sets the defaults; the parser below checks it
    first.add_argument("--tpu", default="")
    tpu = first.parse_known_args(argv)[0].tpu.split(":")[0]
    on_gpu = jax.default_backend() in ("gpu", "tpu") or bool(tpu)  # an accelerator's defaults
    p = cli.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--tpu", type=tpu_generation, metavar="GEN",
                   help="compile every program for this TPU (v4, v5e, v5p, v6e, or its topology, e.g. v5e:2x2) "
                        "with libtpu on this host, and run nothing")
    p.add_argument("--models", nargs="+", default=decode_report.GPU_MODELS if on_gpu else decode_report.CPU_MODELS,
                   help=f"NAME[:field=value,...]: a preset with ModelConfig fields changed (Huginn at a CPU's "
                        f"scale: {decode_report.CPU_HUGINN})")
    p.add_argument("--layers", type=cli.positive_int,
                   help="looped layers (Ouro layers, Huginn core blocks) of every model")
    labels = [s.label for s in catalog()]
    p.add_argument("--formats", nargs="+", choices=labels, default=list(BENCH_DECODE), metavar="LABEL",
                   help=f"scheme labels of the catalog (rq_jax/cache/schemes.py), among {labels}")
    p.add_argument("--impls", nargs="+", choices=("xla", "native"), default=["auto"] if on_gpu else ["xla", "native"],
                   metavar="IMPL", help="attend_impl of every format, one row per impl (xla, native; on a GPU the "
                                        "default is the formats' own 'auto')")
    p.add_argument("--context", type=cli.positive_int, nargs="+",
                   default=[4096, 16384] if tpu else [1024, 2048, 4096, 8192, 16384] if on_gpu else [4096],
                   help="tokens already cached")
    p.add_argument("--batch", type=cli.positive_int, nargs="+", default=[1, 4, 16] if on_gpu else [1],
                   help="rows per step")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16" if on_gpu else "float32",
                   help="compute dtype")
    p.add_argument("--weight-dtype", choices=("float32", "bfloat16"), default="bfloat16", help="weights' dtype")
    p.add_argument("--memory-gb", type=cli.nonnegative_float,
                   default=float(tpu_deviceless.HBM_GIB.get(tpu, 16)) if tpu else 32.0 if on_gpu else None,
                   help="one memory budget in GiB for every largest-batch search (0: skip the search; default "
                        "on a CPU: --budget-rows; with --tpu: the chip's HBM)")
    p.add_argument("--budget-rows", type=cli.positive_int, default=4,
                   help="without --memory-gb: each (model, context)'s budget is the 'dense bf16' step's memory at "
                        "this batch, so dense fits exactly that many rows")
    p.add_argument("--max-batch", type=cli.positive_int, default=4096, help="largest batch the search tries")
    p.add_argument("--machine-gb", type=cli.positive_float,
                   help="memory a run may use (default: the device's free memory; CPU: 60%% of MemAvailable)")
    p.add_argument("--repeats", type=cli.positive_int, default=10 if on_gpu else 3,
                   help="timed steps (the median is reported)")
    p.add_argument("--warmup", type=cli.nonnegative_int, default=1, help="untimed steps before them")
    p.add_argument("--no-run", action="store_true", help="compile only: bytes and the budget search, no timing")
    p.add_argument("--run-contexts", type=cli.positive_int, nargs="+",
                   help="time only these contexts (the others compile only; default: every context)")
    p.add_argument("--filled", type=cli.nonnegative_int,
                   help="also time each step with its cache holding only this many tokens")
    p.add_argument("--prefill", type=cli.positive_int, nargs="+", default=[],
                   help="also compile (batch 1, not run) the prefill of a prompt of this many tokens per format")
    p.add_argument("--prefill-chunk", type=cli.nonnegative_int, default=PREFILL_CHUNK,
                   help="tokens per model call of those prefills (rq_jax.sampling.prefill; 0: one call)")
    p.add_argument("--write-slots", type=cli.positive_int, nargs="+", default=[],
                   help="also time one token's write alone (its encode and store) into caches of these many "
                        "positions, at the first --batch: in place, it costs the same at every size")
    p.add_argument("--engine-chunk", type=cli.nonnegative_int, default=0,
                   help="also compile the serving engine's programs after each budget search, over a pool of the "
                        "engine's pages holding the largest batch found: its decode call at that many rows and "
                        "a prompt chunk of this many tokens (the server's --chunk; 0: not compiled)")
    p.add_argument("--read-mb", type=cli.positive_int, default=1024,
                   help="MiB summed (jit(jnp.sum), float32) to measure the read bandwidth")
    p.add_argument("--out", help="write PREFIX.md and PREFIX.json")
    args = p.parse_args(argv)
    if args.tpu:
        if not tpu_deviceless.libtpu_available():
            sys.exit(f'--tpu needs libtpu: pip install "jax[tpu]=={jax.__version__}"')
        if "native" in args.impls:
            p.error("--tpu compiles the TPU's kernels: --impls native runs on a CPU")
        args.no_run = True
    if args.engine_chunk and args.memory_gb == 0:
        p.error("--engine-chunk compiles the engine's programs at the budget search's largest batch: not with "
                "--memory-gb 0")
    if args.memory_gb is None and decode_report.DENSE not in args.formats:
        p.error(f"--budget-rows needs '{decode_report.DENSE}' among --formats (or give --memory-gb)")
    impls, dropped = pa.usable_impls(list(dict.fromkeys(args.impls)))
    if dropped:
        print(dropped)
    if not impls:
        sys.exit(f"{dropped}; no --impls left to run")
    command = "python scripts/bench_decode.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result = decode_report.run(args, impls, command)
    print("\n" + "\n".join(decode_report.tables(result)))
    if args.out:
        report.write_text(args.out + ".md", decode_report.page(result))
        report.write_text(args.out + ".json", json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
