"""The synchroniser's step lifecycle: open a step's window, dispatch its exchange on the worker,
end and count the step, and release a step left in flight (also at interpreter exit).

`DADSynchronizer`'s base (it holds the state these methods read); `ddp_hook` drives the same
methods when DDP's communication hook runs the step.
"""
from __future__ import annotations

import atexit
import functools
import threading
import time
import weakref
from typing import Callable, List, Optional, Type

from dad_integrations.capture.compiled import guard_compiled_hooks
from dad_integrations.comm.errors import note_step
from dad_integrations.capture.sink import BucketViewSink, GradSink
from dad_integrations.exchange.window import StepWindow
from dad_integrations.exchange.worker import Worker
from dad_integrations.report import StepReport

_ENGINE_DRAIN_S = 0.05  # at exit: time given to the engine's threads to release finished collectives


class StepLifecycle:
    """Open, dispatch, end and finish a step; release one in flight."""

    def _init_step_state(self) -> None:
        """The step's state, before any hook can open a step (``_driven_by_ddp`` is set)."""
        self._sink_type: Type[GradSink] = BucketViewSink if self._driven_by_ddp else GradSink
        self._lock = threading.Lock()
        self._window: Optional[StepWindow] = None
        self._accumulating = False
        self._steps = 0
        self._verified = not self.config.verify_first_step
        self._report: Optional[StepReport] = None

    def _start_worker(self) -> None:
        """The exchange's thread, and its release at interpreter exit."""
        self._worker = Worker("dad-sync")
        self._closed = False
        # at exit, release a step left in flight (an error before synchronize()), so that its
        # thread ends cleanly instead of being torn down while it waits
        self._atexit = functools.partial(_abandon, weakref.ref(self))
        atexit.register(self._atexit)

    def _current_window(self) -> StepWindow:
        """The open step's window, opened now if there is none."""
        with self._lock:
            if self._window is None:
                guard_compiled_hooks()  # (dynamo imported after attach: guard from the first step on)
                self._window = StepWindow(self._plan.units, self._sink_type)
                self._window.started = self._clock.open()
                note_step(self._steps)  # for the messages of collectives that fail in it
            return self._window

    def _dispatch(self, window: StepWindow, job: Callable[[StepWindow], StepReport]) -> None:
        """Start the step's exchange on the worker (once per step)."""
        with window.lock:
            if window.future is None:
                window.future = self._worker.submit(functools.partial(job, window))

    def _exchange(self, window: StepWindow, postscale: Optional[float] = None) -> StepReport:
        """Run the step's exchange; ``postscale`` replaces ``postscale_factor`` for this step."""
        return self._exchanger.run(window, window.sink, step=self._steps, verify=not self._verified,
                                   prescale=self.prescale_factor,
                                   postscale=self.postscale_factor if postscale is None else postscale)

    def _end_step(self, window: StepWindow) -> List[str]:
        """Drop the step's window and rows; returns the weights whose rows arrived after their exchange."""
        late = [u.name for c in self._plan.captures for u in c.uses if u.pairs] + window.twice
        for c in self._plan.captures:
            c.clear()
        with self._lock:
            if self._window is window:
                self._window = None
        return late

    def _finish(self, report: StepReport, late: List[str]) -> None:
        """Count the finished step, then raise if this rank saw rows arrive after their exchange.

        The step is counted first: the error is this rank's alone, and a caller that goes on must
        find every rank in the same state (same step count, same first-step check), or the next
        step's collectives would not match.
        """
        self._report = report
        self._steps += 1
        # a step in which no rank had factor rows (synchronize() before any backward, as
        # hvd.broadcast_optimizer_state does) checked nothing: keep the check for the first real one;
        # max_rows is agreed by all ranks, so they keep or drop the check together
        if any(p.max_rows for p in report.params):
            self._verified = True
        self._plan_next_step()
        if late:
            raise RuntimeError(f"the gradients of {sorted(set(late))} came in twice in one step, after their "
                               f"exchange had started: a weight used in several reentrant-checkpointed "
                               f"segments (exclude it with the 'exclude' config key, or use "
                               f"use_reentrant=False), or backward run twice without no_sync()")

    def _plan_next_step(self) -> None:
        """Note which units the next step sends dense whatever their rows (see `_bookless`)."""
        policy, step, verify = self._exchanger.policy, self._steps, not self._verified
        self._bookless = frozenset(u.index for u in self._plan.units if policy.dense_for_sure(u, step, verify))

    def _release(self) -> None:
        """Stop the worker thread, abandoning a step in flight (its waits return at once)."""
        self._closed = True
        self._exchanger.closed = True
        window = self._window
        if window is not None:
            window.release_all()
        self._worker.stop()


def _abandon(ref: "weakref.ref[StepLifecycle]") -> None:
    """At interpreter exit: release the synchroniser's step in flight, if it still lives."""
    sync = ref()
    if sync is not None:
        sync._release()
        sync._worker.join(timeout=5.0)
        # A gloo worker thread drops its last reference to a finished collective's tensors a
        # moment after the wait returns, and that needs the GIL; once the interpreter finalises,
        # taking the GIL ends the thread inside a noexcept destructor (std::terminate). Hand the
        # GIL over briefly so those threads finish while they still can.
        time.sleep(_ENGINE_DRAIN_S)
