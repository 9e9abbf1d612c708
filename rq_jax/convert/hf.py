"""Hugging Face checkpoints (Ouro, Huginn) → Flax NNX models.

Names map mechanically: our parameter path joined with dots, under the family's prefix, with
`kernel` → `weight` (transposed: HF linears are [out, in]) and `embedding` → `weight`. Layer stacks
(`layers`, `prelude`, `core_block`, `coda`) hold every layer's parameter on a leading [N] axis; layer i
is HF's `<stack>.<i>.…`. Every tensor is checked: a missing, unexpected or mis-shaped one raises an error
naming it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from rq_jax.config import ModelConfig, from_hf_config
from rq_jax.models import model_class
from rq_jax.nn.layers import rope_angles

_PREFIX = {"ouro": "model.", "huginn": "transformer."}
_STACKS = ("layers", "prelude", "core_block", "coda")


class CheckpointError(ValueError):
    """A checkpoint that does not match its config: missing, unexpected or mis-shaped tensors."""


def resolve(path_or_id: str | os.PathLike) -> str:
    """A local folder, or a hub model id already in the local Hugging Face cache (never the network).
    Raises FileNotFoundError naming the path: a file, a missing folder (a path whose parent folder
    exists, or that starts with `.`, `/` or `~`), or an id that is not in the cache."""
    path = os.fspath(path_or_id)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise FileNotFoundError(f"{path} is a file; expected a checkpoint folder with config.json")
    local = path.startswith((".", "/", "~")) or (os.sep in path and os.path.isdir(os.path.dirname(path)))
    from huggingface_hub import snapshot_download  # heavy: huggingface_hub (~0.13 s with httpx), only hub ids need it

    try:
        return snapshot_download(path, local_files_only=True)
    except Exception:  # the hub library raises several types for "not cached" / bad ids
        if local:
            raise FileNotFoundError(f"no checkpoint folder {path}") from None
        raise FileNotFoundError(f"{path!r} is neither a local folder nor a model in the local Hugging Face cache "
                                "(rq_jax never downloads: fetch it with `huggingface-cli download` first)") from None


def read_tensors(folder: str) -> dict[str, np.ndarray]:
    """All tensors of `model.safetensors` or of the shards listed in `model.safetensors.index.json`."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(folder, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")
    tensors = {}
    for name in files:
        path = os.path.join(folder, name)
        try:
            with safe_open(path, framework="numpy") as f:
                for key in f.keys():
                    tensors[key] = f.get_tensor(key)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path} (listed by the shard index) does not exist") from None
        except Exception as err:  # safetensors raises its own error types for truncated or corrupt files
            raise CheckpointError(f"cannot read {path}: {type(err).__name__}: {err} (truncated or not a "
                                  "safetensors file?)") from None
    return tensors


def hf_name(config: ModelConfig, path: tuple[Any, ...], layer: int | None = None) -> tuple[str, bool]:
    """The HF tensor name of our parameter `path` (of stacked layer `layer`), and whether HF stores
    it transposed."""
    *parts, leaf = (str(p) for p in path)
    transpose = leaf == "kernel"
    leaf = "weight" if leaf in ("kernel", "embedding") else leaf
    prefix = "" if parts[:1] == ["lm_head"] else _PREFIX[config.family]
    if layer is not None:
        parts.insert(1, str(layer))
    return prefix + ".".join([*parts, leaf]), transpose


def _layer_names(config: ModelConfig, path: tuple[Any, ...], shape: tuple[int, ...]) -> list[tuple[str, bool]]:
    """HF names of a parameter: one per layer of a stack (leading axis of `shape`), else one."""
    if str(path[0]) in _STACKS:
        return [hf_name(config, path, i) for i in range(shape[0])]
    return [hf_name(config, path)]


def _check_huginn_rope(config: ModelConfig, freqs_cis: np.ndarray) -> None:
    """Our RoPE table is computed from rope_base; the stored buffer must agree with it."""
    angles = rope_angles(jnp.arange(freqs_cis.shape[1])[None], config.head_dim, config.rope_theta)[0]
    ours = np.stack([np.cos(angles), np.sin(angles)], axis=-1)
    stored = np.asarray(freqs_cis, np.float32).reshape(ours.shape)
    err = float(np.max(np.abs(ours - stored)))
    if err > 1e-4:
        raise CheckpointError(f"freqs_cis differs from RoPE with rope_base={config.rope_theta} (max error {err:.2e})")


def load_model(path_or_id: str | os.PathLike, *, dtype=jnp.float32, param_dtype=jnp.float32,
               config: ModelConfig | None = None):
    """Load an HF Ouro or Huginn checkpoint as an NNX model computing in `dtype`.

    Returns (model, config). Raises CheckpointError naming any missing, unexpected or mis-shaped
    tensor; Huginn's `lm_head.weight` may be present or absent when embeddings are tied.
    """
    folder = resolve(path_or_id)
    config = config or from_hf_config(folder)
    tensors = read_tensors(folder)
    abstract = nnx.eval_shape(lambda: model_class(config)(config, rngs=nnx.Rngs(0), dtype=dtype,
                                                           param_dtype=param_dtype))
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    used = set()
    leaves = []
    for path, var in flat:
        shape = var.get_value().shape
        names = _layer_names(config, path, shape)
        stacked = str(path[0]) in _STACKS
        values = []
        for name, transpose in names:
            if name not in tensors:
                raise CheckpointError(f"checkpoint {folder} is missing tensor {name!r}")
            value, want = (tensors[name].T if transpose else tensors[name]), shape[1:] if stacked else shape
            if value.shape != want:
                raise CheckpointError(f"tensor {name!r} has shape {tensors[name].shape}, expected "
                                      f"{want[::-1] if transpose else want}")
            used.add(name)
            values.append(value)
        value = np.stack(values) if stacked else values[0]
        if not np.all(np.isfinite(value.astype(np.float32))):
            bad = [name for (name, _), v in zip(names, values) if not np.all(np.isfinite(v.astype(np.float32)))]
            raise CheckpointError(f"checkpoint {folder}: tensor {bad[0]!r} holds NaN or infinite values")
        leaves.append(var.replace(jnp.asarray(value, param_dtype)))
    if config.family == "huginn":
        if "freqs_cis" in tensors:
            _check_huginn_rope(config, tensors["freqs_cis"])
            used.add("freqs_cis")
        if config.tie_word_embeddings:
            used.add("lm_head.weight")  # the hub checkpoint stores the tied copy too
    unexpected = sorted(set(tensors) - used)
    if unexpected:
        raise CheckpointError(f"checkpoint {folder} has unexpected tensors {unexpected[:5]}"
                              f"{' ...' if len(unexpected) > 5 else ''}")
    state = nnx.from_flat_state([(path, leaf) for (path, _), leaf in zip(flat, leaves)])
    return nnx.merge(graphdef, state), config


def hf_config(config: ModelConfig) -> dict[str, Any]:
    """The HF `config.json` contents that `from_hf_config` reads back as `config`."""
    c = config
    if c.family == "ouro":
        return dict(
            model_type="ouro", architectures=["OuroForCausalLM"], vocab_size=c.vocab_size,
            hidden_size=c.hidden_size, num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
            num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, intermediate_size=c.intermediate_size,
            total_ut_steps=c.num_loops, max_position_embeddings=c.max_position_embeddings,
            rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=c.tie_word_embeddings,
            early_exit_threshold=c.early_exit_threshold, hidden_act="silu", initializer_range=c.init_std)
    return dict(
        model_type="huginn_raven", architectures=["RavenForCausalLM"], vocab_size=c.vocab_size,
        padded_vocab_size=c.vocab_size, n_embd=c.hidden_size, n_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, n_layers=c.num_prelude + c.num_layers + c.num_coda,
        n_layers_in_prelude=c.num_prelude, n_layers_in_recurrent_block=c.num_layers,
        n_layers_in_coda=c.num_coda, intermediate_size=c.intermediate_size, mean_recurrence=c.num_loops,
        block_size=c.max_position_embeddings, rope_base=c.rope_theta, norm_eps=c.rms_norm_eps,
        tie_embeddings=c.tie_word_embeddings, qk_bias=c.qk_bias, bias=False, injection_type="linear",
        init_values=dict(embed_scale=c.embed_scale, std=c.init_std))


def save_hf(model, folder: str | os.PathLike, *, dtype=np.float32, extra_config: dict | None = None) -> None:
    """Write `model` as an HF checkpoint folder (config.json + model.safetensors) that `load_model` reads.

    Tensors are stored in `dtype`; `extra_config` entries are added to config.json.
    """
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    tensors = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = np.asarray(var.get_value()).astype(dtype)
        names = _layer_names(model.config, path, value.shape)
        layers = value if str(path[0]) in _STACKS else [value]
        for (name, transpose), layer in zip(names, layers):
            tensors[name] = np.ascontiguousarray(layer.T if transpose else layer)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**hf_config(model.config), **(extra_config or {})}, f, indent=2)
