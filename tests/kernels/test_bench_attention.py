"""Smoke tests of scripts/bench_attention.py at tiny shapes (CPU: XLA and, where built, the native kernels)."""

from __future__ import annotations

import json

import pytest

import cpu_kernels
from tests.conftest import run_script


def test_bench_attention_writes_table_and_json(tmp_path):
    """One row per format and impl (native where the kernels load); every ratio pairs the dense row of its
    own impl; the read bandwidth is measured, positive and in the JSON, and "% read BW" follows from it."""
    out_json, out_md = tmp_path / "b.json", tmp_path / "b.md"
    run = run_script("bench_attention", "--models", "ouro-1.4b", "--batch", "1", "--context", "64", "--repeats", "1",
                     "--copy-mb", "1", "--read-mb", "1", "--formats", "dense bf16", "[2,2,2,4] g32", "--json", out_json,
                     "--markdown", out_md)
    assert run.code == 0, run.err
    data = json.loads(out_json.read_text())
    impls = ["xla", "native"] if cpu_kernels.available() else ["xla"]
    assert data["impls"] == impls
    assert data["read_bandwidth"] > 0 and data["copy_bandwidth"] > 0
    assert "read bandwidth" in data["header"] and "read bandwidth" in run.out
    rows = data["rows"]
    assert [(r["format"], r["impl"]) for r in rows] == [(f, i) for f in ("dense bf16", "[2,2,2,4] g32") for i in impls]
    by = {(r["format"], r["impl"]): r for r in rows}
    for (label, impl), r in by.items():
        dense = by["dense bf16", impl]
        assert r["dense_impl"] == impl and r["speedup"] == pytest.approx(dense["ms"] / r["ms"])
        assert r["read_fraction"] == pytest.approx(r["bytes"] / (r["ms"] / 1e3) / data["read_bandwidth"])
        assert r["fallback"] is None  # the native kernels cover these formats at Ouro's head dim
        assert abs(by["[2,2,2,4] g32", impl]["byte_limit"] - 64 / 25.875) < 1e-9  # the byte budget
        assert by["dense bf16", impl]["bytes"] == 4 * 2 * 2 * 128 * 64 * 16
    table = out_md.read_text()
    assert "| impl |" in table and "| % read BW |" in table and "| % copy BW |" in table
    for impl in impls:
        assert f"| [2,2,2,4] g32 | {impl} |" in table


def test_bench_attention_drops_native_rows_when_unavailable(tmp_path, monkeypatch):
    """Without the native kernels one line says why; the native rows are dropped, the xla rows stay; with
    only native asked for, the run stops with that line."""
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    monkeypatch.setattr(cpu_kernels, "unavailable_reason", lambda: "not built in this test")
    out_json = tmp_path / "b.json"
    argv = ("--models", "ouro-1.4b", "--batch", "1", "--context", "16", "--repeats", "1", "--copy-mb", "1",
            "--read-mb", "1", "--formats", "dense bf16")
    run = run_script("bench_attention", *argv, "--impls", "native", "xla", "--json", out_json)
    assert run.code == 0, run.err
    assert "native is unavailable (not built in this test): its rows are dropped" in run.out
    rows = json.loads(out_json.read_text())["rows"]
    assert [(r["format"], r["impl"]) for r in rows] == [("dense bf16", "xla")]
    run = run_script("bench_attention", *argv, "--impls", "native")
    assert run.code == 1 and "no --impls left to run" in run.err
