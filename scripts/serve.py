"""Serve a looped model over an OpenAI-compatible HTTP API with continuous batching over a compressed KV cache.

    python scripts/serve.py --model huginn --port 8000                     # residual [2,2,2,4] cache
    python scripts/serve.py --model ouro --cache dense --memory-gb 1       # slots from a cache budget
    python scripts/serve.py --model ouro --mesh data=4,model=2             # slots over data, heads over model

Without --checkpoint it serves a small model shipped in checkpoints/ (generate.py's defaults). The
number of decode slots is --max-slots, or as many slots of --max-len tokens as --memory-gb of cache
holds in the chosen format (the arrays' own bytes). Every program compiles at start-up (printed with
its seconds) and is kept in the compile cache ($RQ_JAX_COMPILE_CACHE, default ~/.cache/rq_jax/jax), so a
second start loads them (--no-compile-cache: compile afresh). Listens on 127.0.0.1 by default;
SIGTERM (or Ctrl-C) stops admitting, lets held requests finish for --drain-timeout seconds, cancels
the rest and exits.
"""

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import time

import jax.numpy as jnp

from rq_jax import checkpoint, cli, memory, sharding
from rq_jax.cli import (add_cache_options, add_model_options, add_runtime_options, cache_policy, check_cache_options,
                        checkpoint_source, model_kwargs, positive_int, stop_token_ids)
from rq_jax.cache import get_format
from rq_jax.calibrate.allocate import load_schedule


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_options(p)
    add_cache_options(p)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--memory-gb", type=float, help="KV cache budget in GiB: the slots it holds (default 1)")
    size.add_argument("--max-slots", type=positive_int, help="decode slots (concurrent sequences)")
    p.add_argument("--max-len", type=positive_int, default=256, help="tokens per slot: prompt + max_tokens - 1")
    p.add_argument("--chunk", type=positive_int, default=256,
                   help="longest prefill call; longer prompts run in chunks between decode steps")
    p.add_argument("--prefill-budget", type=positive_int,
                   help="prefill tokens (bucketed) per engine step before its decode step (default --chunk)")
    p.add_argument("--max-waiting", type=positive_int, default=256, help="queued requests before 429")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the model id of the API (default: the checkpoint folder's name)")
    p.add_argument("--mesh", help="run sharded on a device mesh, e.g. data=4,model=2 (default: one device)")
    p.add_argument("--warmup-echo", action="store_true",
                   help="also compile the prefills that return prompt log-probabilities (echo); else on first use")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds held requests get after SIGTERM")
    add_runtime_options(p)
    args = p.parse_args(argv)
    check_cache_options(p, args)
    if args.model == "ouro" and args.init_state:
        p.error("--init-state is for Huginn")
    if args.memory_gb is not None and not args.memory_gb > 0:
        p.error("--memory-gb must be positive")
    if args.max_slots is None and args.memory_gb is None:
        args.memory_gb = 1.0
    return args


def build(args):
    """The engine thread, tokenizer, model name and chat template of a command line (nothing compiled yet)."""
    from rq_jax.serve.chat import ChatTemplate
    from rq_jax.serve.engine import Engine
    from rq_jax.serve.metrics import ServeMetrics
    from rq_jax.serve.runner import EngineThread
    from rq_jax.tokenizer import load_tokenizer

    try:
        mesh = sharding.parse_mesh(args.mesh)
    except ValueError as err:
        sys.exit(f"serve.py: bad --mesh: {err}")
    source = checkpoint_source(args)
    model, folder = checkpoint.load(source, dtype=jnp.dtype(args.dtype))
    if model.config.family != args.model:
        sys.exit(f"serve.py: --model {args.model} but {source} holds a {model.config.family} model")
    try:
        tokenizer = load_tokenizer(folder)
    except FileNotFoundError as err:
        sys.exit(f"serve.py: {err} (the checkpoint needs its tokenizer.json)")
    try:
        fmt = load_schedule(args.schedule, **cache_policy(args)) if args.schedule else \
            get_format(args.cache, **cache_policy(args))
        fmt.bits_per_element(model.config.num_loops, model.config.head_dim)
    except ValueError as err:
        sys.exit(f"serve.py: bad --cache policy: {err}")
    kwargs = model_kwargs(args)
    loops = kwargs["num_loops"] or model.config.num_loops
    if args.max_len > model.config.max_position_embeddings:
        sys.exit(f"serve.py: --max-len {args.max_len} exceeds the model's {model.config.max_position_embeddings} "
                 f"positions")
    try:
        calib = cli.calibration(args, model, fmt, loops)
    except ValueError as err:
        sys.exit(f"serve.py: {err}")
    if calib is None and fmt.needs_data:
        sys.exit(f"serve.py: the {args.cache} cache needs --calibration (a fitted artifact, scripts/calibrate.py)")
    name = args.served_model_name or os.path.basename(os.path.normpath(folder))
    metrics = ServeMetrics(name, args.cache)
    budget = None if args.memory_gb is None else int(args.memory_gb * 2**30)
    try:
        engine = Engine(model, tokenizer, fmt, eos_ids=stop_token_ids(tokenizer, folder), max_len=args.max_len,
                        num_slots=args.max_slots, memory_bytes=budget, calib=calib, mesh=mesh, chunk=args.chunk,
                        prefill_budget=args.prefill_budget, metrics=metrics, **kwargs)
        memory.check_fits(model, fmt, batch=engine.num_slots, prompt_len=1, max_len=args.max_len,
                          num_loops=loops, compute_itemsize=jnp.dtype(args.dtype).itemsize, what="this server",
                          advice="use a smaller --memory-gb, --max-slots or --max-len")
    except (ValueError, MemoryError) as err:
        sys.exit(f"serve.py: {err}")
    runner = EngineThread(engine, max_waiting=args.max_waiting, warm_up_echo=args.warmup_echo)
    return runner, tokenizer, name, ChatTemplate.from_folder(folder), metrics, source, mesh


def main(argv=None):
    start = time.perf_counter()
    args = parse_args(argv)
    cli.start(args)
    import uvicorn

    from rq_jax.serve.api import Server, create_app

    runner, tokenizer, name, chat_template, metrics, source, mesh = build(args)
    engine = runner.engine
    print(f"model: {name} from {source}; cache {args.cache}: {engine.num_slots} slots of {engine.max_len} tokens, "
          f"{engine.slot_bytes:,} bytes each (dense bf16: {engine.dense_slot_bytes:,}); prefill buckets "
          f"{list(engine.buckets)}, decode buckets {list(engine.decode_buckets)}"
          + ("" if chat_template else "; no chat template"), flush=True)
    if mesh is not None:
        print("\n".join(sharding.describe(engine.config, mesh, batch=engine.num_slots)), flush=True)

    def report_ready():
        """Print the warm-up's compile seconds once it has finished (from the engine thread's state)."""
        while runner.state == "warming up":
            time.sleep(0.05)
        if runner.state == "ready":
            parts = ", ".join(f"{k} {v:.2f}" for k, v in runner.warm_up_seconds.items())
            print(f"compiled in {sum(runner.warm_up_seconds.values()):.1f} s ({parts}); ready after "
                  f"{time.perf_counter() - start:.1f} s at http://{args.host}:{args.port}/v1", flush=True)

    import threading

    threading.Thread(target=report_ready, daemon=True).start()

    class Uvicorn(uvicorn.Server):
        def handle_exit(self, sig, frame):
            runner.drain()  # stop admitting; held requests run on for the graceful-shutdown timeout
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            """SIGINT/SIGTERM shut down gracefully; unlike uvicorn's own, the signal is not raised again
            afterwards, so a drained server exits with status 0."""
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    app = create_app(Server(runner, tokenizer, name, chat_template, metrics))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=args.drain_timeout)
    logging.basicConfig(level=logging.WARNING)
    Uvicorn(config).run()
    print(json.dumps({"stopped": True, "held": len(engine.held())}), flush=True)


if __name__ == "__main__":
    main()
