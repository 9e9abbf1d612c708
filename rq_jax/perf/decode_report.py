"""The decode benchmark behind `scripts/bench_decode.py`: every format (and attention impl) at every
model, context and batch through `rq_jax.perf.decode.DecodeBench`, the largest batch a memory budget
holds, ratios to the dense row of the same run, and the tables and JSON of the run.

The timed step is the Sampler's decode step: the model's own jitted forward for one new token per row
through a cache already holding `--context` tokens (each format's attention to the stored past, the new
token's K/V of every loop written back), then the greedy next token. The cache argument is donated, as
a decode loop updates it in place; its lengths are reset after each step so every step sees the same
context. Weights are random (`init_model`) in `--weight-dtype` (bf16); compute runs in `--dtype`
(float32 by default on a CPU, where bf16 dots and attention are several times slower than float32).
Latency is the median of `--repeats` steps after `--warmup` steps, each ended by `block_until_ready`;
tokens/s = batch / latency.

Implementations (`--impls`, column `impl`): every format runs once per entry with its `attend_impl` set
to it (`rq_jax.cache.attention`) — on a CPU by default "xla" (the jnp attention, tiled: column `tile`)
and "native" (the C++ kernels of `cpu_kernels` through the XLA FFI, which read the codes where they lie
and take no tile); on a GPU the formats' own "auto" (the Pallas kernels). Where the native kernels cannot
run here one line says why and their rows are dropped. A format without an `attend_impl` (KIVI) has XLA's
attention only: one row, impl "xla" ("auto" on a GPU), compared with the xla dense row. "native→xla"
marks a row where the op fell back to XLA for some slot (the reason is printed and kept in `fallback`).
The impl picks the attention to the stored past only: the new token's K/V are written the same way in
every row (XLA's in-place dynamic-update-slices on a CPU). Every ratio to dense
below pairs a row with the dense row of the same impl (and model, context, batch) of the same run, and
with `--budget-rows` each impl's budget is its own dense step's memory; compare impls with each other
on ms/step, tok/s and max batch of the same format.

Read bandwidth: the run first times `jit(jnp.sum)` over `--read-mb` MiB of float32 (median of
`--repeats`; header and JSON `read_bandwidth`, bytes/s: what XLA's own reduction reaches on this
machine, not a hardware peak). Columns `attn MiB read` and `% read BW`: the cache bytes the step's
attention reads at the row's context (`rq_jax.perf.attention.bytes_read`: the format's
`read_bits_per_element`, a residual loop re-reading its anchor, over every looped and plain slot, K and
V) and those bytes over the step's time as a fraction of the read bandwidth. Attention's bytes only:
the step also reads the weights (column `step GiB`), the new token's K/V and the activations, so the
fraction is a lower bound on the step's memory traffic; near 100% the step's time is the cache read
alone, and a kernel reading faster than XLA's reduction passes 100%.

The cache is filled through each format's own `write` (`rq_jax.perf.decode`), not by running the model.

Memory budget (`--memory-gb`, GiB): a batch fits when the compiled step's memory as XLA reports it
(`memory_analysis()`: arguments — weights, cache, calibration — plus outputs not aliased to the donated
cache, temporaries and generated code) is at most the budget. The search compiles programs for abstract
inputs (`jax.ShapeDtypeStruct`, `jax.eval_shape`: nothing allocated; on a CPU with LLVM optimisation
off, which changes code generation, not buffer sizes) and returns the largest batch b that fits with
the figure of b + 1 beside it: secant estimates from batches 1 and 2 (memory is affine in the batch
past a small-batch plateau), then steps that double and bisection (`largest_fitting`). Temporaries are
the backend's own (a GPU's differ). The step computes with the weights as stored and attends one
context tile at a time, so its temporaries do not grow with the context: the step's activations (per
row) and a few tiles' decoded K/V and scores (at most `base.TILE_ELEMENTS` float32 elements each, at any
batch). The peak tokens/s is
measured at the largest batch when the step fits this machine (`--machine-gb`, default 60% of the
memory available), else the table says "not run".

Ratios to dense are measured in the same run and printed beside their limits (dense bytes / format
bytes by the formats' own accounting): cache bytes, batches and peak tokens/s beside the storage limit
16 / bits per element; tokens/s at a fixed batch beside the read limit 16 / bits read per element
(ResidualQuant's residual loops also read their anchor: Ouro's [2,2,2,4] stores 3.09 bits per element
and reads 6.47). KIVI's bits are its own accounting at the row's context.

"""
from __future__ import annotations

import importlib.metadata
import sys
import time

import jax
from tqdm import tqdm

from rq_jax import report
from rq_jax.cache import base
from rq_jax.cache.context import SELF_TILE
from rq_jax.config import ModelConfig, changes_from, parse_preset
from rq_jax.perf import attention as pa
from rq_jax.perf.decode import TPU_POSITIONS, DecodeBench, describe_device

GiB = 2**30
MiB = 2**20
CPU_MODELS = ["ouro-1.4b:num_layers=2"]
#: Huginn at a CPU's scale (pass it to --models): real width, heads and vocabulary; one core block, one
#: group of 4 steps, no prelude/coda (each of its blocks holds 0.4B parameters).
CPU_HUGINN = "huginn-0125:num_layers=1,num_loops=4,num_prelude=0,num_coda=0"
GPU_MODELS = ["ouro-1.4b", "huginn-0125"]
#: The scheme every ratio is taken against (and whose step memory sets the budget without --memory-gb).
DENSE = "dense bf16"


def parse_model(spec: str, layers: int | None, max_context: int) -> tuple[str, ModelConfig, str]:
    """(name, config, what differs from the preset) of `NAME[:field=value,...]`; `layers` (if given)
    sets num_layers, and the positions are raised to hold `max_context` + 1."""
    name, config = parse_preset(spec)
    config = config.replace(num_layers=layers or config.num_layers,
                            max_position_embeddings=max(config.max_position_embeddings, max_context + 1))
    return name, config, changes_from(name, config)


def parse_models(specs: list[str], layers: int | None, max_context: int) -> list[tuple[str, ModelConfig, str]]:
    """`parse_model` of every spec, labelled by preset name; a name given more than once is numbered
    "NAME (i)" by its place in `specs`."""
    models = [parse_model(spec, layers, max_context) for spec in specs]
    names = [m[0] for m in models]
    return [(f"{n} ({i + 1})" if names.count(n) > 1 else n, c, d) for i, (n, c, d) in enumerate(models)]


def impl_runs(formats: list[str], impls: list[str]) -> dict[str, list[str]]:
    """The impls each format runs on: all of `impls`, or "xla" for a format without an `attend_impl`
    (KIVI: XLA's attention only, one row; "auto" stays "auto", as on a GPU)."""
    return {fmt: list(dict.fromkeys(i if pa.takes_impl(DecodeBench.fmt(fmt)) or i == "auto" else "xla"
                                    for i in impls)) for fmt in formats}


def budget_words(memory_gb: float | None, budget_rows: int) -> str:
    """The budget in words: the fixed GiB, or dense's step memory at `budget_rows` rows."""
    if memory_gb is not None:
        return f"{memory_gb:g} GiB"
    return f"the '{DENSE}' step's memory at batch {budget_rows} (per model and context)"


# ---- the run ----------------------------------------------------------------------------------------


def header(args, models, impls: list[str], read_bw: float, run_contexts: set[int], command: str) -> list[str]:
    """The run's settings in lines (the Markdown page's list, the JSON's `header`)."""
    return [
        f"device: {describe_device(args.tpu)}; jax {jax.__version__}; " + (
            f"read bandwidth {read_bw / 1e9:.1f} GB/s (jit(jnp.sum) of {args.read_mb} MiB float32, median of "
            f"{args.repeats})" if read_bw else "compiled on this host by libtpu "
            f"{importlib.metadata.version('libtpu')}, not run; each cache's positions rounded up to "
            f"{TPU_POSITIONS}; 'Mosaic kernels': the compiled step's call sites of each"),
        "attention impl: " + pa.describe_impls(impls) + " (each format's attend_impl, one row per format and impl; a "
        "format without attend_impl: xla only; '→xla': the op fell back to XLA for some slot)",
        f"dtypes: weights {args.weight_dtype}, compute {args.dtype}, cache as each format's label says",
        *(f"model {label}: {c.num_layers} looped layers x {c.num_loops} loops"
          + (f" + {c.num_plain_layers} plain layers" if c.num_plain_layers else "")
          + f", {c.num_heads} heads x {c.head_dim}, hidden {c.hidden_size}, vocab {c.vocab_size} ({changed})"
          for label, c, changed in models),
        f"step: median of {args.repeats} after {args.warmup} warm-up, block_until_ready; cache filled by each "
        "format's write (random K/V, one row repeated); timed contexts: "
        + (", ".join(map(str, sorted(run_contexts))) or "none (compile only)"),
        f"XLA's attention: tiled, tile = rq_jax.cache.base.context_tile (a float32 operand of at most "
        f"{base.TILE_ELEMENTS} elements, at least {base.MIN_TILE} tokens; column 'tile'); prompts over "
        f"{SELF_TILE} tokens attend to themselves in {SELF_TILE} x {SELF_TILE} tiles",
        f"memory: XLA memory_analysis of the compiled step; budget {budget_words(args.memory_gb, args.budget_rows)}",
        f"command: {command}",
    ]


def _budget_row(bench: DecodeBench, fmt: str, impl: str, context: int, budget: int, timed: bool, rows: list[dict],
                bar) -> dict:
    """The largest batch of (fmt, impl, context) within `budget` and its peak tokens/s (measured when
    the context is timed, reusing a step row of that batch)."""
    label = bench.label
    found = bench.largest_batch(fmt, context, budget, bench.args.max_batch, impl)
    bar.update()
    found["peak_tok_s"], found["peak_run"] = None, "none fits" if not found["max_batch"] else "-"
    if found["max_batch"] and timed:
        bar.set_postfix_str(f"{label.split()[0]} {context} {fmt} {impl} b{found['max_batch']} (peak)")
        done = next((r for r in rows if (r["model"], r["context"], r["format"], r["impl"], r["batch"])
                     == (label, context, fmt, impl, found["max_batch"])), None)
        peak = done or bench.measure(fmt, context, found["max_batch"], impl=impl)
        found["peak_tok_s"], found["peak_run"] = peak["tok_s"], peak["run"]
        found["peak_ms"] = peak["ms"]
    elif found["max_batch"]:
        found["peak_run"] = "not run (compile only)"
    bar.update()
    found["fallback"] = list(bench.fallbacks.get((fmt, impl), ())) or None
    return found


def run(args, impls: list[str], command: str) -> dict:
    """The whole run of `scripts/bench_decode.py`'s `args` on `impls` (`attention.usable_impls` of its
    --impls): the header printed, progress on stderr, one line per measurement; returns the run's JSON
    (header, device, read_bandwidth, budget, timings, models, and its step, budget and prefill rows with
    their attention bytes and ratios to dense)."""
    run_contexts = set() if args.no_run else set(args.run_contexts or args.context)
    models = parse_models(args.models, args.layers, max(args.context + args.prefill))
    fixed_budget = None if args.memory_gb is None else int(args.memory_gb * GiB)
    search = fixed_budget != 0
    runs = impl_runs(args.formats, impls)
    read_bw = None if args.tpu else pa.read_bandwidth(args.read_mb << 20, args.repeats)
    head = header(args, models, impls, read_bw, run_contexts, command)
    for line in head:
        print(line)
    writes = len(args.write_slots) if run_contexts else 0
    searched = (1 + (2 if args.engine_chunk else 0)) if search else 0  # the search, the engine's two programs
    per_model = sum(map(len, runs.values())) * (len(args.context) * (len(args.batch) + searched)
                                                + len(args.prefill) + writes)
    bar = tqdm(total=per_model * len(models), desc="bench_decode", unit="step", file=sys.stderr)
    rows, budget_rows, prefill_rows, write_rows, compile_s, began = [], [], [], [], {}, time.perf_counter()
    engine_rows = []
    said = set()  # the decode-attention op's fallback warnings printed so far
    for label, config, _ in models:
        bench = DecodeBench(label, config, args, run=bool(run_contexts))
        for context in args.context:
            timed = context in run_contexts
            budgets = {}
            for fmt in args.formats:
                for impl in runs[fmt]:
                    name = f"{label.split()[0]} {context} {fmt} {impl}"
                    for batch in args.batch:
                        bar.set_postfix_str(f"{name} b{batch}")
                        row = bench.measure(fmt, context, batch, timed, args.filled, impl)
                        rows.append(row)
                        bar.update()
                        tqdm.write(f"  {label} ctx {context} b{batch} {fmt} {impl_label(row)}: "
                                   + (f"{row['ms']:.1f} ms, {row['tok_s']:.2f} tok/s" if row["ms"] else row["run"])
                                   + f", cache {row['cache_nbytes'] / MiB:.1f} MiB"
                                   + ("" if row["memory"] is None else f", temp {row['memory']['temp'] / MiB:.1f} MiB, "
                                      f"step {row['memory']['total'] / GiB:.2f} GiB") + kernels_words(row))
                    for message in bench.fallbacks.get((fmt, impl), []):
                        if (label, message) not in said:
                            said.add((label, message))
                            tqdm.write(f"  {label} {fmt} {impl}: {message}")
                    if not search:
                        continue
                    if impl not in budgets:  # --budget-rows: dense's step memory on the same impl
                        budgets[impl] = fixed_budget or bench.memory(DENSE, context, args.budget_rows, impl)["total"]
                    bar.set_postfix_str(f"{name} budget search")
                    found = _budget_row(bench, fmt, impl, context, budgets[impl], timed, rows, bar)
                    budget_rows.append(found)
                    tqdm.write(f"  {label} ctx {context} {fmt} {impl}: largest batch {found['max_batch']} in "
                               f"{budgets[impl] / GiB:.2f} GiB ({len(found['totals'])} programs compiled), peak "
                               + (f"{found['peak_tok_s']:.2f} tok/s" if found["peak_tok_s"] else found["peak_run"])
                               + kernels_words(found))
                    requests = found["max_batch"]
                    for call_rows, width in ((requests, 1), (1, args.engine_chunk)):
                        if not args.engine_chunk or not requests:
                            continue
                        bar.set_postfix_str(f"{name} engine {call_rows} x {width}")
                        engine_rows.append(_engine_row(bench, fmt, impl, context, requests, call_rows, width,
                                                       budgets[impl]))
                        bar.update()
                        tqdm.write(f"  {label} ctx {context} {fmt} {impl}: engine {_program(engine_rows[-1])}, "
                                   + _fit_words(engine_rows[-1]) + kernels_words(engine_rows[-1]))
        for tokens in args.prefill:
            for fmt in args.formats:
                for impl in runs[fmt]:
                    bar.set_postfix_str(f"{label.split()[0]} prefill {tokens} {fmt} {impl}")
                    mem = bench.prefill_memory(fmt, tokens, impl)
                    prefill_rows.append(dict(model=label, tokens=tokens, format=fmt, impl=impl,
                                             **_compiled(bench, mem, (fmt, impl, "prefill", tokens))))
                    bar.update()
        for slots in args.write_slots if run_contexts else ():
            for fmt in args.formats:
                for impl in runs[fmt]:
                    bar.set_postfix_str(f"{label.split()[0]} write at {slots} slots {fmt} {impl}")
                    write_rows.append(bench.write_time(fmt, slots, args.batch[0], impl))
                    bar.update()
        compile_s[label] = bench.compile_seconds
        del bench
    bar.close()
    wall = time.perf_counter() - began
    head.append(f"wall time {wall:.0f} s, of which compiling steps "
                + ", ".join(f"{label} {secs:.0f} s" for label, secs in compile_s.items()))
    add_reads(rows, {label: c for label, c, _ in models}, read_bw)
    add_ratios(rows, budget_rows)
    return dict(header=head, device=describe_device(args.tpu), platform="tpu" if args.tpu else jax.default_backend(),
                jax=jax.__version__,
                read_bandwidth=read_bw, impls=impls, args=vars(args), budget=fixed_budget, wall_s=wall,
                compile_s=compile_s, models={label: dict(config=vars(c), changed=d) for label, c, d in models},
                rows=rows, budget_rows=budget_rows, prefill_rows=prefill_rows, write_rows=write_rows,
                engine_rows=engine_rows)


# ---- ratios and bytes -------------------------------------------------------------------------------


def add_ratios(rows: list[dict], budget_rows: list[dict]) -> None:
    """Ratios to the dense row of the same model, context, impl (and batch), from this run's figures:
    bytes_x_dense, tok_s_x_dense on the step rows, batch_x_dense, peak_x_dense on the budget rows (None
    without a dense row or a time)."""
    dense = {(r["model"], r["context"], r["impl"], r["batch"]): r for r in rows if r["format"] == DENSE}
    for r in rows:
        d = dense.get((r["model"], r["context"], r["impl"], r["batch"]))
        r["bytes_x_dense"] = d["cache_nbytes"] / r["cache_nbytes"] if d else None
        r["tok_s_x_dense"] = r["tok_s"] / d["tok_s"] if d and r["tok_s"] and d["tok_s"] else None
    dense = {(r["model"], r["context"], r["impl"]): r for r in budget_rows if r["format"] == DENSE}
    for r in budget_rows:
        d = dense.get((r["model"], r["context"], r["impl"]))
        r["batch_x_dense"] = r["max_batch"] / d["max_batch"] if d and d["max_batch"] else None
        r["peak_x_dense"] = r["peak_tok_s"] / d["peak_tok_s"] if d and r["peak_tok_s"] and d["peak_tok_s"] else None


def add_reads(rows: list[dict], configs: dict[str, ModelConfig], read_bw: float) -> None:
    """Each step row's attention bytes (`rq_jax.perf.attention.bytes_read`: the cache bytes its attention
    reads at the row's context, by the format's `read_bits_per_element`) and, when timed, those bytes per
    second as a fraction of the measured read bandwidth."""
    for r in rows:
        r["attn_bytes"] = pa.bytes_read(DecodeBench.fmt(r["format"], r["impl"]), configs[r["model"]], r["batch"],
                                        r["context"])
        r["read_fraction"] = r["attn_bytes"] / (r["ms"] / 1e3) / read_bw if r["ms"] else None


# ---- tables -----------------------------------------------------------------------------------------


def _ratio(ratio: float | None, limit: float) -> str:
    return "-" if ratio is None else f"{ratio:.2f} (limit {limit:.2f})"


def _gib(m) -> str:
    if m is None:
        return "-"
    return f"{m['total'] / GiB:.2f} = {m['weights'] / GiB:.2f} w + {m['cache'] / GiB:.2f} c + {m['temp'] / GiB:.2f} t" \
           f" + {m['other'] / GiB:.2f} o"


def _mib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / MiB:.1f}"


def kernels_cell(counts: dict[str, int] | None) -> str:
    """Call sites per Mosaic kernel ("4 tpu_residual_decode_attention + 30 tpu_write_token"), "none" for a
    program with none, "-" where not compiled for a TPU."""
    if counts is None:
        return "-"
    return " + ".join(f"{n} {name}" for name, n in counts.items()) or "none"


def kernels_words(r: dict) -> str:
    """", Mosaic kernels: N name + ..." for a row compiled for a TPU, else ""."""
    return f", Mosaic kernels: {kernels_cell(r['tpu_kernels'])}" if r.get("tpu_kernels") is not None else ""


def _kernel_cells(rows: list[dict], cols: tuple, cells: list[tuple]) -> tuple[tuple, list[tuple]]:
    """The columns and cells with a "Mosaic kernels" column when the rows were compiled for a TPU."""
    if not any("tpu_kernels" in r for r in rows):
        return cols, cells
    return (*cols, "Mosaic kernels"), [(*c, kernels_cell(r.get("tpu_kernels"))) for r, c in zip(rows, cells)]


def impl_label(r: dict) -> str:
    """The row's impl, "→xla" added when the decode-attention op fell back to XLA for some slot."""
    return r["impl"] + ("→xla" if r.get("fallback") else "")


def step_table(rows: list[dict]) -> list[str]:
    """The decode-step rows (after `add_reads` and `add_ratios`) as Markdown lines."""
    cols = ("model", "context", "batch", "format", "impl", "tile", "ms/step", "tok/s", "tok/s × dense (read limit)",
            "attn MiB read", "% read BW", "cache MiB", "dense bytes ÷ format bytes (storage limit)",
            "temp MiB (per row)", "step GiB (weights + cache + temp + other)", "ms holding `filled` tokens (× full)")
    cells = []
    for r in rows:
        timed = r["ms"] is not None
        filled = "-" if r.get("ms_filled") is None else \
            f"{r['ms_filled']:.1f} at {r['filled']} ({r['ms_filled'] / r['ms']:.2f})"
        cells.append((r["model"], r["context"], r["batch"], r["format"], impl_label(r), r["tile"],
                      f"{r['ms']:.1f}" if timed else r["run"], f"{r['tok_s']:.2f}" if timed else "-",
                      _ratio(r["tok_s_x_dense"], r["read_limit"]), _mib(r["attn_bytes"]),
                      "-" if r["read_fraction"] is None else f"{100 * r['read_fraction']:.0f}%",
                      _mib(r["cache_nbytes"]), _ratio(r["bytes_x_dense"], r["storage_limit"]),
                      "-" if r["memory"] is None else
                      f"{_mib(r['memory']['temp'])} ({_mib(r['memory']['temp'] / r['batch'])})",
                      _gib(r["memory"]), filled))
    return report.table(*_kernel_cells(rows, cols, cells))


def budget_table(rows: list[dict]) -> list[str]:
    """The largest-batch rows (after `add_ratios`) as Markdown lines."""
    cols = ("model", "context", "format", "impl", "budget GiB", "max batch", "GiB at max (w + c + t + o)",
            "GiB at max + 1", "MiB per added row (cache, temp per row)", "batch × dense (storage limit)", "peak tok/s",
            "peak × dense (storage limit)")
    cells = []
    for r in rows:
        best = r["max_batch"] if r["max_batch"] else "none fits"
        if r["max_batch"] and r["next_batch"] is None:
            best = f"≥ {r['max_batch']} (cap)"
        per_row = "-" if r["per_row"] is None else \
            f"{_mib(r['per_row'])} ({_mib(r['cache_per_row'])}, {_mib(r['temp_per_row'])})"
        cells.append((r["model"], r["context"], r["format"], impl_label(r), f"{r['budget'] / GiB:.2f}", best,
                      _gib(r["memory"]), "-" if r["next_memory"] is None else f"{r['next_memory']['total'] / GiB:.2f}",
                      per_row, _ratio(r["batch_x_dense"], r["storage_limit"]),
                      f"{r['peak_tok_s']:.2f}" if r["peak_tok_s"] else r["peak_run"],
                      _ratio(r["peak_x_dense"], r["storage_limit"])))
    return report.table(*_kernel_cells(rows, cols, cells))


def _engine_row(bench, fmt: str, impl: str, context: int, requests: int, rows: int, width: int, budget: int) -> dict:
    """The serving engine's program (`DecodeBench.engine_memory`) for `rows` rows of `width` tokens over a
    pool holding `requests` requests of `context` + 1 tokens, against `budget`."""
    mem = bench.engine_memory(fmt, context, requests, rows, width, impl)
    return dict(model=bench.label, context=context, format=fmt, impl=impl, requests=requests, rows=rows, width=width,
                budget=budget, fits=mem is not None and mem["total"] <= budget,
                **_compiled(bench, mem, (fmt, impl, "engine", context, requests, rows, width)))


def _compiled(bench, mem: dict | None, key: tuple) -> dict:
    """A compiled program's row fields: its memory (None where refused), on a TPU its Mosaic kernels' call
    sites apart, and the TPU compiler's refusal (`bench.refused[key]`) when there is one."""
    kernels = {"tpu_kernels": mem.pop("tpu_kernels") if mem else None} if bench.tpu else {}
    refused = bench.refused.get(key)
    return dict(memory=mem, **kernels, **({"refused": refused} if refused else {}))


def _program(r: dict) -> str:
    """An engine row's program: "decode, N rows" or "prompt chunk of T tokens"."""
    rows = f"{r['rows']} row" + ("s" if r["rows"] != 1 else "")
    return f"decode, {rows}" if r["width"] == 1 else f"prompt chunk of {r['width']} tokens, {rows}"


def _fit_words(r: dict) -> str:
    if r["memory"] is None:
        return f"refused by the TPU compiler: {r['refused']}"
    return f"{r['memory']['total'] / GiB:.2f} GiB, " + ("fits" if r["fits"] else "over") + \
        f" {r['budget'] / GiB:.2f} GiB"


def engine_table(rows: list[dict]) -> list[str]:
    """The engine rows (compile only) as Markdown lines."""
    cols = ("model", "context", "format", "impl", "requests held", "program", "GiB (weights + cache + temp + other)",
            "temp MiB", "within the budget")
    cells = [(r["model"], r["context"], r["format"], r["impl"], r["requests"], _program(r), _gib(r["memory"]),
              _mib(r["memory"] and r["memory"]["temp"]), "yes" if r["fits"] else _fit_words(r)) for r in rows]
    return report.table(*_kernel_cells(rows, cols, cells))


def prefill_table(rows: list[dict]) -> list[str]:
    """The prefill rows (compile only) as Markdown lines; a program the TPU compiler refused, with its words."""
    cols = ("model", "prompt tokens", "format", "impl", "cache MiB", "temp GiB",
            "step GiB (weights + cache + temp + other)")
    cells = []
    for r in rows:
        mem = r["memory"]
        sizes = (_mib(mem["cache"]), f"{mem['temp'] / GiB:.2f}", _gib(mem)) if mem else (
            "-", "-", f"refused by the TPU compiler: {r['refused']}")
        cells.append((r["model"], r["tokens"], r["format"], r["impl"], *sizes))
    return report.table(*_kernel_cells(rows, cols, cells))


def write_table(rows: list[dict]) -> list[str]:
    """The write rows (`DecodeBench.write_time`) as Markdown lines, each against the same format's and impl's
    write at the fewest slots."""
    cols = ("model", "batch", "format", "impl", "slots", "cache MiB", "write ms", "× the fewest slots' write",
            "temp MiB")
    first = {}
    cells = []
    for r in sorted(rows, key=lambda r: (r["model"], r["format"], r["impl"], r["slots"])):
        base_ms = first.setdefault((r["model"], r["format"], r["impl"]), r["ms"])
        cells.append((r["model"], r["batch"], r["format"], r["impl"], r["slots"], _mib(r["cache_nbytes"]),
                      f"{r['ms']:.2f}", f"{r['ms'] / base_ms:.2f}", _mib(r["temp"])))
    return report.table(cols, cells)


def tables(result: dict) -> list[str]:
    """A run's tables (`run`'s result) as Markdown lines: the decode step, the largest batch when
    searched, the prefills when compiled, the write alone when timed."""
    lines = ["## Decode step", "", *step_table(result["rows"])]
    if result["budget"] != 0:
        words = budget_words(result["args"]["memory_gb"], result["args"]["budget_rows"])
        lines += ["", f"## Largest batch in {words}", "", *budget_table(result["budget_rows"])]
    if result["prefill_rows"]:
        lines += ["", "## Prefill (compile only, batch 1)", "", *prefill_table(result["prefill_rows"])]
    if result.get("engine_rows"):
        lines += ["", "## The serving engine's programs over a pool holding the largest batch (compile only)", "",
                  *engine_table(result["engine_rows"])]
    if result.get("write_rows"):
        lines += ["", "## One token's write, alone (held as bits, donated)", "", *write_table(result["write_rows"])]
    return lines


def page(result: dict) -> str:
    """A run's Markdown page (PREFIX.md): a title, the header as a list, the tables."""
    return "\n".join(["# bench_decode", "", *(f"- {h}" for h in result["header"]), "", *tables(result)]) + "\n"
