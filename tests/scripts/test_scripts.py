"""The benchmark and K/V-error scripts run as their command lines on tiny shapes (smoke tests, not timings)."""

import json
import math

import jax
import pytest

from rq_jax.cache import get_format
from tests.conftest import SHIPPED, fixture_dir, run_script


def run_ok(name, *argv):
    run = run_script(name, *argv)
    assert run.code == 0, run.err
    return run


def test_bench_decode_rows_bytes_ratios_and_budget(tmp_path):
    """Every requested row, once per impl (native where the kernels load); cache bytes equal `cache_nbytes`
    of a cache built the same way; ratios follow the bytes and times of the same run and pair rows of the
    same impl; the attention's bytes follow `rq_jax.perf.attention.bytes_read` and "% read BW" the measured
    read bandwidth; the largest batch's compiled step fits the budget and the next batch's does not. Also
    the byte limits at Ouro-1.4B's shape (no compile)."""
    import cpu_kernels
    from rq_jax.cache import cache_nbytes, init_cache
    from rq_jax.config import ModelConfig, preset
    from rq_jax.memory import byte_limits
    from rq_jax.perf.attention import bytes_read

    tiny = ("ouro-1.4b:num_layers=1,hidden_size=64,num_heads=2,num_kv_heads=2,head_dim=32,intermediate_size=128,"
            "vocab_size=256")
    out = tmp_path / "bench"
    run = run_ok("bench_decode", "--models", tiny, "--formats", "dense bf16", "direct INT2 g32", "--context", "40",
                 "--batch", "1", "--memory-gb", "0.004", "--repeats", "1", "--read-mb", "1", "--out", out)
    assert "dense bytes ÷ format bytes (storage limit)" in run.out and "| impl |" in run.out
    assert "| attn MiB read | % read BW |" in run.out
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["read_bandwidth"] > 0 and "read bandwidth" in data["header"][0]
    impls = ["xla", "native"] if cpu_kernels.available() else ["xla"]
    assert data["impls"] == impls
    assert "## Largest batch in 0.004 GiB" in out.with_suffix(".md").read_text()
    config = ModelConfig(**data["models"]["ouro-1.4b"]["config"])
    names = {"dense bf16": "dense", "direct INT2 g32": "uniform"}
    rows = {(r["format"], r["impl"], r["batch"]): r for r in data["rows"]}
    assert sorted(rows) == sorted((f, i, 1) for f in names for i in impls)
    for (label, impl, batch), r in rows.items():
        fmt = get_format(names[label], attend_impl=impl)
        dense = rows["dense bf16", impl, batch]
        assert r["fallback"] is None
        assert r["cache_nbytes"] == cache_nbytes(init_cache(config, batch, 41, fmt)) == r["memory"]["cache"]
        assert r["ms"] > 0 and r["tok_s"] == pytest.approx(batch / (r["ms"] / 1e3))
        assert r["bytes_x_dense"] == dense["cache_nbytes"] / r["cache_nbytes"]
        assert r["tok_s_x_dense"] == r["tok_s"] / dense["tok_s"]
        assert r["storage_limit"] == pytest.approx(16 / float(fmt.bits_per_element(4, 32)))
        assert r["attn_bytes"] == bytes_read(fmt, config, batch, 40) == \
            int(fmt.read_bits_per_element(4, 32, 40) * 2 * 4 * batch * 2 * 40 * 32 / 8)
        assert r["read_fraction"] == pytest.approx(r["attn_bytes"] / (r["ms"] / 1e3) / data["read_bandwidth"])
    assert rows["direct INT2 g32", "xla", 1]["bytes_x_dense"] == \
        pytest.approx(rows["direct INT2 g32", "xla", 1]["storage_limit"])
    budget = {(r["format"], r["impl"]): r for r in data["budget_rows"]}
    assert sorted(budget) == sorted((f, i) for f in names for i in impls) and data["budget"] == int(0.004 * 2**30)
    for (label, impl), r in budget.items():
        assert r["max_batch"] >= 1 and r["next_batch"] == r["max_batch"] + 1
        assert r["memory"]["total"] <= data["budget"] < r["next_memory"]["total"]
        assert r["memory"]["cache"] == cache_nbytes(init_cache(config, r["max_batch"], 41, get_format(names[label])))
        assert r["peak_tok_s"] > 0
        assert r["batch_x_dense"] == r["max_batch"] / budget["dense bf16", impl]["max_batch"]
        assert r["peak_x_dense"] == r["peak_tok_s"] / budget["dense bf16", impl]["peak_tok_s"]
    # The limits at Ouro-1.4B: [2,2,2,4] stores 3.09 bits and reads 6.47 (each residual loop reads the anchor).
    limits = byte_limits(get_format("residual"), preset("ouro-1.4b"), 4096)
    assert limits["storage_bits"] == 3.09375 and limits["read_limit"] == pytest.approx(64 / 25.875)


def test_bench_decode_times_the_write_alone(tmp_path):
    """--write-slots: one row per format, impl and cache size, the write's temporaries the same at every size
    (in place: its cost is the token's, not the cache's)."""
    tiny = ("ouro-1.4b:num_layers=1,hidden_size=64,num_heads=2,num_kv_heads=2,head_dim=32,intermediate_size=128,"
            "vocab_size=256")
    out = tmp_path / "bench"
    run = run_ok("bench_decode", "--models", tiny, "--formats", "dense bf16", "[2,2,2,4] g32", "--context", "40",
                 "--memory-gb", "0", "--repeats", "1", "--read-mb", "1", "--write-slots", "64", "2048", "--out", out)
    assert "## One token's write, alone" in run.out
    data = json.loads(out.with_suffix(".json").read_text())
    rows = {(r["format"], r["impl"], r["slots"]): r for r in data["write_rows"]}
    assert sorted(rows) == sorted((f, i, n) for f in ("dense bf16", "[2,2,2,4] g32") for i in data["impls"]
                                  for n in (64, 2048))
    for (label, impl, slots), r in rows.items():
        assert r["ms"] > 0 and r["cache_nbytes"] > 0
        if slots == 2048:
            assert r["temp"] == rows[label, impl, 64]["temp"] and r["cache_nbytes"] == 32 * rows[label, impl, 64][
                "cache_nbytes"]


def test_bench_compile_table(tmp_path):
    out = tmp_path / "compile.json"
    run_ok("bench_compile", "--models", "ouro-1.4b", "--formats", "dense", "--width", "32", "--head-dim", "16",
           "--context", "8", "--repeats", "1", "--json", out)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["depth"], r["layers"], r["loops"]) for r in rows] == [("half", 12, 4), ("full", 24, 4)]
    assert all(math.isfinite(r["first_s"]) and r["first_s"] > 0 and r["step_ms"] > 0 for r in rows)
    assert rows[1]["full_over_half"] == rows[1]["first_s"] / rows[0]["first_s"]


def test_kv_error_table_json_and_the_compile_cache(tmp_path, monkeypatch):
    """kv_error.py prints its header (model, loops, prompt), defines NMSE, and always writes its JSON
    (into a folder it creates); with the persistent compile cache on (here in tmp_path) a second run
    loads its programs from there instead of compiling them. The scripts also quiet XLA's C++ logs."""
    from jax._src import compilation_cache

    from rq_jax import cli, compilation

    cache = tmp_path / "jax-cache"
    monkeypatch.setenv("RQ_JAX_COMPILE_CACHE", str(cache))
    keep = compilation.use_persistent_cache

    def keep_every_program(folder):  # under the suite's XLA flags the prefill compiles in about the 0.5 s floor
        keep(folder)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

    monkeypatch.setattr(cli, "use_persistent_cache", keep_every_program)  # the name cli.setup calls
    monkeypatch.delenv("JAX_LOGGING_LEVEL", raising=False)
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    out = tmp_path / "new" / "kv.json"
    argv = ["--checkpoint", fixture_dir("ouro-tiny"), "--group-size", "8", "--seq", "8", "--json", out]
    try:
        first = run_ok("kv_error", *argv)
        assert any(cache.iterdir()) and jax.config.jax_logging_level == "CRITICAL"
        jax.clear_caches()  # a new process would compile again
        second = run_ok("kv_error", *argv)
    finally:
        jax.config.update("jax_compilation_cache_dir", None)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        jax.config.update("jax_logging_level", None)
        compilation_cache.reset_cache()
    assert "model: ouro from" in first.out and "2 looped layers x 4 loops" in first.out
    assert "prompt: 2 random token sequences of 8 tokens (seed 0)" in first.out
    assert "NMSE = ‖X̂ − X‖² / ‖X‖²" in first.out
    assert "compiling the dense prefill (first run only; later runs load them from the compile cache)" in first.out
    assert "compiled programs came from the compile cache" in second.out
    rows = {r["scheme"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["[2,2,2,4] g8"]["k_nmse"] < rows["direct INT2 g8"]["k_nmse"]
    assert f"wrote {out}" in second.out


def test_random_checkpoint_writes_a_folder_the_loaders_read(tmp_path):
    """A random-weight model at a preset's widths and the shipped tokenizer's vocabulary, as an HF folder that
    the converter's loader reads back weight for weight and generate.py runs."""
    import numpy as np
    from flax import nnx

    from rq_jax.convert.hf import load_model
    from rq_jax.models import init_model

    dest = tmp_path / "ouro-random"
    run_ok("random_checkpoint", dest, "--preset", "ouro-tiny", "--layers", "1", "--seed", "3", "--dtype", "float32")
    model, config = load_model(dest)
    assert config.hidden_size == 64 and config.num_layers == 1 and config.vocab_size == 259
    assert json.loads((dest / "config.json").read_text())["rq_jax"]["weights"] == "random"
    want = nnx.state(init_model(config, seed=3), nnx.Param)
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    run = run_ok("generate", "--checkpoint", dest, "--cache", "residual", "--group-size", "16", "--max-new-tokens", "3",
                 "--prompt", "12+")
    assert run.out


@pytest.mark.parametrize("script,argv,message", [
    ("kv_error", ["--seq", "0"], "argument --seq: must be a positive integer, got 0"),
    ("kv_error", ["--group-size", "7"], "argument --group-size: 7 does not divide the model's head_dim 16"),
    ("kv_error", ["--group-size", "8", "--json", "/proc/nope/kv.json"], "argument --json: cannot create /proc/nope"),
    ("bench_compile", ["--width", "30", "--head-dim", "16"], "argument --head-dim: 16 does not divide --width 30"),
    ("bench_compile", ["--formats", "dense,nope"], "argument --formats: nope; the formats are"),
    ("bench_decode", ["--prefill-chunk", "-1"], "argument --prefill-chunk: must be ≥ 0, got -1"),
    ("bench_decode", ["--formats", "direct INT2 g32"], "--budget-rows needs 'dense bf16' among --formats"),
    ("bench_decode", ["--tpu", "v3"], "argument --tpu: unknown TPU 'v3': choose from v4 (v4:2x2x1), v5e (v5e:2x2)"),
    ("bench_decode", ["--tpu", "v5e:4x4"], "argument --tpu: unknown TPU 'v5e:4x4'"),
    ("train_tiny", ["--model", "ouro", "--run-dir", "/proc/nope/run"], "argument --run-dir: cannot create /proc/nope"),
    ("train_tiny", ["--model", "ouro", "--run-dir", "RUN", "--hidden", "100"],
     "argument --hidden: 100 is not a multiple of 64"),
    ("train_tiny", ["--model", "ouro", "--run-dir", "RUN", "--rows", "1,2"],
     "argument --rows: expected 3 comma-separated numbers, got '1,2'"),
    ("train_tiny", ["--model", "ouro", "--run-dir", "RUN", "--lr", "-1"], "argument --lr: must be > 0, got -1"),
    ("train_qat", ["--checkpoint", SHIPPED / "nope", "--run-dir", "RUN", "--steps", "5"],
     f"argument --checkpoint: no checkpoint folder {SHIPPED / 'nope'}"),
    ("train_qat", ["--checkpoint", SHIPPED / "ouro-small", "--run-dir", "RUN", "--steps", "5", "--group-size", "24"],
     "argument --group-size: 24 does not divide the model's head_dim 64"),
    ("train_qat", ["--checkpoint", SHIPPED / "ouro-small", "--run-dir", "RUN", "--steps", "5", "--warmup", "5"],
     "argument --warmup: 5 must be below --steps (5)"),
    ("convert", [SHIPPED / "ouro-small", SHIPPED / "ouro-small" / "inner"], "argument dest: "),
    ("serve", ["--model", "ouro", "--group-size", "7"], "argument --group-size: 7 does not divide the model's"),
    ("serve", ["--model", "ouro", "--max-len", "100000"], "argument --max-len: 100000 exceeds the model's 2048"),
    ("serve", ["--model", "huginn", "--mesh", "data=x"], "argument --mesh: bad mesh 'data=x'"),
    ("serve", ["--model", "ouro", "--port", "70000"], "argument --port: 70000 is not a TCP port"),
    ("serve", ["--model", "ouro", "--cache", "dense", "--bits", "2"], "--cache dense does not take --bits"),
    ("random_checkpoint", [SHIPPED / "ouro-small"], "argument dest: "),
])
def test_scripts_reject_bad_options_in_one_line(script, argv, message):
    if script == "kv_error":
        argv = ["--checkpoint", fixture_dir("ouro-tiny"), *argv]
    run = run_script(script, *argv)
    assert run.code == 2 and run.err.startswith(f"{script}.py: error: ") and run.err.count("\n") == 1, run.err
    assert message in run.err


def test_bench_decode_says_native_is_unavailable(monkeypatch):
    """Without the native kernels one line says why their rows are dropped; with only native asked for the
    run stops there (before any compile)."""
    import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    monkeypatch.setattr(cpu_kernels, "unavailable_reason", lambda: "not built in this test")
    run = run_script("bench_decode", "--impls", "native", "--no-run", "--memory-gb", "0")
    assert run.code == 1, run.err
    assert "native is unavailable (not built in this test): its rows are dropped" in run.out
    assert "no --impls left to run" in run.err


def test_bench_decode_on_a_tpu_compiled_here(tmp_path, monkeypatch):
    """--tpu: every program compiled for a v5e by libtpu (skipped without it), nothing run: the decode-attention
    op's Mosaic kernels in each compiled step, the cache at a multiple of 128 positions (201 -> 256), the
    header naming the chip, a batch over the chip's HBM refused in its row; without libtpu one line names
    the install."""
    from pallas_kernels import tpu_deviceless
    from rq_jax.cache import cache_nbytes, init_cache
    from rq_jax.config import ModelConfig
    from rq_jax.perf.decode import DecodeBench

    installed = tpu_deviceless.libtpu_available()
    monkeypatch.setattr(tpu_deviceless, "libtpu_available", lambda: False)
    run = run_script("bench_decode", "--tpu", "v5e")
    assert run.code == 1 and run.err.strip() == f'--tpu needs libtpu: pip install "jax[tpu]=={jax.__version__}"'
    monkeypatch.undo()
    if not installed:
        pytest.skip("libtpu not installed: pip install 'jax[tpu]' pinned to the jaxlib in use")
    tiny = ("ouro-1.4b:num_layers=1,hidden_size=256,num_heads=2,num_kv_heads=2,head_dim=128,intermediate_size=256,"
            "vocab_size=256")
    out = tmp_path / "tpu"
    run_ok("bench_decode", "--tpu", "v5e:2x2", "--models", tiny, "--formats", "dense bf16", "[2,2,2,4] g32",
           "--context", "200", "--batch", "2", "100000", "--memory-gb", "0.01", "--max-batch", "2", "--engine-chunk",
           "32", "--out", out)
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["platform"] == "tpu" and data["read_bandwidth"] is None and data["args"]["no_run"]
    assert "one chip of v5e:2x2, 16 GiB HBM" in data["device"] and "by libtpu" in data["header"][0]
    config = ModelConfig(**data["models"]["ouro-1.4b"]["config"])
    rows = [r for r in data["rows"] if r["batch"] == 2]
    for r in rows + data["budget_rows"]:
        attention = "tpu_dense_decode_attention" if r["format"] == "dense bf16" else "tpu_residual_decode_attention"
        assert r["tpu_kernels"].get(attention, 0) >= 1 and r["fallback"] is None, r
        assert ("tpu_write_token" in r["tpu_kernels"]) == (r["format"] != "dense bf16"), r  # dense's rows: token-major
    for r in rows:
        fmt = DecodeBench.fmt(r["format"])
        assert r["ms"] is None and r["cache_nbytes"] == cache_nbytes(init_cache(config, 2, 256, fmt)), r
    for r in data["rows"]:  # 100k rows of a ~1 MiB cache each: more than a v5e's HBM, which its compiler says
        if r["batch"] == 100000:
            assert r["memory"] is None and r["run"].startswith("refused by the TPU compiler: RESOURCE_EXHAUSTED"), r
    assert "| Mosaic kernels |" in out.with_suffix(".md").read_text()
    # The serving engine's decode and prompt programs over a pool of 128-token pages holding the largest batch:
    # the TPU kernels read the pool, and residual's decode stores through the Mosaic store.
    assert [(r["format"], r["width"]) for r in data["engine_rows"]] == [
        ("dense bf16", 1), ("dense bf16", 32), ("[2,2,2,4] g32", 1), ("[2,2,2,4] g32", 32)]
    for r in data["engine_rows"]:
        found = next(b for b in data["budget_rows"] if b["format"] == r["format"])
        attention = "tpu_dense_decode_attention" if r["format"] == "dense bf16" else "tpu_residual_decode_attention"
        assert r["requests"] == found["max_batch"] >= 1 and r["tpu_kernels"].get(attention, 0) >= 1, r
        assert ("tpu_write_token" in r["tpu_kernels"]) == (r["format"] != "dense bf16" and r["width"] == 1), r


def test_bench_decode_help_shows_defaults():
    run = run_ok("bench_decode", "--help")
    assert "tokens already cached (default: " in run.out and "largest batch the search tries (default: 4096)" in run.out
