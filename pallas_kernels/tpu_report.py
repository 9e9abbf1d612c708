"""The TPU report behind `scripts/kernel_report.py --tpu`: every configuration of `configs.MATRIX` compiled
with libtpu's Mosaic and XLA:TPU compilers for TPU generations, without a TPU (`tpu_deviceless`), as rows,
a summary and a Markdown table.

A configuration's TPU call (`KernelConfig.tpu_call`) is the GPU one's inputs (16 kv heads, S = 4096, batch
1, 4 slots, float32 queries), contiguous, with the launch entry of `tpu_launch` for the generation. The packed
kernel holds every kv head of a page in one grid step, so on the TPU the heads (and the chain) set how much
VMEM a step takes, and the kernel halves its page until the double-buffered inputs fit.

A row is one (configuration, generation), its `status` one of

* "ok": both compilers accepted it with one Mosaic kernel in the compiled HLO: `kernel` (its HLO op name),
  `page` (tokens per grid step: S over the pallas_call grid's page count), `vmem_limit` (its scoped VMEM
  limit) and `vmem_used` (what the compiled kernel takes of it), and the program's `generated_code_bytes`,
  `temp_bytes` and `argument_bytes` (`memory_analysis()`, HBM);
* "declined": the TPU kernel refuses the configuration by name when traced (NotImplementedError, its message
  in `error`): not a failure;
* "error": a compiler refused it (e.g. RESOURCE_EXHAUSTED over the VMEM limit), or the compiled HLO holds no
  Mosaic kernel or several; `error` says which.

Every row has `seconds` (trace + lower + compile). Like the rest of this package it imports nothing from
rq_jax.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import time

import jax
from jax.extend.core import subjaxprs

from pallas_kernels import configs
from pallas_kernels import tpu_deviceless as td

MIB = 1 << 20
STATUSES = ("ok", "declined", "error")


def no_libtpu_message() -> str:
    """The one line printed when libtpu is missing: the install command pinned to the jax in use."""
    return f'the TPU report needs libtpu: pip install "jax[tpu]=={jax.__version__}"'


def versions() -> dict:
    """The compilers' versions: libtpu, jax, jaxlib."""
    return {name: importlib.metadata.version(name) for name in ("libtpu", "jax", "jaxlib")}


def pallas_grids(jaxpr) -> list[tuple[int, ...]]:
    """The grid of every pallas_call in `jaxpr` (a core Jaxpr), nested jaxprs (jit, cond, ...) included."""
    grids = [tuple(e.params["grid_mapping"].grid) for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    return grids + [g for sub in subjaxprs(jaxpr) for g in pallas_grids(sub)]


def compile_row(cfg: configs.KernelConfig, generation: str) -> dict:
    """One report row (module docstring): `cfg`'s TPU call traced (a NotImplementedError: declined), then
    compiled for `generation`."""
    row = dict(config=cfg.name, generation=generation, launch_kernel=cfg.kernel)
    start = time.perf_counter()
    try:
        fn, args = cfg.tpu_call(generation)
        grids = pallas_grids(jax.make_jaxpr(fn)(*args).jaxpr)
    except NotImplementedError as e:
        return row | dict(status="declined", error=str(e), seconds=round(time.perf_counter() - start, 3))
    res = td.compile_for(fn, args, generation)
    seconds = round(time.perf_counter() - start, 3)
    if not res.ok:
        return row | dict(status="error", error=res.error, seconds=seconds)
    if len(res.kernels()) != 1 or len(grids) != 1:
        return row | dict(status="error", seconds=seconds, error=f"{len(res.kernels())} Mosaic kernels compiled "
                          f"from {len(grids)} pallas_calls, not one: custom calls {res.custom_calls}")
    [limit], [used] = res.vmem_limits, res.vmem_used
    return row | dict(status="ok", error="", kernel=res.kernels()[0], page=-(-cfg.seq // grids[0][-1]),
                      vmem_limit=limit, vmem_used=used, generated_code_bytes=res.generated_code_bytes,
                      temp_bytes=res.temp_bytes, argument_bytes=res.argument_bytes, seconds=seconds)


def line(row: dict) -> str:
    """A report row as one log line."""
    head = f"{row['config']:54s} {row['generation']:4s}"
    if row["status"] != "ok":
        return f"{head} {row['status'].upper()}: {row['error'][:160]}"
    return (f"{head} ok  page {row['page']:4d}  VMEM {row['vmem_used'] / MIB:5.2f} / {row['vmem_limit'] / MIB:.0f} MiB"
            f"  code {row['generated_code_bytes'] / 1024:6.0f} KiB  temp {row['temp_bytes']} B  {row['seconds']:.1f}s")


def report(cfgs, generations, log=print) -> list[dict]:
    """Every configuration of `cfgs` compiled for every generation: the rows, each logged as it is done."""
    rows = []
    for cfg, generation in itertools.product(cfgs, generations):
        rows.append(compile_row(cfg, generation))
        log(line(rows[-1]))
    return rows


def failed(rows: list[dict]) -> bool:
    """Whether any compile failed (a declined configuration is not a failure)."""
    return any(r["status"] == "error" for r in rows)


def summary(rows: list[dict]) -> str:
    """Per generation, how many compiled, were declined and failed; then one indented line per failure."""
    lines = []
    for generation in dict.fromkeys(r["generation"] for r in rows):
        n = {s: sum(r["status"] == s for r in rows if r["generation"] == generation) for s in STATUSES}
        lines.append(f"{generation}: {n['ok']} compiled, {n['declined']} declined, {n['error']} errors")
    return "\n".join(lines + [f"  {r['config']} ({r['generation']}): {r['error']}" for r in rows
                              if r["status"] == "error"])


def markdown(rows: list[dict], versions: dict) -> str:
    """The report as a Markdown table, one line per configuration with the generations side by side; the
    reasons of declined configurations numbered below it."""
    generations = list(dict.fromkeys(r["generation"] for r in rows))
    by = {(r["config"], r["generation"]): r for r in rows}
    reasons = list(dict.fromkeys(r["error"] for r in rows if r["status"] == "declined"))

    def cell(row: dict | None) -> str:
        if row is None:
            return "—"
        if row["status"] == "declined":
            return f"declined [{reasons.index(row['error']) + 1}]"
        if row["status"] == "error":
            return f"**error**: {row['error'][:120]}".replace("|", "/")
        return (f"{row['page']} · {row['vmem_used'] / MIB:.2f} / {row['vmem_limit'] / MIB:.0f} MiB · "
                f"{row['generated_code_bytes'] / 1024:.0f} KiB · {row['temp_bytes']}")

    head = (f"libtpu {versions['libtpu']}, jax {versions['jax']}, jaxlib {versions['jaxlib']}; topologies "
            + ", ".join(td.TOPOLOGIES[g] for g in generations)
            + ". Cells: tokens per grid step · scoped VMEM the kernel uses / its limit · generated code · "
              "HBM temporaries (bytes).\n\n" + summary(rows).replace("\n", "  \n") + "\n\n")
    lines = ["| configuration | kernel | " + " | ".join(generations) + " |", "|---|---|" + "---|" * len(generations)]
    for name in dict.fromkeys(r["config"] for r in rows):
        gen_rows = [by.get((name, g)) for g in generations]
        kernel = next((r["kernel"] for r in gen_rows if r and r["status"] == "ok"), "")
        lines.append(f"| {name} | {kernel} | " + " | ".join(cell(r) for r in gen_rows) + " |")
    notes = [f"[{i}] {why}" for i, why in enumerate(reasons, 1)]
    return head + "\n".join(lines) + "\n" + ("\nDeclined:\n\n" + "  \n".join(notes) + "\n" if notes else "")
