"""Evaluation: cache-format reconstruction error (more metrics arrive with later issues)."""
