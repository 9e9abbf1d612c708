"""The benchmark and evaluation scripts run end to end on tiny shapes (smoke tests, not timings)."""

import importlib.util
import json
import math
import pathlib

from rq_jax.cache import get_format

SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "scripts"


def run_script(name, argv):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(argv)


def test_bench_decode_rows_match_the_accounting(tmp_path):
    """One row per format, finite positive times, and bytes equal to the toolbox's bits per element
    (kivi adds its full-precision open key group: bf16 [L, N, B, K, g, D])."""
    out = tmp_path / "bench.json"
    run_script("bench_decode", ["--context", "32", "--heads", "2", "--head-dim", "32", "--layers", "1",
                                "--repeats", "1", "--json", str(out)])
    rows = {r["format"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["dense bf16", "uniform INT2", "rotated INT2", "kivi INT2", "residual [2,2,2,4]"]
    assert all(math.isfinite(r["ms"]) and r["ms"] > 0 for r in rows.values())
    elements = 2 * 4 * 1 * 1 * 2 * 33 * 32  # K and V · loops · layers · batch · kv heads · positions · D
    for label, name in (("dense bf16", "dense"), ("uniform INT2", "uniform"), ("rotated INT2", "rotated"),
                        ("residual [2,2,2,4]", "residual")):
        assert rows[label]["nbytes"] == get_format(name).bits_per_element(4, 32) * elements / 8, label
    # kivi at its defaults (R = 128 full-precision tokens, fp16): a 33-token context is all full precision.
    s, d = 33, 32
    assert rows["kivi INT2"]["nbytes"] == 4 * 2 * 2 * s * d * 2  # loops · kv heads · (K, V) · S · D · fp16


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
    assert rows["residual [2,2,2,4]"]["k_nmse"] < rows["uniform INT2"]["k_nmse"]
