"""The engine on a thread of its own, fed through a thread-safe inbox: what the HTTP server talks to.

The thread warms the engine up (compiling every program) and freezes the heap it made (`freeze_heap`), then
loops: take new requests and cancellations from the inbox, run one `Engine.step` while there is work, sleep
on the inbox when there is none. Callers on other threads (the asyncio server) only `submit`, `cancel` and read state.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from typing import Callable, Sequence

from rq_jax.serve.engine import Engine
from rq_jax.serve.output import Delta
from rq_jax.serve.params import SamplingParams

log = logging.getLogger(__name__)


def freeze_heap() -> None:
    """Collect once, then move every object alive (the model, its compiled programs, the caches of jax and the
    libraries: nearly all of the heap) to the collector's permanent generation, as vLLM and SGLang do after
    their warm-up. While serving, a full collection otherwise walks all of it to free almost nothing:
    Ouro-small's server at concurrency 128 paused 68-246 ms in each, stalling every request."""
    gc.collect()
    gc.freeze()


class NotReady(Exception):
    """The engine is warming up or draining: the API's 503."""


class QueueFull(Exception):
    """As many requests wait for a slot as the queue holds: the API's 429."""


class EngineThread:
    """Runs `engine` on a daemon thread; at most `max_waiting` requests queue for a slot."""

    def __init__(self, engine: Engine, *, max_waiting: int = 256, warm_up_echo: bool = False):
        self.engine, self.max_waiting, self.warm_up_echo = engine, max_waiting, warm_up_echo
        self.state = "warming up"
        self.warm_up_seconds: dict[str, float] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued = 0  # submitted, not yet taken from the inbox
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rq-serve-engine", daemon=True)
        self.error: BaseException | None = None

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def start(self) -> "EngineThread":
        self._thread.start()
        return self

    def submit(self, prompt: Sequence[int], params: SamplingParams, sink: Callable[[Delta], None],
               request_id: str) -> None:
        """Queue a request. Raises NotReady, QueueFull, or `ParamError` (from `Engine.check`)."""
        if not self.ready:
            raise NotReady(f"the server is {self.state}")
        self.engine.check(prompt, params)
        with self._lock:
            if self._queued + self.engine.num_waiting >= self.max_waiting:
                raise QueueFull(f"{self.max_waiting} requests are already waiting for a slot")
            self._queued += 1
        self._inbox.put(("add", (list(prompt), params, sink, request_id, time.perf_counter())))

    def cancel(self, request_id: str) -> None:
        """Cancel a request (a no-op once it finished); its slot is free before the next decode step."""
        self._inbox.put(("cancel", request_id))

    def drain(self) -> None:
        """Stop admitting: new requests get NotReady; the ones held run on."""
        if self.state in ("warming up", "ready"):
            self.state = "draining"

    def idle(self) -> bool:
        """Nothing queued or running."""
        return self._queued == 0 and not self.engine.has_work()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel whatever is still held and end the thread (while warming up: once the program compiling
        now is done, however long that takes — a process that exits with XLA compiling aborts)."""
        warming = self.state == "warming up"
        self.drain()
        self._stop.set()
        self._inbox.put(("wake", None))
        self._thread.join(None if warming else timeout)
        self.state = "stopped"

    def _run(self) -> None:
        try:
            self.warm_up_seconds = self.engine.warm_up(echo=self.warm_up_echo, stop=self._stop.is_set)
            freeze_heap()
            if self.state == "warming up":
                self.state = "ready"
            while not self._stop.is_set():
                self._take(block=not self.engine.has_work())
                if self.engine.has_work():
                    self.engine.step()
        except BaseException as err:  # a bug: say so, fail what is held, and refuse new work
            log.exception("the engine thread failed")
            self.error, self.state = err, "failed"
        finally:
            self._take(block=False)
            for request_id in self.engine.held():
                self.engine.cancel(request_id)

    def _take(self, block: bool) -> None:
        """Apply everything in the inbox (waiting up to 50 ms for the first item when `block`)."""
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, value = item
            if kind == "add":
                prompt, params, sink, request_id, arrival = value
                with self._lock:
                    self._queued -= 1
                self.engine.add_request(prompt, params, request_id=request_id, sink=sink, arrival=arrival)
            elif kind == "cancel":
                self.engine.cancel(value)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
