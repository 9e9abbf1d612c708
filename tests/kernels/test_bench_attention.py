"""Smoke test of scripts/bench_attention.py at a tiny shape (CPU: the XLA reference paths)."""

from __future__ import annotations

import importlib.util
import json
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_bench_attention_writes_table_and_json(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_attention", REPO / "scripts" / "bench_attention.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out_json, out_md = tmp_path / "b.json", tmp_path / "b.md"
    bench.main(["--models", "ouro-1.4b", "--batch", "1", "--context", "64", "--repeats", "1", "--copy-mb", "1",
                "--formats", "dense bf16", "[2,2,2,4] g32",
                "--json", str(out_json), "--markdown", str(out_md)])
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["format"] for r in rows] == ["dense bf16", "[2,2,2,4] g32"]
    by = {r["format"]: r for r in rows}
    assert abs(by["[2,2,2,4] g32"]["byte_limit"] - 64 / 25.875) < 1e-9  # the byte budget
    assert by["dense bf16"]["bytes"] == 4 * 2 * 2 * 128 * 64 * 16
    assert "[2,2,2,4] g32" in out_md.read_text()
