"""Evaluation: scoring through a cache (`loops`), the accuracy-versus-memory table (`table`), K/V
reconstruction error (`kv_error`), and readers/scorers of real benchmarks (`benchmarks`)."""

from rq_jax.eval.benchmarks import (CodeProblem, MathProblem, Result, boxed_answer, gsm8k_answer, gsm8k_prompt,
                                    humaneval_prompt, math_equal, math_prompt, mbpp_prompt, pass_at_1, read_gsm8k,
                                    read_humaneval, read_math500, read_mbpp, run_program, score_code, score_gsm8k,
                                    score_math500)
from rq_jax.eval.loops import CacheScorer, Scores, paired_bootstrap, score_examples, score_windows, task_metrics, text_metrics

__all__ = ["CacheScorer", "CodeProblem", "MathProblem", "Result", "Scores", "boxed_answer", "gsm8k_answer",
           "gsm8k_prompt", "humaneval_prompt", "math_equal", "math_prompt", "mbpp_prompt", "paired_bootstrap",
           "pass_at_1", "read_gsm8k", "read_humaneval", "read_math500", "read_mbpp", "run_program", "score_code",
           "score_examples", "score_gsm8k", "score_math500", "score_windows", "task_metrics", "text_metrics"]
