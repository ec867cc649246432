"""`Worker`: the one background thread on which a synchroniser's exchanges run, in order."""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable


class Worker:
    """One daemon thread running submitted jobs in order.

    A daemon, unlike a ``ThreadPoolExecutor`` thread, so that a step abandoned after an error
    (its thread waiting for a backward that never comes) cannot keep the process from exiting.
    """

    def __init__(self, name: str):
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], object]) -> Future:
        """Run ``fn`` after the jobs before it; its result or exception goes to the future."""
        future: Future = Future()
        self._jobs.put((fn, future))
        return future

    def stop(self) -> None:
        """End the thread after the jobs already submitted."""
        self._jobs.put(None)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # handed to whoever waits on the future
                    future.set_exception(e)
