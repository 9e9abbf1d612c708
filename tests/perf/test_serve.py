"""rq_jax.perf.serve without a server: /metrics text as ServeMetrics renders it, peak concurrent streams,
a load point's summary, and the tables and files of the run checked in at docs/results/bench_serve."""

from __future__ import annotations

import json
import math
import pathlib
from types import SimpleNamespace

import numpy as np
import pytest

from rq_jax.perf import serve
from rq_jax.serve.metrics import PHASES, ServeMetrics
from rq_jax.tokenizer import load_tokenizer

REPO = pathlib.Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs" / "results"


def test_metrics_text_sums_samples_by_name_and_phase():
    m = ServeMetrics("tiny", "dense")
    m.slots_total.set(12)
    m.decode_rows.inc(7)
    for phase, seconds in [("decode", 0.5), ("decode", 0.25), ("prefill", 2.0)]:
        m.ran(phase, seconds)
    text = m.render().decode()
    assert serve.metric(text, "slots_total") == 12
    assert serve.metric(text, "engine_calls_total") == 3  # every phase's samples
    assert serve.metric(text, "engine_seconds_total", "decode") == 0.75
    assert serve.metric(text, "nothing_total") == 0
    counters = serve.engine_counters(text)
    assert set(counters) == {f"{p}_{w}" for p in PHASES for w in ("seconds", "calls")} | {
        "decode_rows", "prompt_tokens", "prefix_hit_tokens", "preemptions"}
    assert (counters["decode_calls"], counters["prefill_seconds"], counters["decode_rows"]) == (2, 2.0, 7)


@pytest.mark.parametrize("spans,peak", [
    ([], 0), ([(0, 1)], 1), ([(0, 2), (1, 3), (1.5, 4)], 3),
    ([(0, 1), (1, 2)], 1),  # one closes as the other opens
    ([(0, 1), (2, 3), (2.5, 2.6)], 2),
])
def test_peak_streaming(spans, peak):
    assert serve.peak_streaming(spans) == peak


@pytest.mark.parametrize("times,start,wall,peak", [
    ([], 0.0, 1.0, 0.0), ([5.2], 5.0, 1.5, 1.0),
    ([10.1, 10.5, 10.99, 11.0, 11.2, 13.7], 10.0, 4.0, 3.0),  # [10, 11) holds three; 11.0 opens the next second
    ([10.1, 10.5, 10.99, 11.0, 11.2, 11.3, 11.9], 10.0, 2.0, 4.0),
    ([10.1, 10.5, 11.0, 11.2, 11.3, 11.4], 10.0, 1.5, 2.0),  # [11, 11.5) is not a whole second
    ([10.1, 10.2, 10.3], 10.0, 0.4, None),  # no whole second: 3 tokens a second would understate 7.5
])
def test_peak_output(times, start, wall, peak):
    assert serve.peak_output(times, start, wall) == peak


def test_point_summary():
    results = [dict(ttft=0.01, itl=[0.002, 0.004], e2e=0.02, tokens=3, streaming=(1.0, 1.5),
                    token_times=[1.0, 1.002, 1.5]),
               dict(ttft=0.03, itl=[0.006], e2e=0.05, tokens=2, streaming=(1.2, 2.0), token_times=[1.2, 2.0]),
               dict(error=429)]
    p = serve.point_summary(results, 0.9, 2.0, 8, None, {"decode_calls": 4})
    assert (p["requests"], p["errors"], p["output_tok_s"], p["req_s"], p["peak_sequences"]) == (2, 1, 2.5, 1.0, 2)
    assert p["peak_tok_s"] == 4.0  # 1.0, 1.002, 1.2 and 1.5 within [0.9, 1.9)
    assert p["ttft_ms_p50"] == pytest.approx(20) and p["itl_ms_p50"] == pytest.approx(4)
    assert (p["concurrency"], p["rate"], p["engine"]) == (8, None, {"decode_calls": 4})
    assert math.isnan(serve.point_summary([dict(error=503)], 0.0, 1.0, None, 5.0, {})["e2e_ms_p99"])


def test_the_checked_in_run_writes_the_same_tables_and_keys(tmp_path):
    """docs/results/bench_serve.json through `write` gives docs/results/bench_serve.md to the byte, the
    JSON's keys and a figure."""
    run = json.loads((RESULTS / "bench_serve.json").read_text())
    args = SimpleNamespace(**dict(run["args"], out=str(tmp_path / "bench")))
    tables = serve.write(run["runs"], args)
    assert tables == (RESULTS / "bench_serve.md").read_text() == (tmp_path / "bench.md").read_text()
    assert "| rq_jax residual [2,2,2,4] |" in tables and "| residual / dense | 5.12x |" in tables
    written = json.loads((tmp_path / "bench.json").read_text())
    assert written == dict(run, args=vars(args)) and list(written) == ["args", "runs", "vllm"]
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    without = [dict(r, points=[p for p in r["points"] if p["concurrency"] != 32]) for r in run["runs"]]
    assert "vLLM comparison" not in serve.markdown(without, args)


def test_the_workloads_requests():
    """sums: 12-token prompts at max_tokens; mixed: log-uniform lengths within their stated ranges, every request
    fitting max_len; long: 2-4k-token prompts at --max-len 4096, uniform, max_tokens out; prefix: GSM8K 3-shot
    prompts sharing their first ~770 tokens, each format also run without the prefix cache; a workload that
    cannot fit max_len is refused by name."""
    tokenizer = load_tokenizer(REPO / "checkpoints" / "ouro-small")
    sums = serve.requests(SimpleNamespace(workload="sums", max_len=32, max_tokens=8), tokenizer, 300)
    assert len(sums) == 300 and all(len(tokenizer.encode(p).ids) == 12 and n == 8 for p, n in sums)
    mixed = serve.requests(SimpleNamespace(workload="mixed", max_len=512, max_tokens=8), tokenizer, 2000)
    lengths, outputs = np.array([len(p) for p, _ in mixed]), np.array([n for _, n in mixed])
    assert lengths.min() >= 8 and lengths.max() <= 256 and outputs.min() >= 4 and outputs.max() <= 256
    assert np.median(lengths) < 80 and (lengths > 128).sum() > 100  # log-uniform: many short, a tail of long
    args = SimpleNamespace(workload="prefix", max_len=1024, max_tokens=8)
    prefix = [tokenizer.encode(p).ids for p, _ in serve.requests(args, tokenizer, 4)]
    shared = next(i for i, (a, b) in enumerate(zip(prefix[0], prefix[1])) if a != b)
    assert 700 < shared < min(map(len, prefix)) and all(p[:shared] == prefix[0][:shared] for p in prefix)
    assert list(serve.variants(args)) == [*serve.FORMATS, *(f + serve.UNCACHED[0] for f in serve.FORMATS)]
    assert list(serve.variants(SimpleNamespace(workload="sums"))) == list(serve.FORMATS)
    with pytest.raises(ValueError, match="prefix workload's prompts reach 790 tokens: --max-len 512"):
        serve.requests(SimpleNamespace(workload="prefix", max_len=512, max_tokens=8), tokenizer, 4)
    long = serve.requests(SimpleNamespace(workload="long", max_len=4096, max_tokens=128), tokenizer, 200)
    lengths = np.array([len(p) for p, _ in long])
    assert lengths.min() >= 2048 and lengths.max() <= 4096 - 128 and {n for _, n in long} == {128}
    assert lengths.max() - lengths.min() > 1500  # uniform over the range, not one length


def test_the_prefix_table_sets_each_format_against_its_uncached_run():
    def point(concurrency, ttft, prompt_tokens):
        engine = {f"{p}_{w}": 1.0 for p in PHASES for w in ("seconds", "calls")}
        engine.update(decode_rows=1, prompt_tokens=prompt_tokens, prefix_hit_tokens=0, preemptions=0)
        return dict(concurrency=concurrency, rate=None, requests=8, errors=0, wall_s=1.0, output_tok_s=10.0,
                    req_s=1.0, peak_sequences=concurrency, ttft_ms_p50=ttft, ttft_ms_p99=ttft, itl_ms_p50=1.0,
                    itl_ms_p99=1.0, e2e_ms_p50=1.0, e2e_ms_p99=1.0, engine=engine)

    runs = [dict(format=label, slots=4, startup_cold_s=1.0, startup_s=1.0, rss_gb=1.0,
                 points=[point(8, ttft, tokens)])
            for label, ttft, tokens in [("dense bf16", 10.0, 100), ("residual [2,2,2,4]", 12.0, 100),
                                        ("dense bf16" + serve.UNCACHED[0], 40.0, 800),
                                        ("residual [2,2,2,4]" + serve.UNCACHED[0], 60.0, 800)]]
    args = SimpleNamespace(workload="prefix", checkpoint="c", max_len=1024, max_tokens=8, memory_gb=1.0)
    tables = serve.markdown(runs, args)
    assert "| dense bf16 | concurrency 8 | 100 / 800 | 10.0 / 40.0 | 0.25 |" in tables
    assert "| residual [2,2,2,4] | concurrency 8 | 100 / 800 | 12.0 / 60.0 | 0.20 |" in tables
    assert "GSM8K 3-shot prompts sharing a ~770-token prefix" in tables and "vLLM comparison" not in tables
