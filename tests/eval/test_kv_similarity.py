"""rq_jax.eval.kv_similarity's pages on made-up figures: the Markdown tables, the model card's section
and how it replaces an earlier one, the heatmap's file."""

import numpy as np

from rq_jax.eval import kv_similarity

LOOPS, LAYERS = 4, 2


def figures(offset: float) -> dict:
    """`measure`'s keys with values that name their place: cos/rel = offset + loop / 10 + layer / 100."""
    sim = {k: [[offset + loop / 10 + layer / 100 for layer in range(LAYERS)] for loop in range(LOOPS)]
           for k in ("k_cos", "k_rel", "v_cos", "v_rel")}
    nmse = {f"{kind}_nmse_{w}": [(loop + 1) * 1e-3 * (2 if w == "direct" else 1) for loop in range(LOOPS)]
            for kind in "kv" for w in ("direct", "residual")}
    ratios = {f"{kind}_nmse_ratio": [0.5] * LOOPS for kind in "kv"}
    return sim | nmse | ratios


def test_markdown_has_a_row_per_loop_and_layer_and_one_per_loop():
    text = kv_similarity.markdown({"addition": figures(0.0), "retrieval": figures(0.5)}, "# header")
    lines = text.splitlines()
    assert lines[0] == "# header" and lines.count("## addition") == 1 and lines.count("## retrieval") == 1
    assert "| 2 | 1 | 0.110 | 0.110 | 0.110 | 0.110 |" in lines  # loop 2 (0.1), layer 1 (0.01)
    assert "| 4 | 0 | 0.800 | 0.800 | 0.800 | 0.800 |" in lines  # retrieval: offset 0.5
    assert "| 3 | 6.0 | 3.0 | 0.50 | 6.0 | 3.0 | 0.50 |" in lines  # NMSE ×10³, residual / direct
    assert sum(line.startswith("| loop | layer |") for line in lines) == 2


def test_card_section_leaves_out_the_anchor_loop():
    section = kv_similarity.card_section({"addition": figures(0.0)}, rows=8, seed=3)
    assert section.startswith("## Loop similarity\n") and "on 8 held-out rows per task (seed 3)" in section
    assert "| addition | 1 | 0.005 | 0.005 | 0.50 | 0.50 |" in section  # the mean over layers
    assert "| addition | 3 |" in section and "| addition | 4 |" not in section


def test_card_section_replaces_the_earlier_one(tmp_path):
    (tmp_path / "README.md").write_text("# m\n\n## Loop similarity\n\nold\n\n## Reproduce\n\ncmd\n")
    kv_similarity.write_card(str(tmp_path), "## Loop similarity\n\nnew\n")
    assert (tmp_path / "README.md").read_text() == "# m\n\n## Loop similarity\n\nnew\n\n## Reproduce\n\ncmd\n"
    kv_similarity.write_card(str(tmp_path / "empty"), "## Loop similarity\n\nnew\n")
    assert (tmp_path / "empty" / "README.md").read_text() == "## Loop similarity\n\nnew\n"
    (tmp_path / "README.md").write_text("# m\n")
    kv_similarity.write_card(str(tmp_path), "## Loop similarity\n\nnew\n")
    assert (tmp_path / "README.md").read_text() == "# m\n\n## Loop similarity\n\nnew\n"


def test_task_rows_are_held_out_rows_of_one_length():
    for task in kv_similarity.TASKS:
        rows = kv_similarity.task_rows(task, 3, 0)
        assert rows.shape[0] == 3 and np.array_equal(rows, kv_similarity.task_rows(task, 3, 0))


def test_heatmap_writes_its_figure(tmp_path):
    path = tmp_path / "sub" / "sim.png"
    kv_similarity.heatmap({"addition": figures(0.0)}, str(path))
    assert path.read_bytes()[:4] == b"\x89PNG"
