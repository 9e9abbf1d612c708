"""Train (or resume) a tiny Ouro or Huginn model on the offline data mixture; optionally export it.

    python scripts/train_tiny.py --model ouro --run-dir /work/runs/ouro-a --lr 1e-3
    python scripts/train_tiny.py --model ouro --run-dir /work/runs/ouro-a --lr 1e-3 --objective ouro --export DIR

(`checkpoints/*/README.md` give each shipped model's full command.)

Rerunning the same command resumes from the run directory's latest checkpoint (the trajectory-defining
flags must match the saved run; the error lists any difference). Progress goes to a tqdm bar, metrics to
RUN_DIR/metrics.jsonl, checkpoints to RUN_DIR/ckpt (orbax) and RUN_DIR/portable (HF-named params and
Adam moments, which `--init-from` reads into a run of newer model code). SIGTERM/SIGINT checkpoint and exit.

`--mesh data=2,model=2` trains sharded (rq_jax/sharding.py): batch rows over `data`, heads and MLP over
`model`. Several hosts run the same command with JAX_COORDINATOR_ADDRESS=host:port, JAX_NUM_PROCESSES
and JAX_PROCESS_ID set and a RUN_DIR they all see; each builds only its own rows of every batch.
"""

import json
import os
import sys

import jax

from rq_jax import cli, sharding
from rq_jax.train import RunOptions, Trainer, commands


def main(argv=None):
    parser = commands.tiny_parser(__doc__)
    a = parser.parse_args(argv)
    try:
        cfg = commands.tiny_config(a)
    except ValueError as err:
        parser.error(str(err))
    if a.export:
        cli.output_folder(parser, "--export", os.path.dirname(os.path.abspath(a.export)))
    cli.output_folder(parser, "--run-dir", a.run_dir)
    cli.start(a)
    mesh = cli.device_mesh(parser, a)
    opts = RunOptions(run_dir=a.run_dir, stop_step=a.stop_step, max_minutes=a.max_minutes,
                      ckpt_every_s=60 * a.ckpt_every_min, eval_every=a.eval_every, eval_addition=a.eval_n,
                      progress=not a.no_progress, init_from=a.init_from, mesh=mesh)
    try:
        trainer = Trainer(cfg, opts)
    except ValueError as err:  # a run directory holding another trajectory, an --init-weights mismatch
        parser.error(str(err))
    if trainer.is_main:
        print(f"{a.model}: step {trainer.step} of {cfg.total_steps}, run dir {a.run_dir}", file=sys.stderr)
        if mesh is not None:
            print("\n".join(sharding.describe(cfg.model, mesh, batch=cfg.data.batch_size)), file=sys.stderr)
    trainer.run()
    if a.export:
        if jax.process_count() > 1:
            parser.error("argument --export: runs in a single process (rerun it without the JAX_* variables)")
        from rq_jax.train.export import export_hf

        n = a.export_n
        sets = dict(addition=cfg.data.addition.examples("eval", n),
                    retrieval=cfg.data.retrieval.examples("eval", n // cfg.data.retrieval.num_queries + 1),
                    retrieval_full=cfg.data.retrieval.examples("eval", n // cfg.data.retrieval.num_queries + 1,
                                                               num_pairs=cfg.data.retrieval.max_pairs),
                    text=trainer.text.eval_windows(cfg.data.seq_len + 1, 64))
        acc = trainer.evaluate(sets)
        command = commands.tiny_command(parser, a)
        info = export_hf(trainer, a.export, acc, command)
        print(json.dumps({"export": os.path.abspath(a.export), "bytes": info["bytes"], **acc}))


if __name__ == "__main__":
    main()
