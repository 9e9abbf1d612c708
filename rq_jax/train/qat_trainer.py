"""Quantization-aware fine-tuning runs: what trains, the loss, the jitted step, checkpoints, eval, export.

    cfg = QATConfig(train=TrainConfig(model=<checkpoint config>, data=..., lr=3e-4, total_steps=500),
                    checkpoint="checkpoints/ouro-small", cache="residual", bits=(2, 2, 2, 2), trainable="lora")
    trainer = QATTrainer(cfg, RunOptions(run_dir="/work/runs/qat-a"))
    trainer.run()
    trainer.export("checkpoints/ouro-small-qat")

The loss is the tiny-model training loss (`TrainConfig`: per-task mean NLL of the weighted tokens,
combined by task weight) of the logits `qat.fake_quant_forward` computes — every read of past K/V
through the chosen format, straight-through, each training row read as if decoded token by token
(every token its own call, so it reads all earlier tokens compressed; `passes` refinement passes) —
plus, with `distill` λ > 0, λ · KL(teacher ‖ student)
on the same tokens, the teacher being the frozen starting model with a dense cache. What trains
(`trainable`): "all" parameters, "attn_norms" (attention projections, Huginn's q/k bias, every
RMSNorm), or "lora" (adapters on the attention projections, `rq_jax.train.lora`; the base frozen).
Rotations and key means stay as calibrated (they do not train).

A run's state is the trainable pytree, the optimizer state and the step; the frozen weights and the
teacher are re-read from `checkpoint` (their fingerprint is checked on resume). The data position is
the step (`Mixture.batch(step)`), Huginn's random initial state is seeded by the step, so a resumed
run follows the uninterrupted one bit for bit. Held-out accuracy goes through the real packed cache
(`rq_jax.scoring.CacheScorer`) on the evaluation split (`rq_jax.data.Tasks`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from rq_jax import checkpoint as model_io
from rq_jax.cache import base, get_format
from rq_jax.calibrate import load_calibration
from rq_jax.calibrate.provenance import fingerprint, weights_mismatch
from rq_jax.convert.hf import save_hf
from rq_jax.data import TASKS, Mixture, StdlibText, Tasks
from rq_jax import scoring, setup
from rq_jax.nn import common
from rq_jax.nn.layers import RMSNorm
from rq_jax.tokenizer import byte_level_tokenizer
from rq_jax.train import lora
from rq_jax.train.run_config import TrainConfig, diff
from rq_jax.train.qat import fake_quant_forward, format_calib, supports_fake_quant
from rq_jax.train.run_dir import RunDir, run_steps
from rq_jax.train.trainer import RunOptions, make_optimizer

TRAINABLE = ("all", "attn_norms", "lora")


@dataclasses.dataclass(frozen=True)
class QATConfig:
    """A QAT run's trajectory. `train` holds the model (the checkpoint's config), the data mixture, the
    optimizer, the loop count and the seed; the rest says which cache format's reads are fake-quantized,
    what trains and how the loss is formed. `passes`: refinement passes of `fake_quant_forward`.
    `remat`: `jax.checkpoint` every scanned layer (recompute in the backward pass)."""

    train: TrainConfig
    checkpoint: str
    cache: str = "residual"
    bits: tuple[int, ...] = (2, 2, 2, 2)
    group_size: int = 32
    calibration: str | None = None
    trainable: str = "lora"
    lora: lora.LoRAConfig = lora.LoRAConfig()
    distill: float = 0.0
    passes: int = 1
    remat: bool = True

    def __post_init__(self):
        object.__setattr__(self, "bits", tuple(int(b) for b in self.bits))
        if self.trainable not in TRAINABLE:
            raise ValueError(f"unknown trainable set {self.trainable!r}: expected one of {TRAINABLE}")
        if not self.distill >= 0:
            raise ValueError(f"distill weight must be ≥ 0, got {self.distill}")
        if isinstance(self.passes, bool) or not isinstance(self.passes, int) or self.passes < 1:
            raise ValueError(f"passes must be a positive integer, got {self.passes!r}")
        fmt = self.format()
        if fmt.bits_per_element(1, 64) >= 16 or not supports_fake_quant(fmt):
            raise ValueError(f"QAT needs a quantized cache format with a fake quantization (uniform, rotated, "
                             f"residual), got {self.cache!r}")

    def format(self) -> base.CacheFormat:
        """The cache format of every layer (looped and Huginn's prelude/coda, as `init_cache` defaults)."""
        return get_format(self.cache, bits=self.bits, group_size=self.group_size)

    def to_json(self) -> dict[str, Any]:
        raw = dataclasses.asdict(self)
        raw["train"] = self.train.to_json()
        return json.loads(json.dumps(raw))

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "QATConfig":
        raw = dict(raw)
        return cls(train=TrainConfig.from_json(raw.pop("train")), lora=lora.LoRAConfig(**raw.pop("lora")),
                   bits=tuple(raw.pop("bits")), **raw)


def trainable_filter(model: nnx.Module, mode: str):
    """The nnx filter of the parameters `mode` trains ("all" or "attn_norms"; "lora" trains adapters)."""
    if mode == "all":
        return nnx.Param
    if mode != "attn_norms":
        raise ValueError(f"{mode!r} selects no base parameters")
    prefixes = [tuple(path) for path, node in nnx.iter_graph(model) if isinstance(node, lora.ATTENTION + (RMSNorm,))]
    return lambda path, x: isinstance(x, nnx.Param) and any(tuple(path[: len(p)]) == p for p in prefixes)


def student_model(graphdef, trainable, frozen, rest, cfg: QATConfig) -> nnx.Module:
    """The model being trained: base params with the trainable part (or LoRA overlay) applied."""
    if cfg.trainable == "lora":
        return nnx.merge(graphdef, lora.apply(frozen, trainable, cfg.lora.scale), rest)
    return nnx.merge(graphdef, trainable, frozen, rest)


def kl_divergence(p_logits: jax.Array, q_logits: jax.Array) -> jax.Array:
    """KL(softmax(p) ‖ softmax(q)) over the last axis, in float32."""
    lp = jax.nn.log_softmax(p_logits.astype(jnp.float32), axis=-1)
    lq = jax.nn.log_softmax(q_logits.astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1)


def make_qat_step(graphdef, teacher_graphdef, cfg: QATConfig):
    """The jitted step (trainable, opt_state, frozen, rest, teacher, teacher_rest, calib, tokens [B, L+1],
    weights [B, L], task [B], step) → (trainable, opt_state, metrics); compiled once per structure."""
    return _jitted_step(graphdef, teacher_graphdef, cfg)


@functools.lru_cache(maxsize=8)
def _jitted_step(graphdef, teacher_graphdef, cfg: QATConfig):
    tc = cfg.train
    tx, _ = make_optimizer(tc)
    fmt = cfg.format()
    kw = {"num_loops": tc.num_loops}
    task_w = np.asarray(tc.task_weights, np.float32) * (np.asarray(tc.data.rows) > 0)
    random_state = tc.random_state and tc.model.family == "huginn"

    def per_task(values, weights, task):
        out = []
        for t in range(len(TASKS)):
            w = weights * (task == t)[:, None]
            out.append(jnp.sum(values * w) / jnp.maximum(jnp.sum(w), 1.0))
        return jnp.stack(out)

    def loss_fn(trainable, frozen, rest, teacher, teacher_rest, calib, tokens, weights, task, step):
        extra = {"rng": jax.random.fold_in(jax.random.key(tc.seed), step)} if random_state else {}
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        with common.remat_layers(cfg.remat):
            model = student_model(graphdef, trainable, frozen, rest, cfg)
            out = fake_quant_forward(model, inputs, fmt, calib, passes=cfg.passes, **kw, **extra)
        nll = optax.softmax_cross_entropy_with_integer_labels(out.logits, targets)  # [B, L]
        kl_dense = kl_divergence(jax.lax.stop_gradient(out.dense_logits), jax.lax.stop_gradient(out.logits))
        objective = nll
        metrics = {}
        if cfg.distill:
            t_logits = nnx.merge(teacher_graphdef, teacher, teacher_rest)(inputs, **kw, **extra).logits
            kl_teacher = kl_divergence(jax.lax.stop_gradient(t_logits), out.logits)
            objective = nll + cfg.distill * kl_teacher
            metrics["kl_teacher"] = jnp.sum(kl_teacher * weights) / jnp.maximum(jnp.sum(weights), 1.0)
        tasks = per_task(objective, weights, task)
        loss = jnp.sum(tasks * task_w) / task_w.sum()
        metrics.update(per_task=tasks, nll=jnp.sum(per_task(nll, weights, task) * task_w) / task_w.sum(),
                       kl_dense=jnp.sum(kl_dense * weights) / jnp.maximum(jnp.sum(weights), 1.0))
        return loss, metrics

    @jax.jit
    def step(trainable, opt_state, frozen, rest, teacher, teacher_rest, calib, tokens, weights, task, step):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            trainable, frozen, rest, teacher, teacher_rest, calib, tokens, weights, task, step)
        updates, opt_state = tx.update(grads, opt_state, trainable)
        trainable = optax.apply_updates(trainable, updates)
        return trainable, opt_state, dict(loss=loss, grad_norm=optax.tree.norm(grads), **metrics)

    return step


class QATTrainer:
    """A QAT run of `cfg` in `opts.run_dir` (restored from its latest checkpoint when there is one).

    `tasks`: the held-out sets of the periodic eval (default: `opts`' sizes on the mixture's tasks).
    Of `RunOptions`, `mesh`, `init_from` and `portable` are not supported (one device; orbax only).
    """

    def __init__(self, cfg: QATConfig, opts: RunOptions, tasks: Tasks | None = None, text: StdlibText | None = None):
        if opts.mesh is not None or opts.init_from:
            raise ValueError("QAT runs on one device from its checkpoint: RunOptions.mesh and init_from are not "
                             "supported")
        self.cfg, self.opts = cfg, opts
        self._text = text
        tc = cfg.train
        base_model, self.base_folder = model_io.load(cfg.checkpoint)
        if base_model.config != tc.model:
            raise ValueError(f"{cfg.checkpoint} holds another model than the run's config: {base_model.config} vs "
                             f"{tc.model}")
        self.fmt = cfg.format()
        self.num_loops = tc.num_loops
        if cfg.calibration:
            self.calib = load_calibration(cfg.calibration, base_model, self.fmt, num_loops=self.num_loops)
        else:
            self.calib = format_calib(tc.model, self.fmt, self.num_loops)
        self.base_fingerprint = fingerprint(base_model)
        self.teacher_graphdef, self.teacher, self.teacher_rest = nnx.split(base_model, nnx.Param, ...)
        if cfg.trainable == "lora":
            self.graphdef, self.frozen, self.rest = self.teacher_graphdef, self.teacher, self.teacher_rest
            self.trainable = lora.init(base_model, cfg.lora, jax.random.fold_in(jax.random.key(tc.seed), 7))
        else:
            self.graphdef, self.trainable, self.frozen, self.rest = nnx.split(
                base_model, trainable_filter(base_model, cfg.trainable), nnx.Param, ...)
        self.tx, self.schedule = make_optimizer(tc)
        self.opt_state = self.tx.init(self.trainable)
        self.step, self.train_seconds = 0, 0.0
        self.tasks = tasks or Tasks(n=opts.eval_addition, addition=tc.data.addition, retrieval=tc.data.retrieval,
                                    retrieval_pairs=tc.data.retrieval.max_pairs, text_windows=opts.eval_text_windows,
                                    text_len=min(256, tc.data.seq_len + 1), text_prefix=min(64, tc.data.seq_len // 4))
        self._step = make_qat_step(self.graphdef, self.teacher_graphdef, cfg)
        self._scorer = None
        self.run_dir = RunDir(opts.run_dir, keep=opts.ckpt_keep)
        self.restore()

    @functools.cached_property
    def text(self) -> StdlibText:
        """The stdlib text source (read on first use: a mismatched resume fails before it)."""
        return self._text if self._text is not None else StdlibText()

    @functools.cached_property
    def mixture(self) -> Mixture:
        """The training stream (`Mixture.batch(step)`)."""
        return Mixture(self.cfg.train.data, self.text)

    # ---- the model ----------------------------------------------------------------------------
    def model(self) -> nnx.Module:
        """The current student (LoRA merged into the weights)."""
        return student_model(self.graphdef, self.trainable, self.frozen, self.rest, self.cfg)

    def trainable_count(self) -> int:
        """Number of trained values (parameters or adapter entries)."""
        return int(sum(x.size for x in jax.tree.leaves(self.trainable)))

    # ---- checkpoints -----------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return {"trainable": self.trainable, "opt_state": self.opt_state, "step": jnp.int32(self.step)}

    def save(self) -> None:
        """Checkpoint the current step (blocking) unless it is already saved."""
        meta = {"step": self.step, "train_seconds": self.train_seconds, "config": self.cfg.to_json(),
                "base_fingerprint": self.base_fingerprint, "jax_version": jax.__version__}
        self.run_dir.save(self.step, self._state(), meta)

    def restore(self) -> bool:
        """Load run_dir's latest checkpoint if any. Raises ValueError if it was saved for another config
        or another starting checkpoint's weights. True if loaded."""
        restored = self.run_dir.restore(self._state())
        if restored is None:
            return False
        state, meta = restored
        saved = QATConfig.from_json(meta["config"])
        if saved != self.cfg:
            raise ValueError(f"{self.opts.run_dir} holds a QAT run with another config; differences (saved != "
                             f"requested):\n  " + "\n  ".join(_config_diff(saved, self.cfg)))
        base_model = nnx.merge(self.teacher_graphdef, self.teacher, self.teacher_rest)
        bad = weights_mismatch(meta["base_fingerprint"], base_model)
        if bad:
            raise ValueError(f"{self.cfg.checkpoint} changed since the run started (parameters {bad[:4]}); the run "
                             "cannot resume on other frozen weights")
        self.trainable, self.opt_state, self.step = state["trainable"], state["opt_state"], int(state["step"])
        self.train_seconds = float(meta.get("train_seconds", 0.0))
        return True

    # ---- metrics -------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Held-out metrics of the current student through the real packed cache (`CacheScorer`, one
        compile per batch shape for the whole run): per task greedy exact match through the format
        (`*_acc`) and through a dense cache (`*_dense_acc`), KL to the dense cache (`*_kl`), greedy
        agreement; stdlib bits per byte (`text_bpb`, `text_dense_bpb`, `text_kl`)."""
        tasks, batch = self.tasks, self.opts.eval_batch
        if self._scorer is None:
            kw = {"num_loops": self.num_loops}
            self._scorer = scoring.CacheScorer(self.model(), self.fmt, calib=self.calib, seed=tasks.seed, **kw)
        else:
            self._scorer.params = setup.weights(self.model())[1]
        out = {}
        for name, examples, length in tasks.answer_sets():
            scores, _, answer_id = scoring.score_examples(self._scorer, examples, length, batch)
            m = scoring.task_metrics(scores, answer_id)
            out.update({f"{name}_acc": m["accuracy"], f"{name}_dense_acc": m["dense_accuracy"],
                        f"{name}_kl": m["kl"], f"{name}_agreement": m["agreement"]})
        if tasks.text_windows:
            windows = self.text.eval_windows(tasks.text_len, tasks.text_windows)
            m = scoring.text_metrics(scoring.score_windows(self._scorer, windows, tasks.text_prefix, batch))
            out.update(text_bpb=m["bpb"], text_dense_bpb=m["dense_bpb"], text_kl=m["kl"])
        return out

    # ---- the loop ----------------------------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, Any]:
        """Run training step `step` on its batch, updating the trainable state; returns its metrics."""
        b = self.mixture.batch(step)
        self.trainable, self.opt_state, m = self._step(
            self.trainable, self.opt_state, self.frozen, self.rest, self.teacher, self.teacher_rest, self.calib,
            jnp.asarray(b.tokens), jnp.asarray(b.weights), jnp.asarray(b.task), jnp.int32(step))
        return m

    def run(self) -> dict | None:
        """Train from the current step until stop_step / total_steps / max_minutes or SIGTERM/SIGINT,
        checkpointing every ckpt_every_s and on exit; evaluate every eval_every steps (and before the
        first step, as the starting point). Returns the last step's record (`run_dir.run_steps`)."""
        tc, o = self.cfg.train, self.opts
        stop = min(o.stop_step if o.stop_step is not None else tc.total_steps, tc.total_steps)
        # a resumed run drops what it writes again: training steps ≥ the current step, evals after it (and
        # the starting eval when it resumes at step 0)
        self.run_dir.truncate_log(lambda r: r["step"] < self.step or (r["step"] == self.step > 0 and "eval" in r))
        return run_steps(self.run_dir, self.step, stop, o, train=self._train_one, evaluate=self.evaluate,
                         save=self.save, desc=f"qat {self.fmt.name}", eval_at_start=self.step == 0)

    def _train_one(self, step: int) -> tuple[dict, dict]:
        """Train step `step` (the current one) and advance: (its log record, the bar's postfix)."""
        t0 = time.time()
        m = self.train_step(step)
        loss = float(m["loss"])
        dt = time.time() - t0
        self.train_seconds += dt
        self.step = step + 1
        tc = self.cfg.train
        record = {"step": step, "loss": loss, "nll": float(m["nll"]),
                  **{f"loss_{t}": float(v) for t, v in zip(TASKS, np.asarray(m["per_task"]))},
                  "kl_dense": float(m["kl_dense"]),
                  **({"kl_teacher": float(m["kl_teacher"])} if "kl_teacher" in m else {}),
                  "lr": float(self.schedule(step)), "grad_norm": float(m["grad_norm"]),
                  "tokens_per_s": tc.data.batch_size * tc.data.seq_len / dt, "s_per_step": dt,
                  "train_seconds": self.train_seconds}
        return record, dict(loss=f"{loss:.3f}", kl=f"{record['kl_dense']:.4f}")

    # ---- export ----------------------------------------------------------------------------------
    def logged_eval(self, step: int) -> dict[str, float] | None:
        """The eval record of `step` in metrics.jsonl (e.g. step 0: the starting model), if any."""
        found = [r["eval"] for r in self.run_dir.records() if "eval" in r and r["step"] == step]
        return found[-1] if found else None

    def export(self, folder: str, *, dtype=np.float32, metrics: dict | None = None, before: dict | None = None,
               command: str | None = None) -> dict:
        """Write the student (LoRA merged) as an HF folder — config.json, model.safetensors in `dtype`,
        the starting checkpoint's tokenizer files, README.md — loadable by `rq_jax.checkpoint.load`.
        `metrics` (and `before`: the starting model's) go to the card. Returns the card's facts. (A
        calibration fitted for the starting weights does not carry over: refit it for the export.)"""
        cfg = self.cfg
        info = {"weights": "quantization-aware fine-tuned", "base_checkpoint": cfg.checkpoint,
                "cache": self.fmt.schedule_name(self.num_loops), "trainable": cfg.trainable,
                "trained_values": self.trainable_count(), "step": self.step,
                "train_seconds": round(self.train_seconds, 1), "qat_config": cfg.to_json(),
                "metrics": metrics or {}, "metrics_before": before or {}, "command": command,
                "storage_dtype": np.dtype(dtype).name,
                "eval_sets": {k: getattr(self.tasks, k) for k in ("n", "retrieval_pairs", "text_windows")}}
        save_hf(self.model(), folder, dtype=dtype, extra_config={"rq_jax": info})
        copied = False
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
            src = os.path.join(self.base_folder, name)
            if os.path.isfile(src):
                shutil.copy(src, os.path.join(folder, name))
                copied |= name == "tokenizer.json"
        if not copied and cfg.train.model.vocab_size == 259:
            byte_level_tokenizer().save(os.path.join(folder, "tokenizer.json"))
        with open(os.path.join(folder, "README.md"), "w") as f:
            f.write(model_card(info, cfg))
        return info


def _config_diff(a: QATConfig, b: QATConfig) -> list[str]:
    out = [f"train.{d}" for d in diff(a.train, b.train)]
    ja, jb = a.to_json(), b.to_json()
    return out + [f"{k}: {ja[k]!r} != {jb[k]!r}" for k in sorted(ja) if k != "train" and ja[k] != jb[k]]


def model_card(info: dict, cfg: QATConfig) -> str:
    """The README.md of an exported QAT model."""
    tc = cfg.train
    trained = {"all": "all parameters", "attn_norms": "attention projections and norms",
               "lora": f"LoRA adapters (rank {cfg.lora.rank}, alpha {cfg.lora.alpha}) on the attention projections, "
                       "merged into the weights"}[cfg.trainable]
    before, sets = info["metrics_before"], info["eval_sets"]
    if before:
        head = "| metric | before QAT | after |\n|---|---|---|"
        rows = "\n".join(f"| {k} | {before[k]:.4f} | {v:.4f} |" for k, v in info["metrics"].items())
    else:
        head = "| metric | value |\n|---|---|"
        rows = "\n".join(f"| {k} | {v:.4f} |" for k, v in info["metrics"].items()) or "| (not evaluated) | |"
    return f"""# {tc.model.family} fine-tuned for a `{info['cache']}` KV cache (rq_jax QAT)

Quantization-aware fine-tuning of `{cfg.checkpoint}`: every attention read of past K/V went through
the `{cfg.cache}` cache format's fake quantization (bits {list(cfg.bits)}, group size {cfg.group_size},
straight-through gradients), teacher-forced in every loop, the in-flight token exact
(`rq_jax.train.qat`, {cfg.passes} refinement pass(es)). Use it with that cache format.

- Trained: {trained} ({info['trained_values']:,} values), {info['step']} steps, {info['train_seconds'] / 60:.0f} min
  of training; weights stored in {info['storage_dtype']}
- Loss: task NLL{f" + {cfg.distill} · KL to the frozen starting model (dense cache)" if cfg.distill else ""}
- Optimizer: AdamW (lr {tc.lr}, warm-up {tc.warmup_steps}, cosine to {tc.lr * tc.final_lr_frac:g} at step
  {tc.total_steps}, weight decay {tc.weight_decay}, clip {tc.clip_norm}), seed {tc.seed}
- Calibration: {f"{cfg.calibration} (fitted for the starting weights; refit it for these)" if cfg.calibration
                 else "none, the format's default rotation"}

## Held-out metrics (through the packed cache)

`*_acc`: greedy exact match through the `{cfg.cache}` cache; `*_dense_acc`: through a dense cache;
`*_kl`: KL from the dense cache's next-token distribution; `text_bpb`: stdlib bits per byte. On the
eval split: {sets['n']} addition examples, {sets['n']} queries of {sets['retrieval_pairs'] or "2 to max"}-pair \
retrieval,
{sets['text_windows']} stdlib windows.

{head}
{rows}

## Reproduce

```
{info['command'] or '(library call)'}
```
"""
