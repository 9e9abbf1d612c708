"""K/V reconstruction error of cache formats on a model's real K/V; prints a table and writes it as JSON.

    python scripts/kv_error.py --checkpoint tests/fixtures/ouro-tiny --group-size 8

The model prefills --batch random token sequences of --seq tokens through a dense float32 cache; each
format then stores those K/V (one write per loop segment) and decodes them. NMSE is the normalised
squared error ‖K̂ − K‖² / ‖K‖² (likewise V), summed over layers, rows, heads and tokens before the ratio
and averaged over loops: 0 is exact, 1 is as far off as storing zeros. Rows are the scheme catalog's
(`rq_jax.cache.schemes.kv_error_labels`) at the given group size; errors are
`rq_jax.cache.kv_error.scheme_errors`.
"""

import json

import jax.numpy as jnp
import numpy as np

from rq_jax import checkpoint, cli, report
from rq_jax.cache.kv_error import dense_kv, scheme_errors


def main(argv=None):
    p = cli.ArgumentParser(description=__doc__)
    p.add_argument("--checkpoint", required=True, help="checkpoint folder or cached hub id")
    p.add_argument("--loops", "--num-steps", dest="loops", type=cli.positive_int,
                   help="loops / recurrence steps (default: the config's)")
    p.add_argument("--group-size", type=cli.positive_int, default=32, help="channel group size of the formats")
    p.add_argument("--seq", type=cli.positive_int, default=64, help="tokens of each random prompt")
    p.add_argument("--batch", type=cli.positive_int, default=2, help="random prompts")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--json", default="kv_error.json", help="where the table is written")
    cli.add_runtime_options(p)
    args = p.parse_args(argv)
    try:
        config, folder = checkpoint.read_config(args.checkpoint)
    except (OSError, ValueError) as err:
        p.error(f"argument --checkpoint: {err}")
    cli.check_group_sizes(p, "--group-size", args.group_size, config.head_dim)
    if args.seq > config.max_position_embeddings:
        p.error(f"argument --seq: {args.seq} exceeds the model's {config.max_position_embeddings} positions")
    cli.output_file(p, "--json", args.json)
    cli.start(args)
    model, _ = checkpoint.load(folder)
    loops = args.loops or config.num_loops
    print(f"model: {config.family} from {args.checkpoint}, {config.num_layers} looped layers x {loops} loops, "
          f"head_dim {config.head_dim}")
    print(f"prompt: {args.batch} random token sequences of {args.seq} tokens (seed {args.seed}), prefilled through a "
          "dense float32 cache")
    print("NMSE = ‖X̂ − X‖² / ‖X‖² of the stored K (or V), averaged over loops: 0 exact, 1 as far off as zeros")
    tokens = jnp.asarray(np.random.default_rng(args.seed).integers(0, config.vocab_size, (args.batch, args.seq)))
    with cli.compiling("the dense prefill"):
        k, v = dense_kv(model, tokens, loops)
    rows = scheme_errors(k, v, args.group_size)
    report.write_text(args.json, json.dumps(dict(checkpoint=args.checkpoint, family=config.family, loops=loops,
                                                 group_size=args.group_size, seq=args.seq, batch=args.batch,
                                                 seed=args.seed, rows=rows), indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
