"""The route registry: every route's name, properties, collectives and bytes, in one place.

A route is one module that builds a `RouteSpec` and hands it to `register_route`. Everything that
asks "which routes are there", "is this one lossless", "does it need captured rows", "what does it
send on this layout" reads the spec: the router's candidates and tie order, the byte model of every
layout (`RouteSpec.bytes`), the collective the link model times (`RouteSpec.collective`), the
compute model's seconds (`RouteSpec.compute`). A name the registry does not know, or a layout a
route does not declare, raises (`get_route`, `RouteSpec.check_layout`): nothing falls back to
another route silently.
"""
from __future__ import annotations

import keyword
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from dad_integrations.routes.layouts import LAYOUTS, Layout

Rows = Sequence[Sequence[int]]
Block = Optional[Tuple[int, int]]
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "all_to_all", "reduce_scatter", "none")
STATES = ("warm_start", "error_feedback")


class UnknownRouteError(ValueError):
    """A route name the registry does not know."""


class UnsupportedRouteError(ValueError):
    """A route asked for on a layout it does not declare."""


@dataclass(frozen=True)
class HopBytes:
    """Bytes per rank of one unit's route on each hop of a three-hop layout (``two_level``,
    ``node_partitions``): to the owner inside the node, between nodes, back from the owner."""

    to_owner: float
    between: float
    from_owner: float
    factors_back: bool  # hop 3 moves the factors (rebuilt on every rank), not the average


@dataclass(frozen=True)
class UnitSizing:
    """What a byte model needs of one unit on one layout, every field agreed across ranks.

    ``rows``: by rank, by use (``flat``, ``row_shards``); by node, by use (``two_level``,
    ``node_partitions``); the most rows any rank has, per use (``replicate_hop``); None where the
    counts are not known (no exact factors then). ``counts`` and ``ranges``: ZeRO's partitions,
    every rank's counts and owned element range. ``world_size``: the flat group; ``nodes`` and
    ``local``: the two-level layouts' node count and ranks per node. ``engine_itemsize``: the
    itemsize of ZeRO's own reduce-scatter."""

    kinds: Tuple[str, ...]
    shape: Tuple[int, int]
    grad_dtype: torch.dtype
    wire_dtype: Optional[torch.dtype]
    rank: int = 0
    rounds: int = 1
    bias_numel: int = 0
    blocks: Optional[Sequence[Block]] = None
    rows: Optional[Rows] = None
    world_size: int = 1
    nodes: int = 1
    local: int = 1
    engine_itemsize: int = 4
    counts: Any = None
    ranges: Any = None

    @property
    def wire(self) -> torch.dtype:
        """The dtype factors travel in: the wire's, else the gradients'."""
        return self.wire_dtype if self.wire_dtype is not None else self.grad_dtype


Bytes = Union[float, Tuple[float, float], HopBytes]
ByteModel = Callable[[UnitSizing], Optional[Bytes]]
# (shape costs or None, capture seconds per call, rows by rank, world size, calls) -> seconds
ComputeFn = Callable[[Any, float, Rows, int, int], float]


@dataclass(frozen=True)
class RouteSpec:
    """One route, as its module declares it.

    Attributes:
        name: the route's name in configs, reports and logs.
        summary: one line for docs and logs.
        order: equal predictions go to the lower (lossless and simplest first).
        lossless: it rebuilds the exact average (allowed in every mode).
        needs_rows: it sends captured rows, so it needs every rank's row counts agreed.
        rank_route: the value of the config's ``rank_route`` that selects it (a rank-``r`` route,
            allowed with a ``rank``, past the lossless steps); None for the others.
        state: what it carries between steps (``"warm_start"``, ``"error_feedback"``).
        collectives: by layout name, the collective kind on each of the layout's hops.
        bytes: by layout name, its byte model: bytes one rank sends for one unit (a float; ZeRO's
            partitions: the busiest rank's and the mean; three-hop layouts: `HopBytes`), or None
            where the unit cannot take it (exact factors without agreed counts; a rank route's
            model is not asked without a rank, `bytes_on`).
        compute: its local seconds for one unit from the compute model's figures.
        codec: a route that brings its own codec (`codec.GradientCodec`) runs through every
            layout's generic exchange (`codec.start_codec`); the built-in routes' codecs are the
            exchanges' own (None).
        opt_in: a config must name it in ``routes`` for auto to choose it (every route but the
            built-in ones).
    """

    name: str
    summary: str
    order: int
    lossless: bool
    needs_rows: bool
    collectives: Mapping[str, Tuple[str, ...]]
    bytes: Mapping[str, ByteModel]
    compute: ComputeFn
    rank_route: Optional[str] = None
    state: Tuple[str, ...] = field(default_factory=tuple)
    codec: Any = None
    opt_in: bool = False

    @property
    def is_rank(self) -> bool:
        """A rank-``r`` route (needs the config's rank; holds warm starts and residuals)."""
        return self.rank_route is not None

    @property
    def layouts(self) -> Tuple[str, ...]:
        return tuple(self.bytes)

    def supports(self, layout: Union[str, Layout]) -> bool:
        return _layout_name(layout) in self.bytes

    def check_layout(self, layout: Union[str, Layout]) -> None:
        """Raise `UnsupportedRouteError` naming the route and the layout where it does not run."""
        name = _layout_name(layout)
        if name not in self.bytes:
            raise UnsupportedRouteError(
                f"dAD route {self.name!r} does not run on the {name!r} layout; it runs on "
                f"{', '.join(repr(x) for x in self.layouts)}")

    def collective(self, layout: Union[str, Layout]) -> str:
        """The collective kind of the layout's wire hop, the one the link model times."""
        lay = LAYOUTS[_layout_name(layout)]
        self.check_layout(lay)
        return self.collectives[lay.name][lay.wire_hop]

    def bytes_on(self, layout: Union[str, Layout], sizing: UnitSizing) -> Optional[Bytes]:
        """This route's bytes for one unit on ``layout`` (`bytes`); None for a rank-``r`` route
        without a rank (no unit can take it)."""
        name = _layout_name(layout)
        self.check_layout(name)
        return None if self.is_rank and not sizing.rank else self.bytes[name](sizing)


_ROUTES: Dict[str, RouteSpec] = {}


def per_layout(**layouts: Tuple[Tuple[str, ...], ByteModel]) -> Dict[str, Dict[str, Any]]:
    """``collectives`` and ``bytes`` for a `RouteSpec` from one ``layout=(collectives by hop, byte
    model)`` entry per layout it runs on."""
    return {"collectives": {name: kinds for name, (kinds, _) in layouts.items()},
            "bytes": {name: model for name, (_, model) in layouts.items()}}


def _layout_name(layout: Union[str, Layout]) -> str:
    return layout.name if isinstance(layout, Layout) else layout


def register_route(spec: RouteSpec) -> RouteSpec:
    """Add ``spec`` to the registry after checking it: a new identifier-like name, known layouts,
    one collective of a known kind per hop of each layout it has bytes for, known state."""
    where = f"dAD route {spec.name!r}"
    if not spec.name.isidentifier() or keyword.iskeyword(spec.name):
        raise ValueError(f"{where}: a route's name must be a Python identifier (it is a config value)")
    if spec.name in _ROUTES and _ROUTES[spec.name] is not spec:
        raise ValueError(f"{where} is registered already")
    if not spec.bytes:
        raise ValueError(f"{where} declares no layout")
    for name in spec.bytes:
        if name not in LAYOUTS:
            raise ValueError(f"{where}: unknown layout {name!r} (known: {', '.join(LAYOUTS)})")
        kinds = spec.collectives.get(name)
        if kinds is None or len(kinds) != len(LAYOUTS[name].hops):
            raise ValueError(f"{where}: the {name!r} layout needs one collective per hop "
                             f"{LAYOUTS[name].hops}, got {kinds}")
        bad = [k for k in kinds if k not in COLLECTIVE_KINDS]
        if bad:
            raise ValueError(f"{where}: unknown collective kinds {bad} (known: {COLLECTIVE_KINDS})")
    if set(spec.collectives) - set(spec.bytes):
        raise ValueError(f"{where}: collectives for layouts without bytes: {set(spec.collectives) - set(spec.bytes)}")
    if any(s not in STATES for s in spec.state):
        raise ValueError(f"{where}: unknown state {spec.state} (known: {STATES})")
    if spec.lossless and spec.is_rank:
        raise ValueError(f"{where}: a rank-r route is not lossless")
    _ROUTES[spec.name] = spec
    return spec


def unregister_route(name: str) -> None:
    """Remove a route (tests that register one of their own)."""
    _ROUTES.pop(name, None)


def get_route(name: str) -> RouteSpec:
    """The registered route ``name``; `UnknownRouteError` naming the known ones otherwise."""
    spec = _ROUTES.get(name)
    if spec is None:
        raise UnknownRouteError(f"unknown dAD route {name!r}; registered routes: {', '.join(route_names())}")
    return spec


def all_routes() -> List[RouteSpec]:
    """Every registered route, in tie order."""
    return sorted(_ROUTES.values(), key=lambda s: (s.order, s.name))


def route_names() -> Tuple[str, ...]:
    """Every registered route's name, in tie order."""
    return tuple(s.name for s in all_routes())


def routes_for(extra: Sequence[str] = ()) -> Tuple[str, ...]:
    """The routes a config may be routed by, in tie order: every route that is not opt-in, and the
    opt-in ones it names (its ``routes``; `get_route` raises on a name it does not know)."""
    named = {get_route(name).name for name in extra}
    return tuple(s.name for s in all_routes() if not s.opt_in or s.name in named)


def has_codec(name: Optional[str]) -> bool:
    """Whether ``name`` is a registered route that brings its own codec (the generic exchange)."""
    return getattr(_ROUTES.get(name), "codec", None) is not None


def rank_route_names(selector: Optional[str] = None) -> Tuple[str, ...]:
    """The rank-``r`` routes, in tie order; with ``selector`` (the config's ``rank_route``:
    ``"allgather"``, ``"allreduce"``, ``"auto"``) those it allows."""
    return tuple(s.name for s in all_routes()
                 if s.is_rank and (selector in (None, "auto") or s.rank_route == selector))


def is_rank_route(name: Optional[str]) -> bool:
    """Whether ``name`` is a registered rank-``r`` route (None and unknown names are not)."""
    return getattr(_ROUTES.get(name), "is_rank", False)


def tie_order(name: str) -> int:
    """The position of route ``name`` in tie order."""
    return get_route(name).order


def estimates_on(layout: Union[str, Layout], sizing: UnitSizing, names: Iterable[str]) -> Dict[str, Bytes]:
    """Bytes of each route of ``names`` that can carry the unit on ``layout`` (those whose byte
    model gives a figure)."""
    out: Dict[str, Bytes] = {}
    for name in names:
        value = get_route(name).bytes_on(layout, sizing)
        if value is not None:
            out[name] = value
    return out


def raise_unsupported(name: str, layout: Union[str, Layout]) -> None:
    """An exchange was handed a route it has no branch for: raise, naming both, rather than send
    the unit some other way (an unknown name raises `UnknownRouteError`)."""
    spec = get_route(name)
    raise UnsupportedRouteError(f"dAD route {spec.name!r} has no exchange on the {_layout_name(layout)!r} layout "
                                f"in this version (its layouts: {', '.join(spec.layouts)})")


def check_routes(names: Sequence[str], layout: Union[str, Layout]) -> None:
    """At attach: every route of ``names`` is registered and runs on ``layout``."""
    for name in names:
        get_route(name).check_layout(layout)
