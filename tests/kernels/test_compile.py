"""The decode kernels compiled for Hopper (sm_90) and Ampere (sm_80) without a GPU: Triton's CUDA stages
and ptxas (the pip `triton` wheel pinned in the test extra) on the IR jax lowers, with the launch
parameters the dispatch picks. A configuration fails when it does not compile, spills, needs more
shared memory or registers than its target has, or runs its dots without tensor cores.

Every run compiles `configs.CI_SUBSET` (14 configurations, two of them paged, both targets: 28 compiles)
and the allocator's schedules' calls that cover all of them (`_base.covering`); RQ_KERNEL_COMPILE=all compiles
the whole `configs.MATRIX` (as scripts/kernel_report.py does) and every schedule's calls. Results are
cached by IR hash under $RQ_KERNEL_CACHE (default ~/.cache/rq_jax/kernels): a cold cache costs 5-60 s per
compile, a warm one only the lowering (docs/performance.md, "What CI compiles").
"""

from __future__ import annotations

import dataclasses
import json
import platform

import pytest

from pallas_kernels import configs, deviceless, launch
from tests.conftest import run_script

from ._base import EVERY, allocated_configs

NAMES = configs.BY_NAME if EVERY else configs.CI_SUBSET
#: The pinned wheel exists for Linux x86_64 only; elsewhere the compile tests cannot run.
WHEEL_PLATFORM = platform.system() == "Linux" and platform.machine() == "x86_64"


@pytest.fixture(scope="module", autouse=True)
def _triton():
    if not WHEEL_PLATFORM:
        pytest.skip(f"no pinned triton wheel for {platform.system()} {platform.machine()}")
    if not deviceless.triton_available():
        pytest.fail("the compile tests need the pip `triton` wheel of the test extra: pip install -e '.[test]'")


@pytest.mark.parametrize("target", list(deviceless.TARGETS))
@pytest.mark.parametrize("name", NAMES)
def test_compiles_without_spills(name, target):
    cfg, tgt = configs.BY_NAME[name], deviceless.TARGETS[target]
    res = cfg.compile(tgt)
    assert deviceless.problems(res) == [], f"{name} on {target} with {cfg.launch()}: {res}"
    assert res.tensor_cores in ("mma", "wgmma"), f"{name} on {target}: no tensor-core instructions"
    assert deviceless.blocks_per_sm(res) >= 1


ALLOCATED = allocated_configs()


@pytest.mark.parametrize("target", list(deviceless.TARGETS))
@pytest.mark.parametrize("name", sorted(ALLOCATED))
def test_allocated_schedules_compile_without_spills(name, target):
    """Issue 28: the emitted schedules' kernel calls (key and value chains apart) compile clean: a covering
    set of them (`_base.covering`), all with RQ_KERNEL_COMPILE=all."""
    cfg = ALLOCATED[name]
    res = cfg.compile(deviceless.TARGETS[target])
    assert deviceless.problems(res) == [], f"{name} on {target} with {cfg.launch()}: {res}"


def test_a_spilling_configuration_fails():
    """The check is live: Huginn's D96 g16 loop at 64-token tiles on 4 warps spills (measured ~1.6 KB)."""
    cfg = configs.BY_NAME["huginn-d96-int2g16-int4g16"]
    res = cfg.compile(deviceless.TARGETS["sm_90"], override=launch.Launch(64, 4, 2, 16))
    assert res.spill_stores > 0 and any("spills" in p for p in deviceless.problems(res))


def test_problems_flags_shared_memory_and_registers():
    ok = deviceless.Resources("k", "sm_80", 4, 2, 160 * 1024, 128, 0, 0, 0, "mma", "h")
    assert deviceless.problems(ok) == []
    assert "shared memory" in deviceless.problems(dataclasses.replace(ok, shared=170 * 1024))[0]
    assert deviceless.problems(dataclasses.replace(ok, target="sm_90", shared=170 * 1024)) == []
    assert "registers" in deviceless.problems(dataclasses.replace(ok, registers=255, num_warps=16))[0]
    assert deviceless.blocks_per_sm(ok) == 1  # 160 KiB of 164 per SM


def test_every_shipped_configuration_has_a_table_entry():
    """The dispatch never falls back to the unchecked FALLBACK parameters for a shipped configuration."""
    entries = launch.TABLE.keys() | launch.OVERRIDES.keys()
    missing = sorted({c.name for c in configs.MATRIX if c.launch_key() not in entries})
    assert not missing, f"no launch.TABLE entry for {missing[:5]} ... ({len(missing)})"


def test_lowering_for_ampere_accepts_fp8_metadata():
    """jax refuses float8 casts below sm_89; the kernel decodes FP8 metadata from its bits instead."""
    fn, args = configs.BY_NAME["ouro-loop-d128-int2g32-int4g32"].call()
    [kernel] = deviceless.triton_kernels(fn, args, capability=80)
    assert kernel.name == "residual_decode_attention" and kernel.ir


@pytest.mark.parametrize("content, message", [
    (None, "not a kernel_report.py JSON report (FileNotFoundError"),
    ("{", "not a kernel_report.py JSON report (JSONDecodeError"),
    ('{"rows": [{"config": "d64-r1-int9g32", "ok": false}]}',
     "configurations not in the matrix reported: d64-r1-int9g32"),
])
def test_refit_refuses_a_bad_report_in_one_line(tmp_path, content, message):
    path = tmp_path / "report.json"
    if content is not None:
        path.write_text(content)
    run = run_script("kernel_report", "--refit", path)
    err = run.err.strip().splitlines()
    assert run.code == 2 and message in err[-1] and f"--refit {path}: " in err[-1] and "Traceback" not in run.err


def test_the_paged_report_reads_through_a_block_table(tmp_path):
    """--page 16: every configuration over 16-token pages, with the paged launch (`launch.PAGED_OVERRIDES`
    where the class has one, tiles of at most a page); and a class's paged override is what its paged
    configurations compile with."""
    out = tmp_path / "paged.json"
    run = run_script("kernel_report", "--page", "16", "--only", "ouro-loop-d128", "--targets", "sm_90", "--json", out)
    assert run.code == 0, run.err
    [row] = json.loads(out.read_text())["rows"]
    assert row["config"] == "paged16-ouro-loop-d128-int2g32-int4g32" and row["ok"] and row["block_s"] == 16
    cfg = configs.paged(configs.BY_NAME["d128-r64-int2g32-int4g32"])
    assert cfg.launch() == launch.PAGED_OVERRIDES[cfg.launch_key()] != launch.lookup("residual", 128, 64, (32, 32))
    assert run_script("kernel_report", "--page", "16", "--sweep").code == 2
