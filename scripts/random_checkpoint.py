"""Write a random-weight model at a preset's widths as a Hugging Face checkpoint folder (config.json +
model.safetensors + the tokenizer files), which scripts/serve.py, generate.py and bench_serve.py load with
--checkpoint, and any server that reads Ouro/Huginn folders too: the serving regime of a large model (long
contexts, where reading the cache is the cost) without its download.

    python scripts/random_checkpoint.py out/ouro-1.4b-2l                         # Ouro-1.4B widths, 2 layers
    python scripts/random_checkpoint.py out/huginn --preset huginn-0125 --layers 1

The model is `--preset`'s (`rq_jax.config.PRESETS`) at `--layers` looped layers, its weights N(0, init_std²)
from `--seed`, stored in `--dtype`. The tokenizer, its config and the stop ids come from a shipped small model
of the family (`--tokenizer-from`), and the vocabulary is that tokenizer's, so every sampled id detokenizes;
config.json's "rq_jax" section says so ("weights": "random"). DEST is written whole or not at all; a non-empty
DEST is replaced only with --overwrite.
"""

import os
import shutil

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from rq_jax import cli
from rq_jax.checkpoint import SHIPPED
from rq_jax.config import PRESETS, preset
from rq_jax.convert.hf import save_hf
from rq_jax.io import atomic_folder, check_folder
from rq_jax.models import init_model
from rq_jax.tokenizer import load_tokenizer

#: What the tokenizer brings along from its folder.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def main(argv=None):
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dest", help="output folder; must not exist or be empty")
    p.add_argument("--preset", choices=sorted(PRESETS), default="ouro-1.4b", help="the model's widths")
    p.add_argument("--layers", type=cli.positive_int, default=2, help="looped layers (Huginn: core blocks)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="stored weights")
    p.add_argument("--tokenizer-from", help="folder with tokenizer.json (default: the family's shipped small model)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty dest (atomically)")
    args = p.parse_args(argv)
    try:
        check_folder(args.dest, overwrite=args.overwrite)
    except FileExistsError as err:
        p.error(f"argument dest: {err}")
    base = PRESETS[args.preset]
    source = args.tokenizer_from or os.path.join(SHIPPED, f"{base.family}-small")
    try:
        vocab = load_tokenizer(source).get_vocab_size()
    except (OSError, ValueError) as err:
        p.error(f"argument --tokenizer-from: {err}")
    config = preset(args.preset, num_layers=args.layers, vocab_size=vocab)
    model = init_model(config, seed=args.seed)
    note = {"rq_jax": {"weights": "random", "family": config.family, "preset": args.preset, "seed": args.seed,
                       "layers": args.layers, "vocab": f"{vocab}, the tokenizer of {os.path.basename(source)}"}}
    dtype = ml_dtypes.bfloat16 if args.dtype == "bfloat16" else np.float32
    try:
        with atomic_folder(args.dest, overwrite=args.overwrite) as tmp:
            save_hf(model, tmp, dtype=dtype, extra_config=note)
            for name in TOKENIZER_FILES:
                if os.path.exists(os.path.join(source, name)):
                    shutil.copy(os.path.join(source, name), tmp)
    except FileExistsError as err:
        p.error(f"argument dest: {err}")
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"wrote {args.dest}: {args.preset} at {args.layers} layers, {params / 1e6:.0f}M parameters in "
          f"{args.dtype}, vocabulary {vocab}")


if __name__ == "__main__":
    main()
