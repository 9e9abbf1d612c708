"""The benchmark and evaluation scripts run end to end on tiny shapes (smoke tests, not timings)."""

import importlib.util
import json
import pathlib

SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "scripts"


def run_script(name, argv):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(argv)


def test_bench_decode_writes_a_row_per_format(tmp_path):
    out = tmp_path / "bench.json"
    run_script("bench_decode", ["--context", "32", "--heads", "2", "--head-dim", "32", "--layers", "1",
                                "--repeats", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["format"] for r in rows][0] == "dense bf16" and len(rows) == 5
    assert all(r["ms"] > 0 for r in rows)
    assert rows[-1]["nbytes"] < rows[0]["nbytes"] / 3  # ResidualQuant vs dense bf16


def test_kv_error_table(tmp_path):
    from tests.conftest import fixture_dir

    out = tmp_path / "kv.json"
    run_script("kv_error", ["--checkpoint", str(fixture_dir("ouro-tiny")), "--group-size", "8", "--seq", "8",
                            "--json", str(out)])
    rows = {r["scheme"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["residual [2,2,2,4]"]["k_nmse"] < rows["uniform INT2"]["k_nmse"]
