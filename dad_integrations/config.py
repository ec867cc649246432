"""`DADConfig`: the one set of options shared by every engine adapter.

The DeepSpeed ``"dad"`` JSON block, the Horovod ``dad=`` keyword and the Accelerate helper all
accept the same keys, so the config round-trips through plain dicts (`from_dict` / `to_dict`) and
rejects anything it does not know, naming the key.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Tuple

import torch

from dad_integrations.comm.link_spec import parse_link_spec
from dad_integrations.comm.topology import parse_topology

MODES = ("exact", "rank", "auto")
RANK_ROUTES = ("auto", "allgather", "allreduce")
# the config's names of the dtypes factors may travel in (None: the gradients' own dtype)
WIRE_DTYPES = {None: None, "float16": torch.float16, "bfloat16": torch.bfloat16}
LAYER_KINDS = ("linear", "conv1d", "embedding", "conv", "mha", "rnn")  # built in: `capture.layers`, one module each
_USER_KINDS: list = []  # kinds users registered (`capture.layers.register_kind`), in registration order


def known_layer_kinds() -> Tuple[str, ...]:
    """Every layer kind a config may name: the built-in ones, then those users registered."""
    return LAYER_KINDS + tuple(_USER_KINDS)


def add_layer_kind(name: str) -> None:
    """Make a user's layer kind a name ``layer_kinds`` accepts and captures by default."""
    if name not in known_layer_kinds():
        _USER_KINDS.append(name)
OBJECTIVES = ("time", "bytes")
UNCAPTURED_MATRICES = ("rank", "dense")
# the objective of a config that names none; a job (or a test suite whose assertions are about bytes)
# can set it for every engine at once without editing configs
OBJECTIVE_ENV = "DAD_OBJECTIVE"
# the same for lossless_steps (a suite that checks compressed routes from the first step sets it to 0)
LOSSLESS_STEPS_ENV = "DAD_LOSSLESS_STEPS"
DEFAULT_LOSSLESS_STEPS = 10


#: ``residual_budget``'s default: dAD's residuals between steps at most a quarter of a sharded rank's
#: engine state (modelled as Adam's, ``routing.memory``); whole fp32 residuals (4 bytes a routed
#: parameter) exceed it under FSDP2 and ZeRO-3 from 2 ranks on
DEFAULT_RESIDUAL_BUDGET = 0.25


def default_objective() -> str:
    """``$DAD_OBJECTIVE`` where it is set (checked in `DADConfig.validate`), else ``"time"``."""
    return os.environ.get(OBJECTIVE_ENV, "time")


def default_lossless_steps() -> Any:
    """``$DAD_LOSSLESS_STEPS`` where it is set (an integer; anything else is reported by
    `DADConfig.validate`), else `DEFAULT_LOSSLESS_STEPS`."""
    value = os.environ.get(LOSSLESS_STEPS_ENV, DEFAULT_LOSSLESS_STEPS)
    try:
        return int(value)
    except ValueError:
        return value


def _reject_unknown_keys(cls: type) -> type:
    """Wrap the dataclass ``__init__`` so that an unknown keyword is a `ValueError` naming it and
    listing the known keys (as `DADConfig.from_dict` does), not the bare `TypeError` of ``__init__``."""
    generated = cls.__init__

    @functools.wraps(generated)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        _check_keys(cls, kwargs)
        generated(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


@_reject_unknown_keys
@dataclass(frozen=True)
class DADConfig:
    """Options of distributed auto-differentiation.

    A config is frozen (every rank must take the same decisions from it, and engines share it):
    assigning an attribute raises `dataclasses.FrozenInstanceError` (an `AttributeError`). Derive a
    changed config with ``dataclasses.replace(cfg, key=value)`` or
    ``DADConfig.from_dict({**cfg.to_dict(), "key": value})``; both validate it again. An unknown
    keyword raises `ValueError` naming it; ``layer_kinds`` and ``exclude`` take lists or tuples of
    strings (stored as tuples), never a bare string.

    Attributes:
        mode: ``"exact"`` sends dAD factors for every supported layer (lossless, the paper's dAD);
            ``"rank"`` sends a rank-``rank`` approximation of every captured weight, embeddings
            included (the paper's rank-dAD, through the rank route ``rank_route`` picks);
            ``"auto"`` picks per weight the fewest bytes among dense all-reduce, exact factors and,
            only when ``rank`` is set, the two rank routes (a weight that went dense or rank-r
            stays on that route). With ``rank=r``, auto never sends more than PyTorch's PowerSGD
            hook at rank r on the same model, in steady state.
        rank: rank of rank-dAD (required for ``mode="rank"``; enables rank-dAD in ``"auto"``).
        power_iterations: subspace iterations per step of the power method.
        warm_start: start each step's power iteration from the previous step's right factor.
        error_feedback: keep what the rank routes left out of each weight's local gradient and
            add it to the next step (GRACE's memory; PowerSGD's default too). On by default:
            without it the rank-r average is biased and trains visibly worse. Memory: one
            gradient-sized residual per rank-routed weight and rank (as PowerSGD's hook keeps);
            nothing for exact or dense weights. ``False`` saves that memory; so, in part, does
            ``error_feedback_rank``.
        error_feedback_rank: keep each residual as its rank-``q`` part (``q (m+n)`` numbers instead
            of ``m n``; `error_feedback.LowRankErrorFeedback`): the residual's strongest
            directions carry over, its tail is dropped. None (the default) keeps it whole. Under
            FSDP2 and ZeRO, where a whole residual per rank costs S times the weight's gradient
            shard, it gives back most of the memory sharding saved, for part of error feedback's
            gain (measured in `benchmarks/results/convergence_error_feedback_memory_2ranks.md`).
        adaptive_tolerance: in (0, 1]; send the fewest components (at most ``rank``) whose
            captured share of the local gradient's energy reaches it (each site's own factors: it
            makes the rank route the all-gather).
        wire_dtype: dtype of factors and dense buckets on the wire; None keeps the gradients' dtype.
        layer_kinds: which layer kinds are captured as factors (`capture.layers`: ``linear``,
            ``conv1d`` (Hugging Face's), ``embedding``, ``conv``, ``mha``, ``rnn``, and the kinds
            registered with `register_kind` before the config is made: by default, all of them).
        exclude: ``fnmatch`` patterns of module names whose parameters always go dense.
        uncaptured_matrices: ``"rank"`` (the default): a parameter with two or more dimensions
            that no captured layer covers (an uncaptured convolution, a class token) still takes
            the rank routes, from its dense gradient viewed as ``(shape[0], -1)``, as PowerSGD
            compresses every matrix; ``"dense"``: it goes dense.
        bucket_cap_mb: size of the dense all-reduce buckets.
        verify_first_step: on the first synchronised step, check on every rank that the captured
            factors rebuild the local gradient autograd computed; parameters that fail (used outside
            a captured module, custom gradient hooks, ...) fall back to dense all-reduce for good.
        rank_route: how rank-r information is shared: ``"allgather"`` (rank-dAD: every rank's own
            rank-r factors, a rank ``S r`` rebuild), ``"allreduce"`` (PowerSGD's shared power
            iteration: rank r of the average; each route's bytes: `dad_integrations.routes`), or
            ``"auto"`` (the default): per weight the fewer bytes, the all-reduce on ties.
        lossless_steps: the first this many synchronised steps take no rank route (auto without
            a rank: exact factors or dense, whichever is cheaper), as PowerSGD's hook all-reduces
            its first ``start_powerSGD_iter`` steps. Default 10 (``$DAD_LOSSLESS_STEPS`` changes
            it for configs that do not name it; `benchmarks/results/convergence_early_training_2ranks.md`
            measures it against 0 and 2 and PowerSGD's 30-step warm-up).
            It costs 10 dense steps once. Modes ``"rank"`` and ``"auto"`` with a rank only.
        objective: what auto minimises per weight. ``"time"`` (the default; ``$DAD_OBJECTIVE``
            changes it for configs that do not name one): the predicted seconds of each route, its
            local compute (`compute_model`) plus its wire time on the job's link (`link`), so
            that on a fast link weights go dense (and stop being captured) and the predicted step
            is never slower than all-reduce's; on a measured link a route trial checks that on
            the job's own steps (``route_trial_steps``). ``"bytes"``: the fewest bytes, with the guarantee
            of never sending more than PyTorch's PowerSGD hook at rank ``rank``.
        byte_cap: under ``objective="time"`` in mode ``"auto"`` with a rank, no weight takes a
            compressed route (exact factors, rank-dAD's all-gather, a route of ``routes``) that sends
            more bytes than PyTorch's PowerSGD hook would for it at rank ``rank`` (the lesser of its
            all-reduced ``P``, ``Q`` and dense); dense stays a choice. False lets time choose any
            route, for example rank-dAD's one all-gather at more than two sites where it is faster
            than PowerSGD's two all-reduces at more bytes.
        link: the link model for ``objective="time"``: None measures it on the job's own group at
            attach (and again every ``route_refresh_steps``); a dict states it, for planning and
            tests: ``{"bandwidth": "10gbit", "latency_us": 20}`` (bandwidth as ``"<n>gbit"``,
            ``"<n>mbit"`` or bytes per second, per rank and direction), optionally per collective
            kind: ``{"all_reduce": {...}, "all_gather": {...}, "all_to_all": {...}}``.
        route_refresh_steps: under ``objective="time"``, every this many steps the link is measured
            again (where it is not stated), every weight's row counts are exchanged and its route
            is chosen again, identically on every rank. Routes are also chosen again when the
            lossless steps end, on the link measured at attach. Under DDP a choosing step is first
            routed on the rows its forward counted (one all-gather at its first bucket); where every
            weight goes dense it runs as DDP's own step (`exchange.ahead`).
        route_trial_steps: under ``objective="time"`` on a measured link, after a refresh that
            compresses any weight, steps on its routes and with every weight dense alternate in
            pairs (``R D D R ...``) for rounds of this many steps (an even number >= 2; up to 3
            rounds while the evidence is split, `route_trial`); a step is timed from its forward
            to the end of its exchange. The routes are kept where they beat all-dense in 3 of 4
            pairs; the difference calibrates the compute model. The chosen steps are watched (also
            where a refresh chose all dense and ran no trial): a sustained miss measures the link
            and routes anew at once. 0 trusts the models without a trial.
        topology: which ranks share a node (`comm.topology`): ``"auto"`` (the default) asks the
            launcher (torchrun, Horovod), else the hostnames; an integer states the ranks per node
            (consecutive ranks share one); ``"flat"`` treats the group as one level. With more than
            one node of more than one rank, the two-level routes (`exchange.two_level`) reduce
            inside each node, compress only between nodes, and run where predicted faster than
            the flat ones; ``link`` may then state each hop: ``{"intra": {...}, "inter": {...}}``.
        routes: names of registered routes beyond the built-in ones (`dad_integrations.routes`:
            a route registered with `register_route`, for example a `routes.codec_route`) that
            ``"auto"`` may also choose per weight, by the same objective; a lossy one only past the
            lossless steps. The built-in routes follow ``mode``, ``rank`` and ``rank_route``. Each
            name is checked at attach: an unknown one, or one that does not run on the engine's
            layout, raises naming it.
        residual_budget: under FSDP2 and ZeRO-2/3, the most error feedback's residuals may hold on
            a rank, as a multiple of the rank's engine state: 16 bytes a parameter (parameter,
            gradient, Adam's two fp32 moments and, for 16-bit parameters, an fp32 master copy, as
            the ZeRO paper counts), each part divided by the ranks the engine shards it over
            (FSDP2 and ZeRO-3: all of it; ZeRO-2: gradients and optimizer state).
            `routing.memory` holds the model. Where whole residuals (fp32 for 16-bit weights, one
            ``m x n`` per weight the rank routes may take) would hold more, each is kept as its
            rank-``q`` part, the largest ``q`` up to 64 that fits (as ``error_feedback_rank: q`` does),
            said at attach (rank 0, a warning). Default 0.25: dAD's residuals at most a quarter of
            the state, so whole fp32 ones (4 bytes a routed parameter) exceed it from 2 ranks on
            under FSDP2 and ZeRO-3 (the state is ``16 / S`` bytes a parameter) and such jobs keep
            rank-``q`` residuals (``benchmarks.sharded_quality`` measures what that costs in held-out
            loss). A step's new residuals wait beside the last ones until the ranks agree it was
            finite: a rank holds twice the residuals at a step's end. None: whole residuals whatever
            they hold (as does a budget large enough). ``error_feedback_rank`` wins where set.
            HSDP's residuals are sharded like the gradient; under DDP, Horovod and ZeRO-0/1 the
            state is at least twice whole residuals: none of them takes a budget.
    """

    mode: str = "auto"
    rank: Optional[int] = None
    power_iterations: int = 1
    warm_start: bool = True
    error_feedback: bool = True
    error_feedback_rank: Optional[int] = None
    adaptive_tolerance: Optional[float] = None
    wire_dtype: Optional[str] = None
    layer_kinds: Tuple[str, ...] = dataclasses.field(default_factory=known_layer_kinds)
    exclude: Tuple[str, ...] = ()
    uncaptured_matrices: str = "rank"
    bucket_cap_mb: float = 25.0
    verify_first_step: bool = True
    rank_route: str = "auto"
    lossless_steps: int = dataclasses.field(default_factory=default_lossless_steps)
    objective: str = dataclasses.field(default_factory=default_objective)
    byte_cap: bool = True
    link: Optional[Mapping[str, Any]] = None
    route_refresh_steps: int = 200
    route_trial_steps: int = 8
    topology: Any = "auto"
    routes: Tuple[str, ...] = ()
    residual_budget: Optional[float] = DEFAULT_RESIDUAL_BUDGET

    def __post_init__(self) -> None:
        # frozen: the normalisation to tuples has to bypass the dataclass' __setattr__
        for key in _STRING_LISTS:
            object.__setattr__(self, key, _string_tuple(key, getattr(self, key)))
        self.validate()

    def validate(self) -> None:
        """Raise `ValueError` naming the first bad key."""
        for key, choices in _CHOICES.items():
            value = getattr(self, key)
            if value not in choices:
                raise ValueError(f"dad config key {key!r}: {value!r}{_source(key, value)} is not one of {choices}")
        for key, (least, optional) in _INTEGERS.items():
            value = getattr(self, key)
            if not (optional and value is None) and (isinstance(value, bool) or not isinstance(value, int)
                                                     or value < least):
                allowed = f"an integer >= {least}{' or None' if optional else ''}"
                raise ValueError(f"dad config key {key!r}: must be {allowed}, got {value!r}{_source(key, value)}")
        if self.mode == "rank" and self.rank is None:
            raise ValueError("dad config key 'rank': mode 'rank' needs a rank (a positive integer)")
        if self.route_trial_steps % 2:
            raise ValueError("dad config key 'route_trial_steps': must be an even integer >= 0 (pairs of "
                             f"steps; 0: no trial), got {self.route_trial_steps!r}")
        for key in ("warm_start", "error_feedback", "verify_first_step", "byte_cap"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"dad config key {key!r}: must be true or false, got {getattr(self, key)!r}")
        tol = self.adaptive_tolerance
        if tol is not None and (not _finite_number(tol) or not 0 < tol <= 1):
            raise ValueError(f"dad config key 'adaptive_tolerance': must be in (0, 1] or None, got {tol!r}")
        if self.rank_route == "allreduce" and tol is not None:
            raise ValueError("dad config key 'adaptive_tolerance': an adaptive rank applies to each site's own "
                             "factors (rank_route 'allgather' or 'auto'), not to the shared all-reduce")
        budget = self.residual_budget
        if budget is not None and (not _finite_number(budget) or budget <= 0):
            raise ValueError(f"dad config key 'residual_budget': must be a number > 0 or None, got {budget!r}")
        if self.link is not None:
            parse_link_spec(self.link)  # names the bad sub-key
        try:
            parse_topology(self.topology)
        except ValueError as e:
            raise ValueError(f"dad config key 'topology': {e}") from None
        bad = [r for r in self.routes if not r.isidentifier()]
        if bad:
            raise ValueError(f"dad config key 'routes': {bad} are not route names")
        bad = [k for k in self.layer_kinds if k not in known_layer_kinds()]
        if bad:
            raise ValueError(f"dad config key 'layer_kinds': unknown kind(s) {bad}; known: {known_layer_kinds()}")
        if not _finite_number(self.bucket_cap_mb) or self.bucket_cap_mb <= 0:
            raise ValueError(
                f"dad config key 'bucket_cap_mb': must be a finite positive number, got {self.bucket_cap_mb!r}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "DADConfig":
        """Build from a dict of config keys (the DeepSpeed block, Horovod's ``dad=``)."""
        if isinstance(values, DADConfig):
            return dataclasses.replace(values)
        if not isinstance(values, Mapping):
            raise ValueError(f"dad config must be a dict of keys, got {type(values).__name__}")
        _check_keys(cls, values)  # before cls(**...): a non-string key would be a bare TypeError there
        return cls(**dict(values))

    def to_dict(self) -> dict:
        """The config as plain JSON-able values; ``from_dict(to_dict())`` gives an equal config."""
        out = dataclasses.asdict(self)
        out.update({key: list(getattr(self, key)) for key in _STRING_LISTS})
        out["link"] = None if self.link is None else dict(self.link)
        return out


def _check_keys(cls: type, keys: Iterable[str]) -> None:
    """Raise `ValueError` naming every key that is not a field of ``cls``, and listing the known keys."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(keys) - known, key=str)  # key=str: a dict may hold non-string keys
    if unknown:
        raise ValueError(f"unknown dad config key(s) {unknown}; known keys: {sorted(known)}")


def _string_tuple(key: str, value: Any) -> Tuple[str, ...]:
    """``value`` (a list or tuple of strings) as a tuple; anything else is a `ValueError` naming ``key``."""
    if isinstance(value, str):  # tuple("out") would be ('o', 'u', 't'): silently wrong
        raise ValueError(f"dad config key {key!r}: must be a list of strings, got the string {value!r} "
                         f"(write [{value!r}])")
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"dad config key {key!r}: must be a list of strings, got {value!r}")
    return tuple(value)


# keys that take one of a fixed set of values; keys that take an integer: (least value, None allowed)
_CHOICES = {"mode": MODES, "rank_route": RANK_ROUTES, "objective": OBJECTIVES, "wire_dtype": tuple(WIRE_DTYPES),
            "uncaptured_matrices": UNCAPTURED_MATRICES}
_INTEGERS = {"rank": (1, True), "error_feedback_rank": (1, True), "lossless_steps": (0, False),
             "power_iterations": (1, False), "route_refresh_steps": (1, False), "route_trial_steps": (0, False)}
_STRING_LISTS = ("layer_kinds", "exclude", "routes")  # keys that take lists of strings (kept as tuples)
_FROM_ENV = {"objective": OBJECTIVE_ENV, "lossless_steps": LOSSLESS_STEPS_ENV}  # keys whose default is read there


def _source(key: str, value: Any) -> str:
    """`` (from $VAR)`` where ``value`` of ``key`` came from its environment variable (`_FROM_ENV`)."""
    env = _FROM_ENV.get(key)
    return f" (from ${env})" if env is not None and os.environ.get(env) == str(value) else ""


def _finite_number(value: Any) -> bool:
    """An int or a finite float; not a bool (True is an int to Python, never a size to a user)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return isinstance(value, int) or math.isfinite(value)  # math.isfinite overflows on huge ints
