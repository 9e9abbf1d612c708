"""Calibrate a model's cache formats on calibration rows: collect activations, fit, report on holdout.

`calibrate_model` runs the model over the fit and holdout rows (`collect`), then fits every stack
(looped layers; Huginn's prelude/coda as one-loop segments) whose format reads a calibration:

- formats that learn rotations (`learns_rotations`: the `LoopQuant` family, `residual`, `rotated`,
  `uniform`): rotations by `method` — "optr-h" (learned,
  with key means and holdout selection, `rq_jax.calibrate.optr`) or "oscar" (covariance eigenbasis,
  `rq_jax.calibrate.oscar`) — reported as per-head holdout losses L_K and L_V before (the format's
  default rotation, no means) and after calibration;
- any other format that needs a calibration (`residual_vq`'s codebooks and scales): its own
  `calibrate` on the fit rows, reported as the holdout reconstruction NMSE per loop.

The result is a `Calibration`: the `CacheCalib` to pass to the model, what it was fitted for (model,
formats, loops, method, data, options) and the report — what `save_calibration` writes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from rq_jax.cache import base
from rq_jax.cache.calib import CacheCalib
from rq_jax.cache.kv_error import reconstruction_error
from rq_jax.cache.loop_quant import LoopQuant
from rq_jax.calibrate import losses, optr, oscar
from rq_jax.calibrate.collect import ModelActivations, collect, output_metrics
from rq_jax.calibrate.data import calibration_set
from rq_jax.calibrate.provenance import format_spec, model_identity

METHODS = ("optr-h", "oscar")
GROUPS = ("looped", "plain")


@dataclasses.dataclass
class Calibration:
    """A fitted calibration: `calib` for the model's cache, `meta` (JSON-able: model identity,
    formats, loops, method, options, data) and `report` (per stack, one dict per segment)."""

    calib: CacheCalib
    meta: dict[str, Any]
    report: dict[str, list[dict[str, Any]] | None]


def _rotation_report(fmt: LoopQuant, seg: base.Segment, holdout: losses.SlotData, calib, query_len: int,
                     d_model: int) -> dict[str, np.ndarray]:
    """Holdout L_K, L_V [G, N, K] of the default rotations (no means) and of `calib`."""
    def slots(x):
        return None if x is None else losses.to_slots(x)
    default = fmt.default_calib(seg, holdout.k.shape[0] // seg.groups, holdout.k.shape[3], holdout.k.shape[5])
    out = {}
    for when, c in (("before", default), ("after", calib)):
        lk, lv = optr._holdout(fmt, holdout, slots(c.key_rot), slots(c.key_mean), slots(c.value_rot),
                               query_len=query_len, d_model=d_model)
        out[f"key_{when}"] = np.asarray(losses.from_slots(lk, seg.groups))
        out[f"value_{when}"] = np.asarray(losses.from_slots(lv, seg.groups))
    return out


def _fit_rotations(fmt: LoopQuant, seg: base.Segment, fit, holdout, metric, d_model, method, config, progress,
                   label):
    """One segment's rotations by `method`, and its report."""
    loops = slice(seg.start, seg.start + seg.num_loops)

    def take(a):
        return losses.segment_slots(a.q[loops], a.k[loops], a.v[loops], metric, seg.groups, seg.size)

    fit_slots, holdout_slots = take(fit), take(holdout)
    if method == "optr-h":
        return optr.fit_segment(fmt, seg, fit_slots, holdout_slots, d_model, config, progress, label)
    calib = oscar.fit_segment(fmt, seg, fit_slots)
    calib = calib._replace(key_rot=jnp.asarray(calib.key_rot), value_rot=jnp.asarray(calib.value_rot))
    query_len = min(config.query_len, holdout_slots.k.shape[4])
    return calib, _rotation_report(fmt, seg, holdout_slots, calib, query_len, d_model)


def calibrate_model(model, fmt: base.CacheFormat, fit_tokens, holdout_tokens, *, method: str = "optr-h",
                    num_loops: int | None = None, plain_fmt: base.CacheFormat | None = None,
                    config: optr.OptRHConfig = optr.OptRHConfig(), seed: int = 0, init_scale: float = 1.0,
                    batch_size: int = 8, progress: bool = False, data_info: dict | None = None) -> Calibration:
    """Fit `fmt` (looped layers) and `plain_fmt` (Huginn's prelude/coda; default `fmt`) for `model` run
    with `num_loops` loops (default the config's), on full rows fit_tokens and holdout_tokens [B, T].

    `method` ("optr-h" or "oscar") applies to formats that learn rotations; `config` holds OptR-H's settings
    (its `query_len` is also the holdout query window of every report). `seed` (fit rows; holdout
    rows `seed + 1`) and `init_scale` set Huginn's random initial state while collecting. Raises
    ValueError for an unknown method or a format that reads no calibration.
    """
    if method not in METHODS:
        raise ValueError(f"unknown calibration method {method!r}: expected one of {METHODS}")
    c = model.config
    num_loops = c.num_loops if num_loops is None else num_loops
    plain_fmt = plain_fmt or fmt
    formats = {"looped": fmt, "plain": plain_fmt if c.num_plain_layers else None}
    if not any(f is not None and f.needs_calib for f in formats.values()):
        raise ValueError(f"the {fmt.name!r} cache format reads no calibration: nothing to fit")
    kw = dict(init_scale=init_scale, batch_size=batch_size)
    fit: ModelActivations = collect(model, fit_tokens, num_loops, seed=seed, **kw)
    holdout: ModelActivations = collect(model, holdout_tokens, num_loops, seed=seed + 1, **kw)
    metrics = output_metrics(model)
    parts, report = {}, {}
    for group in GROUPS:
        f = formats[group]
        parts[group] = report[group] = None
        if f is None or not f.needs_calib:
            continue
        segs = base.segments(num_loops if group == "looped" else 1, f.group_len)
        fit_acts, holdout_acts = fit.part(group), holdout.part(group)
        calibs, reports = [], []
        for i, seg in enumerate(segs):
            if f.learns_rotations:
                calib, rep = _fit_rotations(f, seg, fit_acts, holdout_acts, metrics[group], c.hidden_size, method,
                                            config, progress, f"{group} segment {i}")
            else:
                lengths = jnp.full((fit_acts.k.shape[2],), fit_acts.k.shape[4], jnp.int32)
                calib = f.calibrate(seg, base.split_loops(fit_acts.k, seg), base.split_loops(fit_acts.v, seg), lengths)
                loops = slice(seg.start, seg.start + seg.num_loops)
                err = reconstruction_error(f, holdout_acts.k[loops], holdout_acts.v[loops], (calib,))
                rep = dict(k_nmse=err["k"], v_nmse=err["v"])
            calibs.append(calib)
            reports.append(dict(segment=list(seg), **rep))
        parts[group], report[group] = tuple(calibs), reports
    meta = dict(
        schedule=fmt.schedule_name(num_loops),
        method=method if fmt.learns_rotations else "format",
        num_loops=num_loops,
        model=model_identity(model),
        format=format_spec(fmt),
        plain_format=None if formats["plain"] is None else format_spec(formats["plain"]),
        options=dataclasses.asdict(config) if method == "optr-h" else dict(query_len=config.query_len),
        data=dict(data_info or {}, fit_rows=int(np.shape(fit_tokens)[0]),
                  holdout_rows=int(np.shape(holdout_tokens)[0]), seq_len=int(np.shape(fit_tokens)[1]),
                  collect_seed=seed, init_scale=init_scale))
    return Calibration(CacheCalib(parts["looped"], parts["plain"]), meta, report)


def fit_rotations(model, fmt: base.CacheFormat, method: str, num_loops: int, *, rows: int = 32, seq_len: int = 256,
                  seed: int = 0, progress: bool = False) -> tuple[CacheCalib, dict[str, float]]:
    """Fit `method`'s rotations for `fmt` (a format that learns rotations) on `rows` fit and `rows`
    holdout rows of the data's calib split (disjoint from the eval split; OptR-H fits key means when
    the format asks for them). Returns (CacheCalib, summary of the per-head holdout losses: mean L_K
    and L_V before (the default rotation) and after, over every head and segment)."""
    fit = calibration_set("fit", rows, seq_len, seed=seed)
    holdout = calibration_set("holdout", rows, seq_len, seed=seed)
    cal = calibrate_model(model, fmt, fit.tokens, holdout.tokens, method=method, num_loops=num_loops,
                          config=optr.OptRHConfig(seed=seed, key_means=fmt.key_means), seed=seed, progress=progress)
    segs = [seg for part in cal.report.values() for seg in part or ()]
    summary = {f"{kind}_{when}": float(np.mean([np.mean(seg[f"{kind}_{when}"]) for seg in segs]))
               for kind in ("key", "value") for when in ("before", "after")}
    return cal.calib, summary


def holdout_table(report: dict) -> list[str]:
    """`Calibration.report` as text lines: per stack and segment, the per-head holdout losses of the
    default rotation and the calibrated one (per group, layer and kv head, then their means), or the
    per-loop holdout NMSE for a segment that fits no rotation."""
    lines = []
    for group, entries in report.items():
        for seg in entries or ():
            start, groups, size = seg["segment"]
            if "key_before" not in seg:
                lines.append(f"{group} loops {start}..{start + groups * size - 1}: holdout NMSE per loop  K "
                             + " ".join(f"{x:.4f}" for x in seg["k_nmse"]) + "   V "
                             + " ".join(f"{x:.4f}" for x in seg["v_nmse"]))
                continue
            lines += [f"{group} segment loops {start}..{start + groups * size - 1} (groups of {size}): "
                      "holdout loss per kv head, default rotation → calibrated",
                      f"  {'group':>5s} {'layer':>5s} {'head':>4s} {'L_K before':>11s} {'L_K after':>11s} "
                      f"{'L_V before':>11s} {'L_V after':>11s}"]
            kb, ka, vb, va = (np.asarray(seg[k]) for k in ("key_before", "key_after", "value_before", "value_after"))
            lines += [f"  {g:5d} {n:5d} {h:4d} {kb[g, n, h]:11.4e} {ka[g, n, h]:11.4e} {vb[g, n, h]:11.4e} "
                      f"{va[g, n, h]:11.4e}" for g, n, h in np.ndindex(kb.shape)]
            lines.append(f"  mean{'':12s} {kb.mean():11.4e} {ka.mean():11.4e} {vb.mean():11.4e} {va.mean():11.4e}")
    return lines
