"""Training the tiny looped models on the offline data mixture (`rq_jax.data`), and quantization-aware
fine-tuning through a compressed KV cache.

`TrainConfig` fixes a run's trajectory, `Trainer(cfg, RunOptions(run_dir)).run()` trains and resumes
it exactly from orbax checkpoints, `export.export_hf` writes the HF folder with tokenizer and model card.
`QATConfig` / `QATTrainer` fine-tune a checkpoint with every past K/V read fake-quantized
(`qat.fake_quant_forward`), training all weights, attention + norms, or LoRA adapters (`lora`).
"""

from rq_jax.train.run_config import TrainConfig, tiny_model_config
from rq_jax.train.qat import QATOutput, TeacherForced, fake_quant_forward, fake_quant_kv, format_calib
from rq_jax.train.qat_trainer import QATConfig, QATTrainer
from rq_jax.train.trainer import RunOptions, Trainer, make_optimizer, make_train_step

__all__ = ["QATConfig", "QATOutput", "QATTrainer", "RunOptions", "TeacherForced", "TrainConfig", "Trainer",
           "fake_quant_forward", "fake_quant_kv", "format_calib", "make_optimizer", "make_train_step",
           "tiny_model_config"]
