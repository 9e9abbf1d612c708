"""Save and restore converted models with orbax-checkpoint.

A saved model is a folder: `rq_config.json` (the `ModelConfig`) and `params/` (an orbax checkpoint of
the NNX parameter state).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from rq_jax.config import ModelConfig
from rq_jax.models import LoopedLM, model_class

CONFIG_FILE = "rq_config.json"


def save(directory: str | os.PathLike, model: LoopedLM) -> None:
    """Write `model`'s config and parameters under `directory` (created; must not hold params yet)."""
    directory = os.path.abspath(os.fspath(directory))
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(dataclasses.asdict(model.config), f, indent=2)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(directory, "params"), nnx.state(model, nnx.Param))


def load_config(directory: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` saved by `save`."""
    with open(os.path.join(os.fspath(directory), CONFIG_FILE)) as f:
        return ModelConfig(**json.load(f))


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
    return nnx.merge(graphdef, state)


def load(path_or_id: str | os.PathLike, *, dtype=jnp.float32, param_dtype=jnp.float32) -> tuple[LoopedLM, str]:
    """A model from a folder saved by `save`, an HF checkpoint folder, or a cached hub id.

    Returns (model, resolved folder).
    """
    from rq_jax.convert.hf import load_model, resolve

    folder = resolve(path_or_id)
    if is_saved_model(folder):
        return restore(folder, dtype=dtype, param_dtype=param_dtype), folder
    return load_model(folder, dtype=dtype, param_dtype=param_dtype)[0], folder
