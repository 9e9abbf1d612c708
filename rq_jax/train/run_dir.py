"""A training run's folder (orbax checkpoints that resume exactly, the JSONL metrics log) and the step
loop both trainers run over it."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any, Callable

import orbax.checkpoint as ocp
from tqdm import tqdm


class RunDir:
    """`path/ckpt`: orbax checkpoints of a state pytree plus JSON metadata; `path/metrics.jsonl`: one
    record per line. With several processes every one saves its shards, only `is_main` writes the log."""

    def __init__(self, path: str, *, keep: int, is_main: bool = True):
        os.makedirs(path, exist_ok=True)
        self.manager = ocp.CheckpointManager(os.path.abspath(os.path.join(path, "ckpt")),
                                             options=ocp.CheckpointManagerOptions(max_to_keep=keep))
        self.log_path = os.path.join(path, "metrics.jsonl")
        self.is_main = is_main

    def save(self, step: int, state: Any, meta: dict) -> bool:
        """Checkpoint `state` (and `meta`) as `step`, blocking, unless that step is already saved."""
        if self.manager.latest_step() == step:
            return False
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)))
        self.manager.wait_until_finished()
        return True

    def restore(self, template: Any) -> tuple[Any, dict] | None:
        """(state, meta) of the latest checkpoint, restored into `template`'s structure and shardings,
        or None when there is none."""
        latest = self.manager.latest_step()
        if latest is None:
            return None
        restored = self.manager.restore(latest, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(template), meta=ocp.args.JsonRestore()))
        return restored.state, restored.meta

    def records(self) -> list[dict]:
        """Every record of the log (none before the first)."""
        if not os.path.exists(self.log_path):
            return []
        with open(self.log_path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def truncate_log(self, keep: Callable[[dict], bool]) -> None:
        """Keep only the records `keep` accepts (a resumed run drops what it will write again)."""
        if self.is_main and os.path.exists(self.log_path):
            kept = [r for r in self.records() if keep(r)]
            with open(self.log_path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)

    def log(self, record: dict) -> None:
        """Append one record."""
        if self.is_main:
            with open(self.log_path, "a") as f:
                f.write(json.dumps(record) + "\n")


def run_steps(run_dir: RunDir, start: int, stop: int, opts, *, train: Callable[[int], tuple[dict, dict]],
              evaluate: Callable[[], dict], save: Callable[[], None], desc: str,
              eval_at_start: bool = False) -> dict | None:
    """The training loop: `train(step)` for step = start, start + 1, … — it trains that step, advances the
    trainer, and returns (the step's log record, the progress bar's postfix) — until `stop`,
    `opts.max_minutes` or SIGTERM/SIGINT. Every `opts.eval_every` steps (and before the first with
    `eval_at_start`) `evaluate()`'s metrics are logged; `save()` runs every `opts.ckpt_every_s` and on exit.
    A tqdm bar when `opts.progress` (process 0 only). Returns the last step's record."""
    stopping = []
    handlers = {s: signal.signal(s, lambda *_: stopping.append(True)) for s in (signal.SIGTERM, signal.SIGINT)}
    start_wall = last_ckpt = time.time()
    last, step = None, start
    bar = tqdm(total=stop, initial=start, disable=not (opts.progress and run_dir.is_main), dynamic_ncols=True,
               mininterval=1.0 if sys.stderr.isatty() else 60.0, desc=desc)

    def eval_and_log():
        t0 = time.time()
        ev = evaluate()
        run_dir.log({"step": step, "eval": ev, "eval_seconds": time.time() - t0})
        if run_dir.is_main:
            bar.write(f"step {step} eval " + " ".join(f"{k}={v:.4f}" for k, v in ev.items()))

    try:
        if opts.eval_every and eval_at_start and step < stop:
            eval_and_log()
        while step < stop and not stopping:
            if opts.max_minutes is not None and time.time() - start_wall > 60 * opts.max_minutes:
                break
            last, postfix = train(step)
            run_dir.log(last)
            step += 1
            bar.update(1)
            bar.set_postfix(**postfix, refresh=False)
            if opts.eval_every and step % opts.eval_every == 0:
                eval_and_log()
            if time.time() - last_ckpt > opts.ckpt_every_s:
                save()
                last_ckpt = time.time()
    finally:
        bar.close()
        save()
        for s, h in handlers.items():
            signal.signal(s, h)
    return last
