"""Evaluation: scoring through a cache (`loops`), the accuracy-versus-memory table (`table`), and
readers/scorers of real benchmarks (`benchmarks`). Import the submodule you need: this package face
imports nothing, so scoring never loads the benchmarks' subprocess sandbox."""
