"""The benchmark and evaluation scripts run end to end on tiny shapes (smoke tests, not timings)."""

import importlib.util
import json
import math
import pathlib

from rq_jax.cache import get_format

SCRIPTS = pathlib.Path(__file__).resolve().parents[2] / "scripts"


def run_script(name, argv):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(argv)


def test_bench_decode_rows_bytes_ratios_and_budget(tmp_path):
    """Every requested row; cache bytes equal `cache_nbytes` of a cache built the same way; ratios follow
    the bytes and times of the same run; the largest batch's compiled step fits the budget and the next
    batch's does not. Also the byte limits at Ouro-1.4B's shape (no compile)."""
    import pytest

    from rq_jax.cache import cache_nbytes, init_cache
    from rq_jax.config import ModelConfig, preset
    from rq_jax.memory import byte_limits

    tiny = ("ouro-1.4b:num_layers=1,hidden_size=64,num_heads=2,num_kv_heads=2,head_dim=32,intermediate_size=128,"
            "vocab_size=256")
    out = tmp_path / "bench"
    run_script("bench_decode", ["--models", tiny, "--formats", "dense bf16", "direct INT2 g32", "--context", "40",
                                "--batch", "1", "--memory-gb", "0.004", "--repeats", "1", "--out", str(out)])
    data = json.loads(out.with_suffix(".json").read_text())
    assert "## Largest batch in 0.004 GiB" in out.with_suffix(".md").read_text()
    config = ModelConfig(**data["models"]["ouro-1.4b"]["config"])
    names = {"dense bf16": "dense", "direct INT2 g32": "uniform"}
    rows = {(r["format"], r["batch"]): r for r in data["rows"]}
    assert sorted(rows) == sorted((f, 1) for f in names)
    for (label, batch), r in rows.items():
        fmt = get_format(names[label])
        dense = rows["dense bf16", batch]
        assert r["cache_nbytes"] == cache_nbytes(init_cache(config, batch, 41, fmt)) == r["memory"]["cache"]
        assert r["ms"] > 0 and r["tok_s"] == pytest.approx(batch / (r["ms"] / 1e3))
        assert r["bytes_x_dense"] == dense["cache_nbytes"] / r["cache_nbytes"]
        assert r["tok_s_x_dense"] == r["tok_s"] / dense["tok_s"]
        assert r["storage_limit"] == pytest.approx(16 / float(fmt.bits_per_element(4, 32)))
    assert rows["direct INT2 g32", 1]["bytes_x_dense"] == pytest.approx(rows["direct INT2 g32", 1]["storage_limit"])
    budget = {r["format"]: r for r in data["budget_rows"]}
    assert sorted(budget) == sorted(names) and data["budget"] == int(0.004 * 2**30)
    for label, r in budget.items():
        assert r["max_batch"] >= 1 and r["next_batch"] == r["max_batch"] + 1
        assert r["memory"]["total"] <= data["budget"] < r["next_memory"]["total"]
        assert r["memory"]["cache"] == cache_nbytes(init_cache(config, r["max_batch"], 41, get_format(names[label])))
        assert r["peak_tok_s"] > 0
        assert r["batch_x_dense"] == r["max_batch"] / budget["dense bf16"]["max_batch"]
        assert r["peak_x_dense"] == r["peak_tok_s"] / budget["dense bf16"]["peak_tok_s"]
    # The limits at Ouro-1.4B: [2,2,2,4] stores 3.09 bits and reads 6.47 (each residual loop reads the anchor).
    limits = byte_limits(get_format("residual"), preset("ouro-1.4b"), 4096)
    assert limits["storage_bits"] == 3.09375 and limits["read_limit"] == pytest.approx(64 / 25.875)


def test_bench_compile_table(tmp_path):
    out = tmp_path / "compile.json"
    run_script("bench_compile", ["--models", "ouro-1.4b", "--formats", "dense", "--width", "32", "--head-dim", "16",
                                 "--context", "8", "--repeats", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["depth"], r["layers"], r["loops"]) for r in rows] == [("half", 12, 4), ("full", 24, 4)]
    assert all(math.isfinite(r["first_s"]) and r["first_s"] > 0 and r["step_ms"] > 0 for r in rows)
    assert rows[1]["full_over_half"] == rows[1]["first_s"] / rows[0]["first_s"]


def test_kv_error_table(tmp_path):
    from tests.conftest import fixture_dir

    out = tmp_path / "kv.json"
    run_script("kv_error", ["--checkpoint", str(fixture_dir("ouro-tiny")), "--group-size", "8", "--seq", "8",
                            "--json", str(out)])
    rows = {r["scheme"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["[2,2,2,4] g8"]["k_nmse"] < rows["direct INT2 g8"]["k_nmse"]
