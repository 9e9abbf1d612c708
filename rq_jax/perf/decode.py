"""Decode throughput and capacity of a cache scheme at a model's shapes: random weights, a cache filled
through the format's own `write`, the shared decode step compiled and timed, and the largest batch a
memory budget holds by XLA's own memory analysis. `scripts/bench_decode.py` prints the tables.

The cache is not filled by running the model (a 16k-token prefill at full width takes hours on a CPU):
random K/V (keys correlated across loops) are written through each format's `write`, in chunks of
tokens, for one row, and that row is repeated to the batch (`rq_jax.perf.fill`). A step's time does not
depend on the values.
"""

from __future__ import annotations

import functools
import os
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import tpu_deviceless
from rq_jax import memory, setup
from rq_jax.cache import base, schemes
from rq_jax.cache.calib import default_calib
from rq_jax.cache.context import CacheContext
from rq_jax.cache.kv import cache_nbytes, init_cache, init_paged_cache
from rq_jax.config import ModelConfig
from rq_jax.models import init_model
from rq_jax.nn import common
from rq_jax.perf.attention import fallbacks, with_impl
from rq_jax.perf.fill import filled_row, repeat_rows
from rq_jax.sampling import PREFILL_CHUNK, decode_step, prefill
from rq_jax.serve import model_runner
from rq_jax.serve.sizing import default_page_size

GiB = 2**30
#: Compiler options of the search's programs on a CPU: LLVM optimisation off (buffer sizes unchanged);
#: none when XLA_FLAGS already sets the level (the test suite does), so searches and runs share programs.
SEARCH_OPTIONS = None if "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", "") else {
    "xla_backend_optimization_level": 0}
#: A cache compiled for a TPU holds a multiple of this many positions (the module docstring says why).
TPU_POSITIONS = 128
#: Timed calls of a write alone (`DecodeBench.write_time`) at the least.
WRITE_REPEATS = 30


def greedy_step(graphdef):
    """jit(params, tokens [B, 1], cache, calib, rng) -> (next tokens [B, 1], cache): `decode_step` then
    the argmax, the cache donated (updated in place when held as bits, `KVCache.as_bits`)."""

    def step(params, tokens, cache, calib, rng):
        out = decode_step(nnx.merge(graphdef, params), tokens[:, 0], cache, calib=calib, rng=rng)
        return jnp.argmax(out.logits, axis=-1).astype(jnp.int32)[:, None], out.cache

    return jax.jit(step, donate_argnums=2)


def prefill_step(graphdef, chunk: int | None = PREFILL_CHUNK):
    """jit(params, tokens [B, T], cache, calib, rng) -> (next tokens [B], cache): the prompt's prefill
    (`sampling.prefill`, `chunk` tokens per model call) into the cache, then the argmax; the cache
    donated (held as bits, as `greedy_step`'s)."""

    def step(params, tokens, cache, calib, rng):
        num_new = jnp.full(tokens.shape[:1], tokens.shape[1], jnp.int32)
        out = prefill(nnx.merge(graphdef, params), tokens, cache, num_new=num_new, chunk=chunk, calib=calib, rng=rng)
        return jnp.argmax(out.logits, axis=-1).astype(jnp.int32), out.cache

    return jax.jit(step, donate_argnums=2)


# ---- caches -----------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _scheme_format(label: str, impl: str = "auto") -> base.CacheFormat:
    (scheme,) = schemes.pick([label])
    return with_impl(scheme.fmt, impl)


# ---- one model --------------------------------------------------------------------------------------


class DecodeBench:
    """One model's random weights, its decode step, and the measurements at (scheme, context, batch).

    `args` carries the run's settings: dtype, weight_dtype, warmup, repeats, machine_gb, prefill_chunk, tpu
    (see `scripts/bench_decode.py`; tpu: compile for that TPU generation, never run). Schemes are the
    catalog's (`rq_jax.cache.schemes`), by label, each on an
    implementation `impl` of the decode-attention op (its `attend_impl`, `rq_jax.perf.attention.with_impl`;
    default "auto"); `fallbacks[(label, impl)]` holds the op's fallback warnings logged while compiling
    its steps (the kernel did not cover a slot and XLA ran instead)."""

    def __init__(self, label: str, config: ModelConfig, args, run: bool):
        self.label, self.config, self.args = label, config, args
        self.tpu = args.tpu
        self.on_tpu = bool(self.tpu) or jax.default_backend() == "tpu"  # compiled for one, or run on one
        self.platform = "tpu" if self.on_tpu else None  # the lowering platform's choices (None: the host's)
        run = run and self.tpu is None

        def make():  # random weights, laid out as generation runs them on the platform (`setup.weights`)
            model = init_model(config, dtype=jnp.dtype(args.dtype), param_dtype=jnp.dtype(args.weight_dtype))
            return common.per_layer(model) if setup.splits_layers(platform=self.platform) else model

        self.graphdef, self.param_shapes = nnx.split(nnx.eval_shape(make))
        self.params = nnx.split(make())[1] if run else None
        self.weights = base.tree_nbytes(self.param_shapes)
        self.step = greedy_step(self.graphdef)
        self.prefill = prefill_step(self.graphdef, args.prefill_chunk or None)
        self.rng = jax.random.key(0)
        self.calibs, self.compiled, self.compile_seconds, self.filled = {}, {}, 0.0, (None, None)
        self.fallbacks: dict[tuple[str, str], list[str]] = {}
        self.tpu_kernels: dict[tuple, dict[str, int]] = {}
        self.refused: dict[tuple, str] = {}

    def positions(self, tokens: int) -> int:
        """Cache positions for `tokens` tokens: as many; on a TPU rounded up to `TPU_POSITIONS` (XLA:TPU tiles
        the token axis by 8 sublanes and lays an unaligned cache out head-minor, copying it every step)."""
        return -(-tokens // TPU_POSITIONS) * TPU_POSITIONS if self.on_tpu else tokens

    def held(self, cache):
        """The cache as the step takes it (`KVCache.held`), for the TPU when compiling for one."""
        return cache.held(self.platform)

    def cache_shapes(self, batch: int, tokens: int, fmt: base.CacheFormat):
        """The abstract cache of `batch` rows holding up to `tokens` tokens, as the step takes it."""
        return jax.eval_shape(lambda: self.held(init_cache(self.config, batch, self.positions(tokens), fmt)))

    def _inputs(self, *args):
        """`args` as the compiled program's inputs: on the TPU's first device when compiling for one."""
        return tpu_deviceless.place(args, self.tpu) if self.tpu else args

    def _options(self, search: bool) -> dict | None:
        """Compiler options: LLVM optimisation off for a search on a CPU, else none."""
        return SEARCH_OPTIONS if search and not self.tpu and jax.default_backend() == "cpu" else None

    def _compile(self, lowered, search: bool):
        """lowered.compile() with `_options(search)`, its seconds counted."""
        options = self._options(search)
        start = time.perf_counter()
        compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
        self.compile_seconds += time.perf_counter() - start
        return compiled

    def calib(self, label: str):
        """The format's data-free calibration (independent of batch, length and impl), built once."""
        if label not in self.calibs:
            shapes = jax.eval_shape(lambda: init_cache(self.config, 1, 1, self.fmt(label)))
            self.calibs[label] = default_calib(shapes)
        return self.calibs[label]

    @staticmethod
    def fmt(label: str, impl: str = "auto") -> base.CacheFormat:
        return _scheme_format(label, impl)

    def _lower(self, fn, label: str, impl: str, *args, **static):
        """fn.lower(*args, **static), the decode-attention op's fallback warnings kept in
        `fallbacks[(label, impl)]`."""

        with fallbacks() as fell:
            lowered = fn.lower(*args, **static)
        seen = self.fallbacks.setdefault((label, impl), [])
        seen += [m for m in fell if m not in seen]
        return lowered

    def compile(self, label: str, context: int, batch: int, search: bool = False, impl: str = "auto"):
        """(compiled step for abstract inputs, its memory dict, the cache's bytes), kept for reuse; the
        call sites of each Mosaic kernel in it in `tpu_kernels` (`tpu_deviceless.kernel_counts`) when compiled
        for a TPU."""
        key = (label, impl, context, batch, tuple(sorted((self._options(search) or {}).items())))
        if key not in self.compiled:
            fmt = self.fmt(label, impl)
            cache = self.cache_shapes(batch, context + 1, fmt)
            nbytes = cache_nbytes(cache)
            lowered = self._lower(self.step, label, impl, *self._inputs(
                self.param_shapes, jax.ShapeDtypeStruct((batch, 1), jnp.int32), cache, self.calib(label), self.rng))
            compiled = self._compile(lowered, search)
            if self.tpu:
                self.tpu_kernels[key[:4]] = tpu_deviceless.kernel_counts(compiled.as_text())
            self.compiled[key] = compiled, memory.step_memory(compiled, self.weights, nbytes), nbytes
        return self.compiled[key]

    def prefill_memory(self, label: str, tokens: int, impl: str = "auto") -> dict | None:
        """The memory of the prefill (`prefill_step`: chunks of `args.prefill_chunk` tokens) of a `tokens`-token
        prompt (batch 1) into an empty cache of `tokens + 1` positions, compiled for abstract inputs (with
        LLVM optimisation off on a CPU, as a search); on a TPU with `tpu_kernels`, its Mosaic kernels. None
        where the TPU compiler refuses it as over the chip's HBM (its words in `refused`)."""
        fmt = self.fmt(label, impl)
        cache = self.cache_shapes(1, tokens + 1, fmt)
        lowered = self._lower(self.prefill, label, impl, *self._inputs(
            self.param_shapes, jax.ShapeDtypeStruct((1, tokens), jnp.int32), cache, self.calib(label), self.rng))
        try:
            compiled = self._compile(lowered, search=True)
        except jax.errors.JaxRuntimeError as e:
            self._refuse((label, impl, "prefill", tokens), e)
            return None
        mem = memory.step_memory(compiled, self.weights, cache_nbytes(cache))
        return {**mem, "tpu_kernels": tpu_deviceless.kernel_counts(compiled.as_text())} if self.tpu else mem

    def engine_memory(self, label: str, context: int, requests: int, rows: int, width: int,
                      impl: str = "auto") -> dict | None:
        """The serving engine's program (`model_runner.step_program`) for a call of `rows` rows of `width`
        tokens (1: its decode program; more: one prompt chunk a row), over a pool of pages of the platform's
        engine page (`sizing.default_page_size`; a TPU's when compiling for one) holding `requests` requests
        of `context` + 1 tokens, compiled for abstract inputs: its memory, with `tpu_kernels` on a TPU; None
        where the TPU compiler refuses it as over the chip's HBM (its words in `refused`)."""
        fmt = self.fmt(label, impl)
        page = default_page_size(self.platform)
        per_row = -(-(context + 1) // page)
        pool = jax.eval_shape(lambda: init_paged_cache(self.config, 1, requests * per_row, page, per_row, fmt)
                              .held(self.platform))
        trees = (self.param_shapes, self.calib(label), (pool.looped, pool.plain))
        program = model_runner.step_program(self.graphdef, pool, *trees[:2], jit=jax.jit)  # lowered for self.platform
        args = self._inputs(*map(jax.tree_util.tree_leaves, trees), *model_runner.padding(rows, width, per_row))
        lowered = self._lower(program, label, impl, *args, prefill=width > 1, echo=False)
        try:
            compiled = self._compile(lowered, search=True)
        except jax.errors.JaxRuntimeError as e:
            self._refuse((label, impl, "engine", context, requests, rows, width), e)
            return None
        mem = memory.step_memory(compiled, self.weights, cache_nbytes(pool))
        return {**mem, "tpu_kernels": tpu_deviceless.kernel_counts(compiled.as_text())} if self.tpu else mem

    def _refuse(self, key: tuple, e: Exception) -> None:
        """Record the TPU compiler's refusal of a program over the chip's HBM under `key`; raise anything else."""
        if not self.tpu or "RESOURCE_EXHAUSTED" not in str(e):
            raise e
        self.refused[key] = str(e).splitlines()[0][:300]

    def memory(self, label: str, context: int, batch: int, impl: str = "auto") -> dict | None:
        """The step's memory at a batch: from a program already compiled for a run, else a search compile;
        None where the TPU compiler refuses the program as over the chip's HBM (its words in `refused`)."""
        key = (label, impl, context, batch)
        done = [v for k, v in self.compiled.items() if k[:4] == key]
        if done or key in self.refused:
            return done[0][1] if done else None
        try:
            return self.compile(label, context, batch, search=True, impl=impl)[1]
        except jax.errors.JaxRuntimeError as e:
            self._refuse(key, e)
            return None

    def room(self) -> int | None:
        """Bytes a step may still take beyond the resident weights on this machine."""
        if self.args.machine_gb:
            return int(self.args.machine_gb * GiB) - self.weights
        device = jax.devices()[0]
        if device.platform != "cpu":
            stats = device.memory_stats() or {}
            if "bytes_limit" in stats:
                return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
        avail = memory.available_bytes()
        return None if avail is None else int(0.6 * avail)

    def tile(self, context: int, batch: int) -> int:
        """Tokens per context tile of the step's tiled attention (`base.context_tile`, one query per row)."""
        c = self.config
        return base.context_tile(batch, 1, c.num_heads, c.num_kv_heads, c.head_dim, context + 1)

    def measure(self, label: str, context: int, batch: int, run: bool = True, filled: int | None = None,
                impl: str = "auto") -> dict:
        """Latency, tokens/s, cache bytes and step memory at (format, impl, context, batch), and with
        `filled` the latency of the same cache holding only `filled` tokens; times None with the reason in
        `run` when the step is not run (`run` False: compile only). `fallback`: the decode-attention op's
        fallback warnings of this format and impl so far (None: none)."""
        fmt = self.fmt(label, impl)
        row = dict(model=self.label, context=context, batch=batch, format=label, impl=impl, stored=fmt.describe(),
                   ms=None, tok_s=None, run="ok", tile=self.tile(context, batch), filled=None, ms_filled=None,
                   **memory.byte_limits(fmt, self.config, context))
        if self.params is None or not run:  # compile only: a search's program has the same buffers
            mem = self.memory(label, context, batch, impl)
            refused = self.refused.get((label, impl, context, batch))
            return {**row, "cache_nbytes": cache_nbytes(self.cache_shapes(batch, context + 1, fmt)), "memory": mem,
                    "run": f"refused by the TPU compiler: {refused}" if refused else "not run (compile only)",
                    "fallback": list(self.fallbacks.get((label, impl), ())) or None,
                    **({"tpu_kernels": self.tpu_kernels.get((label, impl, context, batch))} if self.tpu else {})}
        compiled, mem, nbytes = self.compile(label, context, batch, impl=impl)
        row.update(cache_nbytes=nbytes, memory=mem, fallback=list(self.fallbacks.get((label, impl), ())) or None)
        room = self.room()
        if room is not None and mem["total"] - self.weights > room:
            row["run"] = f"not run: needs {(mem['total'] - self.weights) / GiB:.1f} GiB beyond the weights, " \
                         f"this machine has {room / GiB:.1f}"
            return row
        start = time.perf_counter()
        if self.filled[0] != (label, context):  # one filled row kept: a format's batches and impls share it
            self.filled = (label, context), None
            self.filled = (label, context), filled_row(self.config, self.fmt(label), self.calib(label), context,
                                                       self.positions(context + 1))
        cache = jax.block_until_ready(self.held(repeat_rows(self.filled[1], batch, context)))
        cache = cache.replace(fmt=fmt, plain_fmt=fmt)  # the same state on this impl (init_cache: plain_fmt = fmt)
        kept = {x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(self.filled[1])}
        if any(x.unsafe_buffer_pointer() in kept for x in jax.tree_util.tree_leaves(cache)):
            cache = jax.tree_util.tree_map(jnp.copy, cache)  # the step donates its cache: never the kept row
        row["fill_s"] = time.perf_counter() - start
        row["cache_nbytes"] = cache_nbytes(cache)
        tokens = jnp.zeros((batch, 1), jnp.int32)
        begin = time.perf_counter()
        for held in (context, filled) if filled is not None and filled < context else (context,):
            times = []
            for i in range(self.args.warmup + self.args.repeats):
                cache = cache.replace(lengths=jnp.full((batch,), held, jnp.int32))  # a fresh buffer: donated
                start = time.perf_counter()
                tokens, cache = jax.block_until_ready(compiled(self.params, tokens, cache, self.calib(label), self.rng))
                if i >= self.args.warmup:
                    times.append(time.perf_counter() - start)
            if held == context:
                row["ms"], row["tok_s"] = 1e3 * statistics.median(times), batch / statistics.median(times)
            else:
                row["filled"], row["ms_filled"] = held, 1e3 * statistics.median(times)
        del cache
        row["run_s"] = time.perf_counter() - begin
        return row

    def write_time(self, label: str, slots: int, batch: int, impl: str = "auto") -> dict:
        """The decode step's write alone: one new token per row encoded and stored (`CacheContext.finish`, the
        model's write) into a cache of `slots` positions holding slots // 2 tokens, held as bits and donated
        as the step holds it; median ms of `WRITE_REPEATS` (or `args.repeats`, if more) after `args.warmup`
        (a write takes milliseconds: a few repeats would leave its median to chance), and the program's
        temporaries. A write in place costs the token's bytes, whatever `slots` is."""
        fmt = self.fmt(label, impl)
        c = self.config
        cache = jax.jit(lambda: self.held(init_cache(c, batch, slots, fmt)))()
        cache = cache.replace(lengths=jnp.full((batch,), slots // 2, jnp.int32))
        calib = self.calib(label)
        shape = (c.num_loops, c.num_layers, batch, c.num_kv_heads, 1, c.head_dim)
        k, v = (jax.random.normal(key, shape, jnp.float32) for key in jax.random.split(jax.random.key(1)))

        def write(cache, k, v, calib):
            ctx = CacheContext.build(cache, jnp.ones((batch,), jnp.int32), 1, calib)
            looped = tuple((base.split_loops(k, seg), base.split_loops(v, seg)) for seg in cache.schedule("looped")[1])
            plain = None if cache.plain is None else tuple(  # Huginn's prelude/coda: layer 0's K/V for each
                jnp.broadcast_to(x[:1], (1, cache.slot_dims("plain")[0], *x.shape[2:]))[None] for x in (k, v))
            out = ctx.finish(looped, plain)[0]
            return out.replace(lengths=cache.lengths)  # the next call writes the same position

        step = jax.jit(write, donate_argnums=0)
        mem = step.lower(cache, k, v, calib).compile().memory_analysis()
        times = []
        for i in range(self.args.warmup + max(self.args.repeats, WRITE_REPEATS)):
            start = time.perf_counter()
            cache = jax.block_until_ready(step(cache, k, v, calib))
            if i >= self.args.warmup:
                times.append(time.perf_counter() - start)
        return dict(model=self.label, format=label, impl=impl, batch=batch, slots=slots,
                    ms=1e3 * statistics.median(times), temp=mem.temp_size_in_bytes, cache_nbytes=cache_nbytes(cache))

    def largest_batch(self, label: str, context: int, budget: int, cap: int, impl: str = "auto") -> dict:
        """The largest batch whose compiled step fits `budget` bytes, with its memory and b + 1's (None, and
        counted as twice the budget, where the TPU compiler refuses the program as over the chip's HBM)."""
        memories = {}

        def total(b):
            memories[b] = self.memory(label, context, b, impl)
            return 2 * budget if memories[b] is None else memories[b]["total"]

        best, seen = memory.largest_fitting(total, budget, cap)
        at, after = memories.get(best), memories.get(best + 1)
        kernels = {"tpu_kernels": self.tpu_kernels.get((label, impl, context, best))} if self.tpu else {}
        return dict(model=self.label, context=context, format=label, impl=impl, budget=budget, max_batch=best,
                    **kernels, memory=at, next_batch=best + 1 if best + 1 in seen else None, next_memory=after,
                    totals={b: seen[b] for b in sorted(seen)},
                    per_row=None if at is None or after is None else after["total"] - at["total"],
                    cache_per_row=None if at is None else at["cache"] / best,
                    temp_per_row=None if at is None else at["temp"] / best,
                    **memory.byte_limits(self.fmt(label, impl), self.config, context))


def describe_device(tpu: str | None = None) -> str:
    """The device in words: the CPU's model name and core count, or the accelerator's kind; with `tpu`
    (a generation compiled for) that TPU's chip."""
    if tpu:
        return f"TPU {tpu} (one chip of {tpu_deviceless.TOPOLOGIES[tpu]}, {tpu_deviceless.HBM_GIB[tpu]} GiB HBM)"
    device = jax.devices()[0]
    if device.platform != "cpu":
        return f"{device.device_kind} ({device.platform}, {jax.device_count()} device(s))"
    info = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (info.read_text().splitlines() if info.exists() else [])
             if line.startswith("model name")]
    return f"cpu ({names[0] if names else platform.processor()}, {os.cpu_count()} cores)"
