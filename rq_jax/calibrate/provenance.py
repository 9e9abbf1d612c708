"""What a calibration was fitted for, as JSON, and the checks that it matches what it is used with.

- Model: its `ModelConfig` (and a hash of it) and a weights fingerprint — per parameter its shape and
  a strided sample of its values — so a calibration of other weights with the same shapes (e.g. an
  untrained copy) is caught too. The fingerprint is compared with a tolerance, so a model loaded
  with bfloat16 parameters still matches its float32 calibration.
- Format: the format's type and the policy fields that decide what is quantized and how (the
  format's `schedule_fields`: bits, group sizes, metadata dtype, residual coding ... ). Runtime choices
  that the calibration overrides or does not depend on (the default rotation kind, attention
  implementation, k-means effort) are recorded but not compared.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import numpy as np
from flax import nnx

from rq_jax.cache import base
from rq_jax.config import ModelConfig

_SAMPLES = 16  # fingerprint values per parameter


def _jsonable(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    return str(value)


def config_dict(config: ModelConfig) -> dict[str, Any]:
    return {k: _jsonable(v) for k, v in dataclasses.asdict(config).items()}


def config_hash(config: ModelConfig) -> str:
    """sha256 of the config's canonical JSON."""
    return hashlib.sha256(json.dumps(config_dict(config), sort_keys=True).encode()).hexdigest()


def fingerprint(model) -> dict[str, dict[str, Any]]:
    """Per parameter (by dotted path): shape, and the RMS and `_SAMPLES` of its values at evenly strided
    positions (float64; only the samples are read, so this is cheap for any model size)."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = var.get_value()
        flat = value.reshape(-1)
        rms_at = np.unique((np.arange(4096) * flat.size) // 4096) if flat.size else np.zeros(0, np.int64)
        strided = np.asarray(flat[rms_at], np.float64)
        pick = np.asarray(flat[(np.arange(_SAMPLES) * flat.size) // _SAMPLES], np.float64) if flat.size else strided
        out[".".join(map(str, path))] = dict(shape=list(value.shape),
                                             rms=float(np.sqrt(np.mean(strided**2))) if flat.size else 0.0,
                                             sample=pick.tolist())
    return out


def model_identity(model) -> dict[str, Any]:
    return dict(config=config_dict(model.config), config_hash=config_hash(model.config),
                fingerprint=fingerprint(model))


def format_spec(fmt: base.CacheFormat) -> dict[str, Any]:
    """The format's type and full policy (JSON)."""
    policy = {f.name: _jsonable(getattr(fmt, f.name)) for f in dataclasses.fields(fmt)}
    return dict(type=type(fmt).__name__, policy=policy)


def format_mismatch(saved: dict[str, Any], fmt: base.CacheFormat) -> list[str]:
    """The schedule fields in which `fmt` differs from a saved `format_spec` ([] when it matches)."""
    now = format_spec(fmt)
    if saved["type"] != now["type"]:
        return [f"format type {saved['type']} vs {now['type']}"]
    fields = fmt.schedule_fields or tuple(now["policy"])
    return [f"{f} {saved['policy'].get(f)!r} vs {now['policy'].get(f)!r}" for f in fields
            if saved["policy"].get(f) != now["policy"].get(f)]


def config_mismatch(saved: dict[str, Any], config: ModelConfig) -> list[str]:
    """Config fields that differ between a saved `model_identity` and `config`."""
    if saved["config_hash"] == config_hash(config):
        return []
    now = config_dict(config)
    diff = [f"{k} {saved['config'].get(k)!r} vs {now.get(k)!r}" for k in sorted(set(now) | set(saved["config"]))
            if saved["config"].get(k) != now.get(k)]
    return diff or ["config hash"]


def weights_mismatch(saved: dict[str, Any], model, rtol: float = 2e-2) -> list[str]:
    """Parameters whose shape or sampled values differ from a saved fingerprint (bfloat16-tolerant)."""
    now = fingerprint(model)
    bad = sorted(set(saved) ^ set(now))
    for name in sorted(set(saved) & set(now)):
        a, b = saved[name], now[name]
        scale = max(a["rms"], b["rms"], 1e-12)
        if a["shape"] != b["shape"] or not np.allclose(a["sample"], b["sample"], rtol=rtol, atol=rtol * scale):
            bad.append(name)
    return bad
