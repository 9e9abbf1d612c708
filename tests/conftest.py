"""Shared test fixtures: the PyTorch-reference checkpoints in tests/fixtures (a copy of the workplace's
shared/fixtures; `RQ_JAX_FIXTURES` points elsewhere)."""

import os
import pathlib

import numpy as np
import pytest

# The suite compiles hundreds of small programs, and LLVM's optimisation passes dominate XLA:CPU's
# compile time; level 0 cuts the suite's time by about 40% and changes only code generation (every
# comparison between separately compiled programs already allows for float re-association).
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")

REPO = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = pathlib.Path(os.environ.get("RQ_JAX_FIXTURES", REPO / "tests" / "fixtures"))


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
