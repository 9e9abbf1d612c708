"""Generate text with a looped model (Ouro or Huginn) and a chosen KV-cache format.

    python scripts/generate.py --model huginn
    python scripts/generate.py --checkpoint ~/weights/huginn-0125 --prompt "The capital of France is"

Without --checkpoint it runs a small model shipped in checkpoints/: `huginn-small` or `ouro-small`
(Ouro trained with Ouro's objective, whose sums survive the residual cache; docs/results.md). The
shipped models know only their training tasks: sums, key-value retrieval and Python source. A sum is
written with both operands zero-padded to 5 digits and every number least significant digit first: the
default prompt 62217+89000= is 71226 + 98, and the answer 423170 reads 71324. For such a prompt the
script prints the sum read the usual way and whether the model got it right.

Prints the text, prefill and decode tokens/s (a first call compiles, then a second is timed), and
the KV cache's bytes against dense bf16. Compiled programs are kept in a cache folder, so the second
run of a command starts fast (--no-compile-cache turns that off).

    python scripts/generate.py --model ouro --mesh data=4,model=2      # sharded over 8 devices

`--mesh` runs on a `jax.sharding.Mesh` (see rq_jax/sharding.py); several hosts run the same command
with JAX_COORDINATOR_ADDRESS=host:port, JAX_NUM_PROCESSES and JAX_PROCESS_ID set, and process 0 prints.
"""

import jax
import jax.numpy as jnp

from rq_jax import checkpoint, cli, memory, sharding
from rq_jax.nn.huginn import DEFAULT_THRESHOLDS, LOOKUPS, AdaptiveExit
from rq_jax.sampling import Sampler, SamplingConfig
from rq_jax.tokenizer import load_tokenizer, stop_token_ids
from rq_jax.train.export import card_facts, trained_mixture


def parse_args(argv=None):
    p = cli.ArgumentParser(description=__doc__)
    cli.add_model_options(p, infer_family=True)
    p.add_argument("--prompt", default=cli.SAMPLE_PROMPT,
                   help="text to continue; the default is a held-out sum the shipped models answer, 71226 + 98 in "
                   "their format (5 digits per operand, least significant first), answered 423170 = 71324")
    p.add_argument("--max-new-tokens", type=cli.positive_int, default=32,
                   help="tokens to generate at most (fewer when a stop token comes)")
    p.add_argument("--temperature", type=cli.nonnegative_float, default=0.0, help="sampling temperature; 0 is greedy")
    p.add_argument("--top-k", type=cli.nonnegative_int, default=0, help="sample among the k likeliest tokens; 0: all")
    p.add_argument("--top-p", type=cli.probability, default=1.0,
                   help="sample among the likeliest tokens holding this probability mass; 1: all")
    p.add_argument("--seed", type=int, default=0, help="seed of sampling and of Huginn's random initial state")
    cli.add_cache_options(p)
    p.add_argument("--exit-criterion", choices=sorted(DEFAULT_THRESHOLDS),
                   help="Huginn: per-token adaptive exit while decoding")
    p.add_argument("--exit-threshold", type=cli.finite_float,
                   help="threshold of --exit-criterion (default: its own: "
                   + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_THRESHOLDS.items()) + ")")
    p.add_argument("--exit-lookup", choices=LOOKUPS, default="full",
                   help="what later tokens read at a skipped step: nothing (full, the reference's default) "
                        "or the token's last computed step (latest-m4, keeps the fused attention)")
    p.add_argument("--mesh", help="run sharded on a device mesh, e.g. data=4,model=2 (default: one device)")
    cli.add_runtime_options(p)
    args = p.parse_args(argv)
    cli.check_cache_options(p, args)
    if args.exit_threshold is not None and not args.exit_criterion:
        p.error("argument --exit-threshold: needs --exit-criterion")
    if args.exit_criterion and args.exit_threshold is not None:
        least = 0 if args.exit_criterion == "argmax-stability" else None
        if least is None and args.exit_threshold <= 0:
            p.error(f"argument --exit-threshold: {args.exit_threshold:g} never fires --exit-criterion "
                    f"{args.exit_criterion} (its value is ≥ 0 and must fall below the threshold); give one > 0")
        if least is not None and args.exit_threshold < least:
            p.error(f"argument --exit-threshold: {args.exit_threshold:g}; argmax-stability counts steps, give one ≥ 0")
    if not args.prompt:
        p.error("argument --prompt: empty; give the text to continue")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:
        p.error("argument --prompt: not valid UTF-8 text")
    return p, args


def main(argv=None):
    """Run the command line; returns the `Generation` it printed."""
    p, args = parse_args(argv)
    cli.start(args)
    mesh = cli.device_mesh(p, args)
    config, folder = cli.resolve_checkpoint(p, args)
    if args.exit_criterion and args.model == "ouro":
        p.error("argument --exit-criterion: Huginn's option; this is an Ouro model")
    loops = config.num_loops if args.loops is None else args.loops
    fmt = cli.build_format(p, args, config, loops)
    try:
        tokenizer = load_tokenizer(folder)
    except FileNotFoundError as err:
        p.error(f"argument --checkpoint: {err} (the checkpoint needs its tokenizer.json)")
    prompt = tokenizer.encode(args.prompt).ids
    if len(prompt) + args.max_new_tokens > config.max_position_embeddings:
        p.error(f"argument --max-new-tokens: {len(prompt)} prompt tokens + {args.max_new_tokens} exceed the "
                f"model's {config.max_position_embeddings} positions")
    source = cli.checkpoint_source(args)
    model, _ = checkpoint.load(folder, dtype=jnp.dtype(args.dtype))
    try:
        memory.check_fits(model, fmt, batch=1, prompt_len=len(prompt), max_len=len(prompt) + args.max_new_tokens,
                          num_loops=loops, compute_itemsize=jnp.dtype(args.dtype).itemsize, what="this generation",
                          advice="use fewer --loops or --max-new-tokens")
    except MemoryError as err:
        p.error(str(err))
    try:
        calib = cli.calibration(args, model, fmt, loops)
    except ValueError as err:
        p.error(str(err))
    kwargs = cli.model_kwargs(args)
    if args.exit_criterion:
        kwargs["decode_kwargs"] = dict(adaptive=AdaptiveExit(args.exit_criterion, args.exit_threshold,
                                                                lookup=args.exit_lookup))
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, stop_tokens=stop_token_ids(tokenizer, folder))
    sampler = Sampler(model, sampling, fmt, calib=calib, mesh=mesh, **kwargs)
    main_process = not jax.process_index()
    note, mixture = card_facts(folder).get("weights"), trained_mixture(folder)
    if main_process:
        print(f"model: {args.model} from {source}" + (f"  [{note}]" if note else ""))
        if mixture is not None:
            print(f"task format: {mixture.addition.describe()}")
        if mesh is not None:
            print("\n".join(sharding.describe(model.config, mesh, batch=1)))
    with cli.compiling("the prefill and decode programs", quiet=not main_process):
        sampler([prompt], seed=args.seed)
    out = sampler([prompt], seed=args.seed)
    if not main_process:
        return out
    n = int(out.num_generated[0])
    text = tokenizer.decode(out.tokens[0, :n].tolist())
    print(f"prompt: {args.prompt!r}")
    print(f"generated: {text!r}")
    if mixture is not None:
        print(mixture.addition.check(args.prompt, text))
    print(f"prefill: {len(prompt) / out.prefill_seconds:,.1f} tok/s ({len(prompt)} tokens)   "
          f"decode: {max(n - 1, 1) / out.decode_seconds:,.1f} tok/s ({n} tokens)   [{args.dtype} compute]")
    if out.mean_steps is not None:
        print(f"adaptive exit ({args.exit_criterion}): {out.mean_steps:.2f} of {out.cache.num_loops} steps "
              f"per decoded token on average")
    print("\n".join(out.cache_report(model.config, args.calibration)))
    return out


if __name__ == "__main__":
    main()
