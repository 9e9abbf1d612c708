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

import json
import os
import sys

import ml_dtypes
import numpy as np

from rq_jax import checkpoint, cli
from rq_jax.data import Tasks
from rq_jax.train import QATTrainer, RunOptions, commands


def main(argv=None):
    parser = commands.qat_parser(__doc__)
    a = parser.parse_args(argv)
    try:
        config, folder = checkpoint.read_config(a.checkpoint)
    except (OSError, ValueError) as err:
        parser.error(f"argument --checkpoint: {err}")
    try:
        cfg = commands.qat_config(a, config, folder)
    except ValueError as err:
        parser.error(str(err))
    if a.export:
        cli.output_folder(parser, "--export", os.path.dirname(os.path.abspath(a.export)))
    cli.output_folder(parser, "--run-dir", a.run_dir)
    cli.start(a)
    tasks = Tasks(n=a.eval_n, addition=cfg.train.data.addition, retrieval=cfg.train.data.retrieval,
                  retrieval_pairs=cfg.train.data.retrieval.max_pairs, text_windows=a.eval_text_windows,
                  text_len=min(256, cfg.train.data.seq_len + 1), text_prefix=min(64, cfg.train.data.seq_len // 4))
    opts = RunOptions(run_dir=a.run_dir, stop_step=a.stop_step, max_minutes=a.max_minutes,
                      ckpt_every_s=60 * a.ckpt_every_min, eval_every=a.eval_every if a.eval_n else 0,
                      eval_batch=a.eval_batch, progress=not a.no_progress, portable=False)
    try:
        trainer = QATTrainer(cfg, opts, tasks)
    except ValueError as err:  # a run directory holding another trajectory, a format the model cannot take
        parser.error(str(err))
    print(f"qat {cfg.cache} {list(cfg.bits)} g{cfg.group_size}, train {cfg.trainable}: step {trainer.step} of "
          f"{cfg.train.total_steps}, {trainer.trainable_count():,} trained values, run dir {a.run_dir}",
          file=sys.stderr)
    trainer.run()
    if a.export:
        metrics = trainer.evaluate() if a.eval_n else {}
        dtype = np.float32 if a.export_dtype == "float32" else ml_dtypes.bfloat16
        trainer.export(a.export, dtype=dtype, metrics=metrics, before=trainer.logged_eval(0),
                       command=commands.qat_command(parser, a))
        print(json.dumps({"export": os.path.abspath(a.export), "step": trainer.step, **metrics}))


if __name__ == "__main__":
    main()
