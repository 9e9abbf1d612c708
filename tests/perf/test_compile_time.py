"""rq_jax.perf.compile_time without compiling: the depth configurations, and the rows and JSON of a run
(its measurement replaced by a rule)."""

from __future__ import annotations

import pytest

from rq_jax.config import preset
from rq_jax.perf import compile_time


@pytest.mark.parametrize("name, half, layers, plain, loops", [
    ("ouro-1.4b", False, 24, 0, 4), ("ouro-1.4b", True, 12, 0, 4),
    ("huginn-0125", False, 4, 4, 32), ("huginn-0125", True, 2, 2, 16),
])
def test_depth_config_keeps_the_depth_at_a_reduced_width(name, half, layers, plain, loops):
    c = compile_time.depth_config(name, half, 96, 32)
    assert (c.num_layers, c.num_plain_layers, c.num_loops) == (layers, plain, loops)
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.vocab_size) == \
        (96, 3, 3, 32, 192, 512)
    assert c.family == preset(name).family


def test_rows_pair_half_and_full_depth(monkeypatch):
    """Half then full depth per (model, format); the full row's ratio is its first call over the half's;
    the log is the table (before-figure beside the full row) and the JSON names every BEFORE figure."""
    monkeypatch.setattr(compile_time, "measure", lambda config, fmt, context, repeats: dict(
        first_s=config.num_layers / 4, step_ms=float(repeats)))
    logged = []
    rows = compile_time.depth_rows(["ouro-1.4b"], ["dense", "residual"], 64, 32, 8, 3, log=logged.append)
    assert [(r["format"], r["depth"], r["layers"], r["first_s"]) for r in rows] == [
        ("dense", "half", 12, 3.0), ("dense", "full", 24, 6.0), ("residual", "half", 12, 3.0),
        ("residual", "full", 24, 6.0)]
    assert [r.get("full_over_half") for r in rows] == [None, 2.0, None, 2.0]
    assert logged[0].startswith("width 64 (head dim 32), context 8, float32") and len(logged) == 6
    assert logged[3].split() == ["ouro-1.4b", "full", "dense", "6.00", "3.00", "28.0", "2.00"]
    out = compile_time.result(dict(width=64), rows)
    assert out["args"] == dict(width=64) and out["rows"] == rows
    assert {(b["model"], b["format"]): b["first_s"] for b in out["before"]} == compile_time.BEFORE
