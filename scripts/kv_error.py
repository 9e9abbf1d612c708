"""K/V reconstruction error of cache formats on a model's real K/V; prints a table, writes JSON.

    python scripts/kv_error.py --checkpoint tests/fixtures/ouro-tiny --group-size 8

Rows are the scheme catalog's (`rq_jax.cache.schemes.kv_error_labels`) at the given group size; errors
are `rq_jax.cache.kv_error.reconstruction_error` of one write of the dense K/V.
"""

import argparse
import json

import jax.numpy as jnp
import numpy as np

from rq_jax import checkpoint
from rq_jax.cache.kv_error import dense_kv, reconstruction_error
from rq_jax.cache.schemes import kv_error_labels, pick


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="checkpoint folder or cached hub id")
    p.add_argument("--loops", type=int, help="loops / recurrence steps (default the config's)")
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--seq", type=int, default=64, help="tokens of the random prompt")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the table here")
    args = p.parse_args(argv)
    model, _ = checkpoint.load(args.checkpoint)
    loops = args.loops or model.config.num_loops
    tokens = jnp.asarray(np.random.default_rng(args.seed).integers(0, model.config.vocab_size, (args.batch, args.seq)))
    k, v = dense_kv(model, tokens, loops)
    rows = []
    print(f"{'scheme':30s} {'bits/elem':>9s} {'K NMSE':>9s} {'V NMSE':>9s}")
    for scheme in pick(kv_error_labels(args.group_size), (args.group_size,)):
        err = reconstruction_error(scheme.fmt, k, v)
        row = dict(scheme=scheme.label, bits=float(scheme.fmt.bits_per_element(loops, k.shape[-1])),
                   k_nmse=float(err["k"].mean()), v_nmse=float(err["v"].mean()),
                   k_nmse_per_loop=err["k"].tolist(), v_nmse_per_loop=err["v"].tolist())
        rows.append(row)
        print(f"{scheme.label:30s} {row['bits']:9.4f} {row['k_nmse']:9.4f} {row['v_nmse']:9.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(checkpoint=args.checkpoint, loops=loops, group_size=args.group_size, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
