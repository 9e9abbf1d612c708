"""Smoke test of scripts/bench_attention.py at a tiny shape (CPU: the XLA reference paths)."""

from __future__ import annotations

import json

from tests.conftest import run_script


def test_bench_attention_writes_table_and_json(tmp_path):
    out_json, out_md = tmp_path / "b.json", tmp_path / "b.md"
    run = run_script("bench_attention", "--models", "ouro-1.4b", "--batch", "1", "--context", "64", "--repeats", "1",
                     "--copy-mb", "1", "--formats", "dense bf16", "[2,2,2,4] g32", "--json", out_json,
                     "--markdown", out_md)
    assert run.code == 0, run.err
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["format"] for r in rows] == ["dense bf16", "[2,2,2,4] g32"]
    by = {r["format"]: r for r in rows}
    assert abs(by["[2,2,2,4] g32"]["byte_limit"] - 64 / 25.875) < 1e-9  # the byte budget
    assert by["dense bf16"]["bytes"] == 4 * 2 * 2 * 128 * 64 * 16
    assert "[2,2,2,4] g32" in out_md.read_text()
