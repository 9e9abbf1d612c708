"""scripts/generate.py runs end to end on the shipped checkpoints."""

import importlib.util
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "generate.py"


def load_script():
    spec = importlib.util.spec_from_file_location("generate_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("model,extra", [("huginn", ["--num-steps", "4"]), ("ouro", ["--dtype", "bfloat16"])])
def test_generate_prints_text_speed_and_bytes(model, extra, capsys):
    load_script().main(["--model", model, "--max-new-tokens", "4", "--prompt", "Hello", *extra])
    out = capsys.readouterr().out
    assert f"checkpoints/{model}-small" in out and "random initialisation" in out
    assert "generated:" in out and "tok/s" in out
    assert "KV cache (dense, looped layers at 16 bits/element):" in out and "dense bf16 would take" in out


@pytest.mark.parametrize("cache", [["--cache", "residual"], ["--cache", "uniform", "--bits", "2", "--group-size", "16"],
                                   ["--cache", "rotated", "--rotation", "random"], ["--cache", "kivi"],
                                   ["--cache", "residual_vq"]])
def test_generate_with_compressed_caches(cache, capsys):
    load_script().main(["--model", "ouro", "--max-new-tokens", "3", *cache])
    out = capsys.readouterr().out
    assert f"KV cache ({cache[1]}, looped layers at" in out and "generated:" in out


def test_bad_cache_policy_is_reported():
    with pytest.raises(SystemExit, match="bad --cache policy: invalid bit width 7"):
        load_script().main(["--model", "ouro", "--cache", "residual", "--bits", "2,7"])


def test_wrong_family_for_checkpoint(capsys):
    shipped = SCRIPT.parents[1] / "checkpoints" / "ouro-small"
    with pytest.raises(SystemExit, match="holds a ouro model"):
        load_script().main(["--model", "huginn", "--checkpoint", str(shipped)])


def test_huginn_adaptive_exit_reports_mean_steps(capsys):
    load_script().main(["--model", "huginn", "--max-new-tokens", "3", "--num-steps", "8", "--cache", "residual",
                        "--exit-criterion", "kl", "--exit-threshold", "10"])
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
