"""scripts/eval.py run as its command line on the shipped Ouro checkpoint (few examples, one
OSCAR-calibrated scheme): the table, JSON and figures it writes, its progress bar, --resume, bad options."""

import json
import re

import pytest

from rq_jax import checkpoint
from rq_jax.cache import cache_nbytes, get_format, init_cache
from rq_jax.cache.schemes import table_schemes
from tests.conftest import SHIPPED, run_script


def test_eval_writes_the_table_json_and_figures(tmp_path):
    """Into a folder that does not exist yet (created before any work)."""
    out = tmp_path / "results" / "ouro"
    run = run_script("eval", "--model", "ouro", "--n", "3", "--retrieval-pairs", "2", "--text-windows", "1",
                     "--batch", "4", "--only", "[2,2,2,4] g32 oscar", "--rotations", "oscar", "--calibration-rows", "2",
                     "--out", out, "--no-progress")
    assert run.code == 0, run.err
    result = json.loads(out.with_suffix(".json").read_text())
    rows = {r["scheme"]: r for r in result["rows"]}
    assert list(rows) == ["[2,2,2,4] g32 oscar"]
    model, _ = checkpoint.load(SHIPPED / "ouro-small")
    length = 256  # the text windows are the longest rows
    cache = init_cache(model.config, 1, length, get_format("residual", group_size=32))
    assert rows["[2,2,2,4] g32 oscar"]["bytes_per_token"] == cache_nbytes(cache) / length
    bits = float(get_format("residual", group_size=32).bits_per_element(4, model.config.head_dim))
    assert rows["[2,2,2,4] g32 oscar"]["bits_per_element"] == pytest.approx(bits)
    mixed = rows["[2,2,2,4] g32 oscar"]
    assert mixed["retrieval"]["kl"] > 0 and 0 <= mixed["addition"]["agreement"] <= 1
    assert len(result["kv_error"]["k_layer"]) == 4 and len(result["kv_error"]["k_layer"][0]) == model.config.num_layers
    cal = mixed["calibration"]  # OSCAR fitted on the calib split: per-head holdout losses before/after
    assert set(cal) == {"fitted", "key_before", "key_after", "value_before", "value_after"} and cal["key_before"] > 0
    text = out.with_suffix(".md").read_text()
    assert f"| [2,2,2,4] g32 oscar | {bits:.3f} |" in text and "Calibrated rotations" in text and text in run.out
    for fig in ("_accuracy.png", "_kv_error.png"):
        assert (out.parent / f"ouro{fig}").stat().st_size > 1000


def test_progress_counts_answers_and_resume_keeps_finished_rows(tmp_path):
    """The bar's total is the answers of every row (2 sums + 2 retrieval queries + 1 text window per
    row here) and it advances as batches finish; --resume scores only the rows the JSON lacks (here a
    table row and a --rivals row) and refuses a JSON written with other settings."""
    out = tmp_path / "t"
    small = ["--model", "ouro", "--n", "2", "--retrieval-pairs", "2", "--text-windows", "1", "--batch", "2",
             "--out", out]
    first = run_script("eval", *small, "--only", "dense bf16")
    assert first.code == 0, first.err
    counts = [int(n) for n in re.findall(r"\| *(\d+)/5 \[", first.err)]
    assert counts[0] == 0 and counts[-1] == 5 and counts == sorted(counts) and set(counts) <= {0, 2, 4, 5}
    assert "answer" in first.err
    kept = json.loads(out.with_suffix(".json").read_text())["rows"]
    again = run_script("eval", *small, "--only", "dense bf16", "--only", "kivi", "--rivals", "--only",
                       "turboquant_3bit", "--resume", "--no-progress", "--compare", "dense bf16")
    assert again.code == 0, again.err
    assert "Against `dense bf16`: accuracy difference in points, paired on the same answers" in again.out
    assert re.search(r"\| kivi INT2 \| [\d.]+ \| [+-]\d+\.\d \([+-]\d+\.\d, [+-]\d+\.\d\) \| ", again.out), again.out
    scored = ["kivi INT2", "vLLM turboquant_3bit_nc"]  # a rival's row (--rivals) beside the table's
    assert re.findall(r"eval: (.*?): addition", again.err) == scored  # one line per row scored
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["scheme"] for r in rows] == ["dense bf16", *scored] and rows[0] == kept[0]
    other_n = small[:3] + ["3"] + small[4:]
    refused = run_script("eval", *other_n, "--only", "dense bf16", "--resume")
    assert refused.code == 2 and "eval.py: error: argument --resume: " in refused.err and "'n': (2, 3)" in refused.err


def test_a_schedules_row_with_its_calibration_and_compared_by_its_label(tmp_path):
    """`--only allocated` keeps the --schedule rows alone (their label: "allocated" and the file's name);
    with --calibration the schedule's row reads the artifact calibrate.py --schedule fitted for it (label
    suffixed with the method), and --compare names it by its label before the suffix."""
    from rq_jax.calibrate.allocate import Schedule, save_schedule

    path = tmp_path / "mine.json"
    save_schedule(str(path), Schedule(((4, 64), (2, 64), (2, 64), (4, 32)), ((2, 32),) * 4), {}, {})
    fit = run_script("calibrate", "--checkpoint", SHIPPED / "ouro-small", "--schedule", path, "--method", "oscar",
                     "--fit-rows", "2", "--holdout-rows", "2", "--seq-len", "40", "--query-len", "16", "--quiet",
                     "--out", tmp_path / "cal" / "art")
    assert fit.code == 0, fit.err
    run = run_script("eval", "--model", "ouro", "--n", "2", "--retrieval-pairs", "2", "--text-windows", "1",
                     "--batch", "2", "--schedule", path, "--only", "allocated", "--calibration", tmp_path / "cal",
                     "--compare", "allocated mine", "--no-progress", "--out", tmp_path / "t")
    assert run.code == 0, run.err
    assert [r["scheme"] for r in json.loads((tmp_path / "t.json").read_text())["rows"]] == ["allocated mine oscar"]
    assert "Against `allocated mine oscar`: accuracy difference in points" in run.out


@pytest.mark.parametrize("argv,message", [
    (["--n", "0"], "argument --n: must be a positive integer, got 0"),
    (["--batch", "nan"], "argument --batch: invalid positive_int value: 'nan'"),
    (["--group-sizes", "32,x"], "argument --group-sizes: must be comma-separated integers"),
    (["--group-sizes", "32,24"], "argument --group-sizes: 24 does not divide the model's head_dim 64"),
    (["--rotations", "pca"], "argument --rotations: pca; the methods are"),
    (["--only", "no such scheme"], "argument --only: no such scheme matches no scheme; the labels are dense bf16"),
    (["--mesh", "data=3"], "argument --mesh: "),
    (["--only", "kivi", "--compare", "dense bf16"], "argument --compare: dense bf16 is not a row of this run"),
    (["--checkpoint", SHIPPED / "huginn-small"], "argument --model: ouro, but --checkpoint"),
    (["--out", "/proc/nope/x"], "argument --out: cannot create /proc/nope"),
])
def test_eval_rejects_bad_options_in_one_line(argv, message, tmp_path):
    argv = ["--model", "ouro", "--out", tmp_path / "x", *argv]
    run = run_script("eval", *argv)
    assert run.code == 2 and run.err.startswith("eval.py: error: ") and run.err.count("\n") == 1, run.err
    assert message in run.err


def test_eval_help_lists_the_only_labels_and_the_default_checkpoints():
    run = run_script("eval", "--help")
    text = " ".join(run.out.split())
    assert run.code == 0 and ", ".join(s.label for s in table_schemes((32, 16))) in text
    assert "checkpoints/ouro-small" in text and "(default: 1000)" in text
