"""rq_jax.calibrate.allocate: the exhaustive search against brute force, schedules as formats, an
end-to-end allocation on the fixture model, and the artifact round trip."""

import itertools

import numpy as np
import pytest

from rq_jax.calibrate.allocate import (Schedule, allocate, best_schedule, load_schedule, measure_kl, save_schedule,
                                       schedule_bits)
from tests.conftest import SHIPPED, run_script

OPTS = ((2, 8), (4, 8), (2, 4), (0, 8))


def test_search_equals_brute_force_under_the_formats_own_accounting():
    """Against every schedule the format accepts (a 0-bit anchor it refuses), with 0-bit options costing
    nothing: the search never puts one at the anchor, the one position they would be cheapest at."""
    rng = np.random.default_rng(0)
    costs = {(kind, p, o): float(rng.uniform(0, 1)) for kind in "kv" for p in range(2) for o in OPTS[::2]}

    def bits(s):
        return schedule_bits(s, 4, 16)

    for budget in (2.6, 4.8, 5.3, 5.9, 7.0):  # at D 16 in pairs: INT2 g8 stores 4 bits, α adds 0.5, 0 bits just α
        best, cost = best_schedule(costs, 2, bits, budget, OPTS)
        brute = []
        for k in itertools.product(OPTS, repeat=2):
            for v in itertools.product(OPTS, repeat=2):
                s = Schedule(k, v)
                if k[-1][0] and v[-1][0] and bits(s) <= budget:
                    brute.append((sum(costs.get((kind, p, o), 0.0) for kind, side in (("k", k), ("v", v))
                                      for p, o in enumerate(side)), s))
        assert cost == pytest.approx(min(c for c, _ in brute))
        assert bits(best) <= budget and best.k[-1][0] and best.v[-1][0]
    assert best_schedule(costs, 2, bits, 2.4, OPTS) == (None, float("inf"))  # the fewest: 2.5


def test_schedule_format_and_bits():
    s = Schedule(((2, 32), (2, 32), (2, 32), (4, 32)), ((2, 32),) * 4)
    fmt = s.format()
    assert fmt.bits == (2, 2, 2, 4) and fmt.bits_v == (2, 2, 2, 2)
    # keys as the paper's [2,2,2,4] (3.09375 at D 128), values as residual INT2 (2.59375): the mean
    assert schedule_bits(s, 4, 128) == (3.09375 + 2.59375) / 2
    assert Schedule.from_json(s.to_json()) == s


def test_allocation_on_the_fixture_model(ouro, tmp_path):
    """Every slot measured, the choice within budget, measured KL ≥ 0, and the artifact loads back as
    the same format."""
    model, ref = ouro
    rows = np.asarray(ref["input_ids"])[:, :8]
    tight, loose = allocate(model, rows, (5.0, 6.0), num_loops=4, prefix=4, batch=2, positions=2,
                            options=((0, 8), (2, 8), (4, 8)))
    for alloc in (tight, loose):  # 0 bits measured at the first position only, not at the anchor
        assert sorted(alloc.costs) == ["k0:0g8", "k0:2g8", "k1:2g8", "v0:0g8", "v0:2g8", "v1:2g8"]
        assert alloc.bits <= alloc.budget and alloc.kl >= 0 and alloc.reference_kl >= 0
    assert loose.predicted_kl <= tight.predicted_kl and tight.costs == loose.costs  # measured once
    alloc = loose
    path = tmp_path / "schedule.json"
    save_schedule(str(path), alloc.schedule, {}, dict(allocation=alloc.to_json(), checkpoint="fixture"))
    assert load_schedule(str(path)) == alloc.schedule.format()
    with pytest.raises(ValueError, match="not a bit-allocation schedule"):
        load_schedule(str(tmp_path / "missing.json"))


def test_measured_kl_on_a_mask_and_its_complement_average_to_every_positions(ouro):
    """`measure_kl`'s mask picks the positions it averages: the KL on a mask and on the rest, weighted by
    their counts past the prefix, give the KL on every position; a mask with none there is refused."""
    model, ref = ouro
    rows = np.asarray(ref["input_ids"])[:, :8]
    mask = np.zeros(rows.shape, bool)
    mask[0, 5], mask[1, 4:7] = True, True
    fmt = Schedule.uniform(4, (2, 8)).format()

    def kl(m):
        return measure_kl(model, fmt, rows, 4, 2, mask=m, num_loops=4)

    every, on, off = kl(None), kl(mask), kl(~mask)
    n_on, n_off = mask[:, 4:].sum(), (~mask)[:, 4:].sum()
    assert on != pytest.approx(off, rel=1e-3)
    assert (n_on * on + n_off * off) / (n_on + n_off) == pytest.approx(every, rel=1e-5)
    mask[:, 4:] = False
    with pytest.raises(ValueError, match="selects no token past the 4-token prefix"):
        kl(mask)


def test_allocate_script_names_calib_rows_without_answers(tmp_path):
    run = run_script("allocate", "--checkpoint", SHIPPED / "ouro-small", "--budget", "3", "--out", tmp_path / "s",
                     "--tasks", "text", "--kl-on", "answers")
    assert run.code == 2 and run.err.count("\n") == 1, run.err
    assert "error: --kl-on answers: the calib rows (--tasks text, --rows 16) have no answer token" in run.err, run.err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "addition,sums"], "--tasks addition,sums): calibration tasks must be a non-empty subset of "),
    (["--tasks", ""], "--tasks ): calibration tasks must be a non-empty subset of "),
    (["--seq-len", "12", "--prefix", "4"], "--seq-len 12, --tasks addition,retrieval,text): seq_len 12 is too "
                                           "short for a retrieval example (13 tokens)"),
])
def test_allocate_script_names_bad_calib_rows(tmp_path, argv, message):
    run = run_script("allocate", "--checkpoint", SHIPPED / "ouro-small", "--budget", "3", "--out", tmp_path / "s",
                     *argv)
    assert run.code == 2 and run.err.count("\n") == 1, run.err
    assert run.err.startswith("allocate.py: error: calib rows (--rows 16, ") and message in run.err, run.err
    assert list(tmp_path.iterdir()) == []


def test_allocate_script_refuses_a_0_bit_reference(tmp_path):
    run = run_script("allocate", "--checkpoint", SHIPPED / "ouro-small", "--budget", "3", "--out", tmp_path / "s",
                     "--options", "2g32,0g32")
    assert run.code == 2 and run.err.count("\n") == 1, run.err
    assert "argument --options: 2g32,0g32: the last option is the reference every slot starts from and cannot be " \
           "0 bits" in run.err


def test_measured_kl_record_resumes_and_refuses_other_settings(tmp_path):
    from rq_jax import report
    from rq_jax.calibrate.allocate import MeasuredKL

    path, lines = str(tmp_path / "m.json"), []
    first = MeasuredKL(path, dict(rows=16), log=lines.append)
    first.add("a", 0.5)
    assert lines == ["  measured a: KL 5.000e-01 (1 so far)"]
    assert MeasuredKL(path, dict(rows=16)) == {"a": 0.5}
    with pytest.raises(report.SettingsMismatch, match="holds measurements of other settings"):
        MeasuredKL(path, dict(rows=8))


def test_paper_rule_keeps_the_int4_anchor_from_its_bits():
    from rq_jax.cache import get_format
    from rq_jax.calibrate.allocate import paper_rule

    assert paper_rule(3.1).bits == (2, 2, 2, 4) and paper_rule(3.0).bits == (2, 2, 2, 2)
    assert paper_rule(3.1).schedule_name(4) == get_format("residual", group_size=32).schedule_name(4)
