"""K/V reconstruction error of cache formats on a model's real K/V; prints a table, writes JSON.

    python scripts/kv_error.py --checkpoint tests/fixtures/ouro-tiny --group-size 8
"""

import argparse
import json

import jax.numpy as jnp
import numpy as np

from rq_jax import checkpoint
from rq_jax.cache import get_format
from rq_jax.eval.kv_error import dense_kv, reconstruction_error

SCHEMES = {  # label: format for a channel group size g
    "uniform INT2": lambda g: get_format("uniform", group_size=g),
    "rotated INT2": lambda g: get_format("rotated", group_size=g),
    "direct [2,2,2,4]": lambda g: get_format("uniform", bits=(2, 2, 2, 4), group_size=g),
    "rotated [2,2,2,4]": lambda g: get_format("rotated", bits=(2, 2, 2, 4), group_size=g),
    "residual INT2 (α=1, no rot)": lambda g: get_format("residual", bits=(2, 2, 2, 2), least_squares=False,
                                                        rotation="identity", group_size=g),
    "residual INT2": lambda g: get_format("residual", bits=(2, 2, 2, 2), group_size=g),
    "residual [2,2,2,4]": lambda g: get_format("residual", group_size=g),
    "residual_vq (2x16x4)": lambda g: get_format("residual_vq"),
}


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
    for label, make in SCHEMES.items():
        fmt = make(args.group_size)
        err = reconstruction_error(fmt, k, v)
        row = dict(scheme=label, bits=float(fmt.bits_per_element(loops, k.shape[-1])),
                   k_nmse=float(err["k"].mean()), v_nmse=float(err["v"].mean()),
                   k_nmse_per_loop=err["k"].tolist(), v_nmse_per_loop=err["v"].tolist())
        rows.append(row)
        print(f"{label:30s} {row['bits']:9.4f} {row['k_nmse']:9.4f} {row['v_nmse']:9.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(checkpoint=args.checkpoint, loops=loops, group_size=args.group_size, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
