"""scripts/generate.py run as its command line on the shipped checkpoints: what it prints against the
library's own tokens and bytes, its answer check, and its one-line errors for bad options."""

import ast
import json
import re

import jax.numpy as jnp
import pytest

from rq_jax import checkpoint, cli
from rq_jax.cache import cache_bytes, cache_nbytes, get_format, init_cache
from rq_jax.sampling import Sampler, SamplingConfig
from rq_jax.tokenizer import load_tokenizer, stop_token_ids
from tests.conftest import SHIPPED, fixture_dir, run_script

OURO = SHIPPED / cli.DEFAULT_CHECKPOINT["ouro"]


def weights_note(folder) -> str:
    """What the shipped checkpoint's config.json says its weights are ("trained", "quantization-aware fine-tuned")."""
    return json.loads((folder / "config.json").read_text())["rq_jax"]["weights"]


def printed(out: str, pattern: str) -> tuple[str, ...]:
    match = re.search(pattern, out)
    assert match, f"{pattern!r} not in {out!r}"
    return match.groups()


def generate(*argv) -> str:
    """generate.py's stdout; the run must succeed."""
    run = run_script("generate", *argv)
    assert run.code == 0, run.err
    return run.out


def library_text(folder, prompt: str, max_new_tokens: int, fmt=None, calib=None, dtype=jnp.float32, **kw) -> str:
    """What the Sampler generates (greedy, the checkpoint's stop ids) for `prompt`, decoded."""
    model, _ = checkpoint.load(folder, dtype=dtype)
    tokenizer = load_tokenizer(folder)
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, stop_tokens=stop_token_ids(tokenizer, folder))
    gen = Sampler(model, sampling, fmt, calib=calib, **kw)([tokenizer.encode(prompt).ids])
    return tokenizer.decode(gen.tokens[0, : int(gen.num_generated[0])].tolist())


@pytest.fixture(scope="module")
def shipped():
    """The default run of each shipped model (generate.py --model NAME): its stdout."""
    return {model: generate("--model", model) for model in ("huginn", "ouro")}


@pytest.mark.parametrize("model", ["huginn", "ouro"])
def test_shipped_models_answer_the_sample_prompt_and_say_it_is_right(shipped, model):
    """The default run (residual cache) states the task format, answers the default sum, stops at its
    newline (generation_config.json's eos ids) and checks the answer read the usual way. Ouro's default
    is the model trained with Ouro's objective (the one trained on its last loop, `ouro-lastloop`, answers
    wrong through this cache, below)."""
    out = shipped[model]
    folder = SHIPPED / cli.DEFAULT_CHECKPOINT[model]
    assert f"model: {model} from checkpoints/{folder.name}  [{weights_note(folder)}]" in out
    assert "task format: sums of 5-digit operands (zero-padded), every number written least significant digit " \
           "first: '62217+89000=' is 71226 + 98, answered '423170' = 71324" in out
    assert re.search(r"compiling the prefill and decode programs \.\.\. [\d.]+ s\n", out)
    assert printed(out, r"generated: '(.*)'")[0] == "423170\\n"
    assert "check: 71226 + 98 = 71324; the model answered 423170 = 71324: right" in out


@pytest.mark.parametrize("model,extra", [("huginn", ["--num-steps", "4"]), ("ouro", ["--dtype", "bfloat16"])])
def test_generate_prints_the_library_tokens_and_exact_bytes(model, extra):
    """The printed text is the Sampler's greedy tokens decoded; the printed bytes are the dense bf16
    cache's: 2 (K, V) · loops · layers · kv heads · positions · head dim · 2 bytes (+ Huginn's plain
    layers). A prompt outside the task format gets the note that the models know only their tasks."""
    out = generate("--model", model, "--cache", "dense", "--max-new-tokens", "4", "--prompt", "Hello", *extra)
    folder = SHIPPED / cli.DEFAULT_CHECKPOINT[model]
    kw = dict(num_loops=4, init_scale=1.0) if model == "huginn" else {}
    dtype = jnp.bfloat16 if "bfloat16" in extra else jnp.float32
    (text,) = printed(out, r"generated: (.*)\n")
    assert ast.literal_eval(text) == library_text(folder, "Hello", 4, dtype=dtype, **kw)
    assert "note: this prompt is not a sum in the training format; the shipped models only know their" in out
    nbytes, positions, dense = (int(x.replace(",", "")) for x in printed(
        out, r"KV cache \(dense: bf16\): looped layers at 16 bits/element, metadata included; ([\d,]+) bytes for "
             r"(\d+) positions \(dense bf16 would take ([\d,]+)"))
    c = checkpoint.read_config(folder)[0]
    loops = 4 if model == "huginn" else c.num_loops
    assert positions == len(load_tokenizer(folder).encode("Hello").ids) + 4
    slots = loops * c.num_layers + c.num_plain_layers
    assert nbytes == dense == 2 * slots * c.num_kv_heads * positions * c.head_dim * 2
    assert printed(out, r"prefill: ([\d,.]+) tok/s")[0] != "0.0"


@pytest.mark.parametrize("argv,fmt,lines", [
    (["--checkpoint", SHIPPED / "ouro-lastloop", "--max-new-tokens", "7"], get_format("residual"),
     ["check: 71226 + 98 = 71324; the model answered 423270 = 72324: wrong",
      "values the cache could not store (metadata outside its dtype's range, non-finite K/V): "]),
    (["--cache", "uniform", "--bits", "2", "--group-size", "16"], get_format("uniform", bits=2, group_size=16), []),
    (["--cache", "rotated", "--rotation", "random"], get_format("rotated", rotation="random"), []),
    (["--super-scale"], get_format("residual", super_scale=True),
     ["values the cache could not store (metadata outside its dtype's range, non-finite K/V): 0\n"]),
    (["--cache", "kivi"], get_format("kivi"),
     ["every token sits in the format's full-precision part (kivi's window of recent tokens, residual_length), "
      "so nothing is quantized yet"]),
    (["--cache", "kivi", "--residual-length", "32", "--max-new-tokens", "24"], get_format("kivi", residual_length=32),
     []),
    (["--cache", "residual_vq"], get_format("residual_vq"),
     ["residual_vq fits its codebooks on this prompt's K/V before decoding"]),
    (["--cache", "share"], get_format("share"), []),
    (["--cache", "turboquant"], get_format("turboquant"), []),
    (["--cache", "share", "--bits", "4", "--rotation", "hadamard"], get_format("share", bits=4, rotation="hadamard"),
     []),
])
def test_generate_with_compressed_caches(argv, fmt, lines):
    """--model comes from the checkpoint's config; printed bytes equal those of a cache the library
    builds for the same positions, the bits per element its arrays' (`cache_bytes`);
    each format's explanation line is there (kivi's window only while every position sits in it)."""
    out = generate(*([] if "--checkpoint" in argv else ["--checkpoint", OURO]), "--max-new-tokens", "3", *argv)
    name = printed(out, r"KV cache \((\w+):")[0]
    bits, nbytes, positions = printed(
        out, rf"KV cache \({name}: .*\): looped layers at ([\d.]+) bits/element, metadata included; ([\d,]+) bytes "
             r"for (\d+) positions")
    assert "model: ouro from " in out
    config, positions = checkpoint.read_config(OURO)[0], int(positions)
    assert int(nbytes.replace(",", "")) == cache_nbytes(init_cache(config, 1, positions, fmt))
    assert float(bits) == pytest.approx(float(cache_bytes(config, fmt, positions).bits_per_element), rel=1e-3)
    assert f"{positions} positions are allocated (prompt + --max-new-tokens); this run stored " in out
    for line in lines:
        assert line in out
    if name == "kivi" and positions > 32:
        assert float(bits) < 16 and "nothing is quantized yet" not in out


def test_huginn_adaptive_exit_reports_mean_steps():
    out = generate("--model", "huginn", "--max-new-tokens", "3", "--num-steps", "8", "--cache", "residual",
                   "--exit-criterion", "kl", "--exit-threshold", "1e9")  # fires after the first step
    assert "adaptive exit (kl): 1.00 of 8 steps per decoded token on average" in out


def test_a_converted_checkpoint_generates_what_the_original_does(tmp_path, shipped):
    """convert.py keeps the runtime files (tokenizer, chat template, generation_config.json's stop ids,
    card): the converted Huginn prints the same answer, stops at the same newline and keeps its notes."""
    run = run_script("convert", SHIPPED / "huginn-small", tmp_path / "huginn")
    assert run.code == 0, run.err
    for name in checkpoint.RUNTIME_FILES:
        assert (tmp_path / "huginn" / name).read_bytes() == (SHIPPED / "huginn-small" / name).read_bytes()
    out = generate("--checkpoint", tmp_path / "huginn")
    for pattern in (r"(generated: .*)\n", r"(check: .*)\n", r"(task format: .*)\n", r"model: huginn from \S+(.*)\n"):
        assert printed(out, pattern) == printed(shipped["huginn"], pattern)


def test_generate_reads_a_calibration_artifact(tmp_path):
    """--calibration loads an OSCAR artifact for the schedule and generates with it (the Sampler's own
    tokens with that calibration); an artifact for another group size is refused by name."""
    from rq_jax.calibrate import calibrate_model, calibration_set, load_calibration, save_calibration

    model, _ = checkpoint.load(OURO)
    rows = [calibration_set(part, 2, 64, tasks=("addition",)).tokens for part in ("fit", "holdout")]
    fmt = get_format("residual", group_size=16)
    path = save_calibration(tmp_path / "cal", calibrate_model(model, fmt, *rows, method="oscar"))
    out = generate("--model", "ouro", "--max-new-tokens", "3", "--group-size", "16", "--calibration", path)
    (text,) = printed(out, r"generated: (.*)\n")
    expected = library_text(OURO, cli.SAMPLE_PROMPT, 3, fmt, calib=load_calibration(path, model, fmt))
    assert ast.literal_eval(text) == expected
    assert f"calibration: fitted, from --calibration {path} (in place of the defaults named above)" in out
    run = run_script("generate", "--model", "ouro", "--max-new-tokens", "2", "--calibration", path)
    assert run.code == 2 and run.err.startswith("generate.py: error: argument --calibration: ")


def test_generate_reads_a_bit_allocation_schedule(tmp_path):
    """--schedule stores the artifact's schedule (keys [2,2,2,4] g32, values INT2 g16 here): the
    Sampler's own tokens through that format and its bits; --bits beside it, or another --cache, is
    refused in one line."""
    from rq_jax.calibrate.allocate import Schedule, save_schedule

    schedule = Schedule(((2, 32), (2, 32), (2, 32), (4, 32)), ((2, 16),) * 4)
    path = tmp_path / "schedule.json"
    save_schedule(str(path), schedule, {}, {})
    out = generate("--model", "ouro", "--max-new-tokens", "3", "--schedule", path)
    (text,) = printed(out, r"generated: (.*)\n")
    assert ast.literal_eval(text) == library_text(OURO, cli.SAMPLE_PROMPT, 3, schedule.format())
    (bits,) = printed(out, r"looped layers at ([\d.]+) bits/element")
    assert float(bits) == pytest.approx(float(schedule.format().bits_per_element(4, 64)), rel=1e-3)
    for argv, message in ((["--bits", "2,2,2,4"], "the schedule " + str(path) + " fixes bits"),
                          (["--cache", "uniform"], "--cache uniform does not take --schedule")):
        run = run_script("generate", "--model", "ouro", "--schedule", path, *argv)
        assert run.code == 2 and run.err.count("\n") == 1 and message in run.err, run.err


@pytest.mark.parametrize("argv,message", [
    (["--cache", "uniform", "--group-size", "7"],
     "argument --group-size: 7 does not divide the model's head_dim 64; use one of 1, 2, 4, 8, 16, 32, 64"),
    (["--cache", "residual", "--group-size", "128"], "argument --group-size: 128 does not divide the model's head_dim"),
    (["--cache", "residual", "--bits", "2,7"], "--cache residual --bits 2,7: "),
    (["--temperature", "-1"], "argument --temperature: must be ≥ 0, got -1"),
    (["--top-p", "2"], "argument --top-p: must lie in (0, 1], got 2"),
    (["--prompt", ""], "argument --prompt: empty"),
    (["--checkpoint", SHIPPED / "nope"], f"argument --checkpoint: no checkpoint folder {SHIPPED / 'nope'}"),
    (["--model", "ouro", "--checkpoint", SHIPPED / "huginn-small"],
     f"argument --model: ouro, but --checkpoint {SHIPPED / 'huginn-small'} holds a huginn model"),
    (["--exit-criterion", "kl", "--exit-threshold", "-1"],
     "argument --exit-threshold: -1 never fires --exit-criterion kl"),
    (["--checkpoint", fixture_dir("ouro-tiny"), "--cache", "dense"], "argument --checkpoint: no tokenizer.json in"),
    (["--checkpoint", fixture_dir("ouro-tiny")],
     "--cache residual: residual cache: group size(s) [32] do not divide head_dim 16"),
    (["--group-size", "0", "--cache", "residual"], "argument --group-size: must be a positive integer, got 0"),
    (["--loops", "0"], "argument --loops/--num-steps: must be a positive integer, got 0"),
    (["--cache", "dense", "--bits", "2", "--group-size", "7", "--rotation", "random"],
     "--cache dense does not take --bits, --group-size, --rotation"),
    (["--cache", "kivi", "--rotation", "hadamard"], "--cache kivi does not take --rotation"),
    (["--cache", "residual", "--cache-dtype", "float32"], "--cache residual does not take --cache-dtype"),
    (["--cache", "dense", "--super-scale"], "--cache dense does not take --super-scale"),
    (["--temperature", "nan"], "argument --temperature: must be a finite number, got nan"),
    (["--top-p", "inf"], "argument --top-p: must be a finite number, got inf"),
    (["--exit-threshold", "0.1"], "argument --exit-threshold: needs --exit-criterion"),
    (["--bits", "2,x", "--cache", "residual"], "argument --bits: must be comma-separated integers"),
    (["--prompt", "caf\udce9"], "argument --prompt: not valid UTF-8 text"),
    (["--mesh", "data=3"], "argument --mesh: "),
])
def test_generate_rejects_bad_options_in_one_line(argv, message):
    """Exit status 2 and one line `generate.py: error: ...` naming the option, the value and what is
    allowed, before any work (these fail before the weights load)."""
    if argv[0] != "--model" and "--checkpoint" not in argv:
        argv = ["--model", "huginn", *argv]
    run = run_script("generate", *argv)
    assert run.code == 2 and run.out == ""
    assert run.err.startswith("generate.py: error: ") and run.err.count("\n") == 1, run.err
    assert message in run.err


def test_generate_help_shows_every_default_and_the_task_format():
    run = run_script("generate", "--help")
    assert run.code == 0
    text = " ".join(run.out.split())
    for default in ("tokens to generate at most (fewer when a stop token comes) (default: 32)", "greedy (default: 0.0)",
                    "0: all (default: 0)", "1: all (default: 1.0)", "(default: 62217+89000=)",
                    "divisor of head_dim; default the format's (32)"):
        assert default in text
    assert "least significant digit first" in text and "62217+89000= is 71226 + 98" in text
