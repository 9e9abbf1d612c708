"""scripts/kv_similarity.py run as a command line on the shipped Ouro: table, JSON and heatmap."""

import json
import shutil

import pytest

from tests.conftest import REPO, run_script


def test_report_on_the_shipped_ouro(tmp_path):
    out, ckpt = tmp_path / "sub" / "sim", tmp_path / "ouro"
    shutil.copytree(REPO / "checkpoints" / "ouro-small", ckpt)
    run = run_script("kv_similarity", "--checkpoint", ckpt, "--rows", "2", "--tasks", "addition", "--out", out,
                     "--card")
    assert run.code == 0, run.err
    data = json.loads(out.with_suffix(".json").read_text())["tasks"]["addition"]
    assert len(data["k_cos"]) == 4 and data["k_cos"][3] == [1.0, 1.0]  # the anchor against itself
    assert data["k_nmse_ratio"][3] == pytest.approx(1.0)  # the anchor row codes the anchor directly
    assert all(0 < r for r in data["k_nmse_ratio"][:3])
    assert out.with_suffix(".png").stat().st_size > 0 and "| loop | layer | K cos" in run.out
    assert out.with_suffix(".md").read_text() == run.out
    card = (ckpt / "README.md").read_text()
    assert card.startswith("# tiny ouro") and card.count("## Loop similarity") == 1
    assert f"| addition | 1 | {sum(data['k_cos'][0]) / 2:.3f} |" in card and "| addition | 4 |" not in card


def test_bad_tasks_are_named():
    run = run_script("kv_similarity", "--checkpoint", REPO / "checkpoints" / "ouro-small", "--tasks", "text",
                     "--out", "/tmp/x")
    assert run.code == 2 and "--tasks takes retrieval and/or addition, got 'text'" in run.err


def test_card_needs_a_local_folder():
    run = run_script("kv_similarity", "--checkpoint", "org/model", "--card", "--out", "/tmp/x")
    assert run.code == 2 and "--card writes into a local checkpoint folder; org/model is not one" in run.err
