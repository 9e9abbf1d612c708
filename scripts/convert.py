"""Convert a Hugging Face Ouro/Huginn checkpoint (folder or cached hub id) to an orbax checkpoint.

The tokenizer.json is copied along, so scripts/generate.py --checkpoint DEST works.

    python scripts/convert.py ByteDance/Ouro-1.4B out/ouro-1.4b
"""

import argparse
import os
import shutil

import jax.numpy as jnp

from rq_jax import checkpoint
from rq_jax.convert.hf import load_model, resolve


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", help="HF checkpoint folder or hub id in the local Hugging Face cache")
    p.add_argument("dest", help="output folder (rq_config.json + params/)")
    p.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32")
    args = p.parse_args(argv)
    folder = resolve(args.source)
    model, config = load_model(folder, param_dtype=jnp.dtype(args.param_dtype))
    checkpoint.save(args.dest, model)
    if os.path.exists(os.path.join(folder, "tokenizer.json")):
        shutil.copy(os.path.join(folder, "tokenizer.json"), args.dest)
    print(f"converted {config.family} ({config.num_layers} looped layers, {config.num_loops} loops) to {args.dest}")


if __name__ == "__main__":
    main()
