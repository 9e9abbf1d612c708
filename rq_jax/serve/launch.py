"""scripts/serve.py's server from its command line: the engine thread a command line describes
(`build`), and the uvicorn server over it that drains on SIGTERM and exits 0 (`run`)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time

import jax.numpy as jnp

from rq_jax import checkpoint, cli, memory, sharding


def build(p, args):
    """The engine thread, tokenizer, model name, chat template, metrics, checkpoint source and mesh of a
    command line (nothing compiled yet); `p.error` names the option behind anything the checkpoint
    refuses, before the weights load where it can."""
    from rq_jax.serve.chat import ChatTemplate
    from rq_jax.serve.engine import Engine
    from rq_jax.serve.metrics import ServeMetrics
    from rq_jax.serve.runner import EngineThread
    from rq_jax.tokenizer import load_tokenizer

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
    budget = None if args.memory_gb is None else int(args.memory_gb * 2**30)
    try:
        engine = Engine(model, tokenizer, fmt, eos_ids=cli.stop_token_ids(tokenizer, folder), max_len=args.max_len,
                        num_slots=args.max_slots, memory_bytes=budget, calib=calib, mesh=mesh, chunk=args.chunk,
                        prefill_budget=args.prefill_budget, prefill_rows=args.prefill_rows,
                        prefill_group=args.prefill_group, metrics=metrics,
                        **cli.model_kwargs(args))
        memory.check_fits(model, fmt, batch=engine.num_slots, prompt_len=1, max_len=args.max_len,
                          num_loops=loops, compute_itemsize=jnp.dtype(args.dtype).itemsize, what="this server",
                          advice="use a smaller --memory-gb, --max-slots or --max-len")
    except (ValueError, MemoryError) as err:
        p.error(str(err))
    runner = EngineThread(engine, max_waiting=args.max_waiting, warm_up_echo=args.warmup_echo)
    return runner, tokenizer, name, ChatTemplate.from_folder(folder), metrics, cli.checkpoint_source(args), mesh


def _report_ready(runner, started: float, url: str) -> None:
    """Print the warm-up's compile seconds once it has finished (from the engine thread's state)."""
    while runner.state == "warming up":
        time.sleep(0.05)
    if runner.state == "ready":
        parts = ", ".join(f"{k} {v:.2f}" for k, v in runner.warm_up_seconds.items())
        print(f"compiled in {sum(runner.warm_up_seconds.values()):.1f} s ({parts}); ready after "
              f"{time.perf_counter() - started:.1f} s at {url}", flush=True)


def run(p, args, started: float) -> None:
    """Build the server of a parsed command line, print what it serves, and serve until SIGINT/SIGTERM:
    admitting stops, held requests get --drain-timeout seconds, then one JSON line says what was left.
    `started`: the process's start (perf_counter), for the "ready after" line."""
    import uvicorn

    from rq_jax.serve.api import Server, create_app

    runner, tokenizer, name, chat_template, metrics, source, mesh = build(p, args)
    engine = runner.engine
    print(f"model: {name} from {source}; cache {args.cache}: {engine.num_slots} slots of {engine.max_len} tokens, "
          f"{engine.slot_bytes:,} bytes each (dense bf16: {engine.dense_slot_bytes:,}); prefill buckets "
          f"{list(engine.buckets)}, decode buckets {list(engine.decode_buckets)}"
          + ("" if chat_template else "; no chat template"), flush=True)
    if mesh is not None:
        print("\n".join(sharding.describe(engine.config, mesh, batch=engine.num_slots)), flush=True)
    threading.Thread(target=_report_ready, args=(runner, started, f"http://{args.host}:{args.port}/v1"),
                     daemon=True).start()

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
