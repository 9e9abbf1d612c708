"""rq_jax.data: determinism, split disjointness, answer formats, and the resumable mixture stream."""

import numpy as np
import pytest

from rq_jax.data import (CALIB_MODULES, EVAL_MODULES, EOS, Addition, Mixture, MixtureConfig, Retrieval, StdlibText,
                         collate, decode, encode, split_of, stream_rng)
from rq_jax.data.common import BYTE_OFFSET
from rq_jax.tokenizer import byte_level_tokenizer


@pytest.fixture(scope="module")
def text():
    return StdlibText()


def test_byte_ids_match_the_tokenizer():
    tok = byte_level_tokenizer()
    s = "x = {'a': 1}\n\tdef f(): pass  # é"
    assert tok.encode(s).ids == encode(s).tolist()
    assert decode(encode(s)) == s.encode()
    assert tok.get_vocab_size() == 256 + BYTE_OFFSET


def test_generators_are_deterministic_and_seeded():
    add, ret = Addition(), Retrieval()
    for gen in (lambda seed: add.examples("eval", 20, seed), lambda seed: ret.examples("calib", 5, seed)):
        a, b, c = gen(0), gen(0), gen(1)
        assert [x.text for x in a] == [x.text for x in b]
        assert [x.text for x in a] != [x.text for x in c]
    # random access: item i does not depend on the items before it
    assert add.examples("train", 7)[6].text == add.sample(stream_rng(0, "train", 0, 6), "train").text


@pytest.mark.parametrize("task", [Addition(3), Retrieval(max_pairs=6, num_queries=3)])
def test_splits_are_disjoint(task):
    sets = {s: task.examples(s, n) for s, n in (("train", 1500), ("calib", 300), ("eval", 300))}
    for split, examples in sets.items():
        assert all(split_of(x.key) == split for x in examples)
    keys = {s: {x.key for x in xs} for s, xs in sets.items()}
    assert not keys["train"] & keys["eval"] and not keys["train"] & keys["calib"] and not keys["calib"] & keys["eval"]


def test_addition_format():
    add = Addition(5)
    ex = add.make(123, 4567)
    assert ex.text == b"32100+76540=096400\n"
    assert decode(ex.prompt()) == b"32100+76540=" and decode(ex.answer()) == b"096400\n"
    assert len(ex) == add.length and ex.num_answers == 1
    for ex in add.examples("eval", 200):
        a, b = (int(x[::-1]) for x in decode(ex.prompt())[:-1].split(b"+"))
        assert int(decode(ex.answer())[:-1][::-1]) == a + b
    with pytest.raises(ValueError):
        add.make(10**5, 1)


def test_retrieval_format_and_curriculum():
    ret = Retrieval()
    for ex in ret.examples("eval", 20, num_pairs=43):
        assert len(ex) == ret.max_length() >= 256 and ex.num_answers == 43
        context = decode(ex.tokens).split(b"\n")[0]
        pairs = dict((p[:1], p[1:]) for p in context.split(b";") if p)
        assert len(pairs) == 43 and all(k.isalpha() and v.isdigit() and len(v) == 1 for k, v in pairs.items())
        queried = set()
        for k in range(1, 44):
            key = decode(ex.prompt(k))[-1:]
            assert decode(ex.answer(k)) == pairs[key]
            queried.add(key)
        assert len(queried) == 43
    counts = {len(decode(x.tokens).split(b"\n")[0].split(b";")) - 1 for x in ret.examples("train", 200)}
    assert min(counts) >= 2 and max(counts) <= 43 and len(counts) > 10
    cfg = MixtureConfig(curriculum_start=8, curriculum_steps=100, retrieval=ret)
    assert [cfg.retrieval_max_pairs(s) for s in (0, 50, 10**6)] == [8, 26, 43]
    with pytest.raises(ValueError, match="52 distinct"):
        Retrieval(max_pairs=53)


def test_text_split_by_fixed_modules(text):
    assert set(text.modules["eval"]) == set(EVAL_MODULES) and set(text.modules["calib"]) == set(CALIB_MODULES)
    files = {s: set(text.files(s)) for s in ("train", "calib", "eval")}
    assert not files["train"] & files["eval"] and not files["train"] & files["calib"]
    assert not set(text.modules["train"]) & (set(EVAL_MODULES) | set(CALIB_MODULES))
    assert any(f.endswith("json/decoder.py") for f in files["eval"])
    assert text.num_bytes("train") > 10 * text.num_bytes("eval") > 0
    w = text.eval_windows(65, 8)
    assert w.shape == (8, 65) and np.array_equal(w, text.eval_windows(65, 8))
    assert "python_version" in text.describe()


def test_mixture_stream_is_deterministic_and_resumable(text):
    cfg = MixtureConfig(seq_len=96, rows=(2, 2, 1), seed=3, retrieval=Retrieval(max_pairs=8, num_queries=3),
                        curriculum_start=2, curriculum_steps=10)
    a, b = Mixture(cfg, text), Mixture(cfg, text)
    full = [x for _, x in zip(range(6), a.stream(0))]
    resumed = [x for _, x in zip(range(2), b.stream(4))]
    for x, y in zip(full[4:], resumed):
        assert x.step == y.step
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_array_equal(x.weights, y.weights)
    assert full[0].tokens.shape == (5, 97) and full[0].weights.shape == (5, 96)
    np.testing.assert_array_equal(full[0].task, [0, 0, 1, 1, 2])
    assert not np.array_equal(full[0].tokens, full[1].tokens)
    other = Mixture(MixtureConfig(**{**cfg.__dict__, "seed": 4}), text).batch(4)
    assert not np.array_equal(other.tokens, full[4].tokens)


def test_mixture_rows_hold_only_training_examples_with_answer_weights(text):
    cfg = MixtureConfig(seq_len=128, rows=(3, 0, 1), retrieval=Retrieval(max_pairs=8))
    batch = Mixture(cfg, text).batch(11)
    add = cfg.addition
    for row, weights in zip(batch.tokens[:3], batch.weights[:3]):
        lines = decode(row).split(b"\n")[:-1]
        assert len(lines) == 128 // add.length
        for line in lines:
            a, b = map(int, line.split(b"=")[0].split(b"+"))
            assert split_of(add.make(a, b).key) == "train"
        # targets row[1:]: weight 1 exactly on answer tokens
        expected = np.zeros(129, np.float32)
        for i in range(len(lines)):
            expected[i * add.length + add.length - add.max_digits - 2 : (i + 1) * add.length] = 1
        np.testing.assert_array_equal(weights, expected[1:])
    assert np.all(batch.weights[3] == 1)


def test_collate_pads_and_rejects_long():
    exs = Addition(2).examples("eval", 3)
    tokens, answer_id = collate(exs, 12)
    assert tokens.shape == (3, 12) and np.all(tokens[:, 10:] == EOS) and answer_id.max() == 1
    with pytest.raises(ValueError):
        collate(exs, 5)
