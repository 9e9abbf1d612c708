"""Training the tiny looped models on the offline data mixture (`rq_jax.data`).

`TrainConfig` fixes a run's trajectory, `Trainer(cfg, RunOptions(run_dir)).run()` trains and resumes
it exactly from orbax checkpoints, `export.export_hf` writes the HF folder with tokenizer and model card.
"""

from rq_jax.train.config import TrainConfig, tiny_model_config
from rq_jax.train.trainer import RunOptions, Trainer, make_optimizer, make_train_step

__all__ = ["RunOptions", "TrainConfig", "Trainer", "make_optimizer", "make_train_step", "tiny_model_config"]
