"""Performance measurement behind the bench scripts: decode steps (`decode`) and attention (`attention`)."""
