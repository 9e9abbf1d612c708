"""Offline calibration of the cache formats: rotations (OptR-H, OSCAR), key means, RVQ codebooks.

    data      calibration rows from the data generators' "calib" split, fit and holdout disjoint
    collect   per-loop queries, keys and values of every attention layer (the model unchanged)
    losses    App. G.1's per-head losses: attention KL and output error through W_O
    optr      OptR-H: T = H·expm(A − Aᵀ) by Adam, straight-through quantizers, holdout selection
    oscar     OSCAR: covariance eigenbasis · Hadamard · bit-reversal permutation, float64, no gradients
    pipeline  `calibrate_model`: collect, fit every stack and segment, report holdout losses
    provenance  what a calibration was fitted for (model, weights, format schedule) and the checks
    artifact  `save_calibration` / `load_calibration` (safetensors + JSON, one folder per schedule)

and `fit_rotations`, the one call that fits a format's rotations on the data's calib split.
"""

from rq_jax.calibrate.artifact import (artifact_name, find_artifact, load_calibration, read_artifact,
                                       save_calibration)
from rq_jax.calibrate.collect import Activations, ModelActivations, collect, output_metrics
from rq_jax.calibrate.data import CalibrationSet, calibration_set, part_of
from rq_jax.calibrate.optr import OptRHConfig
from rq_jax.calibrate.pipeline import METHODS, Calibration, calibrate_model, fit_rotations

__all__ = ["Activations", "Calibration", "CalibrationSet", "METHODS", "ModelActivations", "OptRHConfig",
           "artifact_name", "calibrate_model", "calibration_set", "collect", "find_artifact", "load_calibration",
           "fit_rotations", "output_metrics", "part_of", "read_artifact", "save_calibration"]
