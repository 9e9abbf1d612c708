"""Performance measurement behind the bench scripts: decode steps (`decode`), attention (`attention`) and
the decode step's compile time at depth (`compile_time`)."""
