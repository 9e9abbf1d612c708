"""Two local processes (coordinator on 127.0.0.1, gloo collectives on CPU, 2 devices each) run one
data=2,model=2 mesh: the same greedy tokens as one process with the KV cache split across both,
per-process training rows, and sharded orbax checkpoints that restore into the sharded layout.

Every wait is bounded: the workers are killed if they have not finished in TIMEOUT seconds.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

REPO = pathlib.Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "multiprocess_worker.py"
TIMEOUT = 150
sys.path.insert(0, str(WORKER.parent))
import multiprocess_worker as setup  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(run_dir: pathlib.Path, processes: int = 2, mesh: str = "data=2,model=2") -> list[subprocess.Popen]:
    """Start `processes` workers of one run on this machine."""
    base = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO), JAX_NUM_PROCESSES=str(processes),
                JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}",
                XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2")
    return [subprocess.Popen([sys.executable, str(WORKER), str(run_dir), mesh], cwd=REPO, text=True,
                             env=dict(base, JAX_PROCESS_ID=str(i)), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for i in range(processes)]


def collect(procs: list[subprocess.Popen]) -> list[dict]:
    """Wait (bounded by TIMEOUT, then kill) for every worker; their reports, process 0 first."""
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=TIMEOUT))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the {len(procs)} worker processes did not finish within {TIMEOUT} s")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    reports = []
    for proc, (out, err) in zip(procs, outputs):
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, f"worker failed (exit {proc.returncode}):\n{err[-4000:]}"
        reports.append(json.loads(lines[-1][len("RESULT "):]))
    return reports


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[list[dict], dict]:
    """The workers' reports and one process's results (computed here while the workers run)."""
    from rq_jax.models import init_model
    from rq_jax.sampling import Sampler
    from rq_jax.train import Trainer

    folder = tmp_path_factory.mktemp("multiprocess")
    procs = launch(folder / "run")
    try:
        single = dict(
            tokens=Sampler(init_model(setup.model_config(), seed=0), setup.SAMPLING, setup.cache_format())(
                setup.PROMPTS).tokens.tolist(),
            loss_step1=Trainer(setup.train_config(), setup.run_options(str(folder / "single"), 2)).run()["loss"])
    finally:
        reports = collect(procs)
    return reports, single


def test_two_processes_form_one_mesh(runs):
    reports, _ = runs
    assert [r["process"] for r in reports] == [0, 1]
    assert all(r["processes"] == 2 and r["devices"] == 4 for r in reports)
    for r in reports:  # the cache is split over both processes' devices
        assert r["cache_spans_processes"] and r["cache_spec"] == str(P(None, None, "data", "model"))
        assert r["cache_shard_shape"][2:4] == [len(setup.PROMPTS) // 2, setup.model_config().num_kv_heads // 2]


def test_same_greedy_tokens_as_one_process(runs):
    reports, single = runs
    for r in reports:
        assert r["tokens"] == single["tokens"]


def test_each_process_loads_its_rows(runs):
    reports, _ = runs
    rows = [r["rows"] for r in reports]
    assert sorted(rows[0] + rows[1]) == list(range(setup.train_config().data.batch_size))
    assert not set(rows[0]) & set(rows[1])


def test_sharded_checkpoint_restores_and_training_matches_one_process(runs):
    """Step 1's loss (after one update) is one process's up to the order of float reductions, so the
    per-process rows made up the right global batch; the step-2 checkpoint restores exactly, params and
    Adam moments in their sharded layout."""
    reports, single = runs
    for r in reports:
        np.testing.assert_allclose(r["loss_step1"], single["loss_step1"], rtol=1e-5)
        assert r["restored_step"] == 2 and r["restored_equal"]
        assert str(P(None, None, "model")) in r["restored_specs"]
        assert str(P(None, None, "model")) in r["restored_opt_specs"]
