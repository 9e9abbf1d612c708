"""The calibration of one scheme (a row of an experiment), where both runners find it: `eval.py`'s
accuracy table and `eval_benchmarks.py`'s Table 2.

    scheme = saved_method(scheme, folder, loops)            # eval.py: adopt a saved artifact's method
    calib, source = scheme_calibration(scheme, model, loops, folder=folder)
"""

from __future__ import annotations

import dataclasses

from rq_jax.cache import CacheCalib
from rq_jax.cache.schemes import Scheme
from rq_jax.calibrate.artifact import find_artifact, load_calibration, read_artifact
from rq_jax.calibrate.pipeline import fit_rotations


class NeedsCalibration(Exception):
    """A row whose rotations must be fitted, with neither an artifact nor data to fit them on."""


def saved_method(scheme: Scheme, folder: str, num_loops: int) -> Scheme:
    """`scheme` as the calibration saved under `folder` for its schedule makes it: a row with the
    format's default rotation (no `method`) whose schedule has one artifact there takes that artifact's
    method, its label suffixed with it ("[2,2,2,4] g32" → "[2,2,2,4] g32 oscar"); any other row as it is."""
    if scheme.method or not scheme.fmt.needs_calib:
        return scheme
    try:
        path = find_artifact(folder, scheme.fmt, num_loops)
    except ValueError:  # none for this schedule (or several: the row keeps its default rotation)
        return scheme
    method = read_artifact(path)[0]["method"]
    return dataclasses.replace(scheme, label=f"{scheme.label} {method}", method=method)


def scheme_calibration(scheme: Scheme, model, num_loops: int, *, folder: str | None = None, can_fit: bool = True,
                       rows: int = 32) -> tuple[CacheCalib | None, dict | None]:
    """(CacheCalib, where it came from) for a row; (None, None) for a row with the format's default
    rotation (no `scheme.method`). With `folder`, the artifact of the row's schedule and method under it
    (source {"artifact": path}); without, the rotations fitted on `rows` fit and `rows` holdout rows of the
    data's calib split (`fit_rotations`; source {"fitted": ..., "key_before": ..., ...: the mean holdout
    losses}) when `can_fit` (the model reads rq_jax's byte-level data). Raises NeedsCalibration naming
    what is missing otherwise."""
    if not scheme.method:
        return None, None
    if folder:
        try:
            path = find_artifact(folder, scheme.fmt, num_loops, method=scheme.method)
            return load_calibration(path, model, scheme.fmt, num_loops=num_loops,
                                    method=scheme.method), dict(artifact=path)
        except (ValueError, FileNotFoundError) as err:
            raise NeedsCalibration(f"needs an {scheme.method} artifact: {err}") from None
    if not can_fit:
        raise NeedsCalibration(
            f"needs --calibration: an {scheme.method} artifact for {scheme.fmt.schedule_name(num_loops)} (rq_jax's "
            "calibration data are byte-level, which this model does not read)")
    calib, summary = fit_rotations(model, scheme.fmt, scheme.method, num_loops, rows=rows)
    return calib, dict(fitted=f"{rows} fit + {rows} holdout rows of the data's calib split", **summary)
