"""Serve a looped model over an OpenAI-compatible HTTP API with continuous batching over a compressed KV cache.

    python scripts/serve.py --model huginn --port 8000                     # residual [2,2,2,4] cache
    python scripts/serve.py --model ouro --cache dense --memory-gb 1       # pages from a cache budget
    python scripts/serve.py --model ouro --mesh data=4,model=2             # rows over data, heads over model

Without --checkpoint it serves a small model shipped in checkpoints/ (generate.py's defaults). The cache
is a pool of pages of --page-size tokens: as many as --memory-gb of cache holds in the chosen format (the
arrays' own bytes), or room for --max-slots requests of --max-len tokens; requests hold the pages their
tokens fill, and prompts that start alike share their full pages (--no-prefix-cache: never). At most
--max-slots requests decode at once (default: as many as the pages allow, up to 256). Every program
compiles at start-up (printed with
its seconds) and is kept in the compile cache ($RQ_JAX_COMPILE_CACHE, default ~/.cache/rq_jax/jax), so a
second start loads them (--no-compile-cache: compile afresh). Listens on 127.0.0.1 by default;
SIGTERM (or Ctrl-C) stops admitting, lets held requests finish for --drain-timeout seconds, cancels
the rest and exits.
"""

import os
import time

import jax.numpy as jnp

from rq_jax import checkpoint, cli
from rq_jax.serve import launch
from rq_jax.serve.chat import ChatTemplate
from rq_jax.serve.engine import Engine
from rq_jax.serve.metrics import ServeMetrics
from rq_jax.serve.runner import EngineThread
from rq_jax.tokenizer import load_tokenizer


def parse_args(argv=None):
    """The parser and the parsed command line (options checked that need no checkpoint)."""
    p = cli.ArgumentParser(description=__doc__)
    cli.add_model_options(p)
    cli.add_cache_options(p)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--memory-gb", type=cli.positive_float,
                      help="KV cache budget in GiB: the pages it holds (default 1)")
    size.add_argument("--max-slots", type=cli.positive_int,
                      help="concurrent requests: pages for this many of --max-len tokens, and the decode step's rows")
    p.add_argument("--max-len", type=cli.positive_int, default=256, help="tokens per request: prompt + max_tokens - 1")
    p.add_argument("--chunk", type=cli.positive_int, default=256,
                   help="prompt chunk: longer prompts run in chunks beside the decoding requests")
    p.add_argument("--token-budget", type=cli.positive_int,
                   help="tokens per engine step, decode tokens first (default max(--chunk, 2048), vLLM's on a CPU)")
    p.add_argument("--page-size", type=cli.positive_int,
                   help="tokens per cache page (default 64 on a CPU, 128 on a TPU, 16 on a GPU)")
    p.add_argument("--no-prefix-cache", action="store_true", help="never share pages between requests")
    p.add_argument("--max-waiting", type=cli.positive_int, default=256, help="queued requests before 429")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the model id of the API (default: the checkpoint folder's name)")
    p.add_argument("--mesh", help="run sharded on a device mesh, e.g. data=4,model=2 (default: one device)")
    p.add_argument("--warmup-echo", action="store_true",
                   help="also compile the prefills that return prompt log-probabilities (echo); else on first use")
    p.add_argument("--drain-timeout", type=cli.nonnegative_float, default=30.0,
                   help="seconds held requests get after SIGTERM")
    cli.add_runtime_options(p)
    args = p.parse_args(argv)
    cli.check_cache_options(p, args)
    if not 0 <= args.port < 2**16:
        p.error(f"argument --port: {args.port} is not a TCP port (0 to 65535)")
    if args.max_slots is None and args.memory_gb is None:
        args.memory_gb = 1.0
    return p, args


def main(argv=None):
    started = time.perf_counter()
    p, args = parse_args(argv)
    cli.start(args)
    mesh = cli.device_mesh(p, args)
    config, folder = cli.resolve_checkpoint(p, args)
    loops = config.num_loops if args.loops is None else args.loops
    fmt = cli.build_format(p, args, config, loops)
    if args.max_len > config.max_position_embeddings:
        p.error(f"argument --max-len: {args.max_len} exceeds the model's {config.max_position_embeddings} positions")
    try:
        tokenizer = load_tokenizer(folder)
    except FileNotFoundError as err:
        p.error(f"argument --checkpoint: {err} (the checkpoint needs its tokenizer.json)")
    model, _ = checkpoint.load(folder, dtype=jnp.dtype(args.dtype))
    try:
        calib = cli.calibration(args, model, fmt, loops)
    except ValueError as err:
        p.error(str(err))
    if calib is None and fmt.needs_data:
        p.error(f"argument --calibration: the {args.cache} cache needs a fitted artifact (scripts/calibrate.py)")
    name = args.served_model_name or os.path.basename(os.path.normpath(folder))
    metrics = ServeMetrics(name, args.cache)
    try:
        engine = Engine(model, tokenizer, fmt, eos_ids=cli.stop_token_ids(tokenizer, folder), max_len=args.max_len,
                        num_slots=args.max_slots, memory_bytes=None if args.memory_gb is None else
                        int(args.memory_gb * 2**30), calib=calib, mesh=mesh, chunk=args.chunk,
                        token_budget=args.token_budget, page_size=args.page_size,
                        prefix_cache=not args.no_prefix_cache, metrics=metrics, **cli.model_kwargs(args))
    except (ValueError, MemoryError) as err:
        p.error(str(err))
    del model  # the engine holds its own weights (per layer on a CPU: setup.weights): free this copy
    runner = EngineThread(engine, max_waiting=args.max_waiting, warm_up_echo=args.warmup_echo)
    launch.run(runner, tokenizer, name, ChatTemplate.from_folder(folder), metrics, source=cli.checkpoint_source(args),
               mesh=mesh, host=args.host, port=args.port, drain_timeout=args.drain_timeout, started=started)


if __name__ == "__main__":
    main()
