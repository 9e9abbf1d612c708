"""The serving benchmark behind scripts/bench_serve.py: scripts/serve.py started per cache format on
127.0.0.1 (cold, then from the compile cache the cold start filled), all of them up at once and taking turns
at each load point (a drift of this shared machine's speed then falls on every format alike, not on the
one that ran last; an idle server waits on its inbox), driven by an async load generator
(aiohttp, as vLLM's own serving benchmark: on 2 cores the client shares the CPU with the server, and
httpx's streaming cost ~0.75 of a core at 700 tok/s, halving what the server was measured to do) with
streamed completions; its tables (`markdown`), JSON and figure (`plot`).

Workloads (`WORKLOADS`, `requests`): `sums`, held-out sums in the models' format (12 tokens) and `max_tokens`
out each; `mixed`, prompt and output lengths drawn log-uniformly (prompts 8 to max_len / 2 tokens of held-out
sums run together, outputs 4 to max_len / 2), so requests of every length share one budget; `long`, prompts
drawn uniformly from max_len / 2 to max_len - max_tokens tokens of the same stream and `max_tokens` out
(2-4k-token prompts at --max-len 4096: the long-context regime, on a large model such as
scripts/random_checkpoint.py writes); `prefix`, the GSM8K 3-shot chain-of-thought prompt of
`rq_jax.eval.prompts` (Ouro's protocol) with a held-out sum as its question, so every request shares a
~770-token prefix, each format run with the prefix cache and without it (`--no-prefix-cache`).

Per request: time to first token, inter-token latency, end to end; per load point (fixed concurrency or
Poisson arrivals): output tok/s, peak output tok/s (the most tokens received in one whole second, as vLLM's
benchmark reports it, none for a point under a second: a decode-only stretch shows there, where the whole
point's figure also pays for the prompts), req/s, peak concurrent sequences (from the client's clock: polling
the server's /metrics would cost it CPU), medians / p99, and the engine's seconds and calls per program
from /metrics before and after.

`args` below is bench_serve.py's parsed command line: model, checkpoint, memory_gb (or max_slots), max_len,
max_tokens, levels (concurrencies, 'max': as many requests of max_len as the cache holds), arrivals (rates),
requests, max_seconds, out.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

from rq_jax import report
from rq_jax.data import Addition
from rq_jax.eval import prompts as eval_prompts
from rq_jax.eval.benchmarks import MathProblem
from rq_jax.serve.metrics import PHASES
from rq_jax.tokenizer import load_tokenizer

REPO = pathlib.Path(__file__).resolve().parents[2]

#: The cache formats compared: label -> serve.py options.
FORMATS = {"dense bf16": ["--cache", "dense"], "residual [2,2,2,4]": ["--cache", "residual"]}
WORKLOADS = ("sums", "mixed", "long", "prefix")
#: The label suffix and serve.py option of a run without the prefix cache (the `prefix` workload's baseline).
UNCACHED = (", no prefix cache", ["--no-prefix-cache"])


def variants(args) -> dict[str, list[str]]:
    """The servers a run compares (label -> serve.py options): every format, and for the `prefix` workload
    every format again without the prefix cache."""
    out = dict(FORMATS)
    if workload_of(args) == "prefix":
        out.update({label + UNCACHED[0]: [*opts, *UNCACHED[1]] for label, opts in FORMATS.items()})
    return out


def workload_of(args) -> str:
    return getattr(args, "workload", "sums")


def requests(args, tokenizer, n: int) -> list[tuple[str | list[int], int]]:
    """`n` requests of `args`'s workload (the module docstring): (prompt text or token ids, max_tokens).
    Raises ValueError when one would not fit `args.max_len`."""
    held_out = [tokenizer.decode(list(e.prompt())) for e in Addition().examples("eval", 1024)]
    sums = (held_out * (n // len(held_out) + 1))[:n]
    kind = workload_of(args)
    if kind == "sums":
        out = [(p, args.max_tokens) for p in sums]
    elif kind == "prefix":
        protocol = eval_prompts.protocol("ouro", "gsm8k")
        out = [(eval_prompts.build_prompt(protocol, MathProblem(str(i), "", q, "", "")), args.max_tokens)
               for i, q in enumerate(sums)]
    else:  # windows of the held-out sums run together
        rng = np.random.default_rng(0)
        stream = [t for p in held_out for t in tokenizer.encode(p).ids]
        if kind == "long":
            top = args.max_len - args.max_tokens
            lengths = rng.integers(min(args.max_len // 2, top), top + 1, n)
            outputs = np.full(n, args.max_tokens)
        else:
            top = max(args.max_len // 2, 8)
            lengths = np.exp(rng.uniform(np.log(8), np.log(top), n)).astype(int)
            outputs = np.exp(rng.uniform(np.log(4), np.log(top), n)).astype(int)
        starts = rng.integers(0, len(stream) - top, n)
        out = [(stream[a : a + int(k)], int(m)) for a, k, m in zip(starts, lengths, outputs)]
    longest = max(len(tokenizer.encode(p).ids) if isinstance(p, str) else len(p) for p, _ in out)
    if longest + max(m for _, m in out) - 1 > args.max_len:
        raise ValueError(f"the {kind} workload's prompts reach {longest} tokens: --max-len {args.max_len} cannot "
                         f"hold them with their output")
    return out
#: vLLM 0.32's CPU build serving checkpoints/ouro-lastloop on this 2-core machine (issue 24; not rerun here).
VLLM = {"c1_tok_s": "282-380", "c1_ttft_ms": "7-9", "c32_tok_s": "1,430-1,640", "c32_ttft_ms": "67-90",
        "startup_cold_s": "78", "startup_cached_s": "40", "rss_gb": "3.3"}


def sizing(args) -> list[str]:
    """serve.py's size options: every format at `max_slots` slots when given, else at the `memory_gb` budget."""
    slots = getattr(args, "max_slots", None)
    return ["--max-slots", str(slots)] if slots else ["--memory-gb", str(args.memory_gb)]


def sizing_words(args) -> str:
    slots = getattr(args, "max_slots", None)
    return f", {slots} slots each" if slots else f" at a {args.memory_gb} GiB cache budget"


class ServerDidNotStart(RuntimeError):
    """serve.py exited, or was not ready within the start-up limit (its output's tail in the message)."""


class ServerProcess:
    """scripts/serve.py on a free 127.0.0.1 port; `startup` seconds from spawn to /health 200."""

    def __init__(self, args, extra: list[str], compile_cache: str, timeout: float = 600.0):
        import httpx  # optional: httpx (the [test] extra)

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, str(REPO / "scripts" / "serve.py"), "--model", args.model, "--checkpoint",
               args.checkpoint, *extra, *sizing(args), "--max-len", str(args.max_len),
               "--max-waiting", "4096", "--host", "127.0.0.1", "--port", str(self.port)]
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        start = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONPATH=str(REPO), RQ_JAX_COMPILE_CACHE=compile_cache))
        while True:
            if self.proc.poll() is not None or time.perf_counter() - start > timeout:
                self.stop()
                raise ServerDidNotStart(f"serve.py did not start:\n{open(self.log.name).read()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.startup = time.perf_counter() - start

    def metric(self, name: str) -> float:
        """A metric's sum in the server's /metrics now."""
        import httpx  # optional: httpx (the [test] extra)

        return metric(httpx.get(self.url + "/metrics", timeout=10).text, name)

    def rss_gb(self) -> float:
        """Peak resident memory of the server process (VmHWM)."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        return kb / 2**20

    def stop(self) -> None:
        """SIGTERM, then SIGKILL when it has not exited within 60 s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def metric(text: str, name: str, phase: str | None = None) -> float:
    """The sum of a metric's samples in Prometheus text (those of engine program `phase` only, when given)."""
    labels = rf"{{[^}}]*phase=\"{phase}\"[^}}]*}}" if phase else r"(?:{[^}]*})?"
    return sum(float(m.group(1)) for m in re.finditer(rf"^rq_serve_{name}{labels} (\S+)$", text, re.M))


def engine_counters(text: str) -> dict:
    """The engine's seconds and calls per program, the decode steps' rows, the prompt tokens it computed,
    the prompt tokens the prefix index served and its preemptions, from /metrics."""
    out = {f"{phase}_{what}": metric(text, f"engine_{what}_total", phase)
           for phase in PHASES for what in ("seconds", "calls")}
    return dict(out, decode_rows=metric(text, "decode_rows_total"),
                prompt_tokens=metric(text, "prompt_tokens_total"),
                prefix_hit_tokens=metric(text, "prefix_cache_hit_tokens"),
                preemptions=metric(text, "preemptions_total"))


async def one_request(http, url: str, prompt: str | list[int], max_tokens: int) -> dict:
    """A streamed completion over aiohttp session `http`: time to first token, the gaps between tokens,
    end to end, tokens received (counted from the chunks' token ids; a chunk carries the tokens of one
    engine step) and when each arrived (`time.perf_counter`)."""
    start = time.perf_counter()
    times = []
    body = dict(prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, stream=True, logprobs=0,
                return_tokens_as_token_ids=True)
    async with http.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            return dict(error=r.status)
        async for line in r.content:  # one SSE line at a time
            if line.startswith(b"data: ") and line.rstrip() != b"data: [DONE]":
                choices = json.loads(line[6:])["choices"]
                now = time.perf_counter()
                times += [now] * len(choices[0]["logprobs"]["tokens"] if choices else [])
    if not times:
        return dict(error="no tokens")
    return dict(ttft=times[0] - start, itl=list(np.diff(times)), e2e=times[-1] - start, tokens=len(times),
                streaming=(times[0], times[-1]), token_times=times)


def peak_streaming(spans: list[tuple[float, float]]) -> int:
    """The most (first, last) token spans open at once (a span closing at a time another opens counts once)."""
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda e: (e[0], e[1]))
    return max(itertools.accumulate(d for _, d in events), default=0)


def peak_output(times: list[float], start: float, wall: float) -> float | None:
    """The most tokens received within one whole second of a point that ran `wall` seconds from `start`
    (buckets [start + i, start + i + 1) that end by start + wall), per second: vLLM's "peak output token
    throughput", less its partial last second. None for a point shorter than a second: its tokens over a
    second would read as a rate below its mean."""
    whole = int(np.floor(wall))
    if whole < 1:
        return None
    seconds = np.floor(np.subtract(times, start)).astype(int)
    return float(np.bincount(seconds[seconds < whole], minlength=1).max())


async def run_point(server: ServerProcess, prompts: list[tuple[str | list[int], int]], args,
                    concurrency: int | None = None, rate: float | None = None) -> dict:
    """One load point over `prompts` ((prompt, max_tokens) each): fixed `concurrency`, or Poisson arrivals
    at `rate` requests/s."""
    import aiohttp  # optional: aiohttp (the [test] extra)

    rng = np.random.default_rng(0)

    async def metrics_text(http) -> str:
        async with http.get(server.url + "/metrics") as r:
            return await r.text()

    connector = aiohttp.TCPConnector(limit=0)  # no cap on connections: the gate below is the concurrency
    # A request may wait for its first token as long as the point lasts (long prompts queue behind each other).
    timeout = aiohttp.ClientTimeout(total=args.max_seconds + 600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        before = engine_counters(await metrics_text(http))
        start = time.perf_counter()
        deadline = start + args.max_seconds
        tasks = []
        if concurrency is not None:
            gate = asyncio.Semaphore(concurrency)

            async def gated(p, n):
                async with gate:
                    if time.perf_counter() > deadline:
                        return None
                    return await one_request(http, server.url, p, n)

            tasks = [asyncio.create_task(gated(p, n)) for p, n in prompts]
        else:
            for p, n in prompts:
                if time.perf_counter() > deadline:
                    break
                tasks.append(asyncio.create_task(one_request(http, server.url, p, n)))
                await asyncio.sleep(rng.exponential(1 / rate))
        results = [r for r in await asyncio.gather(*tasks) if r is not None]
        wall = time.perf_counter() - start
        after = engine_counters(await metrics_text(http))
    return point_summary(results, start, wall, concurrency, rate, {k: after[k] - before[k] for k in after})


def point_summary(results: list[dict], start: float, wall: float, concurrency: int | None, rate: float | None,
                  engine: dict) -> dict:
    """A load point's row from its requests' results (`one_request`'s), its start (`time.perf_counter`) and
    wall seconds, and the engine counters it added: throughput, peak output tok/s (`peak_output`), peak
    concurrent sequences, medians and p99 (ms; NaN without data)."""
    ok = [r for r in results if "error" not in r]
    itl = [x for r in ok for x in r["itl"]]

    def ms(values, q):
        return float(np.percentile(values, q) * 1e3) if values else float("nan")

    return dict(concurrency=concurrency, rate=rate, requests=len(ok), errors=len(results) - len(ok), wall_s=wall,
                output_tok_s=sum(r["tokens"] for r in ok) / wall,
                peak_tok_s=peak_output([t for r in ok for t in r["token_times"]], start, wall), req_s=len(ok) / wall,
                peak_sequences=peak_streaming([r["streaming"] for r in ok]),
                ttft_ms_p50=ms([r["ttft"] for r in ok], 50), ttft_ms_p99=ms([r["ttft"] for r in ok], 99),
                itl_ms_p50=ms(itl, 50), itl_ms_p99=ms(itl, 99), e2e_ms_p50=ms([r["e2e"] for r in ok], 50),
                e2e_ms_p99=ms([r["e2e"] for r in ok], 99), engine=engine)


def start(label: str, options: list[str], args, cache_dir: str, stack: contextlib.ExitStack
          ) -> tuple[dict, ServerProcess]:
    """One server (`label`, serve.py `options`) started cold, stopped, and started again from the compile
    cache the cold start filled, stopped when `stack` closes: its run record (start-ups, room) and the
    running server."""
    out = dict(format=label, points=[])
    cold = ServerProcess(args, options, cache_dir)
    out["startup_cold_s"] = cold.startup
    cold.stop()
    server = ServerProcess(args, options, cache_dir)
    stack.callback(server.stop)
    out["startup_s"] = server.startup
    out["slots"] = int(server.metric("cache_capacity_tokens")) // args.max_len
    print(f"{label}: room for {out['slots']} requests of {args.max_len} tokens, started in "
          f"{out['startup_cold_s']:.1f} s cold, {server.startup:.1f} s from the compile cache", flush=True)
    return out, server


def loads(run: dict, args) -> list[dict]:
    """A server's load points, as `run_point` keywords: each concurrency ('max': as many requests of max_len
    as its cache holds; a repeat runs once), then each Poisson rate."""
    levels = dict.fromkeys(run["slots"] if c == "max" else c for c in args.levels)
    return [dict(concurrency=c) for c in levels] + [dict(rate=r) for r in args.arrivals]


def run_load(run: dict, server: ServerProcess, prompts: list[tuple[str | list[int], int]], args, load: dict) -> None:
    """One load point on `server`, added to its `run`."""
    c = load.get("concurrency")
    point = asyncio.run(run_point(server, prompts[: max(args.requests, c or 0)], args, **load))
    run["points"].append(point)
    what = f"concurrency {c}" if c else f"{load['rate']:g} req/s"
    print(f"  {run['format']}, {what}: {rate(point['output_tok_s'])} tok/s, TTFT p50 {point['ttft_ms_p50']:.1f} ms, "
          f"peak {point['peak_sequences']} sequences", flush=True)


def rate(x: float, decimals: int = 0) -> str:
    """A throughput for a table: `decimals` places where that leaves three figures or more (tok/s: 1,374;
    req/s with 1 decimal: 171.8), else three significant figures (3.12 tok/s, 0.0237 req/s)."""
    return f"{x:,.{decimals}f}" if x >= 10 ** (2 - decimals) else f"{x:.3g}"


def peak_rate(tok_s: float | None) -> str:
    """A peak tok/s in one second for a table; "—" (None) for a point shorter than a second, or a run recorded
    before it was measured."""
    return "—" if tok_s is None else rate(tok_s)


def load(point: dict) -> str:
    """A load point's label."""
    return f"concurrency {point['concurrency']}" if point["concurrency"] else f"Poisson {point['rate']:g} req/s"


def _rule(n: int) -> str:
    return report.row(["---"] * n)


def model_words(args) -> str:
    """The served model in words: a random-weight checkpoint's preset and layers (scripts/random_checkpoint.py),
    else the checkpoint folder's name."""
    try:
        with open(os.path.join(args.checkpoint, "config.json")) as f:
            note = json.load(f).get("rq_jax", {})
    except (OSError, ValueError):
        note = {}
    if note.get("weights") == "random":
        return f"random-weight {note['preset']} widths at {note['layers']} layers"
    return os.path.basename(os.path.normpath(args.checkpoint))


def workload_words(args) -> str:
    """The workload's prompts and outputs in words."""
    top = max(args.max_len // 2, 8)
    return {"sums": f"12-token prompts, {args.max_tokens} output tokens",
            "mixed": f"prompts of 8-{top} tokens and outputs of 4-{top} (log-uniform)",
            "long": f"prompts of {min(top, args.max_len - args.max_tokens)}-{args.max_len - args.max_tokens} tokens "
                    f"(uniform), {args.max_tokens} output tokens",
            "prefix": f"GSM8K 3-shot prompts sharing a ~770-token prefix, {args.max_tokens} output tokens"
            }[workload_of(args)]


def markdown(runs: list[dict], args) -> str:
    """The run's tables: every load point, where the engine's time went, dense against residual, the
    prefix cache against none (the `prefix` workload), and the vLLM comparison workload (when both formats
    ran concurrency 1 and 32 of the `sums` workload)."""
    row = report.row
    lines = [f"{model_words(args)} ({args.checkpoint}), requests of {args.max_len} tokens{sizing_words(args)}, "
             f"{workload_words(args)} (greedy, ignore_eos); medians and p99 of one run.",
             "", row(["format", "load", "requests", "output tok/s", "peak tok/s in 1 s", "req/s", "peak sequences",
                      "TTFT p50 / p99 ms", "ITL p50 / p99 ms", "e2e p50 / p99 ms"]), _rule(10)]
    for run in runs:
        for p in run["points"]:
            lines.append(row([run["format"], load(p), p["requests"], rate(p["output_tok_s"]),
                              peak_rate(p.get("peak_tok_s")), rate(p["req_s"], 1), p["peak_sequences"],
                              f"{p['ttft_ms_p50']:.1f} / {p['ttft_ms_p99']:.1f}",
                              f"{p['itl_ms_p50']:.1f} / {p['itl_ms_p99']:.1f}",
                              f"{p['e2e_ms_p50']:.0f} / {p['e2e_ms_p99']:.0f}"]))
    lines += ["", "Where the engine's time went (wall seconds of each program with its results ready, from /metrics; "
              "busy: their sum over the point's wall time):", "",
              row(["format", "load", "prompt chunk calls × ms (tokens)", "prefix hit tokens",
                   "decode steps × ms (mean rows)", "preemptions", "busy"]), _rule(7)]
    for run in runs:
        for p in run["points"]:
            e = p["engine"]

            def calls(phase):
                n = e[f"{phase}_calls"]
                return f"{n:.0f} × {e[f'{phase}_seconds'] / n * 1e3:.1f}" if n else "0"

            busy = sum(e[f"{phase}_seconds"] for phase in PHASES) / p["wall_s"]
            rows = e["decode_rows"] / e["decode_calls"] if e["decode_calls"] else 0
            lines.append(row([run["format"], load(p), f"{calls('prefill')} ({e['prompt_tokens']:.0f})",
                              f"{e['prefix_hit_tokens']:.0f}", f"{calls('decode')} ({rows:.0f})",
                              f"{e['preemptions']:.0f}", f"{busy:.0%}"]))
    dense, residual = runs[0], runs[1]

    def at(run, c):
        return next((p for p in run["points"] if p["concurrency"] == c), None)

    def sat(run):
        return max(p["output_tok_s"] for p in run["points"])

    def peak(run):
        return max(p["peak_sequences"] for p in run["points"])

    def burst(run):  # the most tokens in one whole second at any point; None when no point has the figure
        return max((p["peak_tok_s"] for p in run["points"] if p.get("peak_tok_s") is not None), default=None)

    lines += ["", row(["", f"requests of {args.max_len} tokens the cache holds", "peak concurrent sequences",
                       "saturated output tok/s", "peak tok/s in 1 s",
                       "start-up s (cold / compile cache)", "peak RSS GB"]), _rule(7)]
    for run in runs:
        lines.append(row([run["format"], run["slots"], peak(run), rate(sat(run)), peak_rate(burst(run)),
                          f"{run['startup_cold_s']:.1f} / {run['startup_s']:.1f}", f"{run['rss_gb']:.2f}"]))
    burst_residual, burst_dense = burst(residual), burst(dense)
    lines.append(row(["residual / dense", f"{residual['slots'] / dense['slots']:.2f}x",
                      f"{peak(residual) / peak(dense):.2f}x", f"{sat(residual) / sat(dense):.2f}x",
                      f"{burst_residual / burst_dense:.2f}x" if burst_residual and burst_dense else "—", "", ""]))
    uncached = {r["format"].removesuffix(UNCACHED[0]): r for r in runs if r["format"].endswith(UNCACHED[0])}
    if uncached:
        lines += ["", "The prefix cache against none (same requests; prompt tokens computed, TTFT p50):", "",
                  row(["format", "load", "prompt tokens cached / uncached", "TTFT p50 ms cached / uncached",
                       "TTFT ratio"]), _rule(5)]
        for run in runs:
            base = uncached.get(run["format"])
            for p in run["points"] if base else []:
                q = next((q for q in base["points"] if load(q) == load(p)), None)
                if q:
                    lines.append(row([run["format"], load(p), f"{p['engine']['prompt_tokens']:,.0f} / "
                                      f"{q['engine']['prompt_tokens']:,.0f}",
                                      f"{p['ttft_ms_p50']:.1f} / {q['ttft_ms_p50']:.1f}",
                                      f"{p['ttft_ms_p50'] / q['ttft_ms_p50']:.2f}"]))
    c1, c32, r1, r32 = at(dense, 1), at(dense, 32), at(residual, 1), at(residual, 32)
    if workload_of(args) == "sums" and c1 and c32 and r1 and r32:
        lines += ["", "The vLLM comparison workload (vLLM's figures quoted from issue 24, not rerun here):", "",
                  row(["", "vLLM 0.32 CPU (quoted)", "rq_jax dense bf16", "rq_jax residual [2,2,2,4]"]), _rule(4),
                  row(["output tok/s, concurrency 1", VLLM["c1_tok_s"], f"{c1['output_tok_s']:,.0f}",
                       f"{r1['output_tok_s']:,.0f}"]),
                  row(["TTFT ms (p50), concurrency 1", VLLM["c1_ttft_ms"], f"{c1['ttft_ms_p50']:.1f}",
                       f"{r1['ttft_ms_p50']:.1f}"]),
                  row(["output tok/s, concurrency 32", VLLM["c32_tok_s"], f"{c32['output_tok_s']:,.0f}",
                       f"{r32['output_tok_s']:,.0f}"]),
                  row(["TTFT ms (p50), concurrency 32", VLLM["c32_ttft_ms"], f"{c32['ttft_ms_p50']:.1f}",
                       f"{r32['ttft_ms_p50']:.1f}"]),
                  row(["start-up s, cold / compile cache", f"{VLLM['startup_cold_s']} / {VLLM['startup_cached_s']}",
                       f"{dense['startup_cold_s']:.1f} / {dense['startup_s']:.1f}",
                       f"{residual['startup_cold_s']:.1f} / {residual['startup_s']:.1f}"]),
                  row(["peak RSS GB", VLLM["rss_gb"], f"{dense['rss_gb']:.2f}", f"{residual['rss_gb']:.2f}"])]
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: str) -> None:
    """Output tok/s and p99 end-to-end latency against offered load: the fixed-concurrency points
    (concurrent requests) above, the Poisson points (arrival rate) below; a row for each kind the run has."""
    kinds = [(kind, xlabel) for kind, xlabel in (("concurrency", "concurrent requests (fixed concurrency)"),
                                                 ("rate", "arrival rate, requests/s (Poisson)"))
             if any(p[kind] for run in runs for p in run["points"])]
    fig, axes = report.pyplot().subplots(len(kinds), 2, figsize=(11, 3.5 * len(kinds)), squeeze=False)
    for (a, b), (kind, xlabel) in zip(axes, kinds):
        for run in runs:
            pts = sorted((p for p in run["points"] if p[kind]), key=lambda p: p[kind])
            x = [p[kind] for p in pts]
            a.plot(x, [p["output_tok_s"] for p in pts], marker="o", label=run["format"])
            b.plot(x, [p["e2e_ms_p99"] for p in pts], marker="o", label=run["format"])
        a.set(xlabel=xlabel, ylabel="output tokens/s", title="throughput")
        # From zero, with room above: with one arrival rate an autoscaled axis magnifies a 0.1% difference and
        # puts the highest point on the frame.
        a.set_ylim(0, 1.1 * max(p["output_tok_s"] for run in runs for p in run["points"] if p[kind]))
        b.set(xlabel=xlabel, ylabel="end-to-end latency p99 (ms)", title="p99 latency", yscale="log")
        for ax in (a, b):
            if kind == "concurrency":
                ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    report.save_figure(fig, path, dpi=120)


def write(runs: list[dict], args) -> str:
    """PREFIX.md (the tables), PREFIX.json ({"args", "runs", "vllm"}) and PREFIX.png for `args.out`;
    returns the tables."""
    tables = markdown(runs, args)
    report.write_text(args.out + ".md", tables)
    report.write_text(args.out + ".json", json.dumps(dict(args=vars(args), runs=runs, vllm=VLLM), indent=2))
    plot(runs, args.out + ".png")
    return tables


def run(args) -> list[dict]:
    """Every server of `variants` under every load point, the servers taking turns at each (all stopped on the
    way out, whatever happens), over at least 4096 requests of the workload (ValueError when they do not fit
    `args.max_len`)."""
    tokenizer = load_tokenizer(args.checkpoint)
    prompts = requests(args, tokenizer, max(args.requests, 4096))
    with tempfile.TemporaryDirectory() as cache_dir, contextlib.ExitStack() as stack:
        runs = []
        for i, (label, options) in enumerate(variants(args).items()):
            run, server = start(label, options, args, os.path.join(cache_dir, str(i)), stack)
            runs.append((run, server, loads(run, args)))
        for i in range(max(len(todo) for *_, todo in runs)):  # the servers take turns at each load point
            for run, server, todo in runs:
                if i < len(todo):
                    run_load(run, server, prompts, args, todo[i])
        for run, server, _ in runs:
            run["rss_gb"] = server.rss_gb()
        return [run for run, *_ in runs]
