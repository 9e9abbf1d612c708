"""Convert a Hugging Face Ouro/Huginn checkpoint (folder or cached hub id) to an orbax checkpoint.

Every file the runtime reads beside the weights is copied along (`rq_jax.checkpoint.RUNTIME_FILES`:
tokenizer.json, tokenizer_config.json with the chat template, generation_config.json with the stop
ids, the README.md model card, and config.json for its notes), so scripts/generate.py --checkpoint
DEST generates exactly what the source does. DEST is written whole or not at all (see
`rq_jax.checkpoint.save`); a non-empty DEST is replaced only with --overwrite.

    python scripts/convert.py ByteDance/Ouro-1.4B out/ouro-1.4b
"""

import os

import jax.numpy as jnp

from rq_jax import checkpoint, cli
from rq_jax.convert.hf import load_model, resolve


def main(argv=None):
    p = cli.ArgumentParser(description=__doc__)
    p.add_argument("source", help="HF checkpoint folder or hub id in the local Hugging Face cache")
    p.add_argument("dest", help="output folder (rq_config.json + params/ + the runtime files); must not exist or be "
                   "empty")
    p.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32", help="stored parameter dtype")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty dest (atomically)")
    args = p.parse_args(argv)
    try:
        folder = os.path.realpath(resolve(args.source))
        checkpoint.read_config(folder)
    except (OSError, ValueError) as err:
        p.error(f"argument source: {err}")
    if checkpoint.is_saved_model(folder):
        p.error(f"argument source: {args.source} is already an orbax checkpoint (rq_config.json)")
    dest = os.path.realpath(args.dest)
    if dest == folder or dest.startswith(folder + os.sep) or folder.startswith(dest + os.sep):
        p.error(f"argument dest: {args.dest} would overlap the source {folder}; choose another folder")
    if os.path.exists(dest) and not os.path.isdir(dest):
        p.error(f"argument dest: {args.dest} is a file")
    if os.path.isdir(dest) and os.listdir(dest) and not args.overwrite:
        p.error(f"argument dest: {args.dest} exists and is not empty; pass --overwrite to replace it")
    cli.output_folder(p, "dest", os.path.dirname(dest))
    model, config = load_model(folder, param_dtype=jnp.dtype(args.param_dtype))
    files = checkpoint.runtime_files(folder)
    checkpoint.save(dest, model, extra_files=files, overwrite=args.overwrite)
    print(f"converted {config.family} ({config.num_layers} looped layers, {config.num_loops} loops) to {args.dest}, "
          f"with {', '.join(os.path.basename(f) for f in files) or 'no runtime files'}")


if __name__ == "__main__":
    main()
