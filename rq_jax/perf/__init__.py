"""Performance measurement behind the bench scripts: decode steps (`decode`) and their run's tables
(`decode_report`), attention (`attention`) and its run's table (`attention_report`), the decode step's
compile time at depth (`compile_time`) and serving under load (`serve`)."""
