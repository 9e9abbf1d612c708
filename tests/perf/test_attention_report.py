"""rq_jax.perf.attention_report on made-up rows (no timing): the ratio to dense pairs the dense row of the
same impl (the dense kernels the first impl's), and the rows' cells and page."""

from __future__ import annotations

from rq_jax import report
from rq_jax.perf import attention_report as ar


def row(fmt, impl, ms, fallback=None):
    return dict(model="m", batch=1, context=64, format=fmt, impl=impl, fallback=fallback, stored="s", ms=ms,
                bytes=2**21, gbps=1.5, copy_fraction=0.25, read_fraction=0.125, byte_limit=2.47)


def test_speedups_pair_the_dense_row_of_the_same_impl():
    block = [row("dense bf16", "auto", 2.0), row("x", "auto", 1.0), row("dense bf16", "pallas", 4.0),
             row("dense bf16", "jax-peer", 1.0), row("x", "xla", 1.0)]
    ar.add_speedups(block, "auto")
    assert [(r["dense_impl"], r["speedup"]) for r in block] == [
        ("auto", 1.0), ("auto", 2.0), ("auto", 0.5), ("auto", 2.0), (None, None)]


def test_cells_and_page():
    rows = [row("dense bf16", "xla", 2.0), row("x", "native", 1.0, fallback=["slot fell back"])]
    ar.add_speedups(rows, "xla")
    assert report.row(ar.cells(rows[0])) == \
        "| m | 1 | 64 | dense bf16 | xla | s | 2.000 | 2.0 | 1.5 | 25% | 12% | 1.00 | 2.47 |"
    assert ar.cells(rows[1])[4] == "native→xla" and ar.cells(rows[1])[11] == "-"
    page = ar.page(dict(header="device: d", rows=rows)).splitlines()
    assert page[:4] == ["device: d", "", report.row(ar.COLUMNS), "|" + "---|" * len(ar.COLUMNS)]
    assert page[4:] == [report.row(ar.cells(r)) for r in rows]
