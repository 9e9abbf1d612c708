"""Write the small checkpoints shipped in checkpoints/ (HF layout + byte-level tokenizer.json).

Until trained models are shipped, the weights are a seeded random initialisation, and config.json says
so under "rq_jax". Run: python scripts/make_checkpoints.py
"""

import argparse
import os

import ml_dtypes
import numpy as np

from rq_jax.config import ModelConfig
from rq_jax.convert.hf import save_hf
from rq_jax.models import init_model
from rq_jax.tokenizer import byte_level_tokenizer

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "checkpoints")


def small_configs(vocab_size: int) -> dict[str, tuple[ModelConfig, type]]:
    """Config and storage dtype of each shipped model, by folder name."""
    common = dict(vocab_size=vocab_size, hidden_size=128, num_heads=4, num_kv_heads=4, head_dim=32,
                  intermediate_size=256, max_position_embeddings=2048)
    return {
        "ouro-small": (ModelConfig(family="ouro", num_layers=2, num_loops=4, rope_theta=10000.0, **common),
                       ml_dtypes.bfloat16),
        "huginn-small": (ModelConfig(family="huginn", num_layers=2, num_loops=8, rope_theta=50000.0,
                                     tie_word_embeddings=True, num_prelude=1, num_coda=1, qk_bias=True,
                                     embed_scale=128**0.5, init_std=(2 / (5 * 128)) ** 0.5, **common),
                         np.float32),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=ROOT)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tokenizer = byte_level_tokenizer()
    for name, (config, dtype) in small_configs(tokenizer.get_vocab_size()).items():
        folder = os.path.join(args.out, name)
        note = {"rq_jax": {"weights": "random initialisation (untrained)", "seed": args.seed}}
        save_hf(init_model(config, args.seed), folder, dtype=dtype, extra_config=note)
        tokenizer.save(os.path.join(folder, "tokenizer.json"))
        print("wrote", folder)


if __name__ == "__main__":
    main()
