"""Load-test scripts/serve.py: dense bf16 against residual [2,2,2,4] at one cache budget, in one run.

    python scripts/bench_serve.py --out docs/bench_serve              # Ouro-small, the vLLM comparison workload
    python scripts/bench_serve.py --workload prefix --max-len 1024 --concurrency 1,8 --out prefix
    python scripts/bench_serve.py --workload mixed --max-len 512 --memory-gb 0.05 --concurrency 8,32,max

For each cache format it starts the server on 127.0.0.1 twice (cold, then with the compile cache the cold
start filled, to time both start-ups), then drives it with an async load generator (aiohttp, as vLLM's own
serving benchmark: on 2 cores the client shares the CPU with the server, and httpx's streaming cost ~0.75 of a
core at 700 tok/s, halving what the server was measured to do; streamed completions) over a workload
(`--workload`: held-out sums in the models' format, 12-token prompts; mixed prompt and output lengths; GSM8K
3-shot prompts sharing a prefix, each format also without the prefix cache: `rq_jax.perf.serve`):
fixed-concurrency points (`--concurrency`, `max` = as many requests of `--max-len` tokens as the budget holds)
and Poisson arrival rates (`--rates`), each bounded by `--requests` and `--max-seconds`. Every request asks
for exactly its tokens (`--max-tokens`, or the mixed workload's draw; greedy, `ignore_eos`). Per request: time
to first token, inter-token latency, end to end; per point: output tok/s, peak output tok/s (the most
tokens received in one whole second, vLLM's "peak output token throughput"; "—" for a point under a
second), req/s, peak concurrent sequences (the most requests streaming at once, first token to last, from the
client's clock: polling the server's /metrics would cost it CPU) and medians / p99. Writes PREFIX.md (tables),
PREFIX.json and PREFIX.png (throughput and p99 latency against offered load).
"""

import argparse
import pathlib
import signal
import sys

from rq_jax.cli import ArgumentParser, output_file, positive_int
from rq_jax.perf import serve

REPO = pathlib.Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("ouro", "huginn"), default="ouro")
    p.add_argument("--checkpoint", default=str(REPO / "checkpoints" / "ouro-small"))
    p.add_argument("--memory-gb", type=float, default=0.004, help="the one cache budget of every format")
    p.add_argument("--max-slots", type=positive_int,
                   help="every format's pages for this many requests of --max-len (and as many decoding at most) "
                        "instead of a budget: equal slots compare what a format costs per row, an equal budget "
                        "(--memory-gb) what its capacity buys")
    p.add_argument("--workload", choices=serve.WORKLOADS, default="sums",
                   help="sums: 12-token prompts; mixed: prompt and output lengths log-uniform up to --max-len / 2; "
                        "prefix: GSM8K 3-shot prompts sharing a prefix, each format also without the prefix cache")
    p.add_argument("--max-len", type=positive_int, default=32)
    p.add_argument("--max-tokens", type=positive_int, default=8)
    p.add_argument("--concurrency", default="1,32,max",
                   help="fixed-concurrency points ('max': the requests of --max-len the cache holds)")
    p.add_argument("--rates", default="25,100", help="Poisson arrival rates, requests/s")
    p.add_argument("--requests", type=positive_int, default=64, help="requests per point (at most)")
    p.add_argument("--max-seconds", type=float, default=60.0, help="time per point (at most)")
    p.add_argument("--out", default="bench_serve", help="output prefix (.md, .json, .png)")
    args = p.parse_args(argv)
    try:
        args.levels = [c if c == "max" else positive_int(c) for c in args.concurrency.split(",")]
        args.arrivals = [float(r) for r in args.rates.split(",")] if args.rates else []
    except (ValueError, argparse.ArgumentTypeError) as err:
        p.error(f"--concurrency takes positive integers or 'max', --rates numbers: {err}")
    if not all(r > 0 for r in args.arrivals):
        p.error("--rates must be positive")
    if not args.memory_gb > 0:
        p.error("--memory-gb must be positive")
    output_file(p, "--out", args.out)
    return args


def main(argv=None):
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("bench_serve.py: terminated"))  # servers stopped on the way out
    try:
        runs = serve.run(args)
    except (serve.ServerDidNotStart, ValueError) as err:
        sys.exit(f"bench_serve.py: {err}")
    print(serve.write(runs, args))


if __name__ == "__main__":
    main()
