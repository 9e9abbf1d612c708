"""Convert a Hugging Face Ouro/Huginn checkpoint (folder or cached hub id) to an orbax checkpoint.

The tokenizer.json is copied along, so scripts/generate.py --checkpoint DEST works. DEST is written
whole or not at all (see `rq_jax.checkpoint.save`); a non-empty DEST is replaced only with --overwrite.

    python scripts/convert.py ByteDance/Ouro-1.4B out/ouro-1.4b
"""

import argparse
import os
import sys

import jax.numpy as jnp

from rq_jax import checkpoint
from rq_jax.convert.hf import load_model, resolve


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", help="HF checkpoint folder or hub id in the local Hugging Face cache")
    p.add_argument("dest", help="output folder (rq_config.json + params/ + tokenizer.json); must not exist or be empty")
    p.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty dest (atomically)")
    args = p.parse_args(argv)
    folder = os.path.realpath(resolve(args.source))
    dest = os.path.realpath(args.dest)
    if dest == folder or dest.startswith(folder + os.sep) or folder.startswith(dest + os.sep):
        sys.exit(f"convert.py: dest {args.dest} would overlap the source {folder}; choose another folder")
    if os.path.isdir(dest) and os.listdir(dest) and not args.overwrite:
        sys.exit(f"convert.py: dest {args.dest} exists and is not empty; pass --overwrite to replace it")
    model, config = load_model(folder, param_dtype=jnp.dtype(args.param_dtype))
    tokenizer = os.path.join(folder, "tokenizer.json")
    checkpoint.save(dest, model, extra_files=(tokenizer,) if os.path.exists(tokenizer) else (),
                    overwrite=args.overwrite)
    print(f"converted {config.family} ({config.num_layers} looped layers, {config.num_loops} loops) to {args.dest}")


if __name__ == "__main__":
    main()
