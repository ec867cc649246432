"""`StepWindow`: what one synchronised step knows, from the first backward that touches it to its end.

A window is created when backward first reaches a synchronised parameter after the last step
(or when DDP hands over the first bucket), and dropped when the step ends. Nothing is reset field
by field: a hook that fires late (on the autograd thread while the worker ends the step) writes
into the old window, which no later step reads.

Gradients left from before. A parameter's ``.grad`` may hold something when backward first reaches
it in a window: gradients that were not zeroed (accumulation across steps), or micro-steps of
the window that the user left in ``.grad``. dAD's factors cover only what this window's backward
adds, so that value (the *prior*) is kept aside and added back: ``.grad = prior + average``. It
is read in a hook that runs just before autograd accumulates into ``.grad`` (a tensor hook on
the parameter), so ``forward -> zero_grad() -> backward`` sees the zeroed gradient, not the one
of the forward's time.

Micro-steps whose gradient the user changed. Inside ``no_sync`` each backward adds a micro-step's
rows. If the user changes ``.grad`` between micro-steps (``zero_grad()`` between them, as DDP
allows: DDP then averages only what ``.grad`` holds), rows of the earlier micro-steps no longer
describe the gradient. Each parameter's ``.grad`` is marked (storage and version counter) after
every accumulation; a parameter whose mark changed before its next accumulation *restarts* its
unit: the rows captured before are dropped, and the unit's priors are re-derived at the exchange.
A version counter is shared by every view of one base tensor: DDP's bucket views
(``gradient_as_bucket_view=True``) share one per bucket, so autograd adding into one
parameter's gradient bumps the counter its bucket siblings read. Every accumulation backward
makes (into a factor weight's or a dense parameter's gradient) therefore moves the marks of the
other gradients in its storage along with it (`StepWindow.note_accumulated`): only a change
made outside backward restarts a unit (a change of one view restarts every unit whose gradient
shares its storage). A parameter whose ``.grad`` the user changed has its prior read at the restart (what ``.grad``
holds then: exact, so ``zero_grad()`` leaves no prior and ranks stay bit-identical); any other
parameter of the unit gets ``.grad`` minus the local rebuild of the rows kept (a local matmul, on
this rare path only).
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Type

import torch

from dad_integrations.capture.sink import GradSink
from dad_integrations.capture.units import FactorUnit

GradMark = Tuple[int, int, int]  # storage, data pointer, version counter


def grad_mark(grad: Optional[torch.Tensor]) -> Optional[GradMark]:
    """Identity and version of a ``.grad`` tensor: any in-place change or replacement alters it
    (and so does an in-place change of another view of the same base: see the module doc)."""
    if grad is None:
        return None
    return grad.untyped_storage().data_ptr(), grad.data_ptr(), grad._version


class StepWindow:
    """Per-step state shared by the hooks (autograd thread) and the exchange (worker thread).

    Attributes:
        ready: per unit index, set when the unit's weight and all its biases are final.
        flush: set when backward is over (every dense gradient is final).
        priors: per parameter id, what ``.grad`` held when this window's backward first reached it.
        restarts: per unit index, how many captured pairs per use to drop (see the module doc).
        twice: names of weights whose gradient came in after their exchange had started.
        sink: where the step reads local gradients and writes results (see `sink`).
    """

    def __init__(self, units: Sequence[FactorUnit], sink_type: Type[GradSink] = GradSink):
        self.ready: Dict[int, threading.Event] = {u.index: threading.Event() for u in units}
        self.flush = threading.Event()
        self.priors: Dict[int, torch.Tensor] = {}
        self.restarts: Dict[int, List[int]] = {}
        self.twice: List[str] = []
        self.passes: Dict[int, int] = {}            # per parameter id: backward passes counted
        self._touched: set = set()                  # parameter ids backward reached in this window
        self._restart_task: Dict[int, int] = {}     # per unit index: the backward pass of its restart
        # per unit index, per parameter id: (backward pass, what .grad held just before it added)
        self._bases: Dict[int, Dict[int, Tuple[int, Optional[torch.Tensor]]]] = {}
        self._marks: Dict[int, Optional[GradMark]] = {}
        self._marked_in: Dict[int, Dict[int, None]] = {}  # per storage: ids of the parameters marked in it
        # per unit index: (backward pass, pairs per use after it, pairs per use after the pass before)
        self._pair_marks: Dict[int, tuple] = {}
        self.future = None
        self.started: Optional[float] = None        # the step's start (`route_trial.StepClock`)
        self.native = None  # DDP's buckets on the wire as they are (`ddp_hook`): a list; False: not; None: undecided
        self.done: List[Callable[[Optional[BaseException]], None]] = []  # DDP futures to complete
        self.lock = threading.Lock()
        self.sink = sink_type(self.priors)

    @property
    def touched(self) -> bool:
        """Backward has reached a synchronised parameter in this window."""
        return bool(self._touched)

    def touch(self, p: torch.Tensor) -> None:
        self._touched.add(id(p))

    # -- on the autograd thread -----------------------------------------------------------------
    def before_accumulate(self, p: torch.Tensor, unit: FactorUnit) -> None:
        """Backward is about to add to ``p.grad``: keep what it holds the first time (the prior),
        and restart the unit if the user changed ``p.grad`` since its last accumulation."""
        key = id(p)
        if key not in self._touched:
            self._touched.add(key)
            prior = _nonzero_copy(p.grad)
            if prior is not None:
                self.priors[key] = prior
            self._bases.setdefault(unit.index, {})[key] = (_graph_task(), prior)
        elif grad_mark(p.grad) != self._marks.get(key):
            self.restarts[unit.index] = self._rows_before_this_backward(unit)
            self._restart_task[unit.index] = _graph_task()
            self._bases.setdefault(unit.index, {})[key] = (_graph_task(), _nonzero_copy(p.grad))

    def restart_priors(self, unit: FactorUnit) -> Dict[int, Optional[torch.Tensor]]:
        """Per parameter id, the exact prior of those of ``unit``'s parameters whose ``.grad`` was
        read just before the backward pass its kept rows start with (None: nothing left there)."""
        task = self._restart_task.get(unit.index)
        return {key: prior for key, (t, prior) in self._bases.get(unit.index, {}).items() if t == task}

    def after_accumulate(self, p: torch.Tensor, unit: FactorUnit) -> None:
        """Backward has added to ``p.grad``: mark it, and the unit's rows so far."""
        self._set_mark(id(p), self.note_accumulated(p))
        task, counts, before = self._pair_marks.get(unit.index, (None, None, None))
        now = _graph_task()
        if task != now:  # the first of the unit's parameters in this backward
            before = counts
        self._pair_marks[unit.index] = (now, [len(c.pairs) for c in unit.uses], before)

    def note_accumulated(self, p: torch.Tensor) -> Optional[GradMark]:
        """Backward has just added into ``p.grad`` (any synchronised parameter). In place, that
        bumped the version counter ``p.grad`` shares with the other views of its base: a mark
        in that storage that was current just before moves on with it. Returns ``p.grad``'s
        mark (`after_accumulate` sets it: read once)."""
        mark = grad_mark(p.grad)
        if mark is None:
            return None
        storage, _, version = mark
        for key in self._marked_in.get(storage, ()):
            m = self._marks[key]
            if key != id(p) and m is not None and m[2] == version - 1:
                self._marks[key] = (m[0], m[1], version)
        return mark

    def _set_mark(self, key: int, mark: Optional[GradMark]) -> None:
        old = self._marks.get(key)
        if old is not None:
            self._marked_in.get(old[0], {}).pop(key, None)
        self._marks[key] = mark
        if mark is not None:
            self._marked_in.setdefault(mark[0], {})[key] = None

    def _rows_before_this_backward(self, unit: FactorUnit) -> List[int]:
        """Per use, how many pairs earlier backward passes captured (this one's come after them)."""
        task, counts, before = self._pair_marks.get(unit.index, (None, None, None))
        if task == _graph_task():  # another of the unit's parameters already finished this pass
            counts = before
        return list(counts) if counts is not None else [0] * len(unit.uses)

    def count_pass(self, p: torch.Tensor) -> int:
        """Count one backward pass of ``p``; returns the count."""
        n = self.passes.get(id(p), 0) + 1
        self.passes[id(p)] = n
        return n

    def release_all(self) -> None:
        """Backward is over: every unit and the dense buckets may go.

        The flush goes last: once it is set the worker may finish the step.
        """
        for event in self.ready.values():
            event.set()
        self.flush.set()

    def take_rows(self, unit: FactorUnit) -> List[list]:
        """Per use, the pairs this window captured (minus those dropped by a restart)."""
        drop = self.restarts.get(unit.index)
        pairs = [c.take() for c in unit.uses]
        if drop is not None:
            pairs = [p[k:] for p, k in zip(pairs, drop)]
        return pairs


def _graph_task() -> int:
    """Which backward call is running (autograd's graph task id)."""
    return torch._C._current_graph_task_id()


def _nonzero_copy(grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A copy of ``grad`` unless it is None or all zeros (``zero_grad(set_to_none=False)``).

    All zeros is read from one ``aminmax`` pass (both ends 0; a NaN is neither), not from
    ``ne(0).any()``'s gradient-sized mask: this runs for every parameter of every step whose
    gradients were zeroed rather than dropped."""
    if grad is None or not grad.numel():
        return None
    if grad.is_floating_point():
        low, high = torch.aminmax(grad.detach())
        if bool((low == 0) & (high == 0)):
            return None
    elif not bool(grad.ne(0).any()):
        return None
    return grad.detach().clone()
