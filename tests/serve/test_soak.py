"""A soak test of scripts/serve.py: a mixed stream of requests at twice what the server holds, with clients
that disconnect mid-stream and bad requests interleaved, for RQ_SOAK_SECONDS (default 20; longer by setting
it). The server: ouro-small, residual [2,2,2,4], a pool of 12 pages of 16 tokens (fewer than its 12
decoding rows can fill, so requests are preempted) and 16 queue places.

Afterwards: every request the server accepted finished exactly once (its /metrics count of finished
requests grew by the accepted requests), none answered twice (ids unique), identical greedy requests got
identical answers whatever was preempted around them, no page or request is held, the 429s the clients saw
are the ones /metrics counted, RSS grew by less than 200 MB, and a SIGTERM under load lets the streams in
flight finish and exits 0."""

import asyncio
import collections
import json
import os
import pathlib
import random
import re
import signal
import time

import httpx
import pytest

from rq_jax.data import Addition
from rq_jax.tokenizer import load_tokenizer

REPO = pathlib.Path(__file__).resolve().parents[2]
SECONDS = float(os.environ.get("RQ_SOAK_SECONDS", "20"))
#: Pages for 12 × 16 tokens of the residual cache (13,056 bytes a page), up to 12 decoding, 16 waiting.
ARGS = ["--model", "ouro", "--cache", "residual", "--memory-gb", "0.000146", "--max-len", "64", "--chunk", "16",
        "--max-waiting", "16", "--drain-timeout", "120", "--page-size", "16"]
CLIENTS = 2 * (12 + 16)  # twice what runs and waits
RSS_GROWTH = 200 * 2**20
#: Bad requests and the field each 400 names.
BAD = [(dict(prompt="1+1=", temperature=-1), "temperature"), (dict(prompt="1+1=", max_tokens=100), "max_tokens"),
       (dict(prompt=[5, 9999]), "prompt"), (dict(prompt="1+1=", min_p=0.5), "min_p")]


def metrics(url: str) -> dict[str, float]:
    """Every rq_serve_ sample of /metrics, summed over labels but `reason` and `status` (kept in the key)."""
    out = collections.defaultdict(float)
    for m in re.finditer(r"^rq_serve_(\w+)(?:{([^}]*)})? (\S+)$", httpx.get(url + "/metrics", timeout=10).text, re.M):
        keep = re.search(r'(?:reason|status)="(\w+)"', m.group(2) or "")
        out[m.group(1) + (f"/{keep.group(1)}" if keep else "")] += float(m.group(3))
    return out


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024


async def client(http: httpx.AsyncClient, rng: random.Random, prompts: list[str], deadline: float, seen: dict):
    """Requests until the deadline: mostly completions (streamed or not, greedy or sampled, 1-16 tokens of a
    sum or a retrieval prompt), some that disconnect after their first chunk, some bad."""
    while time.monotonic() < deadline:
        kind = rng.choices(["plain", "stream", "disconnect", "bad"], [5, 3, 1, 1])[0]
        if kind == "bad":
            body, field = rng.choice(BAD)
            r = await http.post("/v1/completions", json=body)
            seen["status"][r.status_code] += 1
            assert r.status_code in (400, 429), r.text
            assert r.status_code == 429 or r.json()["error"]["param"] == field, r.text
            continue
        body = dict(prompt=rng.choice(prompts), max_tokens=rng.randint(1, 16), temperature=rng.choice([0, 0, 0.8]),
                    seed=rng.randint(0, 3), ignore_eos=rng.random() < 0.5)
        if kind == "plain":
            r = await http.post("/v1/completions", json=body)
            seen["status"][r.status_code] += 1
            if r.status_code == 200:
                out = r.json()
                seen["ids"].append(out["id"])
                if body["temperature"] == 0:
                    seen["greedy"][json.dumps(body, sort_keys=True)].add(out["choices"][0]["text"])
            else:
                assert r.status_code == 429, r.text
            continue
        async with http.stream("POST", "/v1/completions", json=dict(body, stream=True)) as r:
            seen["status"][r.status_code] += 1
            if r.status_code != 200:
                assert r.status_code == 429
                continue
            lines = []
            async for line in r.aiter_lines():
                if line:
                    lines.append(line)
                    if kind == "disconnect":
                        break  # leaving the block closes the connection: the server cancels the request
            if kind == "stream":
                assert lines[-1] == "data: [DONE]", lines[-3:]
                seen["ids"].append(json.loads(lines[0][6:])["id"])


@pytest.fixture(scope="module")
def soak_server(start_server):
    return start_server(ARGS)


def test_a_mixed_overload_leaves_nothing_held(soak_server):
    url = soak_server.url
    tokenizer = load_tokenizer(REPO / "checkpoints" / "ouro-small")
    prompts = [tokenizer.decode(list(e.prompt())) for e in Addition().examples("eval", 16)]
    prompts += ["q5;B1;m9;x3;a7;Z0;k2;\nx", "q5;B1;m9;x3;a7;Z0;k2;e8;u4;\nu"]  # 23 and 29 tokens: two 16-token chunks
    before, rss_before = metrics(url), rss(soak_server.proc.pid)
    seen = dict(status=collections.Counter(), ids=[], greedy=collections.defaultdict(set))

    async def run():
        limits = httpx.Limits(max_connections=CLIENTS + 8)
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
            deadline = time.monotonic() + SECONDS
            await asyncio.gather(*(client(http, random.Random(i), prompts, deadline, seen) for i in range(CLIENTS)))

    asyncio.run(run())
    deadline = time.monotonic() + 120  # cancellations of the last disconnects land within a few steps
    while time.monotonic() < deadline and (m := metrics(url))["requests_running"] + m["requests_waiting"]:
        time.sleep(0.2)
    after = metrics(url)
    accepted = seen["status"][200]
    finished = sum(after[f"requests_finished_total/{r}"] - before[f"requests_finished_total/{r}"]
                   for r in ("stop", "length", "cancelled"))
    assert finished == accepted, (finished, seen["status"])
    assert len(seen["ids"]) == len(set(seen["ids"]))
    assert all(len(texts) == 1 for texts in seen["greedy"].values()), seen["greedy"]
    assert after["requests_running"] == after["requests_waiting"] == after["pages_used"] == 0
    assert after["requests_refused_total/429"] - before["requests_refused_total/429"] == seen["status"][429]
    assert seen["status"][429] > 0 and seen["status"][400] > 0 and after["preemptions_total"] > 0, (seen, after)
    assert after["requests_finished_total/cancelled"] > before["requests_finished_total/cancelled"]
    assert rss(soak_server.proc.pid) - rss_before < RSS_GROWTH


def test_sigterm_under_load_drains_and_exits_0(soak_server):
    """Eight streams in flight when SIGTERM comes: each still ends with all its 20 tokens and [DONE], and
    the process exits 0."""
    async def stream(http, i):
        body = dict(prompt="1+1=", max_tokens=20, temperature=0, ignore_eos=True, stream=True, seed=i, logprobs=0,
                    return_tokens_as_token_ids=True)
        async with http.stream("POST", "/v1/completions", json=body) as r:
            return [line async for line in r.aiter_lines() if line]

    async def run():
        async with httpx.AsyncClient(base_url=soak_server.url, timeout=300) as http:
            tasks = [asyncio.create_task(stream(http, i)) for i in range(8)]
            deadline = time.monotonic() + 60
            while metrics(soak_server.url)["requests_running"] < 8 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            soak_server.proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks)

    for lines in asyncio.run(run()):
        assert lines[-1] == "data: [DONE]"
        assert sum(len(json.loads(line[6:])["choices"][0]["logprobs"]["tokens"]) for line in lines[:-1]) == 20
    assert soak_server.proc.wait(180) == 0
