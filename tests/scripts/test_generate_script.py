"""scripts/generate.py runs end to end on the shipped checkpoints."""

import ast
import importlib.util
import json
import pathlib
import re

import jax.numpy as jnp
import numpy as np
import pytest

from rq_jax import checkpoint, cli
from rq_jax.cache import cache_nbytes, get_format
from rq_jax.sampling import Sampler, SamplingConfig
from rq_jax.tokenizer import load_tokenizer

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "generate.py"
SHIPPED = SCRIPT.parents[1] / "checkpoints"


def load_script():
    spec = importlib.util.spec_from_file_location("generate_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def weights_note(folder: pathlib.Path) -> str:
    """What the shipped checkpoint's config.json says its weights are ("trained", "quantization-aware fine-tuned")."""
    return json.loads((folder / "config.json").read_text())["rq_jax"]["weights"]


def printed(out: str, pattern: str) -> tuple[str, ...]:
    match = re.search(pattern, out)
    assert match, f"{pattern!r} not in {out!r}"
    return match.groups()


@pytest.mark.parametrize("model,extra", [("huginn", ["--num-steps", "4"]), ("ouro", ["--dtype", "bfloat16"])])
def test_generate_prints_the_library_tokens_and_exact_bytes(model, extra, capsys):
    """The printed text is the Sampler's greedy tokens decoded; the printed bytes are the dense bf16
    cache's: 2 (K, V) · loops · layers · kv heads · positions · head dim · 2 bytes (+ Huginn's plain layers)."""
    script = load_script()
    gen = script.main(["--model", model, "--cache", "dense", "--max-new-tokens", "4", "--prompt", "Hello", *extra])
    out = capsys.readouterr().out
    folder = SHIPPED / cli.DEFAULT_CHECKPOINT[model]
    assert f"checkpoints/{folder.name}  [{weights_note(folder)}]" in out
    lm, _ = checkpoint.load(folder, dtype=jnp.dtype(extra[1]) if extra[0] == "--dtype" else jnp.float32)
    tokenizer = load_tokenizer(folder)
    kw = dict(num_loops=4, init_scale=1.0) if model == "huginn" else {}
    prompt = tokenizer.encode("Hello").ids
    stops = cli.stop_token_ids(tokenizer, folder)
    library = Sampler(lm, SamplingConfig(max_new_tokens=4, stop_tokens=stops), **kw)([prompt])
    np.testing.assert_array_equal(gen.tokens, library.tokens)
    (text,) = printed(out, r"generated: (.*)\n")
    assert ast.literal_eval(text) == tokenizer.decode(library.tokens[0, : int(library.num_generated[0])].tolist())
    nbytes, positions, dense = (int(x.replace(",", "")) for x in printed(
        out, r"KV cache \(dense, looped layers at 16 bits/element\): ([\d,]+) bytes for (\d+) positions "
             r"\(dense bf16 would take ([\d,]+)"))
    c = lm.config
    loops = 4 if model == "huginn" else c.num_loops
    assert positions == len(prompt) + 4
    slots = loops * c.num_layers + c.num_plain_layers
    assert nbytes == dense == 2 * slots * c.num_kv_heads * positions * c.head_dim * 2
    assert printed(out, r"prefill: ([\d,.]+) tok/s")[0] != "0.0"


@pytest.mark.parametrize("cache", [["--cache", "residual"], ["--cache", "uniform", "--bits", "2", "--group-size", "16"],
                                   ["--cache", "rotated", "--rotation", "random"], ["--cache", "kivi"],
                                   ["--cache", "residual_vq"]])
def test_generate_with_compressed_caches(cache, capsys):
    """Printed bytes equal the arrays' own; for the loop formats also the toolbox's bits per element."""
    gen = load_script().main(["--model", "ouro", "--max-new-tokens", "3", *cache])
    out = capsys.readouterr().out
    bits, nbytes = printed(out, rf"KV cache \({cache[1]}, looped layers at ([\d.]+) bits/element\): ([\d,]+) bytes")
    nbytes = int(nbytes.replace(",", ""))
    assert nbytes == cache_nbytes(gen.cache)
    if cache[1] in ("residual", "uniform", "rotated"):
        c = gen.cache
        layers, kv_heads, head_dim = c.slot_dims("looped")
        elements = 2 * c.num_loops * layers * kv_heads * c.max_len * head_dim  # K, V · loops · layers · heads · S · D
        exact = float(c.fmt.bits_per_element(c.num_loops, head_dim))
        assert float(bits) == pytest.approx(exact, rel=1e-3) and nbytes == exact * elements / 8
    assert len(gen.tokens[0]) == 3


def test_bad_cache_policy_is_reported():
    with pytest.raises(SystemExit, match="bad --cache policy: invalid bit width 7"):
        load_script().main(["--model", "ouro", "--cache", "residual", "--bits", "2,7"])


def test_wrong_family_for_checkpoint(capsys):
    shipped = SCRIPT.parents[1] / "checkpoints" / "ouro-small"
    with pytest.raises(SystemExit, match="holds a ouro model"):
        load_script().main(["--model", "huginn", "--checkpoint", str(shipped)])


def test_huginn_adaptive_exit_reports_mean_steps(capsys):
    load_script().main(["--model", "huginn", "--max-new-tokens", "3", "--num-steps", "8", "--cache", "residual",
                        "--exit-criterion", "kl", "--exit-threshold", "1e9"])  # fires after the first step
    out = capsys.readouterr().out
    assert "adaptive exit (kl): 1.00 of 8 steps per decoded token on average" in out


def test_convert_then_generate_from_the_orbax_checkpoint(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("convert_script", SCRIPT.parent / "convert.py")
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    convert.main([str(SCRIPT.parents[1] / "checkpoints" / "ouro-small"), str(tmp_path / "ouro")])
    load_script().main(["--model", "ouro", "--checkpoint", str(tmp_path / "ouro"), "--max-new-tokens", "2"])
    assert "generated:" in capsys.readouterr().out


def test_checkpoint_without_tokenizer_is_reported():
    from tests.conftest import fixture_dir

    with pytest.raises(SystemExit, match="no tokenizer.json"):
        load_script().main(["--model", "ouro", "--checkpoint", str(fixture_dir("ouro-tiny"))])


def test_residual_is_the_default_and_values_out_of_range_are_reported(capsys):
    load_script().main(["--model", "ouro", "--max-new-tokens", "2"])
    out = capsys.readouterr().out
    bits = float(get_format("residual").bits_per_element(4, 64))  # the shipped Ouro: 4 loops, head_dim 64
    assert f"KV cache (residual, looped layers at {bits:.4g} bits/element)" in out
    assert re.search(r"values the cache could not store \(metadata outside its dtype's range, non-finite K/V\): "
                     r"[\d,]+", out)


def test_super_scale_and_kivi_window_options(capsys):
    gen = load_script().main(["--model", "ouro", "--max-new-tokens", "2", "--super-scale"])
    out = capsys.readouterr().out
    assert "bits/element" in out and int(gen.cache.out_of_range.sum()) == 0
    gen = load_script().main(["--model", "ouro", "--max-new-tokens", "2", "--cache", "kivi", "--residual-length", "32"])
    bits = float(printed(capsys.readouterr().out, r"KV cache \(kivi, looped layers at ([\d.]+) bits/element")[0])
    assert bits == pytest.approx(float(gen.cache.fmt.bits_per_element(4, 64, context_len=gen.cache.max_len)), rel=1e-3)
    with pytest.raises(SystemExit):
        load_script().main(["--model", "ouro", "--cache", "dense", "--super-scale"])


def test_generate_reads_a_calibration_artifact(tmp_path, capsys):
    """--calibration loads an OSCAR artifact for the schedule and generates with it (the Sampler's own
    tokens with that calibration); an artifact for another group size is refused by name."""
    from rq_jax.cache import get_format
    from rq_jax.calibrate import calibrate_model, calibration_set, load_calibration, save_calibration

    folder = SHIPPED / cli.DEFAULT_CHECKPOINT["ouro"]
    model, _ = checkpoint.load(folder)
    rows = [calibration_set(part, 2, 64, tasks=("addition",)).tokens for part in ("fit", "holdout")]
    fmt = get_format("residual", group_size=16)
    path = save_calibration(tmp_path / "cal", calibrate_model(model, fmt, *rows, method="oscar"))
    gen = load_script().main(["--model", "ouro", "--max-new-tokens", "3", "--group-size", "16", "--calibration", path])
    tokenizer = load_tokenizer(folder)
    stops = cli.stop_token_ids(tokenizer, folder)
    calib = load_calibration(path, model, fmt)
    library = Sampler(model, SamplingConfig(max_new_tokens=3, stop_tokens=stops), fmt, calib=calib)(
        [tokenizer.encode(load_script().SAMPLE_PROMPT).ids])
    np.testing.assert_array_equal(gen.tokens, library.tokens)
    with pytest.raises(SystemExit, match="--calibration"):
        load_script().main(["--model", "ouro", "--max-new-tokens", "2", "--calibration", path])


@pytest.mark.parametrize("model", ["huginn", "ouro"])
def test_shipped_models_answer_the_sample_prompt(model, capsys):
    """The default run (residual cache) answers the default sum and stops at its newline (the
    checkpoint's generation_config.json eos ids). Ouro's default is its QAT model: the base
    `ouro-small` answers 423270 through this cache (see docs/results.md)."""
    script = load_script()
    script.main(["--model", model])
    out = capsys.readouterr().out
    assert f"[{weights_note(SHIPPED / cli.DEFAULT_CHECKPOINT[model])}]" in out and "KV cache (residual" in out
    assert printed(out, r"generated: '(.*)'")[0] == "423170\\n"
