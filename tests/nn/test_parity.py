"""Parity with the original PyTorch code (fixtures in tests/fixtures), float32, max abs error ≤ 1e-4."""

import jax.numpy as jnp
import numpy as np
import pytest

from rq_jax.cache import Dense
from rq_jax.nn.ouro import ExitRule
from rq_jax.sampling import Sampler, SamplingConfig

TOL = 1e-4


def max_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


class TestOuro:
    def test_default_exit_logits(self, ouro):
        model, ref = ouro
        out = model(jnp.asarray(ref["input_ids"]))
        assert max_err(out.logits, ref["logits"]) <= TOL
        assert max_err(out.extras["hidden_steps"], ref["hidden_steps"]) <= TOL
        assert max_err(out.extras["gate_logits"], ref["exit_gate_logits"]) <= TOL
        assert max_err(np.moveaxis(np.asarray(out.extras["exit_pdf"]), 0, -1), ref["exit_pdf"]) <= 1e-5
        np.testing.assert_array_equal(out.extras["exit_steps"], ref["exit_steps_default"])

    @pytest.mark.parametrize("step", range(4))
    def test_exit_at_step(self, ouro, step):
        model, ref = ouro
        out = model(jnp.asarray(ref["input_ids"]), exit=ExitRule("step", step))
        assert max_err(out.logits, ref[f"logits_step{step}"]) <= TOL

    def test_threshold_exit(self, ouro):
        model, ref = ouro
        out = model(jnp.asarray(ref["input_ids"]), exit=ExitRule("threshold", 0.5))
        np.testing.assert_array_equal(out.extras["exit_steps"], ref["exit_steps_thr0p5"])
        assert max_err(out.logits, ref["logits_exit_thr0p5"]) <= TOL

    def test_weighted_exit(self, ouro):
        model, ref = ouro
        out = model(jnp.asarray(ref["input_ids"]), exit=ExitRule("weighted"))
        assert max_err(out.logits, ref["logits_weighted_exit"]) <= TOL

    def test_cached_kv_per_loop_and_layer(self, ouro):
        model, ref = ouro
        cache = model.init_cache(2, 16, Dense("float32"))
        out = model(jnp.asarray(ref["input_ids"]), cache)
        assert max_err(out.logits, ref["logits"]) <= TOL
        k, v = out.cache.dense_kv()
        for loop in range(4):
            for layer in range(2):
                assert max_err(k[loop, layer, :, :, :10], ref[f"k_s{loop}_l{layer}"]) <= TOL
                assert max_err(v[loop, layer, :, :, :10], ref[f"v_s{loop}_l{layer}"]) <= TOL

    def test_cached_greedy_decode(self, ouro):
        model, ref = ouro
        sampler = Sampler(model, SamplingConfig(max_new_tokens=6), Dense("float32"), return_logits=True)
        out = sampler(ref["input_ids"].tolist())
        np.testing.assert_array_equal(out.tokens, ref["gen_tokens"])
        assert max_err(out.logits, ref["gen_logits"]) <= TOL


class TestHuginn:
    @pytest.mark.parametrize("steps", [1, 2, 4, 8])
    def test_logits_and_latents(self, huginn, steps):
        model, ref = huginn
        out = model(jnp.asarray(ref["input_ids"]), num_steps=steps)
        assert max_err(out.logits, ref[f"logits_r{steps}"]) <= TOL
        assert max_err(out.extras["latents"], ref[f"latents_r{steps}"]) <= TOL

    def test_cached_kv_per_block_execution(self, huginn):
        model, ref = huginn
        cache = model.init_cache(2, 16, Dense("float32"), num_loops=4)
        c = model(jnp.asarray(ref["input_ids"]), cache, num_steps=4).cache
        # Reference index: prelude 0, core step t block j → 1 + 2t + j, coda → −1.
        (pk, pv), (k, v) = c.dense_kv("plain"), c.dense_kv()
        assert max_err(pk[0, 0, :, :, :10], ref["k_idx0"]) <= TOL
        assert max_err(pv[0, 0, :, :, :10], ref["v_idx0"]) <= TOL
        assert max_err(pk[0, 1, :, :, :10], ref["k_idxm1"]) <= TOL
        assert max_err(pv[0, 1, :, :, :10], ref["v_idxm1"]) <= TOL
        for step in range(4):
            for block in range(2):
                idx = 1 + 2 * step + block
                assert max_err(k[step, block, :, :, :10], ref[f"k_idx{idx}"]) <= TOL
                assert max_err(v[step, block, :, :, :10], ref[f"v_idx{idx}"]) <= TOL

    def test_cached_greedy_decode(self, huginn):
        model, ref = huginn
        sampler = Sampler(model, SamplingConfig(max_new_tokens=6), Dense("float32"), return_logits=True,
                          num_steps=4, init_scale=0.0)
        out = sampler(ref["input_ids"].tolist())
        np.testing.assert_array_equal(out.tokens, ref["gen_tokens"])
        assert max_err(out.logits, ref["gen_logits"]) <= TOL
