"""A code-version-independent snapshot of a run: params and Adam moments as HF checkpoints, plus the step.

Orbax checkpoints mirror the current module tree; when the model code changes its parameter layout
(e.g. layers stacked for `lax.scan`) they no longer restore. HF tensor names do not change, so
`save_portable` writes params, Adam's mu and nu each through `save_hf` (float32, exact) and
`load_portable` reads them back into whatever layout the current code has, with the step and the
optimizer's counts. With unchanged code the continued run is bit-identical to an orbax resume.

    folder/params/, folder/adam_mu/, folder/adam_nu/   HF folders (config.json + model.safetensors)
    folder/meta.json                                   {"step", "train_seconds", "config"}
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from optax import tree_utils

from rq_jax.convert.hf import load_model, save_hf
from rq_jax.train.run_config import TrainConfig, diff

PARTS = ("params", "adam_mu", "adam_nu")


def save_portable(trainer, folder: str) -> None:
    """Write `trainer`'s params, Adam moments and step to `folder` (replacing what is there)."""
    states = {"params": trainer.params, "adam_mu": tree_utils.tree_get(trainer.opt_state, "mu"),
              "adam_nu": tree_utils.tree_get(trainer.opt_state, "nu")}
    for name, state in states.items():
        save_hf(nnx.merge(trainer.graphdef, state, trainer.rest), os.path.join(folder, name), dtype=np.float32)
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump({"step": trainer.step, "train_seconds": trainer.train_seconds, "config": trainer.cfg.to_json()}, f)


def load_params(folder: str, config, like):
    """The float32 params of the HF folder `folder` read as a `config` model, in the tree of `like`.

    Raises ValueError if the trees differ."""
    model, _ = load_model(folder, config=config)
    params = nnx.state(model, nnx.Param)
    if jax.tree.structure(params) != jax.tree.structure(like):
        raise ValueError(f"{folder} does not match the model's parameter tree")
    return params


def load_portable(trainer, folder: str) -> None:
    """Set `trainer`'s params, Adam moments, counts and step from a `save_portable` folder.

    Raises ValueError if the snapshot's TrainConfig differs from the trainer's."""
    with open(os.path.join(folder, "meta.json")) as f:
        meta = json.load(f)
    saved = TrainConfig.from_json(meta["config"])
    if saved != trainer.cfg:
        raise ValueError(f"{folder} was saved by a run with another config (saved != requested):\n  "
                         + "\n  ".join(diff(saved, trainer.cfg)))
    loaded = {name: load_params(os.path.join(folder, name), trainer.cfg.model, trainer.params) for name in PARTS}
    step = int(meta["step"])
    trainer.params = loaded["params"]
    trainer.opt_state = tree_utils.tree_set(trainer.opt_state, mu=loaded["adam_mu"], nu=loaded["adam_nu"],
                                            count=jnp.asarray(step, jnp.int32))
    trainer.step, trainer.train_seconds = step, float(meta["train_seconds"])
