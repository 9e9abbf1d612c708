"""Generate text with a looped model (Ouro or Huginn) and a chosen KV-cache format.

    python scripts/generate.py --model huginn --prompt "The capital of France is"

Without --checkpoint it runs the small model shipped in checkpoints/. Prints the text, prefill and
decode tokens/s (a warm-up call compiles first), and the KV cache's bytes.
"""

import argparse
import json
import os
import sys

import jax.numpy as jnp

from rq_jax import checkpoint
from rq_jax.cache import available_formats, cache_nbytes, dense_equivalent_nbytes, get_format
from rq_jax.nn.huginn import DEFAULT_THRESHOLDS, AdaptiveExit
from rq_jax.sampling import Sampler, SamplingConfig
from rq_jax.tokenizer import load_tokenizer

SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "checkpoints")
STOP_STRINGS = ("<|endoftext|>", "<|end_text|>", "<|end_turn|>", "<|im_end|>")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("huginn", "ouro"), required=True)
    p.add_argument("--checkpoint", help="checkpoint folder or cached hub id (default: the shipped small model)")
    p.add_argument("--prompt", default="The looped transformer")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--loops", "--num-steps", dest="loops", type=int,
                   help="loops (Ouro) or recurrence steps (Huginn); default the config's")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype")
    p.add_argument("--cache", choices=available_formats(), default="dense", help="KV cache format")
    p.add_argument("--bits", help="bits per loop in a group, e.g. 2,2,2,4 (residual) or 2 (uniform, kivi)")
    p.add_argument("--group-size", type=int, help="channel group size of the quantizers")
    p.add_argument("--rotation", choices=("identity", "hadamard", "random"), help="uniform/rotated/residual")
    p.add_argument("--cache-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="storage dtype of the dense cache")
    p.add_argument("--init-state", choices=("zeros", "random"), default="random",
                   help="Huginn's initial latent state (random is seeded by --seed)")
    p.add_argument("--exit-criterion", choices=sorted(DEFAULT_THRESHOLDS),
                   help="Huginn: per-token adaptive exit while decoding")
    p.add_argument("--exit-threshold", type=float, help="threshold of --exit-criterion (default: its own)")
    return p.parse_args(argv)


def cache_policy(args) -> dict:
    """Keyword arguments of the chosen cache format from the command line (only those given)."""
    if args.cache == "dense":
        return dict(dtype=args.cache_dtype)
    policy = {}
    if args.bits:
        bits = tuple(int(b) for b in args.bits.split(","))
        policy["bits"] = bits[0] if args.cache == "kivi" and len(bits) == 1 else bits
    if args.group_size:
        policy["group_size"] = args.group_size
    if args.rotation:
        policy["rotation"] = args.rotation
    return policy


def main(argv=None):
    """Run the command line; returns the `Generation` it printed."""
    args = parse_args(argv)
    source = args.checkpoint or os.path.relpath(os.path.join(SHIPPED, f"{args.model}-small"))
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
    stops = tuple(i for i in map(tokenizer.token_to_id, STOP_STRINGS) if i is not None)
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, stop_tokens=stops)
    if args.model == "ouro":
        if args.exit_criterion:
            sys.exit("generate.py: --exit-criterion is for Huginn")
        kwargs = dict(num_loops=args.loops)
    else:
        kwargs = dict(num_loops=args.loops, init_scale=1.0 if args.init_state == "random" else 0.0)
        if args.exit_criterion:
            kwargs["decode_kwargs"] = dict(adaptive=AdaptiveExit(args.exit_criterion, args.exit_threshold))
    try:
        fmt = get_format(args.cache, **cache_policy(args))
        fmt.bits_per_element(model.config.num_loops, model.config.head_dim)
    except ValueError as err:
        sys.exit(f"generate.py: bad --cache policy: {err}")
    sampler = Sampler(model, sampling, fmt, **kwargs)
    prompt = tokenizer.encode(args.prompt).ids
    sampler([prompt], seed=args.seed)  # compile
    out = sampler([prompt], seed=args.seed)
    n = int(out.num_generated[0])
    dense_bytes = dense_equivalent_nbytes(model.config, out.cache)

    print(f"model: {args.model} from {source}" + (f"  [{note}]" if note else ""))
    print(f"prompt: {args.prompt!r}")
    print(f"generated: {tokenizer.decode(out.tokens[0, :n].tolist())!r}")
    print(f"prefill: {len(prompt) / out.prefill_seconds:,.1f} tok/s ({len(prompt)} tokens)   "
          f"decode: {max(n - 1, 1) / out.decode_seconds:,.1f} tok/s ({n} tokens)   [{args.dtype} compute]")
    if out.mean_steps is not None:
        print(f"adaptive exit ({args.exit_criterion}): {out.mean_steps:.2f} of {out.cache.num_loops} steps "
              f"per decoded token on average")
    bits = float(fmt.bits_per_element(out.cache.num_loops, model.config.head_dim))
    nbytes = cache_nbytes(out.cache)
    print(f"KV cache ({args.cache}, looped layers at {bits:.4g} bits/element): {nbytes:,} bytes for "
          f"{out.cache.max_len} positions (dense bf16 would take {dense_bytes:,}: {nbytes / dense_bytes:.1%})")
    return out


if __name__ == "__main__":
    main()
