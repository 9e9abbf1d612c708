"""Calibration artifacts on disk: one folder per (format, bits, group size, loops) schedule and method.

    <model folder>/calibration/<schedule>-<method>/      e.g. residual-b2.2.2.4-g32-L4-optr-h/
        calibration.safetensors    the CacheCalib arrays, named "<stack>/<segment>/<field>"
                                   (e.g. "looped/0/key_rot" [G, N, K, D, D], "looped/0/k/c1")
        calibration.json           what it was fitted for (model config, hash and weights fingerprint;
                                   format policies; loops; method, options, data) and the report
                                   (per-head holdout losses before/after), plus the arrays' sha256

Why safetensors + JSON rather than orbax: a calibration is a handful of named float arrays with no
sharding, optimizer state or async saving to manage, and the loader must check every name and shape
against what the cache expects before anything is used — a flat name → array file makes that check
direct. safetensors is already a dependency (the HF converter), loads without pickle, is byte-for-byte
deterministic and readable from PyTorch (the reference keeps `rotations.pt` per schedule); the JSON
next to it is human-readable, which the report is for. Folders are written to a temporary sibling and
renamed into place, so an interrupted save leaves nothing half-written.

`load_calibration(path, model or config, cache or format)` returns the `CacheCalib` for that cache
and raises ValueError naming the difference when the artifact was fitted for another model (config,
weights), format schedule (bits, group sizes, ...), loop count or plain-layer format, or when an
array's name or shape is not what the format expects.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from rq_jax.cache import base
from rq_jax.cache.calib import CacheCalib, check_calib
from rq_jax.cache.kv import KVCache, init_cache
from rq_jax.calibrate.pipeline import GROUPS, Calibration
from rq_jax.calibrate.provenance import config_mismatch, format_mismatch, weights_mismatch
from rq_jax.config import ModelConfig
from rq_jax.io import atomic_folder

ARRAYS = "calibration.safetensors"
META = "calibration.json"
FORMAT_VERSION = 1


def artifact_name(cal: Calibration) -> str:
    """The default folder name of a calibration: its schedule and method, e.g. "residual-b2.2.2.4-g32-L4-optr-h"."""
    return f"{cal.meta['schedule']}-{cal.meta['method']}"


def _leaf_name(path) -> str:
    return "/".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)


def _flatten(calib: CacheCalib) -> dict[str, np.ndarray]:
    out = {}
    for group in GROUPS:
        part = getattr(calib, group)
        for i, entry in enumerate(part or ()):
            for path, leaf in jax.tree_util.tree_flatten_with_path(entry)[0]:
                out[f"{group}/{i}/{_leaf_name(path)}"] = np.ascontiguousarray(np.asarray(leaf, np.float32))
    return out


def _to_json(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _to_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_to_json(v) for v in x]
    if isinstance(x, (np.ndarray, jax.Array)):
        return np.asarray(x).tolist()
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    return x


def save_calibration(directory: str | os.PathLike, cal: Calibration, *, overwrite: bool = False) -> str:
    """Write `cal` as the artifact folder `directory` (see the module docstring); returns its path.

    A non-empty `directory` raises FileExistsError unless `overwrite`."""
    directory = os.path.abspath(os.fspath(directory))
    with atomic_folder(directory, overwrite=overwrite) as tmp:
        arrays = _flatten(cal.calib)
        save_file(arrays, os.path.join(tmp, ARRAYS), metadata={"format": "rq_jax.calibration"})
        with open(os.path.join(tmp, ARRAYS), "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        meta = dict(format_version=FORMAT_VERSION, **cal.meta, arrays_sha256=digest,
                    tensors={k: list(v.shape) for k, v in arrays.items()}, report=_to_json(cal.report))
        with open(os.path.join(tmp, META), "w") as f:
            json.dump(meta, f, indent=1)
    return directory


def read_artifact(directory: str | os.PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(metadata, arrays) of an artifact folder; ValueError if unreadable or the two do not belong together."""
    directory = os.fspath(directory)
    try:
        with open(os.path.join(directory, META), encoding="utf-8") as f:
            meta = json.load(f)
        with open(os.path.join(directory, ARRAYS), "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        arrays = load_file(os.path.join(directory, ARRAYS))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{directory} is not a readable calibration artifact: {err}") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{directory}: calibration format version {meta.get('format_version')!r}, this code reads "
                         f"{FORMAT_VERSION}")
    if meta.get("arrays_sha256") != digest:
        raise ValueError(f"{directory}: {ARRAYS} does not match the checksum recorded in {META} (mixed or damaged "
                         "files); recalibrate")
    return meta, arrays


def _is_artifact(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META))


def find_artifact(path: str | os.PathLike, fmt: base.CacheFormat, num_loops: int, method: str | None = None) -> str:
    """The artifact folder for `fmt` run with `num_loops` loops: `path` itself when it is one, else the
    one artifact directly under `path` (or `path`/calibration) fitted for that schedule (and `method`)."""
    path = os.fspath(path)
    if _is_artifact(path):
        return path
    roots = [p for p in (path, os.path.join(path, "calibration")) if os.path.isdir(p)]
    if not roots:
        raise ValueError(f"no calibration artifact at {path}")
    found, seen = [], []
    for root in roots:
        for name in sorted(os.listdir(root)):
            sub = os.path.join(root, name)
            if name.startswith(".") or not _is_artifact(sub):
                continue
            try:
                with open(os.path.join(sub, META), encoding="utf-8") as f:
                    meta = json.load(f)
                saved = meta["format"]
            except (OSError, ValueError, KeyError, TypeError):
                continue  # not readable as an artifact: not a candidate
            seen.append(name)
            if (meta.get("num_loops") == num_loops and not format_mismatch(saved, fmt)
                    and (method is None or meta.get("method") == method)):
                found.append(sub)
    want = fmt.schedule_name(num_loops) + (f" ({method})" if method else "")
    if not found:
        raise ValueError(f"no calibration artifact for {want} under {path}; found: {seen or 'none'} — "
                         "run scripts/calibrate.py for this schedule")
    if len(found) > 1:
        raise ValueError(f"several calibration artifacts for {want} under {path}: "
                         f"{[os.path.basename(f) for f in found]}; pass one folder (or the method)")
    return found[0]


def _optional(expected, path) -> bool:
    """Whether the calibration leaf at `path` may be absent: a field of a NamedTuple that defaults to
    None (e.g. `RotationCalib.key_mean`)."""
    parent = expected
    for key in path[:-1]:
        parent = parent[key.idx] if hasattr(key, "idx") else getattr(parent, key.name)
    name = getattr(path[-1], "name", None)
    return name is not None and getattr(type(parent), "_field_defaults", {}).get(name, 0) is None


def load_calibration(path: str | os.PathLike, model_or_config, cache_or_fmt: KVCache | base.CacheFormat, *,
                     num_loops: int | None = None, plain_fmt: base.CacheFormat | None = None,
                     method: str | None = None) -> CacheCalib:
    """The `CacheCalib` saved under `path` (an artifact folder, or a folder holding artifacts — e.g. the
    model folder — from which the one for this schedule is picked) for a model and its cache.

    `model_or_config`: the model (config and weights checked) or its `ModelConfig` (config only).
    `cache_or_fmt`: the `KVCache` it will be used with, or the looped layers' format (then `num_loops`
    defaults to the config's and `plain_fmt` to the format). Raises ValueError with the differences
    when the artifact does not match.
    """
    config = model_or_config if isinstance(model_or_config, ModelConfig) else model_or_config.config
    if isinstance(cache_or_fmt, KVCache):
        fmt, plain_fmt, num_loops = cache_or_fmt.fmt, cache_or_fmt.plain_fmt, cache_or_fmt.num_loops
    else:
        fmt = cache_or_fmt
        plain_fmt = plain_fmt or fmt
        num_loops = config.num_loops if num_loops is None else num_loops
    directory = find_artifact(path, fmt, num_loops, method)
    meta, arrays = read_artifact(directory)
    where = f"calibration {directory}"
    diff = config_mismatch(meta["model"], config)
    if diff:
        raise ValueError(f"{where} was fitted for another model: {'; '.join(diff)} (artifact vs this model)")
    if not isinstance(model_or_config, ModelConfig):
        bad = weights_mismatch(meta["model"]["fingerprint"], model_or_config)
        if bad:
            raise ValueError(f"{where} was fitted for other weights of this architecture (parameters differ: "
                             f"{', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}); recalibrate for this model")
    diff = format_mismatch(meta["format"], fmt)
    if diff:
        raise ValueError(f"{where} was fitted for another format schedule: {'; '.join(diff)} (artifact vs cache)")
    if meta["num_loops"] != num_loops:
        raise ValueError(f"{where} was fitted for {meta['num_loops']} loops, the cache runs {num_loops}")
    formats = {"looped": fmt, "plain": plain_fmt if config.num_plain_layers else None}
    if formats["plain"] is not None and formats["plain"].needs_calib:
        if meta.get("plain_format") is None:
            raise ValueError(f"{where} has no calibration for the prelude/coda format {plain_fmt.name!r}")
        diff = format_mismatch(meta["plain_format"], formats["plain"])
        if diff:
            raise ValueError(f"{where} was fitted for another prelude/coda format: {'; '.join(diff)}")
    parts, used = {}, set()
    for group in GROUPS:
        f = formats[group]
        parts[group] = None
        if f is None or not f.needs_calib:
            continue
        layers = config.num_layers if group == "looped" else config.num_plain_layers
        entries = []
        for i, seg in enumerate(base.segments(num_loops if group == "looped" else 1, f.group_len)):
            prefix = f"{group}/{i}/"
            expected = f.calib_shapes(seg, layers, config.num_kv_heads, config.head_dim)
            leaves, treedef = jax.tree_util.tree_flatten_with_path(expected)
            values = []
            for p, spec in leaves:
                name = prefix + _leaf_name(p)
                if name not in arrays and _optional(expected, p):
                    values.append(None)
                    continue
                if name not in arrays:
                    raise ValueError(f"{where} lacks the array {name!r} that the {f.name!r} format needs")
                if tuple(arrays[name].shape) != tuple(spec.shape):
                    raise ValueError(f"{where}: array {name!r} has shape {tuple(arrays[name].shape)}, the cache "
                                     f"needs {tuple(spec.shape)}")
                values.append(jnp.asarray(arrays[name], spec.dtype))
                used.add(name)
            entries.append(jax.tree_util.tree_unflatten(treedef, values))
        parts[group] = tuple(entries)
    extra = sorted(set(arrays) - used)
    if extra:
        raise ValueError(f"{where} holds arrays this cache does not use: {extra[:4]}")
    calib = CacheCalib(parts["looped"], parts["plain"])
    cache = jax.eval_shape(lambda: init_cache(config, 1, 1, fmt, num_loops=num_loops, plain_fmt=plain_fmt))
    check_calib(cache, calib)
    return calib
