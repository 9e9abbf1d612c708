"""Train (or resume) a tiny Ouro or Huginn model on the offline data mixture; optionally export it.

    python scripts/train_tiny.py --model ouro --run-dir /work/runs/ouro-a --lr 1e-3
    python scripts/train_tiny.py --model ouro --run-dir /work/runs/ouro-a --lr 1e-3 --export checkpoints/ouro-small

Rerunning the same command resumes from the run directory's latest checkpoint (the trajectory-defining
flags must match the saved run; the error lists any difference). Progress goes to a tqdm bar, metrics to
RUN_DIR/metrics.jsonl, checkpoints to RUN_DIR/ckpt (orbax) and RUN_DIR/portable (HF-named params and
Adam moments, which `--init-from` reads into a run of newer model code). SIGTERM/SIGINT checkpoint and exit.

`--mesh data=2,model=2` trains sharded (rq_jax/sharding.py): batch rows over `data`, heads and MLP over
`model`. Several hosts run the same command with JAX_COORDINATOR_ADDRESS=host:port, JAX_NUM_PROCESSES
and JAX_PROCESS_ID set and a RUN_DIR they all see; each builds only its own rows of every batch.
"""

import argparse
import json
import os
import sys

import jax

from rq_jax import sharding
from rq_jax.cli import spelled_command
from rq_jax.data import Addition, MixtureConfig, Retrieval
from rq_jax.train import RunOptions, TrainConfig, Trainer, tiny_model_config


def make_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["ouro", "huginn"], required=True)
    p.add_argument("--run-dir", required=True, help="checkpoints and metrics.jsonl (outside the git tree)")
    g = p.add_argument_group("trajectory (must match when resuming)")
    g.add_argument("--loops", type=int, default=None, help="training loops / recurrence steps (default: model's)")
    g.add_argument("--one-loop-steps", type=int, default=0,
                   help="run the first N steps with one loop (see TrainConfig)")
    g.add_argument("--hidden", type=int, default=None, help="override hidden size (heads = hidden / 64)")
    g.add_argument("--intermediate", type=int, default=None)
    g.add_argument("--layers", type=int, default=None, help="looped layers / core blocks")
    g.add_argument("--init-std", type=float, default=None)
    g.add_argument("--embed-std", type=float, default=None, help="re-initialise the embedding with this std")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--warmup", type=int, default=100)
    g.add_argument("--total-steps", type=int, default=5000, help="length of the cosine schedule")
    g.add_argument("--final-lr-frac", type=float, default=0.1)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--b2", type=float, default=0.95)
    g.add_argument("--clip", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--seq-len", type=int, default=258)
    g.add_argument("--rows", default="2,6,1", help="rows per batch: addition,retrieval,text")
    g.add_argument("--task-weights", default="1,1,1")
    g.add_argument("--max-digits", type=int, default=5)
    g.add_argument("--max-pairs", type=int, default=43)
    g.add_argument("--queries", type=int, default=43)
    g.add_argument("--curriculum-start", type=int, default=4)
    g.add_argument("--curriculum-steps", type=int, default=3000)
    g.add_argument("--prompt-weight", type=float, default=0.0)
    g.add_argument("--branch-norm-init", type=float, default=None,
                   help="ouro: initial weight of the norms on each branch's output (default 1)")
    g.add_argument("--objective", choices=["last-loop", "ouro"], default="last-loop",
                   help="last-loop: NLL of the last loop; ouro: Ouro's loss, every loop's NLL weighted by the exit "
                   "distribution minus --entropy-beta × its entropy (rq_jax/train/objectives.py)")
    g.add_argument("--entropy-beta", type=float, default=0.1,
                   help="β of the ouro objective before --entropy-beta-switch (Ouro's Stage 1a: 0.1)")
    g.add_argument("--entropy-beta-late", type=float, default=0.05,
                   help="β from --entropy-beta-switch on (Ouro's later stages: 0.05)")
    g.add_argument("--entropy-beta-switch", type=int, default=None,
                   help="step where β drops (default: total steps / 2)")
    g.add_argument("--zero-state", action="store_true", help="huginn: train from a zero initial state, not noise")
    g.add_argument("--init-weights", metavar="DIR", help="a second stage: start from the weights of a model that "
                   "an earlier run exported (--export), with a fresh optimizer and schedule")
    r = p.add_argument_group("run control")
    r.add_argument("--stop-step", type=int, default=None, help="stop before this step (default: total steps)")
    r.add_argument("--max-minutes", type=float, default=None)
    r.add_argument("--ckpt-every-min", type=float, default=5.0)
    r.add_argument("--eval-every", type=int, default=250)
    r.add_argument("--eval-n", type=int, default=256, help="addition examples per periodic eval")
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--init-from", metavar="DIR", help="start from a portable snapshot (RUN_DIR/portable of a run "
                   "with the same flags, e.g. written by older model code) when RUN_DIR has no checkpoint")
    r.add_argument("--export", metavar="DIR", help="after training, write the HF folder + tokenizer + model card")
    r.add_argument("--export-n", type=int, default=1000, help="held-out examples per task for the model card")
    r.add_argument("--mesh", help="train on a device mesh, e.g. data=2,model=2 (default: one device)")
    p.trajectory = g
    return p


def training_command(parser, a) -> str:
    """The command that trains this run, every trajectory flag given spelled out (for model cards), with
    no machine paths: the run folder is RUN and an --init-weights folder STAGE (`export.model_card` numbers
    the stages)."""
    a = argparse.Namespace(**{**vars(a), "init_weights": a.init_weights and "STAGE"})
    return spelled_command(["python", "scripts/train_tiny.py", "--model", a.model, "--run-dir", "RUN"],
                           parser.trajectory, a)


def build_config(a) -> TrainConfig:
    over = {k: v for k, v in dict(hidden_size=a.hidden, intermediate_size=a.intermediate, num_layers=a.layers,
                                   init_std=a.init_std).items() if v is not None}
    if a.hidden is not None:
        over.update(num_heads=a.hidden // 64, num_kv_heads=a.hidden // 64)
        if a.model == "huginn":
            over.setdefault("init_std", (2 / (5 * a.hidden)) ** 0.5)
            over["embed_scale"] = a.hidden ** 0.5
    data = MixtureConfig(seq_len=a.seq_len, rows=tuple(int(x) for x in a.rows.split(",")), seed=a.seed,
                         addition=Addition(a.max_digits), prompt_weight=a.prompt_weight,
                         retrieval=Retrieval(max_pairs=a.max_pairs, num_queries=a.queries),
                         curriculum_start=a.curriculum_start, curriculum_steps=a.curriculum_steps)
    return TrainConfig(model=tiny_model_config(a.model, **over), data=data, loops=a.loops, lr=a.lr,
                       warmup_steps=a.warmup, total_steps=a.total_steps, final_lr_frac=a.final_lr_frac,
                       weight_decay=a.weight_decay, b2=a.b2, clip_norm=a.clip, seed=a.seed,
                       task_weights=tuple(float(x) for x in a.task_weights.split(",")), random_state=not a.zero_state,
                       embed_std=a.embed_std, branch_norm_init=a.branch_norm_init,
                       one_loop_steps=a.one_loop_steps, init_weights=a.init_weights,
                       objective=a.objective, entropy_beta=a.entropy_beta,
                       entropy_beta_late=a.entropy_beta_late, entropy_beta_switch=a.entropy_beta_switch)


def main(argv=None):
    parser = make_parser()
    a = parser.parse_args(argv)
    cfg = build_config(a)
    sharding.init_distributed()  # from JAX_COORDINATOR_ADDRESS etc.; a no-op when they are not set
    try:
        mesh = sharding.parse_mesh(a.mesh)
    except ValueError as err:
        parser.error(str(err))
    opts = RunOptions(run_dir=a.run_dir, stop_step=a.stop_step, max_minutes=a.max_minutes,
                      ckpt_every_s=60 * a.ckpt_every_min, eval_every=a.eval_every, eval_addition=a.eval_n,
                      progress=not a.no_progress, init_from=a.init_from, mesh=mesh)
    trainer = Trainer(cfg, opts)
    if trainer.is_main:
        print(f"{a.model}: step {trainer.step} of {cfg.total_steps}, run dir {a.run_dir}", file=sys.stderr)
        if mesh is not None:
            print("\n".join(sharding.describe(cfg.model, mesh, batch=cfg.data.batch_size)), file=sys.stderr)
    trainer.run()
    if a.export:
        if jax.process_count() > 1:
            sys.exit("train_tiny.py: --export runs in a single process (rerun it without the JAX_* variables)")
        from rq_jax.train.export import export_hf

        n = a.export_n
        sets = dict(addition=cfg.data.addition.examples("eval", n),
                    retrieval=cfg.data.retrieval.examples("eval", n // cfg.data.retrieval.num_queries + 1),
                    retrieval_full=cfg.data.retrieval.examples("eval", n // cfg.data.retrieval.num_queries + 1,
                                                               num_pairs=cfg.data.retrieval.max_pairs),
                    text=trainer.text.eval_windows(cfg.data.seq_len + 1, 64))
        acc = trainer.evaluate(sets)
        command = training_command(parser, a)
        info = export_hf(trainer, a.export, acc, command)
        print(json.dumps({"export": os.path.abspath(a.export), "bytes": info["bytes"], **acc}))


if __name__ == "__main__":
    main()
