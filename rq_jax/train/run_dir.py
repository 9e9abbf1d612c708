"""A training run's folder: orbax checkpoints that resume exactly, and the JSONL metrics log."""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import orbax.checkpoint as ocp


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
