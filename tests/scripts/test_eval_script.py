"""scripts/eval.py end to end on the shipped Ouro checkpoint (few examples, one OSCAR-calibrated scheme)."""

import importlib.util
import json
import pathlib

import pytest

from rq_jax import checkpoint
from rq_jax.cache import cache_nbytes, get_format, init_cache

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "eval.py"


def load_script():
    spec = importlib.util.spec_from_file_location("eval_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_eval_writes_the_table_json_and_figures(tmp_path):
    out = tmp_path / "ouro"
    load_script().main(["--model", "ouro", "--n", "3", "--retrieval-pairs", "2", "--text-windows", "1", "--batch", "4",
                        "--only", "[2,2,2,4] g32 oscar", "--rotations", "oscar", "--calibration-rows", "2",
                        "--out", str(out), "--no-progress"])
    result = json.loads(out.with_suffix(".json").read_text())
    rows = {r["scheme"]: r for r in result["rows"]}
    assert list(rows) == ["[2,2,2,4] g32 oscar"]
    model, _ = checkpoint.load(SCRIPT.parents[1] / "checkpoints" / "ouro-small")
    length = 256  # the text windows are the longest rows
    cache = init_cache(model.config, 1, length, get_format("residual", group_size=32))
    assert rows["[2,2,2,4] g32 oscar"]["bytes_per_token"] == cache_nbytes(cache) / length
    bits = float(get_format("residual", group_size=32).bits_per_element(4, model.config.head_dim))
    assert rows["[2,2,2,4] g32 oscar"]["bits_per_element"] == pytest.approx(bits)
    mixed = rows["[2,2,2,4] g32 oscar"]
    assert mixed["retrieval"]["kl"] > 0 and 0 <= mixed["addition"]["agreement"] <= 1
    assert len(result["kv_error"]["k_layer"]) == 4 and len(result["kv_error"]["k_layer"][0]) == model.config.num_layers
    cal = mixed["calibration"]  # OSCAR fitted on the calib split: per-head holdout losses before/after
    assert set(cal) == {"key_before", "key_after", "value_before", "value_after"} and cal["key_before"] > 0
    text = out.with_suffix(".md").read_text()
    assert f"| [2,2,2,4] g32 oscar | {bits:.3f} |" in text and "Calibrated rotations" in text
    for fig in ("_accuracy.png", "_kv_error.png"):
        assert (tmp_path / f"ouro{fig}").stat().st_size > 1000


def test_resume_keeps_finished_rows_and_rejects_other_settings(tmp_path, capsys):
    script = load_script()
    out = str(tmp_path / "t")
    small = ["--model", "ouro", "--n", "2", "--retrieval-pairs", "2", "--text-windows", "1", "--batch", "2",
             "--out", out, "--no-progress"]
    script.main(small + ["--only", "dense bf16"])
    first = json.loads(pathlib.Path(out + ".json").read_text())["rows"]
    assert "eval: dense bf16: addition" in capsys.readouterr().err  # the per-row line of --no-progress
    scored = []
    real = script.evaluate
    script.evaluate = lambda model, scheme, *a, **k: scored.append(scheme.label) or real(model, scheme, *a, **k)
    rows = script.main(small + ["--only", "dense bf16", "--only", "kivi", "--resume"])
    assert scored == ["kivi INT2"] and [r["scheme"] for r in rows] == ["dense bf16", "kivi INT2"]
    assert rows[0] == first[0]
    other_n = small[:3] + ["3"] + small[4:]
    with pytest.raises(SystemExit, match="--resume: .*'n': 2"):
        script.main(other_n + ["--only", "dense bf16", "--resume"])
