"""Compilation: how long a block of code spends compiling, and the persistent cache of compiled programs.

`CompileClock` listens to JAX's monitoring events for tracing, lowering and compiling a program (a
program loaded from the persistent cache counts its load), so run time and compile time can be told
apart: the `Sampler` reports them separately, and the scripts print what they compiled and for how long.
`use_persistent_cache` keeps compiled programs on disk (`jax_compilation_cache_dir`), so a second run
of the same command loads them instead of compiling.
"""

from __future__ import annotations

import os
import threading

import jax

#: Monitoring events that span the work of making a program (nested spans overlap; `CompileClock` merges them).
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
#: Environment variable naming the persistent cache folder; empty turns the cache off.
CACHE_ENV = "RQ_JAX_COMPILE_CACHE"


class CompileClock:
    """A context manager: while it is open, the wall seconds this thread spends compiling (`seconds`,
    overlapping spans counted once) and the programs it loads from the persistent cache (`cache_hits`).
    Compilation in other threads is not counted."""

    def __init__(self):
        self.spans: list[tuple[float, float]] = []
        self.cache_hits = 0
        self._thread = threading.get_ident()

    def _span(self, event: str, start: float, end: float, **_) -> None:
        if event in COMPILE_EVENTS and threading.get_ident() == self._thread:
            self.spans.append((start, end))

    def _event(self, event: str, **_) -> None:
        if event == CACHE_HIT_EVENT and threading.get_ident() == self._thread:
            self.cache_hits += 1

    def __enter__(self) -> "CompileClock":
        jax.monitoring.register_event_time_span_listener(self._span)
        jax.monitoring.register_event_listener(self._event)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_time_span_listener(self._span)
        jax.monitoring.unregister_event_listener(self._event)

    @property
    def seconds(self) -> float:
        """Seconds covered by the union of the compile spans so far."""
        total, end = 0.0, float("-inf")
        for start, stop in sorted(self.spans):
            if stop > end:
                total += stop - max(start, end)
                end = stop
        return total


def default_cache_dir() -> str | None:
    """The persistent cache folder: $RQ_JAX_COMPILE_CACHE (empty: none), else rq_jax/jax under the
    user's cache folder ($XDG_CACHE_HOME, default ~/.cache)."""
    if CACHE_ENV in os.environ:
        return os.environ[CACHE_ENV] or None
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "rq_jax", "jax")


def use_persistent_cache(folder: str) -> None:
    """Keep every program that takes at least half a second to compile in `folder`, and load it from
    there in later processes (JAX's persistent compilation cache; programs are keyed by their HLO,
    compile options, devices and jax version, so a stale entry is never used)."""
    os.makedirs(folder, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def quiet_xla() -> None:
    """Silence XLA's C++ log lines below FATAL (e.g. "Constant folding an instruction is taking > 1s",
    which would print into progress bars), and jax's Python loggers below CRITICAL; errors still raise.
    Left alone when the user chose a level ($JAX_LOGGING_LEVEL or $TF_CPP_MIN_LOG_LEVEL)."""
    if "JAX_LOGGING_LEVEL" not in os.environ and "TF_CPP_MIN_LOG_LEVEL" not in os.environ:
        jax.config.update("jax_logging_level", "CRITICAL")
