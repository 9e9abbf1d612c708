"""pallas_kernels.report without compiling: the launch table written as Python and JSON, the Markdown
report, a report's failed classes, and the sweep's and refit's candidate order (compiles replaced by a
rule)."""

from __future__ import annotations

import json

import pytest

from pallas_kernels import configs, deviceless, launch, report

TARGETS = list(deviceless.TARGETS.values())


def rule_row(fits):
    """A `compile_row` stand-in: clean where `fits(cfg, cand)`, else spilling; every call kept in `.calls`."""

    def row(cfg, target, cache, cand=None):
        row.calls.append((cfg.name, target.name, cand))
        ok = fits(cfg, cand)
        return dict(config=cfg.name, target=target.name, block_s=cand.block_s, block_r=16, num_warps=cand.num_warps,
                    num_stages=2, shared=0, registers=255, spill_stores=0 if ok else 8, spill_loads=0 if ok else 4,
                    tensor_cores="mma", blocks_per_sm=1, seconds=0.0, ok=ok, problems=[] if ok else ["spills"])

    row.calls = []
    return row


def test_table_source_is_the_table_as_python():
    """The shipped launch.TABLE written out and read back is itself; a class without a clean launch is left
    out of the source and kept as null in the JSON."""
    names = {"LaunchKey": launch.LaunchKey, "Launch": launch.Launch}
    exec(report.table_source(launch.TABLE), names)
    assert names["TABLE"] == launch.TABLE
    none = launch.LaunchKey("residual", 128, 4, 16, 64)
    table = {none: None, launch.LaunchKey("dense-bfloat16", 64, 0, 0, 16): launch.Launch(64, 4, 2, 16)}
    assert report.table_source(table, "OVERRIDES").splitlines() == [
        "OVERRIDES: dict[LaunchKey, Launch] = {",
        "    LaunchKey('dense-bfloat16', 64, 0, 0, 16): Launch(64, 4, 2, 16, False),", "}"]
    assert report.table_json(table) == [[["dense-bfloat16", 64, 0, 0, 16], [64, 4, 2, 16, False]],
                                        [list(none), None]]


def test_markdown_and_summary():
    """One line per configuration, the targets side by side; a spill in bold, a failed compile named, a
    target not compiled a dash; the summary counts the clean compiles and names each failure."""
    versions = dict(triton="3", ptxas="12", jax="0.1", jaxlib="0.1")
    base = dict(block_s=32, block_r=16, num_warps=4, num_stages=2, shared=2048, registers=128, spill_stores=0,
                spill_loads=0, tensor_cores="mma", blocks_per_sm=3, ok=True, problems=[])
    rows = [dict(base, config="a", target="sm_90"), dict(base, config="a", target="sm_80", spill_stores=8,
                                                         spill_loads=4, ok=False, problems=["spills 8 B"]),
            dict(config="b", target="sm_90", block_s=16, block_r=16, num_warps=8, num_stages=2, ok=False,
                 problems=["does not compile: boom"])]
    text = report.markdown(rows, versions)
    assert text.startswith("Triton 3 (ptxas 12), jax 0.1, jaxlib 0.1.")
    assert text.splitlines()[-3:] == [
        "|---|---|---|---|",
        "| a | 32 · 16 · 4 · 2 | 2.0 KB · 128 · 0 / 0 · mma · 3 | 2.0 KB · 128 · **8 / 4** · mma · 3 |",
        "| b | 16 · 16 · 8 · 2 | **does not compile** | — |"]
    assert report.summary(rows).splitlines() == ["3 compiles, 1 clean", "  a (sm_80): spills 8 B",
                                                 "  b (sm_90): does not compile: boom"]


def test_failed_keys_of_a_report(tmp_path):
    path = tmp_path / "report.json"
    a, b = configs.MATRIX[0], next(c for c in configs.MATRIX if c.launch_key() != configs.MATRIX[0].launch_key())
    path.write_text(json.dumps(dict(rows=[dict(config=a.name, ok=True), dict(config=b.name, ok=False),
                                          dict(config=b.name, ok=False)])))
    assert report.failed_keys(path) == [b.launch_key()]
    path.write_text('{"rows": [{"ok": false}]}')
    with pytest.raises(ValueError, match="not a kernel_report.py JSON report \\(KeyError"):
        report.failed_keys(path)


def test_sweep_bounds_a_larger_class_by_a_smaller_one(monkeypatch):
    """Within a family the smaller head dim is swept first; its clean block_s bounds the larger class's
    candidates (64 is not tried at D128 once D64 chose 32), and each candidate stops at its first failing
    target."""
    row = rule_row(lambda cfg, cand: cand.block_s <= 32)
    monkeypatch.setattr(report, "compile_row", row)
    small, large = (launch.LaunchKey("residual", d, 2, 32, 16) for d in (64, 128))
    out = report.sweep([large, small], TARGETS, None, log=lambda line: None)
    chosen = launch.Launch(32, 4, 2, 16)
    assert out["table"] == {small: chosen, large: chosen}
    tried = [(name.split("-")[1], t, c.block_s) for name, t, c in row.calls]
    assert tried == [("d64", "sm_90", 64), ("d64", "sm_90", 32), ("d64", "sm_80", 32),
                     ("d128", "sm_90", 32), ("d128", "sm_80", 32)]
    assert [r["key"] for r in out["rows"]] == [list(small)] * 3 + [list(large)] * 2


@pytest.mark.parametrize("heavy_fits, chosen", [
    (lambda c: c.block_s == 16 and c.num_warps == 8, launch.Launch(16, 8, 2, 16)),
    (lambda c: c.block_s == 16 and c.dequant_keys, launch.Launch(16, 4, 2, 16, dequant_keys=True)),
])
def test_refit_keeps_the_first_candidate_clean_on_every_member(monkeypatch, heavy_fits, chosen):
    """`refit_key` (kernel_report.py --refit's search): candidates in the sweep's order, each tried on every
    member configuration and target until one fails, then the same candidates with the reconstructed-key
    path; the first clean on all of them is kept."""
    row = rule_row(lambda cfg, cand: cfg.name == "light" or heavy_fits(cand))
    monkeypatch.setattr(report, "compile_row", row)
    members = [configs.KernelConfig("light", 64, 1, ((2, 16),)), configs.KernelConfig("heavy", 64, 1, ((8, 16),))]
    got, tried = report.refit_key(launch.LaunchKey("residual", 64, 1, 16, 16), members, TARGETS, None,
                                  log=lambda line: None)
    assert got == chosen and len(tried) == len(row.calls)
    first = launch.Launch(64, 4, 2, 16)
    assert row.calls[:4] == [("light", "sm_90", first), ("light", "sm_80", first), ("heavy", "sm_90", first),
                             ("light", "sm_90", first._replace(block_s=32))]  # a failure ends the candidate
    assert row.calls[-4:] == [(n, t, chosen) for n in ("light", "heavy") for t in ("sm_90", "sm_80")]
