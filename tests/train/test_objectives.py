"""rq_jax.train.objectives: Ouro's expected loss against a hand computation; gradients reach every loop."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rq_jax.data import Addition, MixtureConfig, Retrieval
from rq_jax.models import init_model
from rq_jax.nn.ouro import exit_distribution
from rq_jax.train import TrainConfig, tiny_model_config
from rq_jax.train.objectives import ouro_loss


def test_ouro_loss_equals_a_hand_computation():
    # two loops, one token, vocabulary of 2: loop 0 puts log-odds 0 on the target, loop 1 log-odds log 3
    logits = jnp.array([[[[0.0, 0.0]]], [[[math.log(3.0), 0.0]]]])  # [L=2, B=1, T=1, V=2]
    gate = jnp.array([[[0.0]], [[5.0]]])  # λ_0 = 1/2; the last loop takes the rest whatever its gate
    pdf = exit_distribution(gate)
    np.testing.assert_allclose(pdf[:, 0, 0], [0.5, 0.5])
    out = ouro_loss(logits, pdf, jnp.array([[0]]), beta=0.1)
    nll0, nll1 = math.log(2.0), -math.log(0.75)
    np.testing.assert_allclose(out.nll[:, 0, 0], [nll0, nll1], rtol=1e-6)
    np.testing.assert_allclose(out.entropy[0, 0], math.log(2.0), rtol=1e-6)
    np.testing.assert_allclose(out.loss[0, 0], 0.5 * nll0 + 0.5 * nll1 - 0.1 * math.log(2.0), rtol=1e-6)


def test_ouro_loss_with_all_mass_on_one_loop_is_its_nll():
    logits = jax.random.normal(jax.random.key(0), (3, 2, 4, 7))
    targets = jnp.zeros((2, 4), jnp.int32)
    pdf = jnp.zeros((3, 2, 4)).at[2].set(1.0)
    out = ouro_loss(logits, pdf, targets, beta=0.5)
    np.testing.assert_allclose(out.entropy, 0.0, atol=1e-6)
    np.testing.assert_allclose(out.loss, out.nll[2], rtol=1e-6)


def test_gradients_reach_every_loop_and_the_gate():
    """The loss's gradient w.r.t. each loop's hidden state is non-zero (the last-loop objective reaches
    earlier loops only through later ones; Ouro's reaches each loop's own prediction), and the exit
    gate gets a gradient."""
    cfg = tiny_model_config("ouro", hidden_size=64, num_heads=1, num_kv_heads=1, intermediate_size=64, num_layers=1)
    model = init_model(cfg, 0)
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)
    out = model(tokens[:, :-1])
    hidden = out.extras["hidden_steps"]  # [L, B, T, E]
    gates = out.extras["gate_logits"]

    def loss(hidden, gates):
        return jnp.mean(ouro_loss(model.head(hidden), exit_distribution(gates), tokens[:, 1:], 0.1).loss)

    g_hidden, g_gate = jax.grad(loss, argnums=(0, 1))(hidden, gates)
    per_loop = jnp.sqrt(jnp.sum(g_hidden**2, axis=(1, 2, 3)))
    assert per_loop.shape == (cfg.num_loops,) and bool(jnp.all(per_loop > 1e-6)), per_loop
    assert bool(jnp.all(jnp.abs(g_gate[:-1]).sum(axis=(1, 2)) > 0))  # the last loop's gate does not enter p

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def param_loss(params):
        m = nnx.merge(graphdef, params, rest)
        o = m(tokens[:, :-1])
        return jnp.mean(ouro_loss(m.head(o.extras["hidden_steps"]), o.extras["exit_pdf"], tokens[:, 1:], 0.1).loss)

    grads = jax.grad(param_loss)(params)
    gate_grad = grads["early_exit_gate"]["kernel"][...]
    assert float(jnp.abs(gate_grad).sum()) > 0


def test_config_checks_and_beta_schedule():
    model = tiny_model_config("ouro")
    data = MixtureConfig(seq_len=48, rows=(1, 1, 1), addition=Addition(2),
                         retrieval=Retrieval(max_pairs=4, num_queries=2))
    cfg = TrainConfig(model=model, data=data, total_steps=100, objective="ouro")
    assert float(cfg.beta_at(49)) == pytest.approx(0.1) and float(cfg.beta_at(50)) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="needs an Ouro model"):
        TrainConfig(model=tiny_model_config("huginn"), data=data, objective="ouro")
    with pytest.raises(ValueError, match="unknown objective"):
        TrainConfig(model=model, data=data, objective="first-loop")
    with pytest.raises(ValueError, match="≥ 0"):
        TrainConfig(model=model, data=data, objective="ouro", entropy_beta=-1.0)


def test_trainer_logs_the_loop_terms(tmp_path):
    from rq_jax.data import StdlibText
    from rq_jax.train import RunOptions, Trainer

    model = tiny_model_config("ouro", hidden_size=64, num_heads=1, num_kv_heads=1, intermediate_size=64,
                              num_layers=1, num_loops=3)
    data = MixtureConfig(seq_len=48, rows=(1, 1, 1), addition=Addition(2), curriculum_start=2, curriculum_steps=3,
                         retrieval=Retrieval(max_pairs=4, num_queries=2))
    cfg = TrainConfig(model=model, data=data, lr=3e-3, warmup_steps=2, total_steps=4, objective="ouro")
    trainer = Trainer(cfg, RunOptions(run_dir=str(tmp_path / "run"), eval_every=0, progress=False), StdlibText())
    trainer.run()
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 4
    for r in steps:
        assert len(r["loop_nll"]) == len(r["exit_pdf"]) == 3
        assert sum(r["exit_pdf"]) == pytest.approx(1.0, abs=1e-4)
        assert 0 < r["exit_entropy"] <= math.log(3) + 1e-6
