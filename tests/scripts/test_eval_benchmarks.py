"""scripts/eval_benchmarks.py run as a command line on a shipped model: a GSM8K-schema file of held-out
additions through dense bf16 and a residual cache scores exactly eval.py's exact match (through the library,
on the same problems); the table, JSON, figure and completion files; resume after a kill; HumanEval."""

import json
import shutil

import numpy as np
import pytest

from rq_jax import checkpoint
from rq_jax.cache.dense import Dense
from rq_jax.cache.schemes import pick
from rq_jax.data import Addition, decode
from rq_jax import scoring
from tests.conftest import REPO, run_script

N = 24
SCHEMES = ["dense bf16", "+rotation g32"]  # residual INT2 g32, Hadamard: the tiny models lose some sums to it
#: Ouro alone: the script has no per-family code, and Huginn through the same engine is the server tests' model.
MODELS = {"ouro": "ouro-small"}


def run(argv):
    result = run_script("eval_benchmarks", *argv)
    assert result.code == 0, result.err
    return result


def refused(argv, message):
    """A bad command line: exit status 2 and one line `eval_benchmarks.py: error: ...` naming the problem."""
    result = run_script("eval_benchmarks", *argv)
    assert result.code == 2 and result.out == "", result
    lines = result.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("eval_benchmarks.py: error: ") and message in lines[0], lines


def records(prefix, label):
    path = prefix.parent / f"{prefix.name}_completions" / f"{label}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def additions(tmp_path_factory):
    """N held-out additions (the eval split) as GSM8K rows in the models' own format: the question is the
    prompt ("62217+89000="), the answer "#### " and the reversed-digit sum."""
    examples = Addition().examples("eval", N, 0)
    path = tmp_path_factory.mktemp("data") / "additions.jsonl"
    path.write_text("".join(json.dumps({"question": decode(e.prompt(1)).decode(),
                                        "answer": "#### " + decode(e.answer(1)).decode().strip()}) + "\n"
                            for e in examples))
    return path, examples


def gsm8k_args(model, data, out, *extra):
    """Two slots: requests still share a batch, and each row compiles only rows 1 and 2 of its programs."""
    return ["--model", model, "--benchmark", "gsm8k", "--data", str(data), "--prompt-format", "raw",
            "--max-new-tokens", "8", "--max-slots", "2", "--chunk", "16", "--schemes", *SCHEMES, "--out", str(out),
            "--no-progress", *extra]


@pytest.fixture(scope="module")
def runs(additions, tmp_path_factory):
    out = {}
    for model in MODELS:
        out[model] = tmp_path_factory.mktemp(model) / "gsm8k"
        run(gsm8k_args(model, additions[0], out[model]))
    return out


@pytest.mark.parametrize("model", MODELS)
def test_accuracy_is_eval_exact_match(model, runs, additions):
    """Each problem's score equals its greedy exact match through the same cache in the eval loop
    (`rq_jax.scoring`, which scripts/eval.py's table runs), for dense bf16 and the residual cache."""
    net, _ = checkpoint.load(REPO / "checkpoints" / MODELS[model])
    (residual,) = pick([SCHEMES[1]])
    scorer = scoring.CacheScorer(net, residual.fmt, reference=Dense("bfloat16"))
    scores, _, answer_id = scoring.score_examples(scorer, additions[1], Addition().length, batch=N)
    exact = scoring.answers(scores, answer_id)
    data = json.loads(runs[model].with_suffix(".json").read_text())
    rows = {r["scheme"]: r for r in data["rows"]}
    for label, want in (("dense-bf16", exact.ref_correct), ("rotation-g32", exact.correct)):
        got = {r["id"]: r["score"] for r in records(runs[model], label)}
        assert [got[str(i)] for i in range(N)] == [float(x) for x in want], label
    assert rows["dense bf16"]["accuracy"] == np.mean(exact.ref_correct)
    assert rows[SCHEMES[1]]["accuracy"] == np.mean(exact.correct) < 1  # some sums lost: a real comparison
    assert data["meta"]["problems"] == N and data["meta"]["family"] == model


def test_table_json_figure_and_completions(runs):
    prefix = runs["ouro"]
    rows = json.loads(prefix.with_suffix(".json").read_text())["rows"]
    dense, residual = rows
    assert dense["accuracy_diff"] == 0 and dense["agreement"] == 1
    assert residual["bits_per_element"] == pytest.approx(2.6875)  # INT2 g32 + fp8 meta + bf16 α at head_dim 64
    assert residual["bytes_per_token"] / residual["dense_bytes_per_token"] == pytest.approx(2.6875 / 16)
    assert residual["agreement"] < 1 and residual["accuracy_diff_lo"] <= residual["accuracy_diff"] <= 0
    assert residual["tokens_per_s"] > 0 and residual["compile_seconds"] > 0 and residual["resumed"] == 0
    for r in records(prefix, "rotation-g32"):
        assert set(r) >= {"id", "text", "tokens", "score", "reason", "answer", "finish_reason", "session"}
        assert r["finish_reason"] == "stop" and r["session"] == 1 and 1 <= len(r["tokens"]) <= 8
        assert (r["score"] == 1) == (r["reason"] == "passed")
    table = prefix.with_suffix(".md").read_text()
    assert "| Setting | Method | scheme | GSM8K % | Δ vs BF16 (95% CI) |" in table
    assert f"| BF16 | — | dense bf16 | {100 * dense['accuracy']:.2f} | — | 1.000 |" in table
    assert (prefix.parent / "gsm8k_accuracy.png").stat().st_size > 0


def test_resume_after_a_kill_generates_only_the_rest(runs, additions, tmp_path):
    """A run killed in its second row (dense finished, 5 residual answers saved, a sixth half written) and
    resumed keeps every saved answer and generates the other 19; resuming the finished run generates and
    scores nothing; other settings are refused."""
    prefix = tmp_path / "gsm8k"
    shutil.copytree(runs["ouro"].parent / "gsm8k_completions", tmp_path / "gsm8k_completions")
    full = {label: records(runs["ouro"], label) for label in ("dense-bf16", "rotation-g32")}
    residual = tmp_path / "gsm8k_completions" / "rotation-g32.jsonl"
    lines = residual.read_text().splitlines(keepends=True)
    residual.write_text("".join(lines[:5]) + lines[5][:20])
    meta = json.loads(runs["ouro"].with_suffix(".json").read_text())
    prefix.with_suffix(".json").write_text(json.dumps(dict(meta=meta["meta"], rows=meta["rows"][:1])))
    err = run(gsm8k_args("ouro", additions[0], prefix, "--resume")).err
    assert "dense bf16: " in err and f"of {N}, 0 generated" in err and f"of {N}, {N - 5} generated" in err
    again = records(prefix, "rotation-g32")
    assert again[:5] == full["rotation-g32"][:5] and {r["session"] for r in again[5:]} == {2}
    assert sorted(r["id"] for r in again) == sorted(str(i) for i in range(N))
    assert records(prefix, "dense-bf16") == full["dense-bf16"]
    # greedy answers do not depend on which requests share the batch: the same scores as the full run
    assert {r["id"]: r["score"] for r in again} == {r["id"]: r["score"] for r in full["rotation-g32"]}
    before = residual.read_text()
    err = run(gsm8k_args("ouro", additions[0], prefix, "--resume")).err
    assert err.count(f"of {N}, 0 generated") == 2 and residual.read_text() == before
    refused([*gsm8k_args("ouro", additions[0], prefix, "--resume"), "--max-new-tokens", "9"],
            "argument --resume: ")
    assert residual.read_text() == before


def test_humaneval_through_a_tiny_model(tmp_path):
    """HumanEval's real problems in the paper's prompt format through the shipped Ouro, which knows only
    sums, with bfloat16 weights and compute (the paper's): every completion is generated, cleaned, run in
    the sandbox and failed, without a crash."""
    prefix = tmp_path / "he"
    run(["--model", "ouro", "--benchmark", "humaneval", "--n", "2", "--max-new-tokens", "8", "--schemes",
         "dense bf16", "--chunk", "32", "--dtype", "bfloat16", "--param-dtype", "bfloat16", "--out", str(prefix),
         "--no-progress"])
    got = records(prefix, "dense-bf16")
    assert [r["id"] for r in got] == ["HumanEval/0", "HumanEval/1"]
    assert all(r["score"] == 0 and r["reason"].startswith("failed") for r in got)
    assert all(r["prompt_tokens"] > 300 for r in got)  # EvalPlus's instruction and the open code fence
    data = json.loads(prefix.with_suffix(".json").read_text())
    row = data["rows"][0]
    assert row["accuracy"] == 0 and row["n"] == 2
    assert (data["meta"]["dtype"], data["meta"]["param_dtype"]) == ("bfloat16", "bfloat16")
    assert "| BF16 | — | dense bf16 | 0.00 |" in prefix.with_suffix(".md").read_text()


def test_bad_options_are_one_line_before_any_work(tmp_path, additions):
    """Each bad option is refused in one line naming it, before the output folder is created."""
    data = additions[0]
    out = tmp_path / "new" / "x"
    refused(["--model", "ouro", "--benchmark", "gsm8k", "--out", str(out)], "argument --data: --benchmark gsm8k needs")
    refused(gsm8k_args("ouro", data, out, "--schemes", "INT3"), "argument --schemes: unknown scheme 'INT3'")
    refused(gsm8k_args("ouro", data, out, "--top-p", "0"), "argument --top-p: must lie in (0, 1]")
    refused(gsm8k_args("ouro", data, out, "--temperature", "-1"), "argument --temperature: must be ≥ 0")
    refused(gsm8k_args("ouro", data, out, "--memory-gb", "nan"), "argument --memory-gb: must be a finite number")
    refused(gsm8k_args("ouro", data, out, "--memory-gb", "1e-6"), "argument --memory-gb: 1e-06 GiB holds no")
    refused(gsm8k_args("ouro", data, out, "--max-new-tokens", "2044"),
            "argument --max-new-tokens: the longest prompt (12 tokens) plus 2044 new tokens needs 2055 positions, "
            "more than the model's 2048")
    refused(["--model", "huginn", "--benchmark", "gsm8k", "--data", str(data), "--out", str(out)],  # the default format
            "argument --prompt-format: the paper prompts (8 shots) are up to 2143 tokens; with 1024 new tokens they "
            "need 3166 positions, more than the model's 2048: use --prompt-format raw")
    refused(gsm8k_args("ouro", data, out, "--init-state", "zeros"), "argument --init-state: Huginn's option")
    refused(gsm8k_args("huginn", data, out, "--checkpoint", str(REPO / "checkpoints" / "ouro-small")),
            "argument --model: huginn, but --checkpoint")
    refused(gsm8k_args("ouro", tmp_path / "none.jsonl", out), "argument --data: ")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1=", "answer": "2"}\n')
    refused(gsm8k_args("ouro", bad, out), "argument --data: ")
    refused(gsm8k_args("ouro", data, out, "--mesh", "data=3"), "argument --mesh: ")
    refused(gsm8k_args("ouro", data, out, "--schedule", str(bad)), "argument --schedule: ")
    assert not out.parent.exists()
    blocked = tmp_path / "file"
    blocked.write_text("")
    refused(gsm8k_args("ouro", data, blocked / "x"), "argument --out: cannot create")
    refused(["--combine", str(bad), "--out", str(out)], "argument --combine: ")
    assert not out.parent.exists()


def test_help_shows_the_defaults():
    text = run(["--help"]).out
    assert "(default: 64)" in text and "(default: paper)" in text and "(default: 256)" in text
