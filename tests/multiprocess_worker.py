"""One process of `tests/test_multiprocess.py`: joins the run named by JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES and JAX_PROCESS_ID, generates greedily on a mesh spanning every process, trains two
steps on per-process rows, checkpoints them (sharded orbax) and restores them, and prints one line
"RESULT {json}". The test imports the shared setup (model, prompts, training config) from here.

    python tests/multiprocess_worker.py RUN_DIR MESH
"""

import json
import sys

import jax
import numpy as np

from rq_jax import sharding
from rq_jax.cache import get_format
from rq_jax.data import Addition, MixtureConfig, Retrieval
from rq_jax.models import init_model
from rq_jax.sampling import Sampler, SamplingConfig
from rq_jax.train import RunOptions, TrainConfig, Trainer, tiny_model_config

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [14]]
SAMPLING = SamplingConfig(max_new_tokens=4)


def cache_format():
    """The dense cache: the formats' sharding is tested on 8 devices in one process (test_sharding.py);
    here the point is the processes, and dense compiles fastest."""
    return get_format("dense")


def model_config():
    """Ouro, 1 layer × 2 loops, 4 heads over 2 kv heads (GQA), head_dim 32."""
    return tiny_model_config("ouro", hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=64,
                             num_layers=1, num_loops=2)


def train_config() -> TrainConfig:
    """Four rows of 33 tokens, a model of the same shapes as `model_config`."""
    data = MixtureConfig(seq_len=32, rows=(2, 1, 1), addition=Addition(2), curriculum_start=2, curriculum_steps=3,
                         retrieval=Retrieval(max_pairs=2, num_queries=1))
    return TrainConfig(model=model_config(), data=data, lr=3e-3, warmup_steps=2, total_steps=20)


def run_options(run_dir: str, stop: int, mesh=None) -> RunOptions:
    return RunOptions(run_dir=run_dir, stop_step=stop, eval_every=0, progress=False, ckpt_every_s=1e9, mesh=mesh)


def main(run_dir: str, mesh_text: str) -> None:
    mesh = sharding.parse_mesh(mesh_text)
    out = Sampler(init_model(model_config(), seed=0), SAMPLING, cache_format(), mesh=mesh)(PROMPTS)
    keys = jax.tree_util.tree_leaves(out.cache.looped)[0]
    report = dict(process=jax.process_index(), processes=jax.process_count(), devices=jax.device_count(),
                  tokens=out.tokens.tolist(), cache_spec=str(keys.sharding.spec),
                  cache_spans_processes=not keys.is_fully_addressable,
                  cache_shard_shape=list(keys.addressable_shards[0].data.shape))

    cfg = train_config()
    shape = (cfg.data.batch_size, cfg.data.seq_len + 1)
    report["rows"] = sharding.process_rows(sharding.batch_sharding(mesh, shape), shape).tolist()
    trainer = Trainer(cfg, run_options(run_dir, 2, mesh))
    report["loss_step1"] = trainer.run()["loss"]  # then checkpoints step 2: every process writes its shards
    resumed = Trainer(cfg, run_options(run_dir, 3, mesh))  # restores step 2 into the sharded layout
    same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(sharding.to_host(trainer.params)),
                                                    jax.tree.leaves(sharding.to_host(resumed.params)), strict=True))
    report.update(restored_step=resumed.step, restored_equal=same,
                  restored_specs=sorted({str(x.sharding.spec) for x in jax.tree.leaves(resumed.params)}),
                  restored_opt_specs=sorted({str(x.sharding.spec) for x in jax.tree.leaves(resumed.opt_state)}))
    print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    sharding.init_distributed()  # before anything touches a device
    main(*sys.argv[1:])
