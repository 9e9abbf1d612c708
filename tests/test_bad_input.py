"""Bad input gets a clear error naming the problem, and existing data is never damaged (issue 8)."""

import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from rq_jax import checkpoint, memory
from rq_jax.cache import CacheCalib, Dense, check_overflow, default_calib, get_format
from rq_jax.cache.residual_vq import RVQCalib
from rq_jax.convert.hf import CheckpointError, load_model
from rq_jax.sampling import Sampler, SamplingConfig
from tests.conftest import SHIPPED, fixture_dir, run_script


# ---- convert: never damage an existing destination ------------------------------------------------

def test_convert_refuses_a_non_empty_destination_and_keeps_it_loadable(tmp_path):
    out = tmp_path / "out"
    assert run_script("convert", SHIPPED / "huginn-small", out).code == 0
    before = sorted(p.name for p in out.iterdir())
    refused = run_script("convert", SHIPPED / "ouro-small", out)
    assert refused.code == 2 and "convert.py: error: argument dest: " in refused.err
    assert "exists and is not empty; pass --overwrite" in refused.err
    assert sorted(p.name for p in out.iterdir()) == before
    assert checkpoint.load(out)[0].config.family == "huginn"
    assert run_script("convert", SHIPPED / "ouro-small", out, "--overwrite").code == 0
    assert checkpoint.load(out)[0].config.family == "ouro"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary folder left behind


def test_convert_into_its_source_or_from_nowhere_is_refused(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(SHIPPED / "ouro-small", src)
    for dest in (src, src / "inner"):
        run = run_script("convert", src, dest)
        assert run.code == 2 and "would overlap the source" in run.err
    run = run_script("convert", tmp_path / "nope", tmp_path / "out")
    assert run.code == 2
    assert run.err == f"convert.py: error: argument source: no checkpoint folder {tmp_path / 'nope'}\n"


def test_interrupted_save_leaves_the_destination_as_it_was(tmp_path, monkeypatch, ouro):
    model, _ = ouro
    out = tmp_path / "out"
    checkpoint.save(out, model)
    saved = checkpoint.load(out)[0]

    def boom(*args, **kwargs):
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(checkpoint.shutil, "copy", boom)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(out, model, extra_files=(str(SHIPPED / "ouro-small" / "tokenizer.json"),), overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    again = checkpoint.load(out)[0]
    np.testing.assert_array_equal(nnx.state(again, nnx.Param)["norm"]["weight"][...],
                                  nnx.state(saved, nnx.Param)["norm"]["weight"][...])


# ---- the cache never drops tokens silently -------------------------------------------------------

@pytest.mark.parametrize("name", ["dense", "residual"])
def test_overflow_under_jit_is_flagged_and_raised(ouro, name):
    model, ref = ouro
    fmt = Dense("float32") if name == "dense" else get_format("residual", group_size=8)
    cache = model.init_cache(1, 4, fmt)
    calib = default_calib(cache)
    step = nnx.jit(lambda m, t, c: m(t, c, calib=calib).cache)
    ids = jnp.asarray(ref["input_ids"][:1])
    for chunk in (ids[:, :3], ids[:, 3:5], ids[:, 5:6]):
        cache = step(model, chunk, cache)
    np.testing.assert_array_equal(cache.overflow, [True])
    np.testing.assert_array_equal(cache.lengths, [4])  # what is stored, never past the end
    with pytest.raises(ValueError, match=r"cache rows \[0\] overflowed in an earlier compiled call"):
        check_overflow(cache)
    with pytest.raises(ValueError, match="overflowed in an earlier compiled call"):
        model(ids[:, 6:7], cache, calib=calib)  # every un-jitted entry checks the flag
    fresh = model(ids[:, :3], model.init_cache(1, 4, fmt), calib=calib).cache
    with pytest.raises(ValueError, match=r"prompt plus cached tokens \(5\) exceed the cache's max_len 4"):
        model(ids[:, 3:5], fresh, calib=calib)  # un-jitted: raised before anything runs


# ---- token ids -------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [128, 300, -5])
def test_token_ids_outside_the_vocabulary(ouro, bad):
    model, _ = ouro  # vocabulary of 128
    match = rf"token ids must lie in \[0, 128\), got ids from {min(bad, 1)} to {max(bad, 2)}"
    with pytest.raises(ValueError, match=match):
        model(jnp.asarray([[1, bad, 2]]))
    with pytest.raises(ValueError, match=rf"prompt token ids must lie in \[0, 128\), got \[{bad}\]"):
        Sampler(model, SamplingConfig(max_new_tokens=2))([[1, bad, 2]])


# ---- scripts refuse a run that does not fit -----------------------------------------------------------

def test_generate_refuses_a_run_that_does_not_fit_in_memory(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda: 2**30)
    run = run_script("generate", "--model", "huginn", "--loops", "100000")
    assert run.code == 2 and run.err.startswith("generate.py: error: this generation needs about ")
    assert re.search(r"needs about [\d.]+ GiB \(cache [\d.]+ GiB.*only 1.00 GiB is available", run.err)


def test_eval_refuses_a_run_that_does_not_fit_in_memory(monkeypatch, tmp_path):
    monkeypatch.setattr(memory, "available_bytes", lambda: 2**20)
    run = run_script("eval", "--model", "ouro", "--out", tmp_path / "x")
    assert run.code == 2 and re.search(r"eval.py: error: this eval needs about [\d.]+ GiB .*use a smaller --batch",
                                       run.err)


# ---- errors that name the file, option or type -----------------------------------------------------

def test_truncated_weights_and_malformed_config_name_the_file(tmp_path):
    dst = tmp_path / "ouro"
    shutil.copytree(fixture_dir("ouro-tiny"), dst)
    weights = dst / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=f"cannot read {weights}.*truncated"):
        load_model(dst)
    (dst / "config.json").write_text('{"model_type": "ouro",')
    with pytest.raises(ValueError, match=f"{dst / 'config.json'} is not valid JSON"):
        load_model(dst)


def test_nan_weight_is_named_at_load(tmp_path):
    dst = tmp_path / "ouro"
    shutil.copytree(fixture_dir("ouro-tiny"), dst)
    tensors = load_file(dst / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = np.nan
    save_file(tensors, dst / "model.safetensors")
    with pytest.raises(CheckpointError, match="tensor 'model.layers.1.mlp.up_proj.weight' holds NaN"):
        load_model(dst)


def test_wrong_calibration_type_is_named(ouro):
    model, ref = ouro
    cache = model.init_cache(2, 12, get_format("residual", group_size=8))
    wrong = CacheCalib((RVQCalib(None, None),))
    with pytest.raises(ValueError, match="'residual' format of the looped layers needs RotationCalib calibration, "
                                         "got RVQCalib"):
        model(jnp.asarray(ref["input_ids"]), cache, calib=wrong)


def test_unknown_policy_keyword_is_named():
    with pytest.raises(ValueError, match=r"cache format 'kivi' does not take \['rotation'\]"):
        get_format("kivi", rotation="hadamard")


# ---- FP8 metadata range and non-finite K/V ---------------------------------------------------------

def _write(fmt, k, v):
    """K/V [L, N, B, K, S, D] written by `fmt` as one segment: (reconstruct(loop) → K̂, V̂ [B, K, S, D],
    the state, out_of_range [B])."""
    from rq_jax.cache.base import segments, split_loops

    (seg,) = segments(k.shape[0], fmt.group_len)
    n, b, kh, s, d = k.shape[1:]
    calib = fmt.default_calib(seg, n, kh, d)
    lengths, num_new = jnp.zeros(b, jnp.int32), jnp.full(b, s, jnp.int32)
    ks, vs = split_loops(k, seg), split_loops(v, seg)
    state, lost = fmt.write(fmt.init(seg, n, b, s, kh, d), ks, vs, lengths, num_new, calib)
    full = jnp.full(b, s, jnp.int32)

    def reconstruct(loop):
        g, r = divmod(loop, seg.size)
        return fmt.reconstruct(state, (g, 0), r, full, calib)

    return reconstruct, state, lost


def _outlier_kv():
    """K/V [4 loops, 1 layer, 2 rows, 1 head, 8 tokens, 64]: row 0 at ~1e-3, row 1 at ~1e4."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 4, 1, 2, 1, 8, 64)).astype(np.float32)
    x[:, :, :, 0] *= 1e-3
    x[:, :, :, 1] *= 1e4
    return jnp.asarray(x[0]), jnp.asarray(x[1])


def _row_errors(reconstruct, k, v):
    """Worst relative RMS error over loops and K/V, per row [B]."""
    rel = []
    for loop in range(k.shape[0]):
        for x, xh in zip((k[loop, 0], v[loop, 0]), reconstruct(loop)):
            x, xh = np.asarray(x), np.asarray(xh)
            rel.append(np.sqrt(np.mean((xh - x) ** 2, axis=(1, 2, 3)) / np.mean(x**2, axis=(1, 2, 3))))
    return np.max(rel, axis=0)


@pytest.mark.parametrize("name,bits", [("residual", (2, 2, 2, 4)), ("rotated", (4,))])
def test_fp8_metadata_out_of_range_is_counted_and_the_super_scale_holds_it(name, bits):
    """Outliers of 1e4 beside values of 1e-3: plain FP8 metadata reports out-of-range values in both
    rows (saturated at 448, flushed to zero) and reconstructs the 1e4 row far off; with `super_scale`
    nothing is out of range and every row reconstructs within the INT2/INT4 error of its own
    magnitude. The bits per element count the super-scale and still equal the arrays' bytes."""
    from rq_jax.cache.base import tree_nbytes

    k, v = _outlier_kv()
    errs = {}
    for sup in (False, True):
        fmt = get_format(name, bits=bits, group_size=32, super_scale=sup)
        reconstruct, state, lost = _write(fmt, k, v)
        assert np.all(np.asarray(lost) > 0) if not sup else np.all(np.asarray(lost) == 0)
        errs[sup] = _row_errors(reconstruct, k, v)
        assert tree_nbytes(state) * 8 == fmt.bits_per_element(4, 64) * 2 * k.size
    assert errs[False][1] > 0.5  # plain FP8: the 1e4 row is clipped
    assert np.all(errs[True] < (0.45 if 2 in bits else 0.12))  # INT2 / INT4 relative error


def test_non_finite_kv_is_stored_as_zero_and_counted():
    """A NaN and an inf in one token's key: that token's other entries and every other token decode
    as if the bad entries were 0, nothing non-finite comes back, and both entries are counted."""
    rng = np.random.default_rng(1)
    k = rng.normal(size=(4, 1, 1, 2, 6, 64)).astype(np.float32)
    v = rng.normal(size=k.shape).astype(np.float32)
    dirty = k.copy()
    dirty[1, 0, 0, 1, 2, 5], dirty[3, 0, 0, 0, 4, 7] = np.nan, np.inf
    clean = np.where(np.isfinite(dirty), dirty, 0.0)
    fmt = get_format("residual", group_size=32)
    rec_dirty, _, lost = _write(fmt, jnp.asarray(dirty), jnp.asarray(v))
    rec_clean, _, none = _write(fmt, jnp.asarray(clean), jnp.asarray(v))
    np.testing.assert_array_equal(lost, [2])
    np.testing.assert_array_equal(none, [0])
    for loop in range(4):
        for a, b in zip(rec_dirty(loop), rec_clean(loop)):
            assert np.all(np.isfinite(np.asarray(a)))
            np.testing.assert_array_equal(a, b)


def test_the_cache_accumulates_out_of_range_through_model_calls(ouro):
    """K projections scaled by 1e5 push key metadata past FP8's 448: the cache's `out_of_range`
    counts it after a prompt and grows with a decode step; the super-scale option reports nothing."""
    model, ref = ouro
    graphdef, state = nnx.split(model)
    state = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 1e5 if "k_proj" in jax.tree_util.keystr(path) else x, state)
    loud = nnx.merge(graphdef, state)
    ids = jnp.asarray(ref["input_ids"][:1, :6])
    for sup in (False, True):
        cache = loud.init_cache(1, 8, get_format("residual", group_size=8, super_scale=sup))
        calib = default_calib(cache)
        first = loud(ids[:, :5], cache, calib=calib).cache
        second = loud(ids[:, 5:6], first, calib=calib).cache
        if sup:
            np.testing.assert_array_equal(second.out_of_range, [0])
        else:
            assert 0 < int(first.out_of_range[0]) < int(second.out_of_range[0])
