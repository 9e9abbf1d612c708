"""Evaluation: the accuracy-versus-memory table (`table`, scored through a cache by `rq_jax.scoring`), and
readers/scorers of real benchmarks (`benchmarks`) with their generation runs (`benchmark_run`, `prompts`).
Import the submodule you need: this package face imports nothing, so a table never loads the
benchmarks' subprocess sandbox."""
