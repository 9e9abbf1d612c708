"""The report writer: tables, a run's JSON, resuming it, figures."""

import json

import pytest

from rq_jax import report


def test_table_lines():
    assert report.table(["a", "b"], [[1, "x"], [2.5, None]]) == ["| a | b |", "|---|---|", "| 1 | x |",
                                                                  "| 2.5 | None |"]


def test_run_round_trip_and_resume(tmp_path):
    prefix = tmp_path / "sub" / "run"
    settings = dict(model="m", n=3)
    path = report.write_run(prefix, dict(settings, command="x"), [dict(scheme="a", v=1)], kv_error=dict(k=2))
    assert path == f"{prefix}.json" and json.loads(open(path).read())["kv_error"] == dict(k=2)
    assert report.finished_rows(path, settings, key="scheme") == {"a": dict(scheme="a", v=1)}
    assert report.finished_rows(tmp_path / "none.json", settings, key="scheme") == {}
    with pytest.raises(report.SettingsMismatch, match=r"'n': \(3, 4\)"):
        report.finished_rows(path, dict(settings, n=4), key="scheme")


def test_read_run_names_a_bad_file(tmp_path):
    (tmp_path / "x.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="x.json is not a run"):
        report.read_run(tmp_path / "x.json")
    (tmp_path / "y.json").write_text("{")
    with pytest.raises(ValueError, match="y.json"):
        report.read_run(tmp_path / "y.json")


def test_save_figure(tmp_path):
    plt = report.pyplot()
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    report.save_figure(fig, tmp_path / "f" / "fig.png", dpi=50)
    assert (tmp_path / "f" / "fig.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not plt.get_fignums()
