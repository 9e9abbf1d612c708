"""Config presets, HF config parsing, and clear errors for bad configs."""

import json

import pytest

from rq_jax.config import PRESETS, from_hf_config, preset
from tests.conftest import fixture_dir


@pytest.mark.parametrize("name", ["ouro-tiny", "huginn-tiny"])
def test_fixture_configs_match_presets(name):
    assert from_hf_config(fixture_dir(name)) == preset(name)


def test_real_model_presets():
    assert preset("ouro-1.4b").num_layers == 24 and preset("ouro-2.6b").num_layers == 48
    h = preset("huginn-0125")
    assert (h.num_prelude, h.num_layers, h.num_coda, h.head_dim, h.num_loops) == (2, 4, 2, 96, 32)
    assert set(PRESETS) >= {"ouro-1.4b", "ouro-2.6b", "huginn-0125", "ouro-tiny", "huginn-tiny"}


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'gpt2'"):
        preset("gpt2")


def raw(name):
    with open(fixture_dir(name) / "config.json") as f:
        return json.load(f)


def test_unknown_model_type():
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        from_hf_config({**raw("ouro-tiny"), "model_type": "llama"})


@pytest.mark.parametrize("name,field", [("ouro-tiny", "total_ut_steps"), ("ouro-tiny", "hidden_size"),
                                        ("huginn-tiny", "n_layers_in_recurrent_block"), ("huginn-tiny", "rope_base")])
def test_missing_field_is_named(name, field):
    config = raw(name)
    del config[field]
    with pytest.raises(ValueError, match=f"missing the required field '{field}'"):
        from_hf_config(config)


@pytest.mark.parametrize("name,field,value", [
    ("ouro-tiny", "use_sliding_window", True),
    ("ouro-tiny", "rope_scaling", {"type": "linear", "factor": 2.0}),
    ("ouro-tiny", "hidden_act", "gelu"),
    ("huginn-tiny", "injection_type", "add"),
    ("huginn-tiny", "bias", True),
])
def test_unsupported_value_is_named(name, field, value):
    with pytest.raises(ValueError, match=f"unsupported config value {field}="):
        from_hf_config({**raw(name), field: value})


def test_inconsistent_heads():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        preset("ouro-tiny").replace(num_kv_heads=3)
