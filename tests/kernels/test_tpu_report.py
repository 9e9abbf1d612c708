"""pallas_kernels.tpu_report and `kernel_report.py --tpu`: the TPU CI subset (`configs.TPU_CI_SUBSET`) compiled
for v5e and v6e through libtpu (skipped where `jax[tpu]` is missing), failing on any compile error; without
compiling, the rows, summary and Markdown of each status, the script's exit status on a compile error, and
its one-line error without libtpu."""

from __future__ import annotations

import json
import os

import jax
import pytest

from pallas_kernels import configs, tpu_launch, tpu_report
from pallas_kernels import tpu_deviceless as td
from tests.conftest import run_script

needs_libtpu = pytest.mark.skipif(not td.libtpu_available(),
                                  reason="libtpu not installed: pip install 'jax[tpu]' pinned to the jaxlib in use")


@needs_libtpu
@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_ci_subset_compiles(generation):
    """Every configuration of the subset (contiguous, and two over a pool of TPU_PAGE-token pages through a
    block table) compiles with its one Mosaic kernel inside the launch entry's VMEM limit and no cache-sized
    temporaries."""
    cfgs = [configs.BY_NAME[n] for n in configs.TPU_CI_SUBSET] + list(configs.TPU_CI_PAGED)
    rows = tpu_report.report(cfgs, [generation], log=lambda line: None)
    assert not tpu_report.failed(rows), tpu_report.summary(rows)
    assert not any(r["status"] == "declined" for r in rows), tpu_report.summary(rows)
    for row in rows:
        if row["status"] != "ok":
            continue
        cfg = {c.name: c for c in cfgs}[row["config"]]
        assert row["kernel"].startswith("tpu_residual" if cfg.links else "tpu_dense"), row
        assert row["vmem_limit"] == tpu_launch.lookup(generation, cfg.kernel).vmem_limit_bytes
        assert 0 < row["vmem_used"] <= row["vmem_limit"] and row["generated_code_bytes"] > 0, row
        assert row["page"] in ((configs.TPU_PAGE,) if cfg.page else (128, 256, 512, 1024, 2048)), row
        assert row["temp_bytes"] < row["argument_bytes"] // 100, row


@needs_libtpu
def test_pooled_configurations_through_the_script(tmp_path):
    """--tpu --page 128: configurations over a pool of 128-token pages, read through a block table."""
    out = tmp_path / "tpu.json"
    run = run_script("kernel_report", "--tpu", "v5e", "--page", "128", "--only", "ouro-loop-d128-int2g32-int4g32",
                     "dense-d128-bfloat16kv", "--json", out)
    assert run.code == 0, run
    rows = json.loads(out.read_text())["rows"]
    assert {r["config"] for r in rows} == {"paged128-ouro-loop-d128-int2g32-int4g32", "paged128-dense-d128-bfloat16kv"}
    assert all(r["status"] == "ok" and r["page"] == 128 for r in rows), rows


real_call = configs.KernelConfig.tpu_call


def refused(fn, args, generation):
    """A `compile_for` stand-in: what a compiler refusal returns."""
    return td.TpuCompile(generation, td.TOPOLOGIES[generation], False, "RESOURCE_EXHAUSTED: scoped vmem", (), (),
                         (), -1, -1, -1, -1, 0.0)


def test_a_compile_error_fails_the_script_and_a_declined_one_does_not(monkeypatch, tmp_path):
    """Traced without libtpu: a refused compile is an error row (exit status 1, in bold in the Markdown), a
    declined configuration is counted apart with its reason numbered below the table."""
    def decline(cfg, generation):  # the kernel covers the whole matrix: a configuration it would decline
        raise NotImplementedError("keys link 0: a reason the kernel gives")

    monkeypatch.setattr(configs.KernelConfig, "tpu_call", lambda cfg, generation: (
        decline(cfg, generation) if cfg.name == "d64-r1-int2g32-int4g32-float16meta" else real_call(cfg, generation)))
    monkeypatch.setattr(td, "compile_for", refused)
    monkeypatch.setattr(td, "libtpu_available", lambda: True)
    monkeypatch.setattr(tpu_report, "versions", lambda: dict(libtpu="0.0", jax="0.1", jaxlib="0.1"))
    md = tmp_path / "tpu.md"
    run = run_script("kernel_report", "--tpu", "v5e", "--only", "dense-d128-bfloat16kv",
                     "d64-r1-int2g32-int4g32-float16meta", "--markdown", md)
    assert run.code == 1, run
    assert "v5e: 0 compiled, 1 declined, 1 errors\n  dense-d128-bfloat16kv (v5e): RESOURCE_EXHAUSTED" in run.out
    lines = md.read_text().splitlines()
    assert lines[0].startswith("libtpu 0.0, jax 0.1, jaxlib 0.1; topologies v5e:2x2.")
    assert "| dense-d128-bfloat16kv |  | **error**: RESOURCE_EXHAUSTED: scoped vmem |" in lines
    assert "| d64-r1-int2g32-int4g32-float16meta |  | declined [1] |" in lines
    assert lines[-1] == "[1] keys link 0: a reason the kernel gives"


def test_markdown_cell_of_a_compiled_row():
    row = dict(config="a", generation="v6e", launch_kernel="residual", status="ok", error="", kernel="k.1", page=512,
               vmem_limit=32 << 20, vmem_used=3 << 19, generated_code_bytes=4096, temp_bytes=0, argument_bytes=1,
               seconds=1.0)
    text = tpu_report.markdown([row], dict(libtpu="0.0", jax="0.1", jaxlib="0.1"))
    assert text.splitlines()[-1] == "| a | k.1 | 512 · 1.50 / 32 MiB · 4 KiB · 0 |"
    assert not tpu_report.failed([row]) and tpu_report.summary([row]) == "v6e: 1 compiled, 0 declined, 0 errors"


@pytest.mark.parametrize("argv, message", [
    (["--tpu", "v5e,v6e"], f'kernel_report.py: the TPU report needs libtpu: pip install "jax[tpu]=={jax.__version__}"'),
    (["--tpu", "v5e,v3"], "unknown TPU generation v3: choose from v4,v5e,v5p,v6e"),
    (["--tpu", "v5e", "--sweep"], "--tpu reports the matrix"),
])
def test_refusals(monkeypatch, argv, message):
    """Without libtpu, one line naming the install command (exit status 2); an unknown generation or a GPU-only
    mode refused as argparse refuses (also 2)."""
    monkeypatch.setattr(td, "libtpu_available", lambda: False)
    run = run_script("kernel_report", *argv)
    assert run.code == 2 and message in run.err and run.out == "", run
    assert len(run.err.strip().splitlines()) == 1


@pytest.mark.parametrize("libtpu, attached, set_here",
                         [(True, False, True), (True, True, False), (False, False, False)])
def test_libtpu_is_quieted_only_without_a_tpu(monkeypatch, libtpu, attached, set_here):
    """quiet_libtpu sets libtpu's no-TPU settings where libtpu is installed and no chip is attached, and never
    overrides a value already set."""
    monkeypatch.setattr(td, "libtpu_available", lambda: libtpu)
    monkeypatch.setattr(td, "tpu_attached", lambda: attached)
    for name in td.ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v6e-8")
    td.quiet_libtpu()
    assert os.environ["TPU_ACCELERATOR_TYPE"] == "v6e-8"
    assert (os.environ.get("TPU_WORKER_HOSTNAMES") == "localhost") == set_here
