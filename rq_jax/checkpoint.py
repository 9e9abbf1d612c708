"""Save and restore converted models with orbax-checkpoint.

A saved model is a folder: `rq_config.json` (the `ModelConfig`) and `params/` (an orbax checkpoint of
the NNX parameter state).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from rq_jax.config import ModelConfig, from_hf_config
from rq_jax.convert.hf import load_model, resolve
from rq_jax.io import atomic_folder
from rq_jax.models import LoopedLM, model_class

CONFIG_FILE = "rq_config.json"
#: The small models shipped with the repository (trained here; see their README cards).
SHIPPED = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "checkpoints"))
#: Files beside the weights that the runtime reads (tokenizer, chat template, stop ids, the card's notes
#: in config.json's "rq_jax" section) or a reader needs (the model card); conversion carries them along.
RUNTIME_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "README.md", "config.json")


def save(directory: str | os.PathLike, model: LoopedLM, *, extra_files: tuple[str, ...] = (),
         overwrite: bool = False) -> None:
    """Write `model`'s config and parameters (and copies of `extra_files`) as the folder `directory`,
    atomically (`atomic_folder`: an existing non-empty folder only with `overwrite`)."""
    with atomic_folder(directory, overwrite=overwrite) as tmp:
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            json.dump(dataclasses.asdict(model.config), f, indent=2)
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(os.path.join(tmp, "params"), nnx.state(model, nnx.Param))
        for path in extra_files:
            shutil.copy(path, tmp)


def load_config(directory: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` saved by `save`."""
    path = os.path.join(os.fspath(directory), CONFIG_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            return ModelConfig(**json.load(f))
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as err:
        raise ValueError(f"{path} is not a valid {CONFIG_FILE}: {err}") from None


def is_saved_model(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds a model written by `save`."""
    return os.path.exists(os.path.join(os.fspath(directory), CONFIG_FILE))


def restore(directory: str | os.PathLike, *, dtype=jnp.float32, param_dtype=jnp.float32) -> LoopedLM:
    """The model saved under `directory`, computing in `dtype` with parameters in `param_dtype`."""
    directory = os.path.abspath(os.fspath(directory))
    config = load_config(directory)
    abstract = nnx.eval_shape(lambda: model_class(config)(config, rngs=nnx.Rngs(0), dtype=dtype,
                                                           param_dtype=param_dtype))
    graphdef, target = nnx.split(abstract)
    with ocp.StandardCheckpointer() as ckptr:
        state = ckptr.restore(os.path.join(directory, "params"), target)
    for path, var in nnx.to_flat_state(state):
        if not bool(jnp.all(jnp.isfinite(var.get_value()))):
            raise ValueError(f"{directory}: parameter {'.'.join(map(str, path))} holds NaN or infinite values")
    return nnx.merge(graphdef, state)


def runtime_files(folder: str | os.PathLike) -> tuple[str, ...]:
    """The `RUNTIME_FILES` present in `folder` (paths)."""
    paths = (os.path.join(os.fspath(folder), name) for name in RUNTIME_FILES)
    return tuple(p for p in paths if os.path.exists(p))


def read_config(path_or_id: str | os.PathLike) -> tuple[ModelConfig, str]:
    """The `ModelConfig` of a checkpoint (a folder saved by `save`, an HF folder or a cached hub id) and
    its resolved folder, without reading the weights. Raises FileNotFoundError for a missing checkpoint
    or config file, ValueError for a config that is not one (see `rq_jax.config.from_hf_config`)."""
    folder = resolve(path_or_id)
    if is_saved_model(folder):
        return load_config(folder), folder
    if not os.path.exists(os.path.join(folder, "config.json")):
        raise FileNotFoundError(f"{folder} has no config.json (nor {CONFIG_FILE}): not a checkpoint folder")
    return from_hf_config(folder), folder


def load(path_or_id: str | os.PathLike, *, dtype=jnp.float32, param_dtype=jnp.float32) -> tuple[LoopedLM, str]:
    """A model from a folder saved by `save`, an HF checkpoint folder, or a cached hub id.

    Returns (model, resolved folder).
    """
    folder = resolve(path_or_id)
    if is_saved_model(folder):
        return restore(folder, dtype=dtype, param_dtype=param_dtype), folder
    return load_model(folder, dtype=dtype, param_dtype=param_dtype)[0], folder
