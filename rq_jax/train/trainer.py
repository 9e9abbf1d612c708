"""The training loop: jitted AdamW step, orbax checkpoints that resume exactly, JSONL metrics, eval.

State saved at a step boundary: params, optimizer state (its schedule count included) and the step.
The data position is the step itself (`Mixture.batch(step)` is a pure function), and the step has no
other randomness, so a resumed run follows the uninterrupted run's trajectory bit for bit.

With a mesh (`RunOptions.mesh`, see `rq_jax.sharding`) params and Adam moments are split over `model`
and the batch rows over `data`; each process builds only the rows its devices hold (`Mixture.row` is
random-access) and orbax saves and restores the sharded arrays, every process writing its shards.
Metrics, logs and portable snapshots are written by process 0 only.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from types import SimpleNamespace
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from rq_jax import sharding
from rq_jax.config import from_hf_config
from rq_jax.data import TASKS, Mixture, StdlibText
from rq_jax.models import init_model
from rq_jax.train import heldout, objectives
from rq_jax.train.portable import load_params, load_portable, save_portable
from rq_jax.train.run_config import TrainConfig, diff
from rq_jax.train.run_dir import RunDir, run_steps


@dataclasses.dataclass
class RunOptions:
    """How a run is driven; none of it changes the trajectory."""

    run_dir: str
    stop_step: int | None = None  # stop (with a checkpoint) before this step; None: total_steps
    max_minutes: float | None = None  # stop (with a checkpoint) after this much wall time
    ckpt_every_s: float = 300.0
    ckpt_keep: int = 3
    eval_every: int = 250  # steps; 0: never
    eval_addition: int = 256
    eval_retrieval: int = 96  # sequences (× num_queries answers), pairs uniform in min..max
    eval_retrieval_full: int = 48  # sequences with retrieval.max_pairs pairs
    eval_text_windows: int = 32
    eval_batch: int = 32
    progress: bool = True
    init_from: str | None = None  # a `portable` snapshot to start from when run_dir has no checkpoint
    portable: bool = True  # also write RUN_DIR/portable (see rq_jax.train.portable) at every checkpoint
    #: Train on this mesh (axes data/model, `rq_jax.sharding.parse_mesh`); None: one device. A mesh
    #: changes only the order of float reductions, so trajectories agree to rounding, not bit for bit.
    mesh: Mesh | None = None


def make_optimizer(cfg: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Global-norm clipping then AdamW (decay on ≥ 2-D params) with warm-up + cosine."""
    sched = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup_steps, cfg.total_steps,
                                               end_value=cfg.lr * cfg.final_lr_frac)
    def decay_mask(params):
        return jax.tree.map(lambda p: p.ndim >= 2, params)
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                     optax.adamw(sched, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask))
    return tx, sched


def make_train_step(graphdef, rest, cfg: TrainConfig, mesh: Mesh | None = None) -> Callable:
    """(params, opt_state, tokens [B, L+1], weights [B, L], task [B], step) → (params, opt_state, metrics),
    jitted (compiled once per (graphdef, cfg, mesh) in a process). `step` seeds Huginn's random initial
    state and picks the loop count (`TrainConfig.loops_at`). With a mesh the new params and Adam moments
    keep `sharding.param_specs`, metrics are replicated."""
    as_step = jnp.int32 if mesh is None else np.int32  # a host scalar is a valid input on any mesh

    def train_step(params, opt_state, tokens, weights, task, step):
        fn = _jitted_train_step(graphdef, cfg, mesh, cfg.loops_at(step))
        return fn(params, rest, opt_state, tokens, weights, task, as_step(step))

    return train_step


@functools.lru_cache(maxsize=8)
def _jitted_train_step(graphdef, cfg: TrainConfig, mesh: Mesh | None, loops: int) -> Callable:
    tx, _ = make_optimizer(cfg)
    task_w = np.asarray(cfg.task_weights, np.float32) * (np.asarray(cfg.data.rows) > 0)

    random_state = cfg.random_state and cfg.model.family == "huginn"

    def loss_fn(params, rest, tokens, weights, task, step):
        model = nnx.merge(graphdef, params, rest)
        extra = {"rng": jax.random.fold_in(jax.random.key(cfg.seed), step)} if random_state else {}
        out = model(tokens[:, :-1], num_loops=loops, **extra)
        aux = {}
        if cfg.objective == "ouro":
            terms = objectives.ouro_loss(model.head(out.extras["hidden_steps"]), out.extras["exit_pdf"],
                                         tokens[:, 1:], cfg.beta_at(step))
            per_token = terms.loss
            mask = weights / jnp.maximum(jnp.sum(weights), 1.0)
            aux = dict(loop_nll=jnp.sum(terms.nll * mask, axis=(1, 2)), exit_pdf=jnp.sum(terms.pdf * mask, axis=(1, 2)),
                       exit_entropy=jnp.sum(terms.entropy * mask))
        else:
            per_token = optax.softmax_cross_entropy_with_integer_labels(out.logits, tokens[:, 1:])  # [B, L]
        per_task = []
        for t in range(len(TASKS)):
            w = weights * (task == t)[:, None]
            per_task.append(jnp.sum(per_token * w) / jnp.maximum(jnp.sum(w), 1.0))
        per_task = jnp.stack(per_task)
        return jnp.sum(per_task * task_w) / task_w.sum(), (per_task, aux)

    @jax.jit
    def step(params, rest, opt_state, tokens, weights, task, step):
        (loss, (per_task, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rest, tokens, weights,
                                                                                 task, step)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = dict(loss=loss, per_task=per_task, grad_norm=optax.tree.norm(grads), **aux)
        if mesh is not None:  # the Adam moments' paths end in the param names, so one rule set fits both
            params = sharding.constrain(params, sharding.param_specs(params, cfg.model, mesh), mesh)
            opt_state = sharding.constrain(opt_state, sharding.param_specs(opt_state, cfg.model, mesh), mesh)
            metrics = sharding.constrain(metrics, jax.tree.map(lambda _: PartitionSpec(), metrics), mesh)
        return params, opt_state, metrics

    return step


def reinit_embedding(params, cfg: TrainConfig):
    """params with the token embedding (the one [vocab, hidden] leaf) redrawn as N(0, embed_std²)."""
    shape = (cfg.model.vocab_size, cfg.model.hidden_size)
    found = [leaf for leaf in jax.tree.leaves(params) if leaf.shape == shape]
    if len(found) != 1:
        raise ValueError(f"expected one [vocab, hidden] = {shape} parameter (the embedding), found {len(found)}")
    key = jax.random.fold_in(jax.random.key(cfg.seed), 10**6)
    return jax.tree.map(lambda p: (jax.random.normal(key, shape, p.dtype) * cfg.embed_std if p.shape == shape else p),
                        params)


#: Ouro's norms on a branch's output, before the residual add (`branch_norm_init`).
BRANCH_NORMS = ("input_layernorm_2", "post_attention_layernorm_2")


def scale_branch_norms(params, value: float | None = None, factor: float | None = None):
    """params with every Ouro branch-output norm weight (`BRANCH_NORMS`) set to `value`, or multiplied by
    `factor`. Raises ValueError unless exactly one of the two is given."""
    if (value is None) == (factor is None):
        raise ValueError(f"scale_branch_norms takes a value or a factor, not both or neither (got {value}, {factor})")

    def one(path, p):
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        if not any(n in BRANCH_NORMS for n in names):
            return p
        return jnp.full_like(p, value) if factor is None else p * factor

    return jax.tree_util.tree_map_with_path(one, params)


def load_weights(folder: str, cfg: TrainConfig, like):
    """The float32 params of the exported model in `folder`, in the tree of `like` (the run's params).

    Raises ValueError if `folder`'s model config differs from `cfg.model` or `cfg.embed_std` is set
    (a re-initialised embedding would discard the loaded one)."""
    if cfg.embed_std is not None or cfg.branch_norm_init is not None:
        raise ValueError("init_weights excludes embed_std and branch_norm_init: they would overwrite loaded weights")
    saved = from_hf_config(folder)
    if saved != cfg.model:
        raise ValueError(f"{folder} holds another model config than the run's:\n  saved:     {saved}\n"
                         f"  requested: {cfg.model}")
    return load_params(folder, cfg.model, like)


class Trainer:
    """Builds (or restores from `opts.run_dir`) a run of `cfg` and trains it; see `run`."""

    def __init__(self, cfg: TrainConfig, opts: RunOptions, text: StdlibText | None = None):
        self.cfg, self.opts = cfg, opts
        self.text = text if text is not None else StdlibText()
        self.mixture = Mixture(cfg.data, self.text)
        model = init_model(cfg.model, cfg.seed)
        self.graphdef, self.params, self.rest = nnx.split(model, nnx.Param, ...)
        if cfg.init_weights is not None:
            self.params = load_weights(cfg.init_weights, cfg, self.params)
        else:
            if cfg.embed_std is not None:
                self.params = reinit_embedding(self.params, cfg)
            if cfg.branch_norm_init is not None:
                self.params = scale_branch_norms(self.params, cfg.branch_norm_init)
        self.tx, self.schedule = make_optimizer(cfg)
        self.mesh = opts.mesh
        self.opt_state = self.tx.init(self.params)
        self._place()
        self.step = 0
        self.train_seconds = 0.0
        self._train_step = make_train_step(self.graphdef, self.rest, cfg, self.mesh)
        self._score = heldout.make_score_fn(self.graphdef, self.rest, cfg.num_loops)
        if self.mesh is not None:
            score = self._score
            self._score = lambda params, tokens: sharding.to_host(
                score(params, sharding.put(tokens, sharding.batch_sharding(self.mesh, tokens.shape))))
        self.is_main = jax.process_index() == 0
        self.run_dir = RunDir(opts.run_dir, keep=opts.ckpt_keep, is_main=self.is_main)
        self._eval_sets = None
        if not self.restore() and opts.init_from:
            load_portable(self, opts.init_from)
            self._place()

    def _place(self) -> None:
        """Put params, optimizer state and rest on the mesh (`sharding.param_specs`); no-op without one."""
        if self.mesh is None:
            return
        self.params = sharding.shard_state(self.params, self.cfg.model, self.mesh)
        self.opt_state = sharding.shard_state(self.opt_state, self.cfg.model, self.mesh)
        self.rest = sharding.put(self.rest, sharding.replicated(self.mesh))

    def batch(self, step: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Step `step`'s training batch as arrays: tokens [B, L+1], weights [B, L], task [B]. With a mesh,
        global arrays split over `data`, of which this process builds only the rows its devices hold."""
        if self.mesh is None:
            b = self.mixture.batch(step)
            return jnp.asarray(b.tokens), jnp.asarray(b.weights), jnp.asarray(b.task)
        b, length = self.cfg.data.batch_size, self.cfg.data.seq_len + 1
        rows_sharding = sharding.batch_sharding(self.mesh, (b,))  # the same rows for every field
        rows = [self.mixture.row(step, r) for r in sharding.process_rows(rows_sharding, (b,))]
        tokens = np.stack([t for t, _, _ in rows])
        weights = np.stack([w for _, w, _ in rows])[:, 1:]
        task = np.array([k for _, _, k in rows], np.int32)
        return tuple(sharding.put_process_local(x, rows_sharding, shape) for x, shape in
                     ((tokens, (b, length)), (weights, (b, length - 1)), (task, (b,))))

    # ---- checkpoints -------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        step = jnp.int32(self.step)
        if self.mesh is not None:  # every saved array global, so each process writes its own shards
            step = sharding.put(np.int32(self.step), sharding.replicated(self.mesh))
        return {"params": self.params, "opt_state": self.opt_state, "step": step}

    def save(self) -> None:
        """Checkpoint the current step (blocking) unless it is already saved."""
        meta = {"step": self.step, "train_seconds": self.train_seconds, "config": self.cfg.to_json(),
                "python_version": self.text.python_version, "jax_version": jax.__version__}
        if not self.run_dir.save(self.step, self._state(), meta):
            return
        if self.opts.portable:
            view = self
            if jax.process_count() > 1:  # gathered on every process (a collective), written by process 0
                view = SimpleNamespace(params=sharding.to_host(self.params), opt_state=sharding.to_host(self.opt_state),
                                       graphdef=self.graphdef, rest=self.rest, step=self.step,
                                       train_seconds=self.train_seconds, cfg=self.cfg)
            if self.is_main:
                save_portable(view, os.path.join(self.opts.run_dir, "portable"))

    def restore(self) -> bool:
        """Load the latest checkpoint of run_dir if any (its config must equal ours). True if loaded."""
        restored = self.run_dir.restore(self._state())
        if restored is None:
            return False
        state, meta = restored
        saved = TrainConfig.from_json(meta["config"])
        if saved != self.cfg:
            raise ValueError(f"{self.opts.run_dir} holds a run with another config; differences (saved != "
                             f"requested):\n  " + "\n  ".join(diff(saved, self.cfg)))
        self.params, self.opt_state, self.step = state["params"], state["opt_state"], int(state["step"])
        self.train_seconds = float(meta.get("train_seconds", 0.0))
        return True

    # ---- metrics ------------------------------------------------------------------------------
    # ---- evaluation ---------------------------------------------------------------------------
    def eval_sets(self) -> dict:
        """Held-out sets (built once): addition, retrieval (uniform pairs and all max_pairs), text windows."""
        if self._eval_sets is None:
            d, o = self.cfg.data, self.opts
            self._eval_sets = dict(
                addition=d.addition.examples("eval", o.eval_addition),
                retrieval=d.retrieval.examples("eval", o.eval_retrieval),
                retrieval_full=d.retrieval.examples("eval", o.eval_retrieval_full, num_pairs=d.retrieval.max_pairs),
                text=self.text.eval_windows(d.seq_len + 1, o.eval_text_windows))
        return self._eval_sets

    def evaluate(self, sets: dict | None = None) -> dict[str, float]:
        """Exact-match accuracy (`*_acc`) and answer-token accuracy (`*_tok`) per task, held-out bits per
        byte. `retrieval` draws pairs uniformly in min..max_pairs, `retrieval{max_pairs}` uses all of them."""
        sets, d, b = sets or self.eval_sets(), self.cfg.data, self.opts.eval_batch
        out = {}
        for name, examples, length in (("addition", sets["addition"], d.addition.length),
                                       ("retrieval", sets["retrieval"], d.seq_len + 1),
                                       (f"retrieval{d.retrieval.max_pairs}", sets["retrieval_full"], d.seq_len + 1)):
            r = heldout.answer_scores(self._score, self.params, examples, length, b)
            out[f"{name}_acc"], out[f"{name}_tok"] = r["em"], r["token_acc"]
        out["text_bpb"] = heldout.bits_per_byte(self._score, self.params, sets["text"], b)
        return out

    def model(self):
        """The current model (an nnx module holding the trained params)."""
        return nnx.merge(self.graphdef, self.params, self.rest)

    # ---- the loop -----------------------------------------------------------------------------
    def run(self) -> dict | None:
        """Train from the current step until stop_step / total_steps / max_minutes or SIGTERM/SIGINT,
        checkpointing every ckpt_every_s and on exit (`run_dir.run_steps`). Returns the last step's metrics."""
        cfg, o = self.cfg, self.opts
        stop = min(o.stop_step if o.stop_step is not None else cfg.total_steps, cfg.total_steps)
        # a resumed run drops the records it writes again: training steps ≥ the current step, evals after it
        self.run_dir.truncate_log(lambda r: r["step"] <= self.step if "eval" in r else r["step"] < self.step)
        return run_steps(self.run_dir, self.step, stop, o, train=self._train_one, evaluate=self.evaluate,
                         save=self.save, desc=cfg.model.family)

    def _train_one(self, step: int) -> tuple[dict, dict]:
        """Train step `step` (the current one) and advance: (its log record, the bar's postfix)."""
        cfg = self.cfg
        t0 = time.time()
        if cfg.branch_norm_switch is not None and step == cfg.one_loop_steps:
            self.params = scale_branch_norms(self.params, factor=cfg.branch_norm_switch)
        tokens, weights, task = self.batch(step)
        self.params, self.opt_state, m = self._train_step(self.params, self.opt_state, tokens, weights, task, step)
        loss, per_task = float(m["loss"]), np.asarray(m["per_task"])
        dt = time.time() - t0
        self.train_seconds += dt
        self.step = step + 1
        record = {"step": step, "loss": loss, **{f"loss_{t}": float(v) for t, v in zip(TASKS, per_task)},
                  "lr": float(self.schedule(step)), "grad_norm": float(m["grad_norm"]),
                  "tokens_per_s": weights.size / dt, "s_per_step": dt,
                  "retrieval_max_pairs": cfg.data.retrieval_max_pairs(step), "loops": cfg.loops_at(step),
                  "train_seconds": self.train_seconds,
                  **{k: np.asarray(m[k]).tolist() for k in ("loop_nll", "exit_pdf", "exit_entropy") if k in m}}
        return record, dict(loss=f"{loss:.3f}", add=f"{per_task[0]:.2f}", ret=f"{per_task[1]:.2f}",
                            txt=f"{per_task[2]:.2f}")
