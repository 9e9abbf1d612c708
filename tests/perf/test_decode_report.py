"""rq_jax.perf.decode_report on made-up rows (no compile): models by label, the impls each format runs
on, ratios paired with the dense row of the same impl, attention bytes, and the tables' cells."""

from __future__ import annotations

import pytest

from rq_jax.config import preset
from rq_jax.perf import attention as pa
from rq_jax.perf import decode_report as dr
from rq_jax.perf.decode import DecodeBench

MiB, GiB = 2**20, 2**30
MEM = dict(total=3 * GiB, weights=2 * GiB, cache=GiB // 2, temp=GiB // 4, other=GiB // 4)


def step(fmt, impl, ms, cache_nbytes, **extra):
    return dict(model="m", context=64, batch=2, format=fmt, impl=impl, tile=64, ms=ms,
                tok_s=None if ms is None else 2e3 / ms, run="ok" if ms else "not run (compile only)",
                cache_nbytes=cache_nbytes, memory=MEM, read_limit=2.0, storage_limit=4.0, **extra)


def budget(fmt, impl, max_batch, peak, **extra):
    return dict(model="m", context=64, format=fmt, impl=impl, budget=4 * GiB, max_batch=max_batch, memory=MEM,
                next_batch=max_batch + 1, next_memory=dict(MEM, total=5 * GiB), per_row=MiB, cache_per_row=MiB / 2,
                temp_per_row=MiB / 4, storage_limit=4.0, peak_tok_s=peak, peak_run="ok", **extra)


def test_models_are_labelled_and_numbered_when_repeated():
    models = dr.parse_models(["ouro-1.4b", "huginn-0125:num_loops=4", "ouro-1.4b:num_heads=8,num_kv_heads=8"], 2, 8191)
    assert [m[0] for m in models] == ["ouro-1.4b (1)", "huginn-0125", "ouro-1.4b (3)"]
    assert all(c.num_layers == 2 for _, c, _ in models)
    assert models[1][1].max_position_embeddings == max(preset("huginn-0125").max_position_embeddings, 8192)
    assert "num_loops 4 of 32" in models[1][2] and "num_heads 8" in models[2][2]


def test_a_format_without_attend_impl_runs_on_xla_once():
    runs = dr.impl_runs(["dense bf16", "kivi INT2"], ["xla", "native"])
    assert runs == {"dense bf16": ["xla", "native"], "kivi INT2": ["xla"]}
    assert dr.impl_runs(["kivi INT2"], ["auto"]) == {"kivi INT2": ["auto"]}


def test_ratios_pair_the_dense_row_of_the_same_impl():
    rows = [step("dense bf16", "xla", 4.0, 800), step("x", "xla", 2.0, 200), step("dense bf16", "native", 1.0, 800),
            step("x", "native", 0.5, 200), step("x", "auto", 1.0, 100)]
    budgets = [budget("dense bf16", "xla", 4, 100.0), budget("x", "xla", 12, 250.0), budget("x", "native", 8, None)]
    dr.add_ratios(rows, budgets)
    assert [r["bytes_x_dense"] for r in rows] == [1.0, 4.0, 1.0, 4.0, None]
    assert [r["tok_s_x_dense"] for r in rows] == [1.0, pytest.approx(2.0), 1.0, pytest.approx(2.0), None]
    assert [(r["batch_x_dense"], r["peak_x_dense"]) for r in budgets] == [(1.0, 1.0), (3.0, 2.5), (None, None)]


def test_reads_are_the_formats_bytes_over_the_step_time():
    config = preset("ouro-1.4b").replace(num_layers=1)
    rows = [step("direct INT2 g32", "xla", 2.0, 1), step("direct INT2 g32", "xla", None, 1)]
    dr.add_reads(rows, {"m": config}, read_bw=1e9)
    nbytes = pa.bytes_read(DecodeBench.fmt("direct INT2 g32", "xla"), config, 2, 64)
    assert [r["attn_bytes"] for r in rows] == [nbytes, nbytes]
    assert rows[0]["read_fraction"] == pytest.approx(nbytes / 2e-3 / 1e9) and rows[1]["read_fraction"] is None


def test_step_table_cells():
    rows = [step("dense bf16", "xla", 4.0, 8 * MiB, filled=32, ms_filled=2.0),
            step("x", "native", None, 2 * MiB, fallback=["slot 0 fell back"])]
    dr.add_ratios(rows, [])
    for r in rows:
        r["attn_bytes"], r["read_fraction"] = 4 * MiB, 0.25 if r["ms"] else None
    header, rule, dense, other = dr.step_table(rows)
    assert header.count(" | ") == 15 and rule == "|" + "---|" * 16
    assert dense == ("| m | 64 | 2 | dense bf16 | xla | 64 | 4.0 | 500.00 | 1.00 (limit 2.00) | 4.0 | 25% | 8.0 | "
                     "1.00 (limit 4.00) | 256.0 (128.0) | 3.00 = 2.00 w + 0.50 c + 0.25 t + 0.25 o | "
                     "2.0 at 32 (0.50) |")
    assert other.startswith("| m | 64 | 2 | x | native→xla | 64 | not run (compile only) | - | - | 4.0 | - | 2.0 | ")
    assert other.endswith("| - |")


def test_budget_table_and_the_page():
    rows = [budget("dense bf16", "xla", 4, 100.0), dict(budget("x", "xla", 64, None), next_batch=None,
                                                        peak_run="not run (compile only)"),
            dict(budget("y", "xla", 0, None), memory=None, next_memory=None, per_row=None, peak_run="none fits")]
    dr.add_ratios([], rows)
    lines = dr.budget_table(rows)
    assert lines[2] == ("| m | 64 | dense bf16 | xla | 4.00 | 4 | 3.00 = 2.00 w + 0.50 c + 0.25 t + 0.25 o | 5.00 | "
                        "1.0 (0.5, 0.2) | 1.00 (limit 4.00) | 100.00 | 1.00 (limit 4.00) |")
    assert "| ≥ 64 (cap) |" in lines[3] and "| not run (compile only) | - |" in lines[3]
    assert lines[4] == "| m | 64 | y | xla | 4.00 | none fits | - | - | - | 0.00 (limit 4.00) | none fits | - |"
    result = dict(header=["device: d"], rows=[], budget=0, budget_rows=rows, prefill_rows=[],
                  args=dict(memory_gb=0.0, budget_rows=4))
    empty = "\n".join(dr.step_table([]))
    assert dr.page(result) == f"# bench_decode\n\n- device: d\n\n## Decode step\n\n{empty}\n"  # no search: no budget
    result |= dict(budget=None, args=dict(memory_gb=None, budget_rows=4),
                   prefill_rows=[dict(model="m", tokens=8, format="x", impl="xla", memory=MEM)])
    text = dr.tables(result)
    assert "## Largest batch in the 'dense bf16' step's memory at batch 4 (per model and context)" in text
    assert text[-6:-4] == ["", "## Prefill (compile only, batch 1)"]
    assert text[-1] == "| m | 8 | x | xla | 512.0 | 0.25 | 3.00 = 2.00 w + 0.50 c + 0.25 t + 0.25 o |"
