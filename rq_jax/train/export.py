"""Export a trained run as an HF checkpoint folder: weights, tokenizer.json, and a model card."""

from __future__ import annotations

import json
import os
import platform
import shlex

import ml_dtypes
import numpy as np

from rq_jax.convert.hf import save_hf
from rq_jax.data import MixtureConfig
from rq_jax.tokenizer import byte_level_tokenizer

MAX_BYTES = 5_000_000


def export_hf(trainer, folder: str, accuracies: dict[str, float], command: str, dtype=ml_dtypes.bfloat16) -> dict:
    """Write `trainer`'s model to `folder` (config.json + model.safetensors in `dtype`, tokenizer.json,
    README.md model card). Returns the card's facts; raises ValueError if the weights exceed 5 MB."""
    cfg = trainer.cfg
    info = {
        "weights": "trained", "family": cfg.model.family, "loops": cfg.num_loops, "step": trainer.step,
        "train_seconds": round(trainer.train_seconds, 1),
        "tokens_seen": trainer.step * cfg.data.batch_size * cfg.data.seq_len,
        "dense_accuracy": accuracies, "data": trainer.text.describe(), "train_config": cfg.to_json(),
        "command": command, "python_version": platform.python_version(), "storage_dtype": np.dtype(dtype).name,
    }
    if cfg.init_weights is not None:  # a second stage: keep the first stage's facts for the card
        with open(os.path.join(cfg.init_weights, "config.json")) as f:
            info["previous"] = json.load(f).get("rq_jax")
        if info["previous"] is None:
            raise ValueError(f"{cfg.init_weights} was not exported by train_tiny.py (its config.json has no 'rq_jax')")
        info["train_config"]["init_weights"] = stage_name(len(stages(info)) - 1)  # no machine paths
    model = trainer.model()
    save_hf(model, folder, dtype=dtype, extra_config={"rq_jax": info})
    tokenizer = byte_level_tokenizer()
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "generation_config.json"), "w") as f:  # answers end at "\n" or ";"
        json.dump({"eos_token_id": [tokenizer.token_to_id(t) for t in ("<|endoftext|>", "Ċ", ";")]}, f, indent=2)
    size = os.path.getsize(os.path.join(folder, "model.safetensors"))
    if size > MAX_BYTES:
        raise ValueError(f"model.safetensors is {size} bytes, over the {MAX_BYTES}-byte budget")
    info["bytes"] = size
    with open(os.path.join(folder, "README.md"), "w") as f:
        f.write(model_card(info, cfg))
    return info


def card_facts(folder: str | os.PathLike) -> dict:
    """What `export_hf` (or a QAT export) recorded in a checkpoint's config.json ("rq_jax"); {} for
    other checkpoints."""
    path = os.path.join(os.fspath(folder), "config.json")
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        facts = json.load(f).get("rq_jax")
    return facts if isinstance(facts, dict) else {}


def trained_mixture(folder: str | os.PathLike) -> MixtureConfig | None:
    """The data mixture a checkpoint was trained (or quantization-aware fine-tuned) on, from its card
    (`card_facts`); None when the card records none."""
    facts = card_facts(folder)
    train = facts.get("train_config") or facts.get("qat_config", {}).get("train")
    return MixtureConfig.from_json(train["data"]) if train else None


def model_card(info: dict, cfg) -> str:
    """The README.md of an exported model."""
    m, d = cfg.model, cfg.data
    arch = (f"Ouro: {m.num_layers} layers × {info['loops']} loops" if m.family == "ouro" else
            f"Huginn: prelude {m.num_prelude} + core {m.num_layers} × {info['loops']} recurrence steps + coda "
            f"{m.num_coda}")
    acc = "\n".join(f"| {k} | {v:.4f} |" for k, v in info["dense_accuracy"].items())
    data = info["data"]
    chain = stages(info)
    steps = " + ".join(str(s["step"]) for s in chain)
    trained = (f"trained {steps} steps" if len(chain) == 1 else
               f"trained {steps} steps in {len(chain)} stages, each starting from the weights the one before exported")
    tokens, seconds = sum(s["tokens_seen"] for s in chain), sum(s["train_seconds"] for s in chain)
    pairs = (f"pair count growing from {d.curriculum_start} to {d.retrieval.max_pairs} over {d.curriculum_steps} steps"
             if d.curriculum_start < d.retrieval.max_pairs
             else f"{d.retrieval.min_pairs} to {d.retrieval.max_pairs} pairs")
    loops = (f"the first {cfg.one_loop_steps} steps ran one loop, the rest {info['loops']}" if cfg.one_loop_steps
             else f"{info['loops']} loops throughout")
    commands = "\n".join(stage_command(s["command"], i) + (f" --export {stage_name(i + 1)}" if i + 1 < len(chain)
                                                             else "") for i, s in enumerate(chain))
    return f"""# tiny {m.family} (rq_jax)

A small looped transformer trained from scratch by `scripts/train_tiny.py` on offline, generated data,
for testing compressed KV caches. Byte-level tokenizer (259 ids: 3 specials, then the 256 bytes).

- Architecture: {arch}; hidden {m.hidden_size}, {m.num_heads} heads × head_dim {m.head_dim}, \
MLP {m.intermediate_size}, vocab {m.vocab_size}
- Weights: {info['bytes']} bytes ({info['storage_dtype']}), {trained}
  ({tokens:,} tokens, {seconds / 3600:.2f} h of training wall time)
- Data: a mixture per batch of {d.rows[0]} addition rows (up to {d.addition.max_digits}-digit operands, zero-padded,
  operands and answer least significant digit first), {d.rows[1]} key–value retrieval rows (one-letter keys,
  one-digit values; {pairs},
  up to {d.retrieval.num_queries} queries each) and {d.rows[2]} rows of Python {data['python_version']} \
standard-library source
  ({data['train_modules']} training modules; held out for evaluation: {', '.join(data['eval_modules'])}; for
  calibration: {', '.join(data['calib_modules'])}). Sequence length {d.seq_len}. Splits never overlap.
- Objective: {objective(cfg)}
- Optimizer: AdamW (lr {cfg.lr}, warm-up {cfg.warmup_steps}, cosine to {cfg.lr * cfg.final_lr_frac:g} at step
  {cfg.total_steps}, weight decay {cfg.weight_decay}, clip {cfg.clip_norm}), seed {cfg.seed};
  {loops}{'' if len(chain) == 1 else ' (the last stage; the commands below give every stage)'}

## Dense-cache held-out results

| metric | value |
|---|---|
{acc}

`*_acc`: greedy exact match of each answer (all its tokens); `*_tok`: answer tokens predicted right.
`retrieval` draws 2..{d.retrieval.max_pairs} pairs per sequence, `retrieval{d.retrieval.max_pairs}` always \
{d.retrieval.max_pairs}
({d.retrieval.num_queries} queries each); `text_bpb`: bits per byte on the held-out stdlib modules. All on the eval
split, dense cache, {info['loops']} loops.

## Reproduce

```
{commands}
```
"""


def objective(cfg) -> str:
    """One line naming the training loss (TrainConfig.objective)."""
    if cfg.objective == "ouro":
        return (f"Ouro's pre-training loss (`rq_jax/train/objectives.py`): every loop's next-token NLL weighted by "
                f"the exit gate's distribution, minus β × that distribution's entropy (β = {cfg.entropy_beta:g}, then "
                f"{cfg.entropy_beta_late:g} from step {cfg.entropy_beta_switch or cfg.total_steps // 2})")
    return "next-token NLL of the last loop's logits"


def stage_name(i: int) -> str:
    """The placeholder folder of training stage i's export (1-based) in a card's commands."""
    return f"STAGE{i}"


def stage_command(command: str, i: int) -> str:
    """Stage i's (0-based) recorded command with its run folder as RUN and the folder it starts from as
    the previous stage's placeholder (cards name no machine paths)."""
    words = shlex.split(command)
    for flag, value in (("--run-dir", "RUN"), ("--init-weights", stage_name(i))):
        if flag in words:
            words[words.index(flag) + 1] = value
    return shlex.join(words)


def stages(info: dict) -> list[dict]:
    """The card facts of every training stage behind `info`, first stage first (see TrainConfig.init_weights)."""
    chain = [info]
    while chain[0].get("previous"):
        chain.insert(0, chain[0]["previous"])
    return chain
