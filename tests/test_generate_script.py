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
    assert "KV cache (dense):" in out and "dense bf16 would take" in out


def test_wrong_family_for_checkpoint(capsys):
    shipped = SCRIPT.parents[1] / "checkpoints" / "ouro-small"
    with pytest.raises(SystemExit, match="holds a ouro model"):
        load_script().main(["--model", "huginn", "--checkpoint", str(shipped)])
