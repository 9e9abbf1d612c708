"""scripts/serve.py's server: uvicorn over an engine thread, draining on SIGTERM and exiting 0 (`run`).
The script builds the engine thread from its command line (`rq_jax.cli`); this room holds what follows."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import threading
import time

import uvicorn

from rq_jax import sharding
from rq_jax.serve.api import Server, create_app


def _report_ready(runner, started: float, url: str) -> None:
    """Print the warm-up's compile seconds once it has finished (from the engine thread's state)."""
    while runner.state == "warming up":
        time.sleep(0.05)
    if runner.state == "ready":
        parts = ", ".join(f"{k} {v:.2f}" for k, v in runner.warm_up_seconds.items())
        print(f"compiled in {sum(runner.warm_up_seconds.values()):.1f} s ({parts}); ready after "
              f"{time.perf_counter() - started:.1f} s at {url}", flush=True)


def run(runner, tokenizer, name: str, chat_template, metrics, *, source: str, mesh, host: str, port: int,
        drain_timeout: float, started: float) -> None:
    """Print what the engine thread `runner` serves (model `name` from `source`) and serve it on
    host:port until SIGINT/SIGTERM: admitting stops, held requests get `drain_timeout` seconds, then one
    JSON line says what was left. `started`: the process's start (perf_counter), for the "ready after"
    line."""
    engine = runner.engine
    runs = engine.runner
    print(f"model: {name} from {source}; cache {engine.fmt.name}: {engine.num_pages} pages of {engine.page_size} "
          f"tokens, {engine.page_bytes:,} bytes each (dense bf16: {engine.dense_token_bytes * engine.page_size:,}), "
          f"requests of {engine.max_len} tokens, at most {engine.max_rows} decoding; prompt chunks of {engine.chunk}, "
          f"{engine.token_budget} tokens a step; prefill widths {list(runs.token_buckets)}, decode rows "
          f"{list(runs.decode_rows)}; prefix cache {'on' if engine.scheduler.cache_key else 'off'}"
          + ("" if chat_template else "; no chat template"), flush=True)
    if mesh is not None:
        print("\n".join(sharding.describe(engine.config, mesh, batch=engine.max_rows)), flush=True)
    threading.Thread(target=_report_ready, args=(runner, started, f"http://{host}:{port}/v1"),
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
    # httptools parses HTTP in C: with uvicorn's pure-Python h11 the server's streaming took CPU from the engine
    # (Ouro-small at concurrency 64: 2,238 tok/s on h11, 3,011 on httptools; docs/performance.md).
    config = uvicorn.Config(app, host=host, port=port, http="httptools", log_level="warning",
                            timeout_graceful_shutdown=drain_timeout)
    logging.basicConfig(level=logging.WARNING)
    Uvicorn(config).run()
    print(json.dumps({"stopped": True, "held": len(engine.held())}), flush=True)
