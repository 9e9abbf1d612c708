"""HF converter: shards, tied heads, corrupted checkpoints, the local hub cache, orbax round trip."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from rq_jax import checkpoint
from rq_jax.convert.hf import CheckpointError, load_model, save_hf
from tests.conftest import fixture_dir

IDS = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6]])


@pytest.fixture
def ouro_copy(tmp_path):
    dst = tmp_path / "ouro"
    shutil.copytree(fixture_dir("ouro-tiny"), dst)
    return dst


def edit_tensors(folder, fn):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path)


def test_missing_tensor_is_named(ouro_copy):
    edit_tensors(ouro_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_model(ouro_copy)


def test_wrong_shape_is_named(ouro_copy):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:8]
    edit_tensors(ouro_copy, shrink)
    with pytest.raises(CheckpointError, match=r"'model.layers.0.self_attn.k_proj.weight' has shape \(8, 64\)"):
        load_model(ouro_copy)


def test_unexpected_tensor_is_named(ouro_copy):
    edit_tensors(ouro_copy, lambda t: t.update({"model.layers.2.input_layernorm.weight": np.ones(64, np.float32)}))
    with pytest.raises(CheckpointError, match="unexpected tensors.*model.layers.2.input_layernorm.weight"):
        load_model(ouro_copy)


def test_missing_weights_file(tmp_path):
    shutil.copy(fixture_dir("ouro-tiny") / "config.json", tmp_path)
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        load_model(tmp_path)


def test_huginn_with_and_without_stored_lm_head(tmp_path, huginn):
    model, ref = huginn  # the fixture is sharded and has no lm_head.weight (tied)
    dst = tmp_path / "huginn"
    shutil.copytree(fixture_dir("huginn-tiny"), dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shard = dst / index["weight_map"]["transformer.wte.weight"]
    tensors = load_file(shard)
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"]
    save_file(tensors, shard)
    index["weight_map"]["lm_head.weight"] = shard.name
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    with_head, _ = load_model(dst)
    ids = jnp.asarray(ref["input_ids"])
    np.testing.assert_array_equal(with_head(ids, num_steps=2).logits, model(ids, num_steps=2).logits)


def test_huginn_rope_buffer_is_checked(tmp_path):
    dst = tmp_path / "huginn"
    shutil.copytree(fixture_dir("huginn-tiny"), dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "rope_base": 10000}))
    with pytest.raises(CheckpointError, match="freqs_cis differs from RoPE"):
        load_model(dst)


def test_hub_id_from_local_cache(tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--acme--ouro-tiny" / "snapshots" / "0123abcd"
    shutil.copytree(fixture_dir("ouro-tiny"), snapshot)
    (tmp_path / "hub" / "models--acme--ouro-tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--ouro-tiny" / "refs" / "main").write_text("0123abcd")
    # huggingface_hub reads its cache folder from the environment when first imported (perhaps by an
    # earlier test in this process): set both.
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, config = load_model("acme/ouro-tiny")
    assert config.family == "ouro"
    with pytest.raises(FileNotFoundError, match="neither a local folder nor a model in the local"):
        load_model("acme/not-cached")


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_orbax_round_trip_gives_identical_logits(tmp_path, family, request):
    model, _ = request.getfixturevalue(family)
    checkpoint.save(tmp_path / "saved", model)
    restored, folder = checkpoint.load(tmp_path / "saved")
    assert restored.config == model.config and folder == str(tmp_path / "saved")
    np.testing.assert_array_equal(restored(IDS).logits, model(IDS).logits)


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_hf_export_round_trip(tmp_path, family, request):
    model, _ = request.getfixturevalue(family)
    save_hf(model, tmp_path)
    again, config = load_model(tmp_path)
    assert config == model.config
    np.testing.assert_array_equal(again(IDS).logits, model(IDS).logits)


def test_bfloat16_compute_from_float32_file(ouro):
    model, ref = ouro
    bf16, _ = load_model(fixture_dir("ouro-tiny"), dtype=jnp.bfloat16)
    ids = jnp.asarray(ref["input_ids"])
    out = bf16(ids)
    assert out.logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(out.logits)))
    # bf16 keeps ~8 mantissa bits through 8 layer applications: agree with float32 to a few percent.
    scale = float(jnp.max(jnp.abs(model(ids).logits)))
    assert float(jnp.max(jnp.abs(out.logits - model(ids).logits))) < 0.1 * scale
