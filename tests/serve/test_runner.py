"""The engine thread: warmed up, it freezes the heap it made before it serves (no model here: a fake engine)."""

import gc
import time

from rq_jax.serve.runner import EngineThread


class _Idle:
    """An engine with nothing to compile and no work."""

    num_waiting = 0

    def warm_up(self, echo, stop):
        self.made = [object() for _ in range(100)]  # alive when the thread freezes the heap
        return {}

    def has_work(self):
        return False

    def held(self):
        return []


def test_the_heap_made_by_the_warm_up_is_frozen_before_serving():
    """Every object alive after the warm-up (here the fake engine's) is in the collector's permanent
    generation once the thread says it is ready, so a full collection while serving does not walk it."""
    gc.unfreeze()
    before = gc.get_freeze_count()
    engine = _Idle()
    runner = EngineThread(engine).start()
    try:
        deadline = time.monotonic() + 10
        while not runner.ready and time.monotonic() < deadline:
            time.sleep(0.01)
        assert runner.ready
        assert gc.get_freeze_count() > before + len(engine.made)
    finally:
        runner.stop()
        gc.unfreeze()
