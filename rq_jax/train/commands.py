"""The training scripts' command lines (scripts/train_tiny.py, scripts/train_qat.py): their parsers, the
configs they build from the parsed options, and the commands that reproduce a run (model cards).

Each parser keeps the options that fix a run's trajectory in its `trajectory` group (they must match
when a run resumes, and the model card spells them out); the run-control options come after.
"""

from __future__ import annotations

import argparse
import dataclasses

from rq_jax.argtypes import (ArgumentParser, divisors, nonnegative_float, nonnegative_int, positive_float, positive_int,
                             probability, spelled_command)
from rq_jax.data import Addition, MixtureConfig, Retrieval
from rq_jax.train.export import trained_mixture
from rq_jax.train.lora import LoRAConfig
from rq_jax.train.qat_trainer import TRAINABLE, QATConfig
from rq_jax.train.run_config import TrainConfig, tiny_model_config


def numbers(text: str, kind=int, count: int | None = None, option: str = "") -> tuple:
    """Comma-separated numbers of an option kept as text (so a model card spells it as given); raises
    ValueError naming `option` for other text or another count."""
    try:
        values = tuple(kind(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"argument {option}: expected comma-separated numbers, got {text!r}") from None
    if count is not None and len(values) != count:
        raise ValueError(f"argument {option}: expected {count} comma-separated numbers, got {text!r}")
    return values


def run_control(p: argparse.ArgumentParser, eval_every: int, eval_n: int) -> argparse._ArgumentGroup:
    """The run-control options both scripts share."""
    r = p.add_argument_group("run control")
    r.add_argument("--stop-step", type=positive_int, default=None,
                   help="stop before this step (default: the schedule's last)")
    r.add_argument("--max-minutes", type=positive_float, default=None, help="stop (checkpointed) after this long")
    r.add_argument("--ckpt-every-min", type=positive_float, default=5.0, help="minutes between checkpoints")
    r.add_argument("--eval-every", type=nonnegative_int, default=eval_every,
                   help="steps between held-out evals (0: none)")
    r.add_argument("--eval-n", type=nonnegative_int, default=eval_n, help="held-out examples per task of an eval")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    return r


# ---- train_tiny.py ------------------------------------------------------------------------------------


def tiny_parser(description: str) -> ArgumentParser:
    """scripts/train_tiny.py's options."""
    p = ArgumentParser(description=description)
    p.add_argument("--model", choices=["ouro", "huginn"], required=True, help="model family")
    p.add_argument("--run-dir", required=True, help="checkpoints and metrics.jsonl (outside the git tree)")
    g = p.add_argument_group("trajectory (must match when resuming)")
    g.add_argument("--loops", type=positive_int, default=None,
                   help="training loops / recurrence steps (default: the model's)")
    g.add_argument("--one-loop-steps", type=nonnegative_int, default=0,
                   help="run the first N steps with one loop (see TrainConfig)")
    g.add_argument("--hidden", type=positive_int, default=None,
                   help="hidden size, a multiple of 64 (heads = hidden / 64; default: tiny_model_config's)")
    g.add_argument("--intermediate", type=positive_int, default=None, help="MLP width (default: the model's)")
    g.add_argument("--layers", type=positive_int, default=None, help="looped layers / core blocks")
    g.add_argument("--init-std", type=positive_float, default=None, help="weight init std (default: the model's)")
    g.add_argument("--embed-std", type=positive_float, default=None,
                   help="re-initialise the embedding with this std")
    g.add_argument("--lr", type=positive_float, default=1e-3, help="peak learning rate")
    g.add_argument("--warmup", type=nonnegative_int, default=100, help="linear warm-up steps")
    g.add_argument("--total-steps", type=positive_int, default=5000, help="length of the cosine schedule")
    g.add_argument("--final-lr-frac", type=nonnegative_float, default=0.1, help="final lr / peak lr")
    g.add_argument("--weight-decay", type=nonnegative_float, default=0.1, help="AdamW weight decay")
    g.add_argument("--b2", type=probability, default=0.95, help="Adam's second-moment decay")
    g.add_argument("--clip", type=positive_float, default=1.0, help="global gradient-norm clip")
    g.add_argument("--seed", type=int, default=0, help="initialisation and data seed")
    g.add_argument("--seq-len", type=positive_int, default=258, help="tokens per training row")
    g.add_argument("--rows", default="2,6,1", help="rows per batch: addition,retrieval,text")
    g.add_argument("--task-weights", default="1,1,1", help="loss weight per task: addition,retrieval,text")
    g.add_argument("--max-digits", type=positive_int, default=5, help="addition operand digits")
    g.add_argument("--max-pairs", type=positive_int, default=43, help="retrieval pairs at the curriculum's end")
    g.add_argument("--queries", type=positive_int, default=43, help="retrieval queries per example")
    g.add_argument("--curriculum-start", type=positive_int, default=4, help="retrieval pairs at step 0")
    g.add_argument("--curriculum-steps", type=nonnegative_int, default=3000,
                   help="steps over which the pair count grows to --max-pairs")
    g.add_argument("--prompt-weight", type=nonnegative_float, default=0.0, help="loss weight of prompt tokens")
    g.add_argument("--branch-norm-init", type=positive_float, default=None,
                   help="ouro: initial weight of the norms on each branch's output (default 1)")
    g.add_argument("--branch-norm-switch", type=positive_float, default=None,
                   help="ouro: multiply the branch-output norms by this at the switch from one loop (step "
                   "--one-loop-steps) to all loops (default: leave them)")
    g.add_argument("--objective", choices=["last-loop", "ouro"], default="last-loop",
                   help="last-loop: NLL of the last loop; ouro: Ouro's loss, every loop's NLL weighted by the exit "
                   "distribution minus --entropy-beta × its entropy (rq_jax/train/objectives.py)")
    g.add_argument("--entropy-beta", type=nonnegative_float, default=0.1,
                   help="β of the ouro objective before --entropy-beta-switch (Ouro's Stage 1a: 0.1)")
    g.add_argument("--entropy-beta-late", type=nonnegative_float, default=0.05,
                   help="β from --entropy-beta-switch on (Ouro's later stages: 0.05)")
    g.add_argument("--entropy-beta-switch", type=nonnegative_int, default=None,
                   help="step where β drops (default: total steps / 2)")
    g.add_argument("--zero-state", action="store_true", help="huginn: train from a zero initial state, not noise")
    g.add_argument("--init-weights", metavar="DIR", help="a second stage: start from the weights of a model that "
                   "an earlier run exported (--export), with a fresh optimizer and schedule")
    r = run_control(p, eval_every=250, eval_n=256)
    r.add_argument("--init-from", metavar="DIR", help="start from a portable snapshot (RUN_DIR/portable of a run "
                   "with the same flags, e.g. written by older model code) when RUN_DIR has no checkpoint")
    r.add_argument("--export", metavar="DIR", help="after training, write the HF folder + tokenizer + model card")
    r.add_argument("--export-n", type=positive_int, default=1000, help="held-out examples per task for the card")
    r.add_argument("--mesh", help="train on a device mesh, e.g. data=2,model=2 (default: one device)")
    p.trajectory = g
    return p


def tiny_command(parser, a) -> str:
    """The command that trains this run, every trajectory flag given spelled out (for model cards), with
    no machine paths: the run folder is RUN and an --init-weights folder STAGE (`export.model_card` numbers
    the stages)."""
    a = argparse.Namespace(**{**vars(a), "init_weights": a.init_weights and "STAGE"})
    return spelled_command(["python", "scripts/train_tiny.py", "--model", a.model, "--run-dir", "RUN"],
                               parser.trajectory, a)


def tiny_config(a) -> TrainConfig:
    """The `TrainConfig` of train_tiny.py's options; raises ValueError naming a bad option."""
    if a.hidden is not None and a.hidden % 64:
        raise ValueError(f"argument --hidden: {a.hidden} is not a multiple of 64 (heads of 64 channels)")
    over = {k: v for k, v in dict(hidden_size=a.hidden, intermediate_size=a.intermediate, num_layers=a.layers,
                                   init_std=a.init_std).items() if v is not None}
    if a.hidden is not None:
        over.update(num_heads=a.hidden // 64, num_kv_heads=a.hidden // 64)
        if a.model == "huginn":
            over.setdefault("init_std", (2 / (5 * a.hidden)) ** 0.5)
            over["embed_scale"] = a.hidden ** 0.5
    data = MixtureConfig(seq_len=a.seq_len, rows=numbers(a.rows, int, 3, "--rows"), seed=a.seed,
                         addition=Addition(a.max_digits), prompt_weight=a.prompt_weight,
                         retrieval=Retrieval(max_pairs=a.max_pairs, num_queries=a.queries),
                         curriculum_start=a.curriculum_start, curriculum_steps=a.curriculum_steps)
    return TrainConfig(model=tiny_model_config(a.model, **over), data=data, loops=a.loops, lr=a.lr,
                       warmup_steps=a.warmup, total_steps=a.total_steps, final_lr_frac=a.final_lr_frac,
                       weight_decay=a.weight_decay, b2=a.b2, clip_norm=a.clip, seed=a.seed,
                       task_weights=numbers(a.task_weights, float, 3, "--task-weights"),
                       random_state=not a.zero_state, embed_std=a.embed_std,
                       branch_norm_init=a.branch_norm_init, branch_norm_switch=a.branch_norm_switch,
                       one_loop_steps=a.one_loop_steps,
                       init_weights=a.init_weights, objective=a.objective, entropy_beta=a.entropy_beta,
                       entropy_beta_late=a.entropy_beta_late, entropy_beta_switch=a.entropy_beta_switch)


# ---- train_qat.py -------------------------------------------------------------------------------------


def qat_parser(description: str) -> ArgumentParser:
    """scripts/train_qat.py's options."""
    p = ArgumentParser(description=description)
    p.add_argument("--checkpoint", required=True, help="the model to fine-tune (HF folder or rq_jax saved model)")
    p.add_argument("--run-dir", required=True, help="checkpoints and metrics.jsonl (outside the git tree)")
    g = p.add_argument_group("trajectory (must match when resuming)")
    g.add_argument("--cache", default="residual", choices=("uniform", "rotated", "residual"),
                   help="cache format whose reads are fake-quantized")
    g.add_argument("--bits", default="2,2,2,2", help="bits per loop of a group, e.g. 2,2,2,4")
    g.add_argument("--group-size", type=positive_int, default=32, help="channel group size, a divisor of head_dim")
    g.add_argument("--calibration", metavar="DIR", help="calibration artifact (scripts/calibrate.py) for the format")
    g.add_argument("--train", choices=TRAINABLE, default="lora", help="what trains")
    g.add_argument("--lora-rank", type=positive_int, default=8, help="LoRA rank")
    g.add_argument("--lora-alpha", type=positive_float, default=16.0, help="LoRA scale numerator (alpha / rank)")
    g.add_argument("--distill", type=nonnegative_float, default=0.0,
                   help="weight of KL to the frozen model's dense logits")
    g.add_argument("--passes", type=positive_int, default=1, help="refinement passes of the teacher-forced forward")
    g.add_argument("--no-remat", action="store_true", help="keep every layer's activations (no jax.checkpoint)")
    g.add_argument("--loops", type=positive_int, default=None,
                   help="loops / recurrence steps (default: the model's)")
    g.add_argument("--steps", type=positive_int, required=True, help="total steps (length of the cosine schedule)")
    g.add_argument("--lr", type=positive_float, default=3e-4, help="peak learning rate")
    g.add_argument("--warmup", type=nonnegative_int, default=None,
                   help="warm-up steps (default: min(20, steps / 10))")
    g.add_argument("--final-lr-frac", type=nonnegative_float, default=0.1, help="final lr / peak lr")
    g.add_argument("--weight-decay", type=nonnegative_float, default=0.0, help="AdamW weight decay")
    g.add_argument("--b2", type=probability, default=0.95, help="Adam's second-moment decay")
    g.add_argument("--clip", type=positive_float, default=1.0, help="global gradient-norm clip")
    g.add_argument("--seed", type=int, default=0, help="data and LoRA seed")
    g.add_argument("--seq-len", type=positive_int, default=None,
                   help="tokens per row (default: the checkpoint's training mixture, else 258)")
    g.add_argument("--rows", default=None, help="rows per batch: addition,retrieval,text (default: the mixture's)")
    g.add_argument("--task-weights", default="1,1,1", help="loss weight per task: addition,retrieval,text")
    g.add_argument("--max-digits", type=positive_int, default=None, help="addition digits (default: the mixture's)")
    g.add_argument("--max-pairs", type=positive_int, default=None, help="retrieval pairs (default: the mixture's)")
    g.add_argument("--queries", type=positive_int, default=None,
                   help="retrieval queries per example (default: the mixture's)")
    g.add_argument("--prompt-weight", type=nonnegative_float, default=None,
                   help="loss weight of prompt tokens (default: the mixture's)")
    g.add_argument("--zero-state", action="store_true", help="huginn: a zero initial state, not noise")
    r = run_control(p, eval_every=100, eval_n=128)
    r.add_argument("--eval-text-windows", type=nonnegative_int, default=16, help="stdlib windows of an eval")
    r.add_argument("--eval-batch", type=positive_int, default=32, help="rows per eval batch")
    r.add_argument("--export", metavar="DIR", help="after training, write the HF folder (LoRA merged) + model card")
    r.add_argument("--export-dtype", choices=("float32", "bfloat16"), default="float32", help="exported weights' dtype")
    p.trajectory = g
    return p


def qat_config(a, config, folder: str) -> QATConfig:
    """The `QATConfig` of train_qat.py's options for the checkpoint in `folder` (`config` its model):
    the data mixture it was trained on (its card's, `trained_mixture`, else the default) with the
    options' changes, fine-tuning starting past the pair curriculum. Raises ValueError naming a bad option."""
    d = trained_mixture(folder) or MixtureConfig()
    addition = Addition(a.max_digits) if a.max_digits is not None else d.addition
    retrieval = dataclasses.replace(d.retrieval, **{k: v for k, v in (("max_pairs", a.max_pairs),
                                                                       ("num_queries", a.queries)) if v is not None})
    data = dataclasses.replace(
        d, addition=addition, retrieval=retrieval, seed=a.seed,
        seq_len=a.seq_len if a.seq_len is not None else d.seq_len,
        rows=numbers(a.rows, int, 3, "--rows") if a.rows else d.rows,
        prompt_weight=a.prompt_weight if a.prompt_weight is not None else d.prompt_weight,
        curriculum_start=retrieval.max_pairs)  # fine-tuning starts past the pair curriculum
    warmup = min(20, a.steps // 10) if a.warmup is None else a.warmup
    if not 0 <= warmup < a.steps:
        raise ValueError(f"argument --warmup: {warmup} must be below --steps ({a.steps})")
    if config.head_dim % a.group_size:
        raise ValueError(f"argument --group-size: {a.group_size} does not divide the model's head_dim "
                         f"{config.head_dim}; use one of {divisors(config.head_dim)}")
    train = TrainConfig(model=config, data=data, loops=a.loops, lr=a.lr, warmup_steps=warmup, total_steps=a.steps,
                        final_lr_frac=a.final_lr_frac, weight_decay=a.weight_decay, b2=a.b2, clip_norm=a.clip,
                        seed=a.seed, task_weights=numbers(a.task_weights, float, 3, "--task-weights"),
                        random_state=not a.zero_state)
    return QATConfig(train=train, checkpoint=a.checkpoint, cache=a.cache, bits=numbers(a.bits, int, None, "--bits"),
                     group_size=a.group_size, calibration=a.calibration, trainable=a.train,
                     lora=LoRAConfig(a.lora_rank, a.lora_alpha), distill=a.distill, passes=a.passes,
                     remat=not a.no_remat)


def qat_command(parser, a) -> str:
    """The command that trains and exports this run, every trajectory flag given spelled out (the LoRA
    ones only when LoRA trains) and the flags that write the card (for model cards)."""
    words = ["python", "scripts/train_qat.py", "--checkpoint", a.checkpoint, "--run-dir", "RUN",
             "--eval-n", str(a.eval_n), "--eval-text-windows", str(a.eval_text_windows)]
    words += ["--export", a.export, "--export-dtype", a.export_dtype] if a.export else []
    lora = {} if a.train == "lora" else dict(lora_rank=None, lora_alpha=None)
    return spelled_command(words, parser.trajectory, argparse.Namespace(**{**vars(a), **lora}))
