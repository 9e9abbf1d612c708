"""Generate text with a looped model (Ouro or Huginn) and a chosen KV-cache format.

    python scripts/generate.py --model huginn
    python scripts/generate.py --model huginn --checkpoint ~/weights/huginn-0125 --prompt "The capital of France is"

Without --checkpoint it runs a small model shipped in checkpoints/ (trained on addition, key-value
retrieval and Python source; the default prompt is a held-out sum it answers): `huginn-small`, and for
Ouro `ouro-small-qat`, `ouro-small` fine-tuned for the residual cache (quantization-aware training),
because the base model's sums do not survive a 2-bit cache (docs/results.md). Prints the text,
prefill and decode tokens/s (a warm-up call compiles first), and the KV cache's bytes against dense bf16.

    python scripts/generate.py --model ouro --mesh data=4,model=2      # sharded over 8 devices

`--mesh` runs on a `jax.sharding.Mesh` (see rq_jax/sharding.py); several hosts run the same command
with JAX_COORDINATOR_ADDRESS=host:port, JAX_NUM_PROCESSES and JAX_PROCESS_ID set, and process 0 prints.
"""

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

from rq_jax import checkpoint, memory, sharding
from rq_jax.cli import (add_cache_options, add_model_options, cache_policy, check_cache_options, checkpoint_source,
                        finite_float, model_kwargs, nonnegative_int, positive_int, stop_token_ids)
from rq_jax.cache import cache_nbytes, dense_equivalent_nbytes, get_format
from rq_jax.cache.base import policy_fields
from rq_jax.nn.huginn import DEFAULT_THRESHOLDS, LOOKUPS, AdaptiveExit
from rq_jax.sampling import Sampler, SamplingConfig
from rq_jax.tokenizer import load_tokenizer

#: 71226 + 98 with every number written least significant digit first (rq_jax.data.addition), the first
#: held-out addition example: the shipped models answer "423170" (071324) and stop at the newline.
SAMPLE_PROMPT = "62217+89000="


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_options(p)
    p.add_argument("--prompt", default=SAMPLE_PROMPT, help="text to continue (default: a held-out sum the "
                   "shipped models were trained to answer, see SAMPLE_PROMPT)")
    p.add_argument("--max-new-tokens", type=positive_int, default=32)
    p.add_argument("--temperature", type=finite_float, default=0.0)
    p.add_argument("--top-k", type=nonnegative_int, default=0)
    p.add_argument("--top-p", type=finite_float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    add_cache_options(p)
    p.add_argument("--exit-criterion", choices=sorted(DEFAULT_THRESHOLDS),
                   help="Huginn: per-token adaptive exit while decoding")
    p.add_argument("--exit-threshold", type=finite_float, help="threshold of --exit-criterion (default: its own)")
    p.add_argument("--exit-lookup", choices=LOOKUPS, default="full",
                   help="what later tokens read at a skipped step: nothing (full, the reference's default) "
                        "or the token's last computed step (latest-m4, keeps the fused attention)")
    p.add_argument("--mesh", help="run sharded on a device mesh, e.g. data=4,model=2 (default: one device)")
    args = p.parse_args(argv)
    check_cache_options(p, args)
    if args.model == "ouro" and (args.exit_criterion or args.init_state):
        p.error("--exit-criterion and --init-state are for Huginn")
    if args.exit_threshold is not None and not args.exit_criterion:
        p.error("--exit-threshold needs --exit-criterion")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:
        p.error("--prompt is not valid UTF-8 text")
    return args


def main(argv=None):
    """Run the command line; returns the `Generation` it printed."""
    args = parse_args(argv)
    sharding.init_distributed()  # from JAX_COORDINATOR_ADDRESS etc.; a no-op when they are not set
    try:
        mesh = sharding.parse_mesh(args.mesh)
    except ValueError as err:
        sys.exit(f"generate.py: bad --mesh: {err}")
    source = checkpoint_source(args)
    model, folder = checkpoint.load(source, dtype=jnp.dtype(args.dtype))
    if model.config.family != args.model:
        sys.exit(f"--model {args.model} but {source} holds a {model.config.family} model")
    note = None
    if os.path.exists(os.path.join(folder, "config.json")):
        with open(os.path.join(folder, "config.json")) as f:
            note = json.load(f).get("rq_jax", {}).get("weights")
    try:
        tokenizer = load_tokenizer(folder)
    except FileNotFoundError as err:
        sys.exit(f"generate.py: {err} (the checkpoint needs its tokenizer.json)")
    stops = stop_token_ids(tokenizer, folder)
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, stop_tokens=stops)
    if args.model == "ouro" and args.exit_criterion:
        sys.exit("generate.py: --exit-criterion is for Huginn")
    kwargs = model_kwargs(args)
    if args.exit_criterion:
        kwargs["decode_kwargs"] = dict(adaptive=AdaptiveExit(args.exit_criterion, args.exit_threshold,
                                                                lookup=args.exit_lookup))
    try:
        fmt = get_format(args.cache, **cache_policy(args))
        fmt.bits_per_element(model.config.num_loops, model.config.head_dim)
    except ValueError as err:
        sys.exit(f"generate.py: bad --cache policy: {err}")
    prompt = tokenizer.encode(args.prompt).ids
    loops = model.config.num_loops if args.loops is None else args.loops
    if len(prompt) + args.max_new_tokens > model.config.max_position_embeddings:
        sys.exit(f"generate.py: {len(prompt)} prompt tokens + --max-new-tokens {args.max_new_tokens} exceed the "
                 f"model's {model.config.max_position_embeddings} positions")
    try:
        memory.check_fits(model, fmt, batch=1, prompt_len=len(prompt), max_len=len(prompt) + args.max_new_tokens,
                          num_loops=loops, compute_itemsize=jnp.dtype(args.dtype).itemsize, what="this generation",
                          advice="use fewer --loops or --max-new-tokens")
    except MemoryError as err:
        sys.exit(f"generate.py: {err}")
    calib = None
    if args.calibration:
        from rq_jax.calibrate import load_calibration

        try:
            calib = load_calibration(args.calibration, model, fmt, num_loops=loops)
        except (ValueError, FileNotFoundError) as err:
            sys.exit(f"generate.py: --calibration {args.calibration}: {err}")
    sampler = Sampler(model, sampling, fmt, calib=calib, mesh=mesh, **kwargs)
    sampler([prompt], seed=args.seed)  # compile
    out = sampler([prompt], seed=args.seed)
    n = int(out.num_generated[0])
    dense_bytes = dense_equivalent_nbytes(model.config, out.cache)
    if jax.process_index():
        return out

    print(f"model: {args.model} from {source}" + (f"  [{note}]" if note else ""))
    if mesh is not None:
        print("\n".join(sharding.describe(model.config, mesh, batch=1)))
    print(f"prompt: {args.prompt!r}")
    print(f"generated: {tokenizer.decode(out.tokens[0, :n].tolist())!r}")
    print(f"prefill: {len(prompt) / out.prefill_seconds:,.1f} tok/s ({len(prompt)} tokens)   "
          f"decode: {max(n - 1, 1) / out.decode_seconds:,.1f} tok/s ({n} tokens)   [{args.dtype} compute]")
    if out.mean_steps is not None:
        print(f"adaptive exit ({args.exit_criterion}): {out.mean_steps:.2f} of {out.cache.num_loops} steps "
              f"per decoded token on average")
    bits = float(fmt.bits_per_element(out.cache.num_loops, model.config.head_dim, out.cache.max_len))
    nbytes = cache_nbytes(out.cache)
    print(f"KV cache ({args.cache}, looped layers at {bits:.4g} bits/element): {nbytes:,} bytes for "
          f"{out.cache.max_len} positions (dense bf16 would take {dense_bytes:,}: {nbytes / dense_bytes:.1%})")
    if fmt.reports_out_of_range:
        lost = int(sharding.to_host(out.cache.out_of_range).sum())
        hint = lost and "super_scale" in policy_fields(args.cache) and not args.super_scale
        print(f"values the cache could not store (metadata outside its dtype's range, non-finite K/V): {lost:,}"
              + ("  (try --super-scale)" if hint else ""))
    return out


if __name__ == "__main__":
    main()
