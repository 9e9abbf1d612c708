"""rq_jax.train: exact resume after an interruption, eval scoring = greedy decoding, and HF export."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rq_jax.data import EOS, Addition, MixtureConfig, Retrieval, StdlibText, collate
from rq_jax.train import RunOptions, TrainConfig, Trainer, tiny_model_config
from rq_jax.train import heldout
from tests.conftest import run_script
from rq_jax.train import trainer as trainer_module


@pytest.fixture(scope="module")
def text():
    return StdlibText()


def small_config(family: str, **kw) -> TrainConfig:
    model = tiny_model_config(family, hidden_size=64, num_heads=1, num_kv_heads=1, intermediate_size=64,
                              num_layers=1, num_loops=2,
                              **({"num_prelude": 1, "num_coda": 1} if family == "huginn" else {}))
    data = MixtureConfig(seq_len=48, rows=(1, 1, 1), addition=Addition(2), curriculum_start=2, curriculum_steps=3,
                         retrieval=Retrieval(max_pairs=4, num_queries=2))
    return TrainConfig(model=model, data=data, lr=3e-3, warmup_steps=2, total_steps=20, **kw)


def params_of(trainer):
    return [np.asarray(x) for x in jax.tree.leaves(trainer.params)]


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def test_interrupted_run_resumes_exactly(tmp_path, text):
    cfg = small_config("ouro", one_loop_steps=3)  # the resumed part crosses the switch to two loops
    def opts(d, stop):
        return RunOptions(run_dir=str(tmp_path / d), stop_step=stop, eval_every=0, progress=False)
    full = Trainer(cfg, opts("full", 5), text)
    full.run()
    first = Trainer(cfg, opts("resumed", 2), text)
    first.run()  # "interrupted" after 2 steps: checkpointed on exit
    trainer_module._jitted_train_step.cache_clear()  # recompile, as a fresh process would
    jax.clear_caches()
    resumed = Trainer(cfg, opts("resumed", 5), text)
    assert resumed.step == 2
    resumed.run()
    assert resumed.step == full.step == 5
    for a, b in zip(params_of(full), params_of(resumed), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(full.opt_state), jax.tree.leaves(resumed.opt_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert losses(tmp_path / "full") == losses(tmp_path / "resumed")
    assert sorted(losses(tmp_path / "resumed")) == list(range(5))
    with open(tmp_path / "resumed" / "metrics.jsonl") as f:
        assert [r["loops"] for r in map(json.loads, f) if "loss" in r] == [1, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="lr"):
        Trainer(TrainConfig(**{**cfg.__dict__, "lr": 1e-4}), opts("resumed", 6), text)


def test_branch_norms_shrink_at_the_switch_to_all_loops(tmp_path, text):
    cfg = small_config("ouro", one_loop_steps=2, branch_norm_switch=0.25)
    trainer = Trainer(cfg, RunOptions(run_dir=str(tmp_path), stop_step=2, eval_every=0, progress=False), text)
    trainer.run()
    before, opt_state = trainer.params, trainer.opt_state
    scaled = trainer_module.scale_branch_norms(before, factor=0.25)
    changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(scaled))]
    assert sum(changed) == len(trainer_module.BRANCH_NORMS)  # the two branch norms (stacked over layers), only
    expected = trainer._train_step(scaled, opt_state, *trainer.batch(2), 2)[0]
    trainer._train_one(2)  # the switch: the norms scaled, then the step
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(trainer.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="branch_norm_switch"):
        small_config("ouro", branch_norm_switch=0.25)  # no one-loop phase to switch from
    for kwargs in ({}, dict(value=1.0, factor=0.25)):
        with pytest.raises(ValueError, match="a value or a factor"):
            trainer_module.scale_branch_norms(before, **kwargs)


def test_training_lowers_the_loss(tmp_path, text):
    cfg = small_config("ouro")
    Trainer(cfg, RunOptions(run_dir=str(tmp_path), stop_step=12, eval_every=0, progress=False), text).run()
    loss = losses(tmp_path)
    assert loss[11] < loss[0] - 0.5


def greedy_decode(model, prompt: np.ndarray, num_tokens: int, loops: int, length: int) -> np.ndarray:
    """Plain greedy decoding without a cache: append argmax num_tokens times to prompt [P] → [num_tokens],
    each step running the whole sequence right-padded to `length` (one shape)."""
    buf = np.full((1, length), EOS, np.int32)
    buf[0, : len(prompt)] = prompt
    fwd = nnx.jit(lambda m, t: m(t, num_loops=loops).logits)
    for pos in range(len(prompt), len(prompt) + num_tokens):
        buf[0, pos] = int(jnp.argmax(fwd(model, jnp.asarray(buf))[0, pos - 1]))
    return buf[0, len(prompt) : len(prompt) + num_tokens]


def test_teacher_forced_exact_match_equals_greedy_decoding(text):
    cfg = small_config("huginn")
    from rq_jax.models import init_model

    model = init_model(cfg.model, 1)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    score = heldout.make_score_fn(graphdef, rest, 2)
    add = Addition(2)
    examples = add.examples("eval", 4)
    # make each example's answer the model's own greedy output, then corrupt half of them
    fixed = []
    for i, ex in enumerate(examples):
        prompt = ex.prompt()
        out = greedy_decode(model, prompt, len(ex.answer()), 2, add.length)
        if i % 2:
            out = out.copy()
            out[-1] = out[-1] + 1 if out[-1] < 258 else 3
        tokens = np.concatenate([prompt, out])
        fixed.append(type(ex)(ex.task, tokens, ex.answer_id, ex.key))
    tokens, answer_id = collate(fixed, add.length)
    preds, _ = heldout.score_batches(score, params, tokens, batch=3)
    np.testing.assert_array_equal(heldout.answer_exact_match(preds, tokens, answer_id), [True, False, True, False])
    assert heldout.answer_scores(score, params, fixed, add.length, batch=3)["em"] == 0.5


def test_evaluate_and_export(tmp_path, text):
    from rq_jax.convert.hf import load_model
    from rq_jax.train.export import export_hf

    cfg = small_config("ouro")
    tr = Trainer(cfg, RunOptions(run_dir=str(tmp_path / "run"), stop_step=1, eval_every=0, progress=False,
                                 eval_addition=8, eval_retrieval=2, eval_retrieval_full=2, eval_text_windows=2), text)
    tr.run()
    acc = tr.evaluate()
    assert set(acc) == {"addition_acc", "retrieval_acc", "retrieval4_acc", "addition_tok", "retrieval_tok",
                        "retrieval4_tok", "text_bpb"}
    assert all(0 <= v <= 1 for k, v in acc.items() if k != "text_bpb") and 4 < acc["text_bpb"] < 12
    info = export_hf(tr, str(tmp_path / "hf"), acc, "python scripts/train_tiny.py ...", dtype=np.float32)
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= set(os.listdir(tmp_path / "hf"))
    assert info["bytes"] < 5_000_000 and "addition_acc" in open(tmp_path / "hf" / "README.md").read()
    model, _ = load_model(tmp_path / "hf")
    toks = jnp.asarray(collate(cfg.data.addition.examples("eval", 2), 16)[0])
    np.testing.assert_allclose(model(toks, num_loops=2).logits, tr.model()(toks, num_loops=2).logits, atol=1e-5)


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_shipped_sizes_fit_the_budget(family):
    from rq_jax.models import init_model

    c = tiny_model_config(family)
    assert c.head_dim >= 64 and c.num_loops >= (4 if family == "ouro" else 8)
    model = nnx.eval_shape(lambda: init_model(c, 0))
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert 2 * n < 5_000_000


def test_portable_snapshot_continues_bit_identically(tmp_path, text):
    cfg = small_config("huginn")
    def opts(d, stop, **kw):
        return RunOptions(run_dir=str(tmp_path / d), stop_step=stop, eval_every=0, progress=False, **kw)

    full = Trainer(cfg, opts("full", 4, portable=False), text)
    full.run()
    Trainer(cfg, opts("first", 2), text).run()
    assert os.path.exists(tmp_path / "first" / "portable" / "adam_nu" / "model.safetensors")
    moved = Trainer(cfg, opts("moved", 4, init_from=str(tmp_path / "first" / "portable")), text)
    assert moved.step == 2
    moved.run()
    for a, b in zip(params_of(full), params_of(moved), strict=True):
        np.testing.assert_array_equal(a, b)


def test_huginn_trains_from_a_seeded_random_state(tmp_path, text):
    first = {}
    for random_state in (True, False):
        cfg = TrainConfig(**{**small_config("huginn").__dict__, "random_state": random_state})
        Trainer(cfg, RunOptions(run_dir=str(tmp_path / str(random_state)), stop_step=1, eval_every=0, progress=False,
                                portable=False), text).run()
        first[random_state] = losses(tmp_path / str(random_state))[0]
    assert first[True] != first[False]


def test_cli_trains_resumes_and_exports(tmp_path):
    flags = ["--model", "ouro", "--run-dir", str(tmp_path / "run"), "--hidden", "64", "--intermediate", "64",
             "--layers", "1", "--loops", "1", "--seq-len", "48", "--max-pairs", "4", "--queries", "2", "--max-digits",
             "2", "--rows", "1,1,1", "--curriculum-start", "2", "--eval-every", "0", "--no-progress"]
    for extra in (["--stop-step", "1"], ["--stop-step", "2", "--export", tmp_path / "hf", "--export-n", "8"]):
        run = run_script("train_tiny", *flags, *extra)
        assert run.code == 0, run.err
    assert sorted(losses(tmp_path / "run")) == [0, 1]
    card = open(tmp_path / "hf" / "README.md").read()
    assert "--hidden 64" in card and "--lr 0.001" in card and "trained 2 steps" in card
    changed = run_script("train_tiny", *flags, "--lr", "3e-3", "--stop-step", "3")
    assert changed.code == 2 and changed.err.startswith("train_tiny.py: error: ") and "lr" in changed.err
    stage2 = flags[:3] + [str(tmp_path / "run2")] + flags[4:] + ["--init-weights", str(tmp_path / "hf")]
    run = run_script("train_tiny", *stage2, "--stop-step", "1", "--export", tmp_path / "hf2", "--export-n", "8")
    assert run.code == 0, run.err
    card = open(tmp_path / "hf2" / "README.md").read()
    assert "trained 2 + 1 steps in 2 stages" in card
    first, second = card.split("## Reproduce")[1].strip().strip("`").strip().splitlines()
    assert "--init-weights" not in first and first.endswith("--export STAGE1")
    assert second.endswith("--init-weights STAGE1") and "--run-dir RUN" in second
    config = open(tmp_path / "hf2" / "config.json").read()
    assert str(tmp_path) not in card and str(tmp_path) not in config  # cards and configs name no machine paths


def test_second_stage_starts_from_exported_weights(tmp_path, text):
    from rq_jax.train.export import export_hf

    cfg = small_config("ouro")
    first = Trainer(cfg, RunOptions(run_dir=str(tmp_path / "a"), stop_step=2, eval_every=0, progress=False), text)
    first.run()
    export_hf(first, str(tmp_path / "hf"), {}, "first", dtype=np.float32)
    second = Trainer(TrainConfig(**{**cfg.__dict__, "init_weights": str(tmp_path / "hf"), "seed": 1}),
                     RunOptions(run_dir=str(tmp_path / "b"), eval_every=0, progress=False), text)
    assert second.step == 0
    for a, b in zip(params_of(first), params_of(second), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="embed_std"):
        Trainer(TrainConfig(**{**cfg.__dict__, "init_weights": str(tmp_path / "hf"), "embed_std": 1.0}),
                RunOptions(run_dir=str(tmp_path / "c"), progress=False), text)
    wider = tiny_model_config("ouro", hidden_size=64, num_heads=1, num_kv_heads=1, intermediate_size=128, num_layers=1,
                              num_loops=2)
    other = TrainConfig(**{**cfg.__dict__, "model": wider,
                           "init_weights": str(tmp_path / "hf")})
    with pytest.raises(ValueError, match="another model config"):
        Trainer(other, RunOptions(run_dir=str(tmp_path / "d"), progress=False), text)


def test_embedding_reinit(tmp_path, text):
    cfg = TrainConfig(**{**small_config("ouro").__dict__, "embed_std": 1.0})
    tr = Trainer(cfg, RunOptions(run_dir=str(tmp_path), eval_every=0, progress=False), text)
    emb = [np.asarray(x) for x in jax.tree.leaves(tr.params) if x.shape == (259, 64)]
    assert len(emb) == 1 and 0.9 < emb[0].std() < 1.1
    assert all(np.asarray(x).std() < 0.1 for x in jax.tree.leaves(tr.params) if x.ndim == 2 and x.shape != (259, 64))
