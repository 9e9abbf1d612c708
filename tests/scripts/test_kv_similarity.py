"""scripts/kv_similarity.py run as a command line on the shipped Ouro: table, JSON and heatmap."""

import json
import runpy
import shutil
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


SCRIPT = runpy.run_path(str(REPO / "scripts" / "kv_similarity.py"))


def test_report_on_the_shipped_ouro(tmp_path, capsys):
    out, ckpt = tmp_path / "sub" / "sim", tmp_path / "ouro"
    shutil.copytree(REPO / "checkpoints" / "ouro-small", ckpt)
    run(["--checkpoint", str(ckpt), "--rows", "2", "--tasks", "addition", "--out", str(out), "--card"])
    data = json.loads(out.with_suffix(".json").read_text())["tasks"]["addition"]
    assert len(data["k_cos"]) == 4 and data["k_cos"][3] == [1.0, 1.0]  # the anchor against itself
    assert data["k_nmse_ratio"][3] == pytest.approx(1.0)  # the anchor row codes the anchor directly
    assert all(0 < r for r in data["k_nmse_ratio"][:3])
    assert out.with_suffix(".png").stat().st_size > 0 and "| loop | layer | K cos" in capsys.readouterr().out
    card = (ckpt / "README.md").read_text()
    assert card.startswith("# tiny ouro") and card.count("## Loop similarity") == 1
    assert f"| addition | 1 | {sum(data['k_cos'][0]) / 2:.3f} |" in card and "| addition | 4 |" not in card


def test_card_section_replaces_the_earlier_one(tmp_path):
    (tmp_path / "README.md").write_text("# m\n\n## Loop similarity\n\nold\n\n## Reproduce\n\ncmd\n")
    SCRIPT["write_card"](str(tmp_path), "## Loop similarity\n\nnew\n")
    assert (tmp_path / "README.md").read_text() == "# m\n\n## Loop similarity\n\nnew\n\n## Reproduce\n\ncmd\n"


def test_bad_tasks_are_named(capsys):
    with pytest.raises(SystemExit) as exit:
        run(["--checkpoint", str(REPO / "checkpoints" / "ouro-small"), "--tasks", "text", "--out", "/tmp/x"])
    assert exit.value.code == 2 and "--tasks takes retrieval and/or addition, got 'text'" in capsys.readouterr().err


def test_card_needs_a_local_folder(capsys):
    with pytest.raises(SystemExit) as exit:
        run(["--checkpoint", "org/model", "--card", "--out", "/tmp/x"])
    assert exit.value.code == 2 and "--card writes into a local checkpoint folder; org/model is not one" in \
        capsys.readouterr().err
