"""End-to-end decode throughput per cache format at Ouro-1.4B / Huginn-0125 shapes, and the largest batch
a memory budget holds; prints Markdown tables and writes PREFIX.md + PREFIX.json.

    python scripts/bench_decode.py --out bench_decode      # CPU default (below): ~8 min on 2 shared cores
    python scripts/bench_decode.py --models ouro-1.4b huginn-0125 --context 1024 2048 4096 8192 16384 \\
        --batch 1 4 16 --memory-gb 32 --out sweep          # the full sweep (the default on a GPU)

Defaults on a CPU: Ouro-1.4B's widths, heads and vocabulary at 2 of its 24 layers, context 4096, batch 1,
float32 compute, a 2.5 GiB budget. On a GPU: both models as released, contexts 1k-16k, batches 1/4/16,
bf16 compute, 32 GiB. `--models NAME[:field=value,...]` takes a preset of `rq_jax.config` with
`ModelConfig` fields changed (Huginn at a CPU's scale: `CPU_HUGINN`) and `--layers N` sets every model's
looped layers; the tables name every change. Huginn's positions are raised past its 4096 when a context
needs it (shapes only: the trained model never saw them).

The timed step is the Sampler's decode step: the model's own jitted forward for one new token per row
through a cache already holding `--context` tokens (each format's attention to the stored past, the new
token's K/V of every loop written back), then the greedy next token. The cache argument is donated, as
a decode loop updates it in place; its lengths are reset after each step so every step sees the same
context. Weights are random (`init_model`) in `--weight-dtype` (bf16); compute runs in `--dtype`
(float32 by default on a CPU, where bf16 dots and attention are several times slower than float32).
Latency is the median of `--repeats` steps after `--warmup` steps, each ended by `block_until_ready`;
tokens/s = batch / latency.

The cache is not filled by running the model (a 16k-token prefill at full width takes hours on a CPU):
random K/V (keys correlated across loops) are written through each format's own `write`, in chunks of
tokens, for one row, and that row is repeated to the batch. A step's time does not depend on the values.

Memory budget (`--memory-gb`, GiB): a batch fits when the compiled step's memory as XLA reports it
(`memory_analysis()`: arguments — weights, cache, calibration — plus outputs not aliased to the donated
cache, temporaries and generated code) is at most the budget. The search compiles programs for abstract
inputs (`jax.ShapeDtypeStruct`, `jax.eval_shape`: nothing allocated; on a CPU with LLVM optimisation
off, which changes code generation, not buffer sizes) and returns the largest batch b that fits with
the figure of b + 1 beside it: secant estimates from batches 1 and 2 (memory is affine in the batch
past a small-batch plateau), then steps that double and bisection (`largest_fitting`). Temporaries are
the backend's own: XLA on a CPU converts bf16 operands to float32 for its dots, so weights and dense K/V
appear again, twice as large, among the temporaries; a GPU's figures differ. The peak tokens/s is
measured at the largest batch when the step fits this machine (`--machine-gb`, default 60% of the
memory available), else the table says "not run".

Ratios to dense are measured in the same run and printed beside their limits (dense bytes / format
bytes by the formats' own accounting): cache bytes, batches and peak tokens/s beside the storage limit
16 / bits per element; tokens/s at a fixed batch beside the read limit 16 / bits read per element
(ResidualQuant's residual loops also read their anchor: Ouro's [2,2,2,4] stores 3.09 bits per element
and reads 6.47). KIVI's bits are its own accounting at the row's context.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import statistics
import sys
import time
from fractions import Fraction
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from tqdm import tqdm

from rq_jax.cache import Kivi, LoopQuant, cache_nbytes, default_calib, get_format, init_cache
from rq_jax.cache.base import segments, split_loops
from rq_jax.config import ModelConfig, preset
from rq_jax.memory import available_bytes
from rq_jax.models import init_model
from rq_jax.quant import bits as qbits

GiB = 2**30
MiB = 2**20
#: Table label -> (registry name, policy, what it stores).
FORMATS = {
    "dense bf16": ("dense", {}, "bf16"),
    "uniform INT2": ("uniform", {}, "INT2 g32 codes + fp8 meta"),
    "rotated INT2": ("rotated", {}, "INT2 g32 codes + fp8 meta"),
    "kivi INT2": ("kivi", {}, "INT2 codes + fp16 meta, last 128 tokens fp16"),
    "residual [2,2,2,4]": ("residual", {}, "INT2/INT4 g32 codes + fp8 meta + bf16 α"),
}
CPU_MODELS = ["ouro-1.4b:num_layers=2"]
#: Huginn at a CPU's scale (pass it to --models): real width, heads and vocabulary; one core block, one
#: group of 4 steps, no prelude/coda (each of its blocks holds 0.4B parameters).
CPU_HUGINN = "huginn-0125:num_layers=1,num_loops=4,num_prelude=0,num_coda=0"
GPU_MODELS = ["ouro-1.4b", "huginn-0125"]
#: Compiler options of the search's programs on a CPU: LLVM optimisation off (buffer sizes unchanged);
#: none when XLA_FLAGS already sets the level (the test suite does), so searches and runs share programs.
SEARCH_OPTIONS = None if "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", "") else {
    "xla_backend_optimization_level": 0}
#: Elements of random K (or V) generated per write call while filling a cache.
FILL_ELEMENTS = 2**25


# ---- models -----------------------------------------------------------------------------------------


def parse_model(spec: str, layers: int | None, max_context: int) -> tuple[str, ModelConfig, str]:
    """(name, config, what differs from the preset) of `NAME[:field=value,...]`; `layers` (if given)
    sets num_layers."""
    name, _, rest = spec.partition(":")
    base = preset(name)
    changes = {}
    for item in filter(None, rest.split(",")):
        field, _, value = item.partition("=")
        if not hasattr(base, field) or not value:
            raise ValueError(f"bad model field {item!r} in {spec!r}: expected field=value of ModelConfig")
        kind = type(getattr(base, field))
        changes[field] = (value.lower() in ("1", "true")) if kind is bool else kind(value)
    if layers:
        changes["num_layers"] = layers
    changes["max_position_embeddings"] = max(base.max_position_embeddings, max_context + 1)
    config = base.replace(**changes)
    shown = [f"{k} {v} of {getattr(base, k)}" for k, v in changes.items() if v != getattr(base, k)]
    return name, config, ", ".join(shown) or "as released"


def decode_step(graphdef):
    """jit(params, tokens [B, 1], cache, calib, rng) -> (next tokens [B, 1], cache), the cache donated."""

    def step(params, tokens, cache, calib, rng):
        model = nnx.merge(graphdef, params)
        out = model(tokens, cache, num_new=jnp.ones(tokens.shape[:1], jnp.int32), rng=rng, last_only=True,
                    calib=calib)
        return jnp.argmax(out.logits, axis=-1).astype(jnp.int32)[:, None], out.cache

    return jax.jit(step, donate_argnums=2)


# ---- bytes: the formats' accounting and XLA's -------------------------------------------------------


def _storage_bits(fmt, loops: int, head_dim: int, context: int) -> Fraction:
    if isinstance(fmt, Kivi):
        return fmt.bits_per_element(loops, head_dim, context_len=context)
    return fmt.bits_per_element(loops, head_dim)


def _read_bits(fmt, loops: int, head_dim: int, context: int) -> Fraction:
    """Bits a step reads per cached element: a ResidualQuant loop reads its reference chain (its own
    residual and α, then the anchor); every other format reads what it stores."""
    if not (isinstance(fmt, LoopQuant) and fmt.residual):
        return _storage_bits(fmt, loops, head_dim, context)
    total = Fraction(0)
    for seg in segments(loops, fmt.group_len):
        cfg = fmt.group_config(seg.size)
        for r in range(seg.size):
            links = fmt.chain(cfg, r)
            bits = sum(qbits.affine_bits(cfg.quant_config(i)) for i in links)
            if cfg.least_squares:
                bits += Fraction(8 * jnp.dtype(cfg.alpha_dtype).itemsize * (len(links) - 1), head_dim)
            total += bits * seg.groups
    return total / loops


def byte_limits(fmt, config: ModelConfig, context: int) -> dict[str, float]:
    """Dense-bf16 bits / the format's bits per element, stored and read, over all slots of the cache
    (looped slots with `fmt` over its loops, Huginn's plain slots with `fmt` as a one-loop group)."""
    looped, plain, d = config.num_loops * config.num_layers, config.num_plain_layers, config.head_dim

    def mean(bits):
        return (looped * bits(fmt, config.num_loops, d, context) + plain * bits(fmt, 1, d, context)) / (looped + plain)

    return dict(storage_bits=float(mean(_storage_bits)), read_bits=float(mean(_read_bits)),
                storage_limit=float(16 / mean(_storage_bits)), read_limit=float(16 / mean(_read_bits)))


def shape_nbytes(tree) -> int:
    """Bytes of every leaf (arrays or ShapeDtypeStructs) of `tree`."""
    return int(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree)))


def step_memory(compiled, weights: int, cache: int) -> dict[str, int]:
    """The compiled step's bytes by XLA's `memory_analysis`: total = arguments + outputs − aliased +
    temporaries + generated code; `other` is the total less weights, cache and temporaries."""
    m = compiled.memory_analysis()
    if m is None:
        raise RuntimeError(f"XLA reports no memory analysis on {jax.default_backend()}")
    total = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
             + m.generated_code_size_in_bytes)
    return dict(total=int(total), weights=weights, cache=cache, temp=int(m.temp_size_in_bytes),
                other=int(total - weights - cache - m.temp_size_in_bytes))


def largest_fitting(total, budget: int, cap: int, estimates: int = 6) -> tuple[int, dict[int, int]]:
    """Largest batch b ≤ cap with total(b) ≤ budget (0: none), for total non-decreasing in b, and the
    totals it evaluated (b + 1 always among them unless b = cap).

    Memory is affine in the batch past a small-batch plateau (where temporaries share buffers), so the
    first `estimates` candidates are secant estimates through the two batches evaluated last (1 and 2
    at first), kept inside the bracket; then steps that double bracket the answer and bisection
    closes it."""
    seen: dict[int, int] = {}

    def fits(b: int) -> bool:
        if b not in seen:
            seen[b] = total(b)
        return seen[b] <= budget

    if not fits(1):
        return 0, seen
    lo, hi, last = 1, None, [1]  # fits(lo); hi (once known) does not fit; last: batches in order
    while lo < cap and (hi is None or hi - lo > 1):
        upper = cap if hi is None else hi - 1
        a, b = (last[-2], last[-1]) if len(last) > 1 else (None, None)
        if len(last) <= estimates and a is not None and seen[a] != seen[b]:
            guess = b + math.floor((budget - seen[b]) * (b - a) / (seen[b] - seen[a]))
        elif len(last) <= estimates or hi is None:  # flat so far, or no bracket yet: double
            guess = 2 * lo
        else:
            guess = (lo + hi) // 2
        guess = min(max(guess, lo + 1), upper)
        last.append(guess)
        if fits(guess):
            lo = guess
        else:
            hi = guess
    return lo, seen


# ---- caches -----------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames="num", donate_argnums=0)
def _write_chunk(cache, calib, key, start, num: int):
    """Write `num` random tokens at position `start` of a one-row cache through its formats' `write`."""
    lengths, num_new = jnp.reshape(start, (1,)), jnp.full((1,), num, jnp.int32)

    def group(name):
        fmt, segs = cache.schedule(name)
        layers, kv_heads, dim = cache.slot_dims(name)
        loops = cache.num_loops if name == "looped" else 1
        ks, kk, kv = jax.random.split(jax.random.fold_in(key, int(name == "plain")), 3)
        shared = jax.random.normal(ks, (layers, 1, kv_heads, num, dim))
        k = shared + 0.3 * jax.random.normal(kk, (loops, layers, 1, kv_heads, num, dim))
        v = jax.random.normal(kv, (loops, layers, 1, kv_heads, num, dim))
        part = calib.looped if name == "looped" else calib.plain
        return tuple(fmt.write(state, split_loops(k, seg), split_loops(v, seg), lengths, num_new,
                               None if part is None else part[i])
                     for i, (state, seg) in enumerate(zip(cache.stack(name), segs)))

    plain = None if cache.plain is None else group("plain")
    return cache.replace(looped=group("looped"), plain=plain)


@functools.partial(jax.jit, static_argnames=("batch", "context"))
def repeat_rows(cache, batch: int, context: int):
    """A one-row cache repeated to `batch` rows: state leaves on their batch axis 2, the per-row
    counters ([1]: lengths and the like) on axis 0; lengths set to `context`."""
    looped, plain = jax.tree_util.tree_map(lambda x: jnp.repeat(x, batch, axis=2), (cache.looped, cache.plain))
    rows = jax.tree_util.tree_map(lambda x: jnp.repeat(x, batch, axis=0), cache.replace(looped=(), plain=None))
    return rows.replace(looped=looped, plain=plain, lengths=jnp.full((batch,), context, jnp.int32))


def filled_row(config: ModelConfig, fmt, calib, context: int, seed: int = 0):
    """A one-row cache of `context + 1` positions whose first `context` hold random K/V written by
    `fmt.write` in chunks of tokens (`repeat_rows` makes a batch of it)."""
    row = jax.jit(lambda: init_cache(config, 1, context + 1, fmt))()
    per_token = config.num_loops * config.num_layers * config.num_kv_heads * config.head_dim
    chunk = max(64, min(2048, 2 ** int(math.log2(max(FILL_ELEMENTS // per_token, 1)))))
    key = jax.random.key(seed)
    for start in range(0, context, chunk):
        row = _write_chunk(row, calib, jax.random.fold_in(key, start), jnp.int32(start), min(chunk, context - start))
    return row


# ---- one model --------------------------------------------------------------------------------------


class Bench:
    """One model's random weights, its decode step, and the measurements at (format, context, batch)."""

    def __init__(self, label: str, config: ModelConfig, args, run: bool):
        self.label, self.config, self.args = label, config, args
        make = functools.partial(init_model, config, dtype=jnp.dtype(args.dtype),
                                 param_dtype=jnp.dtype(args.weight_dtype))
        graphdef, self.param_shapes = nnx.split(nnx.eval_shape(make))
        self.params = nnx.split(make())[1] if run else None
        self.weights = shape_nbytes(self.param_shapes)
        self.step = decode_step(graphdef)
        self.rng = jax.random.key(0)
        self.calibs, self.compiled, self.compile_seconds, self.filled = {}, {}, 0.0, (None, None)

    def calib(self, label: str):
        """The format's data-free calibration (independent of batch and length), built once."""
        if label not in self.calibs:
            shapes = jax.eval_shape(lambda: init_cache(self.config, 1, 1, self.fmt(label)))
            self.calibs[label] = default_calib(shapes)
        return self.calibs[label]

    @staticmethod
    def fmt(label: str):
        name, policy, _ = FORMATS[label]
        return get_format(name, **policy)

    def compile(self, label: str, context: int, batch: int, search: bool = False):
        """(compiled step for abstract inputs, its memory dict, the cache's bytes), kept for reuse. A
        search compiles with LLVM optimisation off on a CPU (same buffers, faster to compile)."""
        options = SEARCH_OPTIONS if search and jax.default_backend() == "cpu" else None
        key = (label, context, batch, tuple(sorted((options or {}).items())))
        if key not in self.compiled:
            cache = jax.eval_shape(lambda: init_cache(self.config, batch, context + 1, self.fmt(label)))
            nbytes = shape_nbytes((cache.looped, cache.plain))
            lowered = self.step.lower(self.param_shapes, jax.ShapeDtypeStruct((batch, 1), jnp.int32), cache,
                                      self.calib(label), self.rng)
            start = time.perf_counter()
            compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
            self.compile_seconds += time.perf_counter() - start
            self.compiled[key] = compiled, step_memory(compiled, self.weights, nbytes), nbytes
        return self.compiled[key]

    def memory(self, label: str, context: int, batch: int) -> dict:
        """The step's memory at a batch: from a program already compiled for a run, else a search compile."""
        done = [v for k, v in self.compiled.items() if k[:3] == (label, context, batch)]
        return done[0][1] if done else self.compile(label, context, batch, search=True)[1]

    def room(self) -> int | None:
        """Bytes a step may still take beyond the resident weights on this machine."""
        if self.args.machine_gb:
            return int(self.args.machine_gb * GiB) - self.weights
        device = jax.devices()[0]
        if device.platform != "cpu":
            stats = device.memory_stats() or {}
            if "bytes_limit" in stats:
                return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
        avail = available_bytes()
        return None if avail is None else int(0.6 * avail)

    def measure(self, label: str, context: int, batch: int) -> dict:
        """Latency, tokens/s, cache bytes and step memory at (format, context, batch); times None with
        the reason in `run` when the step is not run."""
        row = dict(model=self.label, context=context, batch=batch, format=label, stored=FORMATS[label][2],
                   ms=None, tok_s=None, run="ok", **byte_limits(self.fmt(label), self.config, context))
        if self.params is None:  # compile only: a search's program has the same buffers
            memory = self.memory(label, context, batch)
            return {**row, "cache_nbytes": memory["cache"], "memory": memory, "run": "not run (--no-run)"}
        compiled, memory, nbytes = self.compile(label, context, batch)
        row.update(cache_nbytes=nbytes, memory=memory)
        room = self.room()
        if room is not None and memory["total"] - self.weights > room:
            row["run"] = f"not run: needs {(memory['total'] - self.weights) / GiB:.1f} GiB beyond the weights, " \
                         f"this machine has {room / GiB:.1f}"
            return row
        start = time.perf_counter()
        if self.filled[0] != (label, context):  # one filled row kept: the batches of a format and context share it
            self.filled = (label, context), None
            self.filled = (label, context), filled_row(self.config, self.fmt(label), self.calib(label), context)
        cache = jax.block_until_ready(repeat_rows(self.filled[1], batch, context))
        kept = {x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(self.filled[1])}
        if any(x.unsafe_buffer_pointer() in kept for x in jax.tree_util.tree_leaves(cache)):
            cache = jax.tree_util.tree_map(jnp.copy, cache)  # the step donates its cache: never the kept row
        row["fill_s"] = time.perf_counter() - start
        row["cache_nbytes"] = cache_nbytes(cache)
        tokens = jnp.zeros((batch, 1), jnp.int32)
        times, begin = [], time.perf_counter()
        for i in range(self.args.warmup + self.args.repeats):
            start = time.perf_counter()
            tokens, cache = jax.block_until_ready(compiled(self.params, tokens, cache, self.calib(label), self.rng))
            if i >= self.args.warmup:
                times.append(time.perf_counter() - start)
            cache = cache.replace(lengths=jnp.full((batch,), context, jnp.int32))  # a fresh buffer: donated
        del cache
        row["run_s"] = time.perf_counter() - begin
        row["ms"] = 1e3 * statistics.median(times)
        row["tok_s"] = batch / statistics.median(times)
        return row

    def largest_batch(self, label: str, context: int, budget: int, cap: int) -> dict:
        """The largest batch whose compiled step fits `budget` bytes, with its memory and b + 1's."""
        memories = {}

        def total(b):
            memories[b] = self.memory(label, context, b)
            return memories[b]["total"]

        best, seen = largest_fitting(total, budget, cap)
        return dict(model=self.label, context=context, format=label, budget=budget, max_batch=best,
                    memory=memories.get(best), next_batch=best + 1 if best + 1 in seen else None,
                    next_memory=memories.get(best + 1), totals={b: seen[b] for b in sorted(seen)},
                    **byte_limits(self.fmt(label), self.config, context))


# ---- tables -----------------------------------------------------------------------------------------


def _ratio(ratio: float | None, limit: float) -> str:
    return "-" if ratio is None else f"{ratio:.2f} (limit {limit:.2f})"


def _gib(m) -> str:
    if m is None:
        return "-"
    return f"{m['total'] / GiB:.2f} = {m['weights'] / GiB:.2f} w + {m['cache'] / GiB:.2f} c + {m['temp'] / GiB:.2f} t" \
           f" + {m['other'] / GiB:.2f} o"


def add_ratios(rows: list[dict], budget_rows: list[dict]) -> None:
    """Ratios to the dense row of the same model, context (and batch), from this run's figures."""
    dense = {(r["model"], r["context"], r["batch"]): r for r in rows if r["format"] == "dense bf16"}
    for r in rows:
        d = dense.get((r["model"], r["context"], r["batch"]))
        r["bytes_x_dense"] = d["cache_nbytes"] / r["cache_nbytes"] if d else None
        r["tok_s_x_dense"] = r["tok_s"] / d["tok_s"] if d and r["tok_s"] and d["tok_s"] else None
    dense = {(r["model"], r["context"]): r for r in budget_rows if r["format"] == "dense bf16"}
    for r in budget_rows:
        d = dense.get((r["model"], r["context"]))
        r["batch_x_dense"] = r["max_batch"] / d["max_batch"] if d and d["max_batch"] else None
        r["peak_x_dense"] = r["peak_tok_s"] / d["peak_tok_s"] if d and r["peak_tok_s"] and d["peak_tok_s"] else None


def step_table(rows: list[dict]) -> list[str]:
    cols = ("model", "context", "batch", "format", "stored", "ms/step", "tok/s", "tok/s × dense (read limit)",
            "cache MiB", "bytes × dense (storage limit)", "step GiB (weights + cache + temp + other)")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        timed = r["ms"] is not None
        cells = (r["model"], r["context"], r["batch"], r["format"], r["stored"],
                 f"{r['ms']:.1f}" if timed else r["run"], f"{r['tok_s']:.2f}" if timed else "-",
                 _ratio(r["tok_s_x_dense"], r["read_limit"]),
                 f"{r['cache_nbytes'] / MiB:.1f}",
                 _ratio(r["bytes_x_dense"], r["storage_limit"]),
                 _gib(r["memory"]))
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def budget_table(rows: list[dict]) -> list[str]:
    cols = ("model", "context", "format", "max batch", "GiB at max (w + c + t + o)", "GiB at max + 1",
            "batch × dense (storage limit)", "peak tok/s", "peak × dense (storage limit)")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        best = r["max_batch"] if r["max_batch"] else "none fits"
        if r["max_batch"] and r["next_batch"] is None:
            best = f"≥ {r['max_batch']} (cap)"
        cells = (r["model"], r["context"], r["format"], best, _gib(r["memory"]),
                 "-" if r["next_memory"] is None else f"{r['next_memory']['total'] / GiB:.2f}",
                 _ratio(r["batch_x_dense"], r["storage_limit"]),
                 f"{r['peak_tok_s']:.2f}" if r["peak_tok_s"] else r["peak_run"],
                 _ratio(r["peak_x_dense"], r["storage_limit"]))
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def describe_device() -> str:
    """The device in words: the CPU's model name and core count, or the accelerator's kind."""
    device = jax.devices()[0]
    if device.platform != "cpu":
        return f"{device.device_kind} ({device.platform}, {jax.device_count()} device(s))"
    info = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (info.read_text().splitlines() if info.exists() else [])
             if line.startswith("model name")]
    return f"cpu ({names[0] if names else platform.processor()}, {os.cpu_count()} cores)"


# ---- main -------------------------------------------------------------------------------------------


def main(argv=None):
    on_gpu = jax.default_backend() == "gpu"
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--models", nargs="+", default=GPU_MODELS if on_gpu else CPU_MODELS,
                   help=f"NAME[:field=value,...]: a preset with ModelConfig fields changed (Huginn at a CPU's "
                        f"scale: {CPU_HUGINN})")
    p.add_argument("--layers", type=int, help="looped layers (Ouro layers, Huginn core blocks) of every model")
    p.add_argument("--formats", nargs="+", choices=list(FORMATS), default=list(FORMATS), metavar="LABEL",
                   help=f"table labels among {list(FORMATS)} (default: all)")
    p.add_argument("--context", type=int, nargs="+",
                   default=[1024, 2048, 4096, 8192, 16384] if on_gpu else [4096])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16] if on_gpu else [1])
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16" if on_gpu else "float32",
                   help="compute dtype")
    p.add_argument("--weight-dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--memory-gb", type=float, default=32.0 if on_gpu else 2.5,
                   help="memory budget in GiB for the largest-batch search (0: skip the search)")
    p.add_argument("--max-batch", type=int, default=4096, help="largest batch the search tries")
    p.add_argument("--machine-gb", type=float,
                   help="memory a run may use (default: the device's free memory; CPU: 60%% of MemAvailable)")
    p.add_argument("--repeats", type=int, default=10 if on_gpu else 3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--no-run", action="store_true", help="compile only: bytes and the budget search, no timing")
    p.add_argument("--out", help="write PREFIX.md and PREFIX.json")
    args = p.parse_args(argv)
    if min(args.context) < 1 or min(args.batch) < 1 or args.repeats < 1 or args.warmup < 0 or args.max_batch < 1:
        p.error("contexts, batches, repeats and --max-batch must be positive, --warmup non-negative")
    models = [parse_model(spec, args.layers, max(args.context)) for spec in args.models]
    names = [m[0] for m in models]
    models = [(f"{n} ({i + 1})" if names.count(n) > 1 else n, c, d) for i, (n, c, d) in enumerate(models)]
    budget = int(args.memory_gb * GiB)
    command = "python scripts/bench_decode.py " + " ".join(sys.argv[1:] if argv is None else argv)
    header = [
        f"device: {describe_device()}; jax {jax.__version__}",
        f"dtypes: weights {args.weight_dtype}, compute {args.dtype}, cache per format (column 'stored')",
        *(f"model {label}: {c.num_layers} looped layers x {c.num_loops} loops"
          + (f" + {c.num_plain_layers} plain layers" if c.num_plain_layers else "")
          + f", {c.num_heads} heads x {c.head_dim}, hidden {c.hidden_size}, vocab {c.vocab_size} ({changed})"
          for label, c, changed in models),
        f"step: median of {args.repeats} after {args.warmup} warm-up, block_until_ready; cache filled by each "
        "format's write (random K/V, one row repeated)",
        f"memory: XLA memory_analysis of the compiled step; budget {args.memory_gb:g} GiB",
        f"command: {command}",
    ]
    for line in header:
        print(line)
    per_model = len(args.formats) * len(args.context) * (len(args.batch) + (2 if budget else 0))
    bar = tqdm(total=per_model * len(models), desc="bench_decode", unit="step", file=sys.stderr)
    rows, budget_rows, compile_s, began = [], [], {}, time.perf_counter()
    for label, config, _ in models:
        bench = Bench(label, config, args, run=not args.no_run)
        for context in args.context:
            for fmt in args.formats:
                for batch in args.batch:
                    bar.set_postfix_str(f"{label.split()[0]} {context} {fmt} b{batch}")
                    row = bench.measure(fmt, context, batch)
                    rows.append(row)
                    bar.update()
                    tqdm.write(f"  {label} ctx {context} b{batch} {fmt}: "
                               + (f"{row['ms']:.1f} ms, {row['tok_s']:.2f} tok/s" if row["ms"] else row["run"])
                               + f", cache {row['cache_nbytes'] / MiB:.1f} MiB, "
                               f"step {row['memory']['total'] / GiB:.2f} GiB")
                if not budget:
                    continue
                bar.set_postfix_str(f"{label.split()[0]} {context} {fmt} budget search")
                found = bench.largest_batch(fmt, context, budget, args.max_batch)
                bar.update()
                found["peak_tok_s"], found["peak_run"] = None, "none fits" if not found["max_batch"] else "-"
                if found["max_batch"]:
                    bar.set_postfix_str(f"{label.split()[0]} {context} {fmt} b{found['max_batch']} (peak)")
                    done = next((r for r in rows if (r["model"], r["context"], r["format"], r["batch"])
                                 == (label, context, fmt, found["max_batch"])), None)
                    peak = done or bench.measure(fmt, context, found["max_batch"])
                    found["peak_tok_s"], found["peak_run"] = peak["tok_s"], peak["run"]
                    found["peak_ms"] = peak["ms"]
                bar.update()
                budget_rows.append(found)
                tqdm.write(f"  {label} ctx {context} {fmt}: largest batch {found['max_batch']} in "
                           f"{args.memory_gb:g} GiB ({len(found['totals'])} programs compiled), peak "
                           + (f"{found['peak_tok_s']:.2f} tok/s" if found["peak_tok_s"] else found["peak_run"]))
        compile_s[label] = bench.compile_seconds
        del bench
    bar.close()
    wall = time.perf_counter() - began
    header.append(f"wall time {wall:.0f} s, of which compiling steps "
                  + ", ".join(f"{label} {secs:.0f} s" for label, secs in compile_s.items()))
    add_ratios(rows, budget_rows)
    lines = ["## Decode step", "", *step_table(rows)]
    if budget:
        lines += ["", f"## Largest batch in {args.memory_gb:g} GiB", "", *budget_table(budget_rows)]
    text = "\n".join(["# bench_decode", "", *(f"- {h}" for h in header), "", *lines]) + "\n"
    print("\n" + "\n".join(lines))
    if args.out:
        Path(args.out + ".md").write_text(text)
        Path(args.out + ".json").write_text(json.dumps(dict(
            header=header, device=describe_device(), platform=jax.default_backend(), jax=jax.__version__,
            args=vars(args), budget=budget, wall_s=wall, compile_s=compile_s,
            models={label: dict(config=vars(c), changed=d) for label, c, d in models},
            rows=rows, budget_rows=budget_rows), indent=2))


if __name__ == "__main__":
    main()
