"""Quantization-aware fine-tuning of a checkpoint for a compressed KV cache (or resume it); optionally export.

    python scripts/train_qat.py --checkpoint checkpoints/ouro-small --cache residual --bits 2,2,2,2 \\
        --group-size 32 --train lora --lora-rank 8 --distill 1.0 --run-dir /work/runs/qat-ouro --steps 500 \\
        --export checkpoints/ouro-small-qat

Every attention read of past K/V goes through the format's fake quantization (straight-through), in
every loop, teacher-forced, the in-flight token exact (`rq_jax.train.qat`); `--passes` refines the
past's own K/V (see that module for what the forward matches exactly). `--train` picks what trains:
all weights, attention + norms, or LoRA adapters on the attention projections (merged on export).
`--distill λ` adds λ·KL to the frozen starting model's dense-cache logits. The data is the tiny-model
training mixture — by default the one the checkpoint was trained on, when its config.json records it
(retrieval at its full pair count) — and `--calibration DIR` reads a `scripts/calibrate.py` artifact.

Rerunning the same command resumes from RUN_DIR's latest checkpoint (the trajectory flags must match;
the error lists any difference). Progress goes to a tqdm bar, metrics to RUN_DIR/metrics.jsonl (loss,
KL to the dense cache, and every --eval-every steps held-out accuracy through the real packed cache),
checkpoints to RUN_DIR/ckpt. SIGTERM/SIGINT checkpoint and exit. `--export DIR` writes an HF folder
that `rq_jax.checkpoint.load` reads.
"""

import argparse
import dataclasses
import json
import os
import sys

import ml_dtypes
import numpy as np

from rq_jax import checkpoint as model_io
from rq_jax.cli import spelled_command
from rq_jax.config import from_hf_config
from rq_jax.convert.hf import resolve
from rq_jax.data import Addition, MixtureConfig
from rq_jax.eval.table import Tasks
from rq_jax.train import QATConfig, QATTrainer, RunOptions, TrainConfig
from rq_jax.train.lora import LoRAConfig
from rq_jax.train.qat_trainer import TRAINABLE


def make_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="the model to fine-tune (HF folder or rq_jax saved model)")
    p.add_argument("--run-dir", required=True, help="checkpoints and metrics.jsonl (outside the git tree)")
    g = p.add_argument_group("trajectory (must match when resuming)")
    g.add_argument("--cache", default="residual", help="cache format whose reads are fake-quantized "
                   "(uniform, rotated, residual)")
    g.add_argument("--bits", default="2,2,2,2", help="bits per loop of a group, e.g. 2,2,2,4")
    g.add_argument("--group-size", type=int, default=32)
    g.add_argument("--calibration", metavar="DIR", help="calibration artifact (scripts/calibrate.py) for the format")
    g.add_argument("--train", choices=TRAINABLE, default="lora", help="what trains")
    g.add_argument("--lora-rank", type=int, default=8)
    g.add_argument("--lora-alpha", type=float, default=16.0)
    g.add_argument("--distill", type=float, default=0.0, help="weight of KL to the frozen model's dense logits")
    g.add_argument("--passes", type=int, default=1, help="refinement passes of the teacher-forced forward")
    g.add_argument("--no-remat", action="store_true", help="keep every layer's activations (no jax.checkpoint)")
    g.add_argument("--loops", type=int, default=None, help="loops / recurrence steps (default: the model's)")
    g.add_argument("--steps", type=int, required=True, help="total steps (length of the cosine schedule)")
    g.add_argument("--lr", type=float, default=3e-4)
    g.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: min(20, steps / 10))")
    g.add_argument("--final-lr-frac", type=float, default=0.1)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--b2", type=float, default=0.95)
    g.add_argument("--clip", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--seq-len", type=int, default=None, help="default: the checkpoint's training mixture, else 320")
    g.add_argument("--rows", default=None, help="rows per batch: addition,retrieval,text")
    g.add_argument("--task-weights", default="1,1,1")
    g.add_argument("--max-digits", type=int, default=None)
    g.add_argument("--max-pairs", type=int, default=None)
    g.add_argument("--queries", type=int, default=None)
    g.add_argument("--prompt-weight", type=float, default=None)
    g.add_argument("--zero-state", action="store_true", help="huginn: a zero initial state, not noise")
    r = p.add_argument_group("run control")
    r.add_argument("--stop-step", type=int, default=None, help="stop before this step (default: --steps)")
    r.add_argument("--max-minutes", type=float, default=None)
    r.add_argument("--ckpt-every-min", type=float, default=5.0)
    r.add_argument("--eval-every", type=int, default=100, help="steps between held-out evals (0: none)")
    r.add_argument("--eval-n", type=int, default=128, help="held-out examples per task (0: no final eval)")
    r.add_argument("--eval-text-windows", type=int, default=16)
    r.add_argument("--eval-batch", type=int, default=32)
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--export", metavar="DIR", help="after training, write the HF folder (LoRA merged) + model card")
    r.add_argument("--export-dtype", choices=("float32", "bfloat16"), default="float32")
    p.trajectory = g
    return p


def base_mixture(folder: str) -> MixtureConfig:
    """The mixture the checkpoint was trained on (config.json's rq_jax.train_config), else the default."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            return TrainConfig.from_json(json.load(f)["rq_jax"]["train_config"]).data
    except (OSError, KeyError, TypeError, ValueError):
        return MixtureConfig()


def build_config(a, config, folder: str) -> QATConfig:
    d = base_mixture(folder)
    addition = Addition(a.max_digits) if a.max_digits is not None else d.addition
    retrieval = dataclasses.replace(d.retrieval, **{k: v for k, v in (("max_pairs", a.max_pairs),
                                                                       ("num_queries", a.queries)) if v is not None})
    data = dataclasses.replace(
        d, addition=addition, retrieval=retrieval, seed=a.seed,
        seq_len=a.seq_len if a.seq_len is not None else d.seq_len,
        rows=tuple(int(x) for x in a.rows.split(",")) if a.rows else d.rows,
        prompt_weight=a.prompt_weight if a.prompt_weight is not None else d.prompt_weight,
        curriculum_start=retrieval.max_pairs)  # fine-tuning starts past the pair curriculum
    warmup = min(20, a.steps // 10) if a.warmup is None else a.warmup
    if not 0 <= warmup < a.steps:
        raise ValueError(f"--warmup ({warmup}) must be below --steps ({a.steps})")
    train = TrainConfig(model=config, data=data, loops=a.loops, lr=a.lr, warmup_steps=warmup, total_steps=a.steps,
                        final_lr_frac=a.final_lr_frac, weight_decay=a.weight_decay, b2=a.b2, clip_norm=a.clip,
                        seed=a.seed, task_weights=tuple(float(x) for x in a.task_weights.split(",")),
                        random_state=not a.zero_state)
    return QATConfig(train=train, checkpoint=a.checkpoint, cache=a.cache, bits=tuple(int(x) for x in a.bits.split(",")),
                     group_size=a.group_size, calibration=a.calibration, trainable=a.train,
                     lora=LoRAConfig(a.lora_rank, a.lora_alpha), distill=a.distill, passes=a.passes,
                     remat=not a.no_remat)


def training_command(parser, a) -> str:
    """The command that trains and exports this run, every trajectory flag given spelled out (the LoRA
    ones only when LoRA trains) and the flags that write the card (for model cards)."""
    words = ["python", "scripts/train_qat.py", "--checkpoint", a.checkpoint, "--run-dir", "RUN",
             "--eval-n", str(a.eval_n), "--eval-text-windows", str(a.eval_text_windows)]
    words += ["--export", a.export, "--export-dtype", a.export_dtype] if a.export else []
    lora = {} if a.train == "lora" else dict(lora_rank=None, lora_alpha=None)
    return spelled_command(words, parser.trajectory, argparse.Namespace(**{**vars(a), **lora}))


def main(argv=None):
    parser = make_parser()
    a = parser.parse_args(argv)
    try:
        folder = resolve(a.checkpoint)
        config = model_io.load_config(folder) if model_io.is_saved_model(folder) else from_hf_config(folder)
        cfg = build_config(a, config, folder)
    except (ValueError, OSError) as err:
        parser.error(str(err))
    tasks = Tasks(n=a.eval_n, addition=cfg.train.data.addition, retrieval=cfg.train.data.retrieval,
                  retrieval_pairs=cfg.train.data.retrieval.max_pairs, text_windows=a.eval_text_windows,
                  text_len=min(256, cfg.train.data.seq_len + 1), text_prefix=min(64, cfg.train.data.seq_len // 4))
    opts = RunOptions(run_dir=a.run_dir, stop_step=a.stop_step, max_minutes=a.max_minutes,
                      ckpt_every_s=60 * a.ckpt_every_min, eval_every=a.eval_every if a.eval_n else 0,
                      eval_batch=a.eval_batch, progress=not a.no_progress, portable=False)
    trainer = QATTrainer(cfg, opts, tasks)
    print(f"qat {cfg.cache} {list(cfg.bits)} g{cfg.group_size}, train {cfg.trainable}: step {trainer.step} of "
          f"{cfg.train.total_steps}, {trainer.trainable_count():,} trained values, run dir {a.run_dir}",
          file=sys.stderr)
    trainer.run()
    if a.export:
        metrics = trainer.evaluate() if a.eval_n else {}
        dtype = np.float32 if a.export_dtype == "float32" else ml_dtypes.bfloat16
        trainer.export(a.export, dtype=dtype, metrics=metrics, before=trainer.logged_eval(0),
                       command=training_command(parser, a))
        print(json.dumps({"export": os.path.abspath(a.export), "step": trainer.step, **metrics}))


if __name__ == "__main__":
    main()
