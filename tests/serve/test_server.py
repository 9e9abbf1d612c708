"""scripts/serve.py as a real server process, driven by real clients: the official `openai` client, 64
concurrent httpx requests, a killed client, bad requests, lm-evaluation-harness, 8 simulated devices, and
SIGTERM. One server (Huginn-small, residual [2,2,2,4] cache, pages for 4 requests of 48 tokens) is shared by
the module."""

import asyncio
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from rq_jax import checkpoint, cli
from rq_jax.cache import get_format
from rq_jax.data import Addition
from rq_jax.sampling import Sampler, SamplingConfig
from rq_jax.tokenizer import load_tokenizer

openai = pytest.importorskip("openai")

REPO = pathlib.Path(__file__).resolve().parents[2]
FOLDER = REPO / "checkpoints" / "huginn-small"
#: --drain-timeout: time enough on a loaded machine for the stream test_sigterm_drains_and_exits_cleanly drains.
ARGS = ["--model", "huginn", "--cache", "residual", "--max-slots", "4", "--max-len", "48", "--chunk", "32",
        "--max-waiting", "64", "--drain-timeout", "600", "--page-size", "16"]
MODEL = "huginn-small"
#: A retrieval context in the models' format (checkpoints/*/README.md), then one query: 20 tokens.
RETRIEVAL = "q5;B1;m9;x3;a7;Z0;\nm"


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(ARGS)


@pytest.fixture(scope="module")
def reference():
    """reference(prompt, max_tokens, seed) -> the Sampler's greedy tokens for that prompt alone (at most 8).

    One Sampler of 8 new tokens and one cache length serves every call (a compile per prompt length):
    a request of fewer tokens is the start of its 8, since each token depends only on those before it
    and the per-step PRNG chain does not depend on the number of steps."""
    model, _ = checkpoint.load(FOLDER)
    tokenizer = load_tokenizer(FOLDER)
    stops = cli.stop_token_ids(tokenizer, str(FOLDER))
    sampler = Sampler(model, SamplingConfig(max_new_tokens=8, stop_tokens=stops), get_format("residual"),
                      init_scale=1.0)
    cache = {}

    def run(prompt: list[int], max_tokens: int, seed: int = 0) -> list[int]:
        assert max_tokens <= 8
        key = (tuple(prompt), seed)
        if key not in cache:
            out = sampler([prompt], seed=seed, max_len=32)
            cache[key] = out.tokens[0, : int(out.num_generated[0])].tolist()
        return cache[key][:max_tokens]

    run.tokenizer, run.stops = tokenizer, stops
    return run


def additions(n: int, offset: int = 0) -> list[str]:
    tokenizer = load_tokenizer(FOLDER)
    return [tokenizer.decode(list(e.prompt())) for e in Addition().examples("eval", n + offset)[offset:]]


def metric(server, name: str, reason: str | None = None, phase: str | None = None) -> float:
    """The sum of a metric's samples in /metrics (those with label `reason` or `phase` only, when given)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    label = ("reason", reason) if reason else ("phase", phase) if phase else None
    labels = rf"{{[^}}]*{label[0]}=\"{label[1]}\"[^}}]*}}" if label else r"(?:{[^}]*})?"
    values = [float(m.group(1)) for m in re.finditer(rf"^rq_serve_{name}{labels} (\S+)$", text, re.M)]
    assert values, f"{name} not in /metrics"
    return sum(values)


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_warming_up_answers_503_and_startup_is_printed(server):
    status, body = server.warming_status
    assert status == 503 and "warming up" in body["error"]["message"]
    deadline = time.monotonic() + 30  # serve.py prints the line from its own thread once /health says ready
    while "compiled in" not in (out := server.output()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert re.search(r"compiled in [\d.]+ s \(decode 1 [\d.]+, decode 2 [\d.]+, decode 3 [\d.]+, decode 4 [\d.]+, "
                     r"prefill 16 x1 [\d.]+, prefill 16 x2 [\d.]+, prefill 16 x4 [\d.]+, prefill 32 x1 [\d.]+, "
                     r"prefill 32 x2 [\d.]+, prefill 32 x4 [\d.]+\)", out), out
    assert "12 pages of 16 tokens" in out and "requests of 48 tokens, at most 4 decoding" in out


def test_openai_client_completion_chat_and_streaming(server, reference):
    """A completion and a chat completion are the Sampler's greedy answer; the stream's deltas
    concatenate to the same text, usage counts right, and the raw stream ends with [DONE]."""
    api = client(server)
    prompt = additions(1)[0]
    ids = reference.tokenizer.encode(prompt).ids
    want = reference(ids, 8)
    text = reference.tokenizer.decode([t for t in want if t not in reference.stops])
    out = api.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert out.choices[0].text == text == "423170" and out.choices[0].finish_reason == "stop"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), len(want))
    chat = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=8,
                                       temperature=0)
    assert chat.choices[0].message.content == text and chat.usage.prompt_tokens == len(ids)
    chunks = list(api.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == len(want) and chunks[-1].usage.total_tokens == len(ids) + len(want)
    pieces = list(api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                              max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in pieces) == text
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json=dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True)) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_logprobs_and_echo(server, reference):
    """logprobs report the chosen token's log-probability and its alternatives (the chosen one first
    under greedy); echo returns the prompt with its log-probabilities (None for its first token), as
    lm-evaluation-harness's loglikelihood reads them."""
    api = client(server)
    prompt = additions(1)[0]
    out = api.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp.tokens == list(out.choices[0].text) and len(lp.token_logprobs) == 3
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert max(top, key=top.get) == token and top[token] == pytest.approx(value) and value <= 0
    echo = api.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True)
    lp = echo.choices[0].logprobs
    n = len(reference.tokenizer.encode(prompt).ids)
    assert echo.choices[0].text.startswith(prompt) and len(lp.token_logprobs) == n + 1
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.tokens[:n] == list(prompt)


def test_64_concurrent_mixed_requests_on_4_slots(server, reference):
    """64 requests at once (sums and a retrieval prompt, 6 or 3 new tokens, seeds): each completes exactly
    once with the Sampler's tokens for its prompt alone, and every page is free afterwards."""
    prompts = additions(32, offset=1)
    jobs = [(prompts[i // 2] if i % 2 == 0 else RETRIEVAL, 6 if i % 2 == 0 else 3, i % 5) for i in range(64)]
    generated = metric(server, "generation_tokens_total")
    prompt_tokens = metric(server, "prompt_tokens_total")
    decode_calls = metric(server, "engine_calls_total", phase="decode")
    busy = metric(server, "engine_seconds_total")

    async def one(http, prompt, max_tokens, seed):
        ids = reference.tokenizer.encode(prompt).ids
        r = await http.post("/v1/completions", json=dict(model=MODEL, prompt=ids, max_tokens=max_tokens,
                                                          temperature=0, seed=seed, logprobs=0,
                                                          return_tokens_as_token_ids=True))
        assert r.status_code == 200, r.text
        return r.json()

    async def run_all():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
            return await asyncio.gather(*(one(http, *job) for job in jobs))

    results = asyncio.run(run_all())
    assert len({r["id"] for r in results}) == 64
    for (prompt, max_tokens, seed), r in zip(jobs, results):
        ids = reference.tokenizer.encode(prompt).ids
        want = reference(ids, max_tokens, seed)
        (choice,) = r["choices"]
        got = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
        assert got == want and r["usage"]["completion_tokens"] == len(want), (prompt, seed)
    assert metric(server, "generation_tokens_total") - generated == sum(r["usage"]["completion_tokens"]
                                                                         for r in results)
    assert metric(server, "slots_used") == 0 and metric(server, "slots_total") == 4
    assert metric(server, "requests_running") == 0 and metric(server, "requests_waiting") == 0
    # Every prompt runs once (each fits one 32-token chunk: no prefix to share, no preemption with 12 pages
    # for 4 requests of at most 2); a request of n tokens takes its first from its prompt chunk and the
    # rest from n - 1 decode steps, 4 rows at a time at best.
    assert metric(server, "prompt_tokens_total") - prompt_tokens == sum(
        len(reference.tokenizer.encode(prompt).ids) for prompt, _, _ in jobs)
    assert metric(server, "preemptions_total") == 0
    steps = metric(server, "engine_calls_total", phase="decode") - decode_calls
    later = sum(r["usage"]["completion_tokens"] - 1 for r in results)
    assert later / 4 <= steps <= later
    assert metric(server, "pages_used") == 0
    assert metric(server, "engine_seconds_total") > busy


def test_the_benchmark_client_counts_every_streamed_token(server):
    """bench_serve.py's load point (`rq_jax.perf.serve.run_point`: aiohttp, streamed, ignore_eos) on the shared
    server: 8 requests of 4 tokens at concurrency 4 all complete, each of their 32 tokens is counted once,
    the peak second (when the point lasts one) holds some and at most all of them, and the engine's counters
    show the point's calls."""
    from rq_jax.perf import serve as bench

    point = asyncio.run(bench.run_point(server, [(p, 4) for p in additions(8, offset=40)],
                                        SimpleNamespace(max_seconds=300), concurrency=4))
    assert (point["requests"], point["errors"], point["concurrency"]) == (8, 0, 4)
    assert point["output_tok_s"] * point["wall_s"] == pytest.approx(32)
    assert 1 <= point["peak_sequences"] <= 4
    if point["wall_s"] >= 1:  # a whole second holds some of the tokens and at most all
        assert 1 <= point["peak_tok_s"] <= 32
    else:
        assert point["peak_tok_s"] is None
    assert point["engine"]["decode_calls"] >= 3 and point["engine"]["prompt_tokens"] > 0


def test_a_killed_client_frees_its_slot(server):
    """A client streaming a long answer is killed: its request is cancelled (long before its 44 tokens),
    its slot freed, and the server goes on serving."""
    cancelled = metric(server, "requests_finished_total", "cancelled")
    generated = metric(server, "generation_tokens_total")
    script = ("import httpx, sys\n"
              f"with httpx.stream('POST', '{server.url}/v1/completions', timeout=60, json=dict(prompt='1+1=', "
              "max_tokens=44, temperature=0, ignore_eos=True, stream=True)) as r:\n"
              "    for line in r.iter_lines():\n"
              "        print(line, flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("data: ")  # streaming has begun
    finally:
        proc.kill()  # long before its 44 tokens are done
        proc.wait(10)
    deadline = time.monotonic() + 120  # generous for a loaded machine; it is a few decode steps
    while time.monotonic() < deadline and (metric(server, "slots_used") or
                                           metric(server, "requests_finished_total", "cancelled") == cancelled):
        time.sleep(0.1)
    assert metric(server, "slots_used") == 0 and metric(server, "pages_used") == 0
    assert metric(server, "requests_finished_total", "cancelled") == cancelled + 1
    assert metric(server, "generation_tokens_total") - generated < 44
    out = client(server).completions.create(model=MODEL, prompt=additions(1)[0], max_tokens=8, temperature=0)
    assert out.choices[0].text == "423170"


@pytest.mark.parametrize("body,field,words", [
    (b"{not json", None, "not valid JSON"),
    (dict(prompt="1+1=", min_p=0.1), "min_p", "Unrecognized request argument supplied: min_p"),
    (dict(prompt="1+1=", max_tokens=0), "max_tokens", "max_tokens must be an integer"),
    (dict(prompt="1+1=", max_tokens=200), "max_tokens", "a request holds 48"),
    (b'{"prompt": "1+1=", "temperature": NaN}', "temperature", "finite number"),
    (dict(prompt="1+1=", temperature=-0.5), "temperature", "finite number"),
    (dict(prompt="1+1=", top_p=0), "top_p", "(0, 1]"),
    (dict(prompt="1+1=", top_p=1.5), "top_p", "(0, 1]"),
    (dict(prompt=[5, 999]), "prompt", "[0, 259)"),
    (dict(prompt=""), "prompt", "empty"),
    (dict(prompt=[]), "prompt", "prompt must be"),
    (dict(prompt="1+1=", n=2), "n", "n must be 1"),
    (dict(prompt="1+1=", logprobs=9), "logprobs", "[0, 5]"),
])
def test_bad_requests_get_400_naming_the_field(server, body, field, words):
    kw = dict(content=body) if isinstance(body, bytes) else dict(json=body)
    r = httpx.post(server.url + "/v1/completions", timeout=30, **kw)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == field and words in error["message"], r.text
    assert error["type"] in ("invalid_request_error", "model_not_found")


def test_an_unknown_model_is_404_model_not_found(server):
    """OpenAI's (and vLLM's) answer for a model not served here: 404, code "model_not_found"."""
    r = httpx.post(server.url + "/v1/completions", json=dict(model="gpt-4", prompt="1+1="), timeout=30)
    error = r.json()["error"]
    assert r.status_code == 404 and error["param"] == "model" and "not served here" in error["message"], r.text
    assert error["code"] == "model_not_found" and error["type"] == "invalid_request_error"


def test_bad_chat_requests_and_unknown_routes(server):
    for body, field in [(dict(messages=[]), "messages"),
                        (dict(messages=[{"role": "tool", "content": "x"}]), "messages"),
                        (dict(messages=[{"role": "user", "content": "1"}], top_logprobs=2), "top_logprobs")]:
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = httpx.get(server.url + "/v1/nothing", timeout=10)
    assert r.status_code == 404 and "error" in r.json()
    assert httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"] == MODEL
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_a_full_queue_answers_429(server):
    """More requests at once than 4 slots and 64 queue places hold: the excess get 429 (OpenAI's shape),
    the rest complete, and the server serves on. (One token each: it comes from the prefill, so the
    queue drains without decode steps.)"""
    async def one(http):
        r = await http.post("/v1/completions", json=dict(prompt="1+1=", max_tokens=1, temperature=0,
                                                          ignore_eos=True))
        return r.status_code, r.json()

    async def run_all():
        async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                     limits=httpx.Limits(max_connections=200)) as http:
            return await asyncio.gather(*(one(http) for _ in range(100)))

    results = asyncio.run(run_all())
    statuses = [s for s, _ in results]
    assert statuses.count(429) >= 1 and set(statuses) == {200, 429}, statuses
    assert all(b["error"]["type"] == "rate_limit_exceeded" for s, b in results if s == 429)
    assert metric(server, "slots_used") == 0


def test_lm_eval_scores_the_residual_cache_through_the_server(server, tmp_path):
    """lm-evaluation-harness (no torch, no HF tokenizer) runs a generate_until task over 20 held-out sums
    in the models' format against the server: huginn-small through the residual cache scores ≥ 95%."""
    tokenizer = load_tokenizer(FOLDER)
    data = tmp_path / "additions.jsonl"
    with open(data, "w") as f:
        for e in Addition().examples("eval", 20):
            f.write(json.dumps(dict(prompt=tokenizer.decode(list(e.prompt())),
                                    answer=tokenizer.decode(list(e.answer())).rstrip("\n"))) + "\n")
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "rq_addition.yaml").write_text(f"""task: rq_addition
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")
    args = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args",
            f"model={MODEL},base_url={server.url}/v1/completions,tokenizer_backend=None,tokenized_requests=False,"
            "num_concurrent=8,max_retries=1,timeout=120", "--tasks", "rq_addition", "--include_path",
            str(tmp_path / "tasks"), "--output_path", str(tmp_path / "out")]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (result,) = (tmp_path / "out").rglob("results_*.json")
    score = json.loads(result.read_text())["results"]["rq_addition"]["exact_match,none"]
    assert score >= 0.95, score


def test_eight_devices_serve_the_same_tokens(server, start_server):
    """The same server on 8 simulated devices (--mesh data=4,model=2: slots over data, kv heads over
    model) answers with the one-device server's tokens and log-probabilities. (Shorter slots and one
    prefill bucket, so that it compiles less: the sums fit one 16-token chunk.)"""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"  # the suite's, 8 devices
    args = [*ARGS, "--mesh", "data=4,model=2", "--max-len", "32", "--chunk", "16"]
    mesh = start_server(args, env=dict(XLA_FLAGS=flags, JAX_PLATFORMS="cpu"))
    assert "mesh data=4 model=2 over 8 devices" in mesh.output()
    prompts = additions(3)

    async def ask(url):
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            rs = await asyncio.gather(*(http.post("/v1/completions", json=dict(prompt=p, max_tokens=6, temperature=0,
                                                                                 seed=i, logprobs=0))
                                        for i, p in enumerate(prompts)))
        return [(r.json()["choices"][0]["logprobs"]["tokens"], r.json()["choices"][0]["logprobs"]["token_logprobs"])
                for r in rs]

    one, eight = asyncio.run(ask(server.url)), asyncio.run(ask(mesh.url))
    for (tokens, lps), (tokens8, lps8) in zip(one, eight):
        assert tokens8 == tokens
        np.testing.assert_allclose(lps8, lps, atol=1e-3)
    assert mesh.stop() == 0


def test_sigterm_drains_and_exits_cleanly(server):
    """SIGTERM while a stream runs: new requests are refused (503 while draining, or the connection
    refused or closed once the listener is), the stream still completes with all its 30 tokens and
    [DONE], and the process exits with status 0. (Runs last: it stops the shared server.)"""
    body = dict(prompt="1+1=", max_tokens=30, temperature=0, ignore_eos=True, stream=True, logprobs=0,
                return_tokens_as_token_ids=True)
    refusals = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=600) as r:
        lines = r.iter_lines()
        first = next(lines)
        server.proc.send_signal(signal.SIGTERM)
        refused = None
        for _ in range(100):  # a request sent before the signal is handled is served: try again
            try:
                status = httpx.post(server.url + "/v1/completions", json=dict(prompt="1+1=", max_tokens=1),
                                    timeout=120).status_code
            except refusals as err:
                refused = type(err).__name__
            else:
                refused = status if status != 200 else None
            if refused is not None:
                break
            time.sleep(0.1)
        rest = [line for line in lines if line]
    assert refused in (503, *(e.__name__ for e in refusals)), refused
    assert first.startswith("data: ") and rest[-1] == "data: [DONE]"
    tokens = [t for line in [first, *rest[:-1]] for t in json.loads(line[6:])["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == 30
    assert server.proc.wait(120) == 0
    assert '"stopped": true' in server.output()
