"""Calibration (rq_jax.calibrate): activation collection, OptR-H, OSCAR, key means, RVQ codebooks,
artifacts and their mismatch errors, calibration data splits, and scripts/calibrate.py.

Everything runs at one set of shapes where it can (ouro-tiny run with 2 loops, [2, 4] bits, g8; 4 rows
of 16 tokens), so the jitted fitting programs compile once for the fixture model and the synthetic
slots alike.
"""

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rq_jax.cache import Dense, get_format, init_cache
from rq_jax.cache.base import Segment
from rq_jax.cache.residual_vq import ResidualVQ, RVQCalib
from rq_jax.calibrate import (OptRHConfig, artifact_name, calibrate_model, calibration_set, collect, find_artifact,
                              load_calibration, optr, oscar, read_artifact, save_calibration)
from rq_jax.calibrate.allocate import load_schedule
from rq_jax.calibrate.losses import SlotData
from rq_jax.data import CALIB_MODULES, EVAL_MODULES, decode, split_of
from rq_jax.cache.kv_error import reconstruction_error
from tests.conftest import run_script

LOOPS, ROWS, SEQ = 2, 4, 16
FMT = get_format("residual", bits=(2, 4), group_size=8)
CONFIG = OptRHConfig(steps=6, candidate_every=3, query_len=8)
REPO = pathlib.Path(__file__).resolve().parents[2]


def tokens(seed: int, vocab: int = 128) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (ROWS, SEQ))


@pytest.fixture(scope="module")
def ouro_cal(ouro):
    model, _ = ouro
    return calibrate_model(model, FMT, tokens(0), tokens(1), num_loops=LOOPS, config=CONFIG)


def orthogonal_error(u) -> float:
    u = np.asarray(u, np.float64)
    return float(np.max(np.abs(u @ np.swapaxes(u, -1, -2) - np.eye(u.shape[-1]))))


# ---- collection -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_collected_kv_equal_the_dense_cache(family, request):
    model, _ = request.getfixturevalue(family)
    ids = tokens(0)
    acts = collect(model, ids, LOOPS)
    cache = init_cache(model.config, ROWS, SEQ, Dense("float32"), num_loops=LOOPS)
    out = model(jnp.asarray(ids), cache, num_loops=LOOPS, rng=jax.random.fold_in(jax.random.key(0), 0))
    k, v = out.cache.dense_kv()
    np.testing.assert_allclose(acts.looped.k, k, atol=2e-5)
    np.testing.assert_allclose(acts.looped.v, v, atol=2e-5)
    c = model.config
    assert acts.looped.q.shape == (LOOPS, c.num_layers, ROWS, SEQ, c.num_heads, c.head_dim)
    if family == "huginn":  # prelude then coda, one loop
        kp, vp = out.cache.dense_kv("plain")
        np.testing.assert_allclose(acts.plain.k, kp, atol=2e-5)
        np.testing.assert_allclose(acts.plain.v, vp, atol=2e-5)
    else:
        assert acts.plain is None


# ---- OptR-H ---------------------------------------------------------------------------------------------

def test_optr_h_on_the_fixture_model(ouro_cal):
    calib = ouro_cal.calib.looped[0]
    assert calib.key_rot.shape == (1, 2, 4, 16, 16) and calib.key_mean.shape == (1, 2, LOOPS, 4, 16)
    assert orthogonal_error(calib.key_rot) < 1e-5 and orthogonal_error(calib.value_rot) < 1e-5
    rep = ouro_cal.report["looped"][0]
    # Holdout selection with the uncalibrated cache among the candidates: never worse, per head.
    assert np.all(rep["key_after"] <= rep["key_before"])
    assert np.all(rep["key_after"] == rep["key_candidates"].min(axis=0))
    assert np.all(rep["value_after"] == rep["value_candidates"].min(axis=0))
    assert np.all(rep["value_after"] <= rep["value_candidates"][0])  # U₀ under the chosen keys
    # Heads that kept the uncalibrated keys carry no key means.
    means = np.asarray(calib.key_mean)[0]  # [N, p, K, D]
    for n, h in zip(*np.nonzero(rep["key_choice"][0] == 0)):
        assert not np.any(means[n, :, h])
    assert rep["key_candidate_labels"] == ["default", "default+means", "step 3", "step 6"]


def synthetic_slots(seed: int) -> SlotData:
    """Slots shaped like ouro-tiny's (2 slots, 2 loops, 4 rows, 16 tokens, 4 kv heads, D 16) whose keys
    are far from isotropic: the channels the queries read (first half) are small, the others large,
    so a Hadamard rotation mixes large irrelevant channels into every INT2 group."""
    rng = np.random.default_rng(seed)
    d = 16
    small = np.arange(d) < d // 2
    k = rng.normal(size=(2, LOOPS, ROWS, 4, SEQ, d)) * np.where(small, 0.3, 4.0)
    v = rng.normal(size=(2, LOOPS, ROWS, 4, SEQ, d)) * np.where(small, 4.0, 0.3)
    q = rng.normal(size=(2, LOOPS, ROWS, SEQ, 4, 1, d)) * np.where(small, 3.0, 0.0)
    w = rng.normal(size=(2, 4, 1, d, 64)) / 8
    m = np.einsum("skgde,skgfe->skgdf", w, w)
    return SlotData(*(jnp.asarray(x, jnp.float32) for x in (q, k, v, m)))


def test_optr_h_beats_hadamard_on_non_isotropic_keys():
    calib, rep = optr.fit_segment(FMT, Segment(0, 1, LOOPS), synthetic_slots(0), synthetic_slots(1), 64, CONFIG)
    assert orthogonal_error(calib.key_rot) < 1e-5 and orthogonal_error(calib.value_rot) < 1e-5
    assert np.all(rep["key_after"] <= rep["key_before"])
    learned = rep["key_choice"] >= 2  # a trained rotation, not U₀ (with or without means)
    assert np.any(learned & (rep["key_after"] < 0.97 * rep["key_before"])), (rep["key_before"], rep["key_after"])
    # The learned rotation is H·expm(A − Aᵀ) away from the Hadamard start.
    u0 = np.asarray(FMT.default_calib(Segment(0, 1, LOOPS), 2, 4, 16).key_rot)
    assert not np.allclose(np.asarray(calib.key_rot)[learned], u0[learned])


# ---- OSCAR ----------------------------------------------------------------------------------------------

def oscar_reference(q, k, v):
    """Float64 numpy re-statement of App. G.1's OSCAR for one slot of `FMT` (last-loop anchor, LS
    residuals against the original anchor): q [p, B, T, K, G, D], k and v [p, B, K, T, D] →
    (U_K, U_V) [K, D, D] with U = (B·H·P)ᵀ."""
    p, rows, t, heads, g, d = q.shape
    h2 = np.array([[1.0, 1.0], [1.0, -1.0]])
    had = functools.reduce(np.kron, [h2] * 4) / 4.0  # Sylvester 16
    perm = [0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15]  # 4-bit reversal
    pmat = np.zeros((d, d))
    pmat[perm, np.arange(d)] = 1.0
    out = []
    for h in range(heads):
        qs = q[:, :, :, h].reshape(-1, d)
        c_k = qs.T @ qs / len(qs)
        c_v, n = np.zeros((d, d)), 0
        for r in range(p):
            for b in range(rows):
                anchor = v[p - 1, b, h]
                z = v[r, b, h]
                if r != p - 1:
                    z = z - (np.sum(z * anchor, -1) / np.sum(anchor * anchor, -1))[:, None] * anchor
                for j in range(g):
                    s = q[r, b, :, h, j] @ k[r, b, h].T / np.sqrt(d)
                    s[np.triu_indices(t, 1)] = -np.inf
                    s = np.exp(s - s.max(-1, keepdims=True))
                    sz = (s / s.sum(-1, keepdims=True)) @ z
                    c_v += sz.T @ sz
                    n += t
        rots = []
        for c in (c_k, c_v / n):
            w, basis = np.linalg.eigh(c)
            basis = basis[:, np.argsort(-w)]
            basis *= np.sign(basis[np.abs(basis).argmax(0), np.arange(d)])
            rots.append((basis @ had @ pmat).T)
        out.append(rots)
    return tuple(np.stack(x) for x in zip(*out))


def test_oscar_equals_a_float64_restatement():
    data = synthetic_slots(2)  # queries get some energy in every channel: distinct eigenvalues
    data = data._replace(q=data.q + 0.1 * jax.random.normal(jax.random.key(2), data.q.shape))
    calib = oscar.fit_segment(FMT, Segment(0, 1, LOOPS), data)
    assert calib.key_mean is None
    for s in range(2):
        u_k, u_v = oscar_reference(*(np.asarray(x[s], np.float64) for x in (data.q, data.k, data.v)))
        np.testing.assert_allclose(np.asarray(calib.key_rot)[0, s], u_k, atol=1e-6)
        np.testing.assert_allclose(np.asarray(calib.value_rot)[0, s], u_v, atol=1e-6)
    assert orthogonal_error(calib.key_rot) < 1e-6 and orthogonal_error(calib.value_rot) < 1e-6
    for n in (16, 24, 96):  # pruned bit reversal is a permutation for any size
        assert sorted(oscar.bit_reversal(n)) == list(range(n))


# ---- key means ------------------------------------------------------------------------------------------

def test_key_means_reduce_residual_key_error():
    rng = np.random.default_rng(3)
    offset = rng.normal(size=(LOOPS, 1, 1, 4, 1, 16)) * 3  # per loop and head

    def keys(seed):  # [L, N, B, K, S, D], the fixture model's shapes (programs compiled once)
        return jnp.asarray(np.random.default_rng(seed).normal(size=(LOOPS, 2, ROWS, 4, SEQ, 16)) + offset, jnp.float32)

    fit, holdout = keys(4), keys(5)
    rot = jax.vmap(lambda k: jax.random.orthogonal(k, 16))(jax.random.split(jax.random.key(0), 8))
    rot = rot.reshape(1, 2, 4, 16, 16)
    means = optr._key_means(FMT, fit[None], jnp.full((ROWS,), SEQ), rot)  # LoopQuant.fit_key_means, jitted
    assert means.shape == (1, 2, LOOPS, 4, 16)
    base = FMT.default_calib(Segment(0, 1, LOOPS), 2, 4, 16)._replace(key_rot=rot, key_mean=jnp.zeros_like(means))
    without = reconstruction_error(FMT, holdout, holdout, (base,))["k"]
    with_means = reconstruction_error(FMT, holdout, holdout, (base._replace(key_mean=means),))["k"]
    assert np.all(with_means < 0.8 * without), (with_means, without)


# ---- RVQ codebooks --------------------------------------------------------------------------------------

RVQ = ResidualVQ(iters=4, restarts=1, calib_tokens=64)


def test_rvq_codebooks_fitted_on_calibration_data_are_used(ouro, tmp_path):
    model, _ = ouro
    cal = calibrate_model(model, RVQ, tokens(0), tokens(1), num_loops=LOOPS)
    assert cal.meta["method"] == "format" and cal.report["looped"][0]["k_nmse"].shape == (LOOPS,)
    (books,) = cal.calib.looped
    acts = collect(model, tokens(7), LOOPS)  # a prompt the codebooks never saw
    k, v = acts.looped.k, acts.looped.v
    fitted = reconstruction_error(RVQ, k, v, cal.calib.looped)
    per_prompt = reconstruction_error(RVQ, k, v)  # the Sampler's default: fit on the prompt itself
    key = jax.random.key(1)

    def rand(b):
        return b._replace(c1=jax.random.normal(key, b.c1.shape), c2=jax.random.normal(key, b.c2.shape) / 2)

    random_books = reconstruction_error(RVQ, k, v, (RVQCalib(rand(books.k), rand(books.v)),))
    for kind in "kv":
        assert not np.allclose(fitted[kind], per_prompt[kind])
        assert np.all(fitted[kind] < random_books[kind])
    path = save_calibration(tmp_path / artifact_name(cal), cal)
    loaded = load_calibration(path, model, RVQ, num_loops=LOOPS)
    jax.tree_util.tree_map(np.testing.assert_array_equal, loaded.looped, cal.calib.looped)
    with pytest.raises(ValueError, match="another format schedule.*n_codes"):
        load_calibration(path, model, ResidualVQ(n_codes=8), num_loops=LOOPS)


# ---- artifacts ------------------------------------------------------------------------------------------

def test_artifact_round_trip(ouro, ouro_cal, tmp_path):
    model, _ = ouro
    name = artifact_name(ouro_cal)
    assert name == "residual-b2.4-g8-L2-optr-h"
    path = save_calibration(tmp_path / "calibration" / name, ouro_cal)
    loaded = load_calibration(path, model, FMT, num_loops=LOOPS)
    assert loaded.plain is None
    jax.tree_util.tree_map(np.testing.assert_array_equal, loaded, ouro_cal.calib)
    # The model folder (or its calibration/ folder) finds the artifact of the cache's schedule.
    cache = model.init_cache(1, 8, FMT, num_loops=LOOPS)
    jax.tree_util.tree_map(np.testing.assert_array_equal, load_calibration(tmp_path, model, cache), ouro_cal.calib)
    meta, arrays = read_artifact(path)
    assert sorted(arrays) == ["looped/0/key_mean", "looped/0/key_rot", "looped/0/value_rot"]
    rep = meta["report"]["looped"][0]
    np.testing.assert_allclose(rep["key_before"], ouro_cal.report["looped"][0]["key_before"])
    np.testing.assert_allclose(rep["key_after"], ouro_cal.report["looped"][0]["key_after"])
    assert meta["options"]["steps"] == CONFIG.steps and meta["num_loops"] == LOOPS
    # The calibration reaches the cache: another reconstruction than the default rotations give.
    acts = collect(model, tokens(1), LOOPS)
    k, v = acts.looped.k, acts.looped.v
    assert not np.allclose(reconstruction_error(FMT, k, v, loaded.looped)["k"],
                           reconstruction_error(FMT, k, v)["k"])
    with pytest.raises(FileExistsError):
        save_calibration(path, ouro_cal)


def test_artifact_mismatch_errors(ouro, huginn, ouro_cal, tmp_path):
    model, _ = ouro
    path = save_calibration(tmp_path / "art", ouro_cal)
    with pytest.raises(ValueError, match="another model.*family 'ouro' vs 'huginn'"):
        load_calibration(path, huginn[0].config, FMT, num_loops=LOOPS)
    other = nnx.clone(model)
    other.norm.weight[...] = other.norm.weight[...] * 1.5
    with pytest.raises(ValueError, match="other weights.*norm.weight"):
        load_calibration(path, other, FMT, num_loops=LOOPS)
    load_calibration(path, model.config, FMT, num_loops=LOOPS)  # a config alone: no weights check
    with pytest.raises(ValueError, match=r"another format schedule: bits \[2, 4\] vs \[2, 2\]"):
        load_calibration(path, model, get_format("residual", bits=(2, 2), group_size=8), num_loops=LOOPS)
    with pytest.raises(ValueError, match=r"group_size \[8, 8\] vs \[16, 16\]"):
        load_calibration(path, model, get_format("residual", bits=(2, 4), group_size=16), num_loops=LOOPS)
    with pytest.raises(ValueError, match="fitted for 2 loops, the cache runs 4"):
        load_calibration(path, model, FMT, num_loops=4)
    with pytest.raises(ValueError, match="no calibration artifact for residual-b2.2.2.4-g32-L4"):
        load_calibration(tmp_path, model, get_format("residual"))
    meta = json.loads((path_obj := pathlib.Path(path) / "calibration.json").read_text())
    path_obj.write_text(json.dumps(dict(meta, arrays_sha256="0" * 64)))
    with pytest.raises(ValueError, match="does not match the checksum"):
        load_calibration(path, model, FMT, num_loops=LOOPS)


# ---- data -----------------------------------------------------------------------------------------------

def test_calibration_rows_come_from_the_calib_split_fit_and_holdout_disjoint():
    fit, holdout = (calibration_set(part, 9, 64) for part in ("fit", "holdout"))
    assert fit.tokens.shape == holdout.tokens.shape == (9, 64)
    keys = {part: {k for row in s.sources if row[0] != b"text" for k in row} for part, s in
            (("fit", fit), ("holdout", holdout))}
    assert keys["fit"] and keys["holdout"] and not keys["fit"] & keys["holdout"]
    assert all(split_of(k) == "calib" for k in keys["fit"] | keys["holdout"])  # never "eval"
    starts = {part: [row[1] for row in s.sources if row[0] == b"text"] for part, s in
              (("fit", fit), ("holdout", holdout))}
    assert all(s // 64 % 2 == 0 for s in starts["fit"]) and all(s // 64 % 2 == 1 for s in starts["holdout"])
    assert fit.info["text_modules"] and not set(fit.info["text_modules"]) & set(EVAL_MODULES)
    assert set(fit.info["text_modules"]) <= set(CALIB_MODULES)
    again = calibration_set("fit", 9, 64)
    np.testing.assert_array_equal(again.tokens, fit.tokens)  # deterministic


def test_calibration_rows_mark_the_answers_of_their_examples():
    """The answer mask covers exactly each packed example's answer: an addition answer follows its "=" and
    ends with "\n"; a retrieval answer is the one digit after a queried key; text rows have none."""
    rows = calibration_set("fit", 3, 259)  # addition, retrieval, text
    assert rows.answers.shape == rows.tokens.shape and not rows.answers[2].any()
    add, ret = ([decode([t]) for t in row] for row in rows.tokens[:2])
    mask = rows.answers[0].astype(int)
    starts, ends = np.flatnonzero(np.diff(mask) == 1) + 1, np.flatnonzero(np.diff(mask) == -1)
    assert len(starts) == len(ends) == len(rows.sources[0])
    assert {add[i - 1] for i in starts} == {b"="} and {add[i] for i in ends} == {b"\n"}
    queries = sum(len(key.split(b"\n")[1]) // 3 for key in rows.sources[1])  # key, value, ";" per query
    at = np.flatnonzero(rows.answers[1])
    assert len(at) == queries and all(ret[i].isdigit() and ret[i - 1].isalpha() for i in at)


# ---- CLI ------------------------------------------------------------------------------------------------

SCHEDULE = REPO / "docs" / "results" / "allocation" / "ouro-len259-3.1875.json"


def test_calibrate_script(tmp_path):
    """calibrate.py fits and saves an artifact (into a folder it creates); an existing one, options the
    format does not take, a group size not dividing head_dim and a model of another vocabulary are
    refused in one line before any work."""
    out = tmp_path / "new" / "art"
    args = ["--checkpoint", REPO / "checkpoints" / "ouro-small", "--bits", "2,2,2,4", "--group-size", "32",
            "--method", "oscar", "--fit-rows", "3", "--holdout-rows", "3", "--seq-len", "40", "--query-len", "16",
            "--quiet"]
    run = run_script("calibrate", *args, "--out", out)
    assert run.code == 0, run.err
    assert "L_K before" in run.out and "saved:" in run.out
    meta, arrays = read_artifact(out)
    assert meta["method"] == "oscar" and meta["data"]["fit"]["part"] == "fit"
    c = json.loads((REPO / "checkpoints" / "ouro-small" / "config.json").read_text())
    assert arrays["looped/0/key_rot"].shape == (1, c["num_hidden_layers"], c["num_key_value_heads"], c["head_dim"],
                                                c["head_dim"])
    for argv, message in [
            ([*args, "--out", out], f"argument --out: {out} exists and is not empty; pass --overwrite"),
            ([*args, "--cache", "residual_vq"], "--cache residual_vq does not take --bits, --group-size"),
            ([*args[:4], "--group-size", "24"], "argument --group-size: 24 does not divide the model's head_dim 64"),
            (["--checkpoint", REPO / "tests" / "fixtures" / "ouro-tiny", "--group-size", "8"], "byte-level token ids"),
            ([*args, "--tasks", "addition,poetry"], "calibration tasks must be a non-empty subset of"),
            ([*args, "--schedule", SCHEDULE], "--schedule FILE fixes the residual format's bits and group sizes"),
            ([*args[:2], "--schedule", out / "missing.json"], "is not a bit-allocation schedule")]:
        run = run_script("calibrate", *argv)
        assert run.code == 2 and run.err.startswith("calibrate.py: error: ") and run.err.count("\n") == 1, run.err
        assert message in run.err


def test_calibrate_script_fits_a_schedule(tmp_path):
    """--schedule fits the rotations of a bit-allocation schedule's own format: eval.py and generate.py
    find the artifact for that schedule, not for the paper's rule at the same bits."""
    args = ["--checkpoint", REPO / "checkpoints" / "ouro-small", "--schedule", SCHEDULE, "--method", "oscar",
            "--fit-rows", "3", "--holdout-rows", "3", "--seq-len", "40", "--query-len", "16", "--quiet"]
    run = run_script("calibrate", *args, "--out", tmp_path / "art")
    assert run.code == 0, run.err
    assert find_artifact(tmp_path, load_schedule(str(SCHEDULE)), 4) == str(tmp_path / "art")
    with pytest.raises(ValueError, match="no calibration artifact"):
        find_artifact(tmp_path, get_format("residual", group_size=32), 4)


def test_reads_calibration_data_names_what_stops_a_model():
    """The byte-level check both runners share: a small vocabulary, another tokenizer, or fine."""
    from types import SimpleNamespace

    from rq_jax.calibrate.data import reads_calibration_data
    from rq_jax.data import encode

    byte_level = SimpleNamespace(encode=lambda text: SimpleNamespace(ids=encode(text).tolist()))
    other = SimpleNamespace(encode=lambda text: SimpleNamespace(ids=[1, 2, 3]))
    assert reads_calibration_data(259) is None and reads_calibration_data(300, byte_level) is None
    assert "vocabulary has 100 entries" in reads_calibration_data(100, byte_level)
    assert "not the byte-level one" in reads_calibration_data(300, other)


def test_holdout_table_lists_every_head_and_the_means():
    from rq_jax.calibrate.pipeline import holdout_table

    losses = {k: np.full((1, 2, 1), v) for k, v in
              dict(key_before=2.0, key_after=1.0, value_before=4.0, value_after=3.0).items()}
    lines = holdout_table({"core": [dict(segment=(0, 1, 4), **losses)],
                           "tail": [dict(segment=(4, 2, 1), k_nmse=[0.1, 0.2], v_nmse=[0.3, 0.4])]})
    assert lines[0].startswith("core segment loops 0..3 (groups of 4)") and len(lines) == 2 + 2 + 1 + 1
    assert lines[-2].split()[-4:] == ["2.0000e+00", "1.0000e+00", "4.0000e+00", "3.0000e+00"]
    assert lines[-1] == "tail loops 4..5: holdout NMSE per loop  K 0.1000 0.2000   V 0.3000 0.4000"
