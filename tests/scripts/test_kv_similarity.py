"""scripts/kv_similarity.py run as a command line on the shipped Ouro: table, JSON and heatmap."""

import json
import runpy
import sys

import pytest

from tests.conftest import REPO


def run(argv):
    old = sys.argv
    sys.argv = ["kv_similarity.py", *argv]
    try:
        runpy.run_path(str(REPO / "scripts" / "kv_similarity.py"), run_name="__main__")
    finally:
        sys.argv = old


def test_report_on_the_shipped_ouro(tmp_path, capsys):
    out = tmp_path / "sub" / "sim"
    run(["--checkpoint", str(REPO / "checkpoints" / "ouro-small"), "--rows", "2", "--tasks", "addition",
         "--out", str(out)])
    data = json.loads(out.with_suffix(".json").read_text())["tasks"]["addition"]
    assert len(data["k_cos"]) == 4 and data["k_cos"][3] == [1.0, 1.0]  # the anchor against itself
    assert data["k_nmse_ratio"][3] == pytest.approx(1.0)  # the anchor row codes the anchor directly
    assert all(0 < r for r in data["k_nmse_ratio"][:3])
    assert out.with_suffix(".png").stat().st_size > 0 and "| loop | layer | K cos" in capsys.readouterr().out


def test_bad_tasks_are_named(capsys):
    with pytest.raises(SystemExit) as exit:
        run(["--checkpoint", str(REPO / "checkpoints" / "ouro-small"), "--tasks", "text", "--out", "/tmp/x"])
    assert exit.value.code == 2 and "--tasks takes retrieval and/or addition, got 'text'" in capsys.readouterr().err
