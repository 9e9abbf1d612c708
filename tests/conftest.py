"""Shared test fixtures: the PyTorch-reference checkpoints in tests/fixtures (a copy of the workplace's
shared/fixtures; `RQ_JAX_FIXTURES` points elsewhere), and `run_script`, which runs a script of scripts/
as its command line would."""

import contextlib
import io
import os
import pathlib
import runpy
import sys
from typing import NamedTuple

import numpy as np
import pytest

# The suite compiles hundreds of small programs, and code generation dominates XLA:CPU's compile time:
# LLVM at optimisation level 0 without its expensive passes, and the classic fusion emitters instead of
# the MLIR-based ones (a third less time on tests/nn/test_adaptive_exit.py + tests/cache/test_tiled.py:
# 266 s -> 176 s), change only code generation (every comparison between separately compiled programs
# already allows for float re-association).
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                      "--xla_cpu_use_fusion_emitters=false")

# Scripts run in this process keep no persistent compile cache (the suite writes nothing to ~/.cache).
os.environ["RQ_JAX_COMPILE_CACHE"] = ""

REPO = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = pathlib.Path(os.environ.get("RQ_JAX_FIXTURES", REPO / "tests" / "fixtures"))
SCRIPTS = REPO / "scripts"
SHIPPED = REPO / "checkpoints"


class ScriptRun(NamedTuple):
    """What a script run left: its exit status, and what it printed to stdout and stderr."""

    code: int
    out: str
    err: str


def run_script(name: str, *argv) -> ScriptRun:
    """Run scripts/NAME.py in this process as `python scripts/NAME.py ARGV...` would (`runpy`, as
    __main__, with sys.argv set), catching its exit and capturing what it prints. A `sys.exit(text)`
    counts as status 1 with the text on stderr, as Python itself reports it."""
    out, err = io.StringIO(), io.StringIO()
    path = SCRIPTS / f"{name}.py"
    saved = sys.argv
    sys.argv = [str(path), *map(str, argv)]
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(str(path), run_name="__main__")
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
                if isinstance(stop.code, str):
                    print(stop.code, file=sys.stderr)
    finally:
        sys.argv = saved
    return ScriptRun(code, out.getvalue(), err.getvalue())


def fixture_dir(name: str) -> pathlib.Path:
    path = FIXTURES / name
    if not path.is_dir():
        pytest.fail(f"parity fixtures not found at {path} (set RQ_JAX_FIXTURES)")
    return path


@pytest.fixture(scope="session")
def ouro():
    from rq_jax.convert.hf import load_model

    model, _ = load_model(fixture_dir("ouro-tiny"))
    return model, dict(np.load(fixture_dir("ouro-tiny") / "reference.npz"))


@pytest.fixture(scope="session")
def huginn():
    from rq_jax.convert.hf import load_model

    model, _ = load_model(fixture_dir("huginn-tiny"))
    return model, dict(np.load(fixture_dir("huginn-tiny") / "reference.npz"))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test module: the suite compiles hundreds of them, and
    keeping them all alive in one process grows its memory for no benefit."""
    yield
    import jax

    jax.clear_caches()
