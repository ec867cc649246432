"""Routes: how one unit's gradient crosses the wire, one module each, in one registry.

=================  =========  ==========  ===========================================================
route              lossless   needs rows  what it sends
=================  =========  ==========  ===========================================================
``dense``          yes        no          the gradient, as the engine reduces it (`dense`)
``exact``          yes        yes         every rank's captured factors (dAD, `exact`)
``rank_allreduce`` no         no          PowerSGD's all-reduced ``P`` and ``Q`` (`rank_allreduce`)
``rank``           no         no          each rank's own rank-``r`` factors (rank-dAD, `rank`)
=================  =========  ==========  ===========================================================

Each module builds a `registry.RouteSpec` (name, tie order, lossless, rows, state, the collective
on each hop of every layout it runs on, its bytes there, its local compute) and registers it at
import. The router, the byte and time models, the planner and every exchanger read the registry;
`registry.get_route` and `registry.RouteSpec.check_layout` raise on a name it does not know and a
layout a route does not declare. Layouts are in `layouts`.
"""
from dad_integrations.routes import dense, exact, rank, rank_allreduce  # noqa: F401  (registers them)
from dad_integrations.routes.layouts import LAYOUTS, Layout
from dad_integrations.routes.registry import (HopBytes, RouteSpec, UnitSizing, UnknownRouteError,
                                              UnsupportedRouteError, all_routes, check_routes, estimates_on,
                                              get_route, is_rank_route, rank_route_names, register_route,
                                              route_names, tie_order)

__all__ = ["LAYOUTS", "Layout", "HopBytes", "RouteSpec", "UnitSizing", "UnknownRouteError", "UnsupportedRouteError",
           "all_routes", "check_routes", "estimates_on", "get_route", "is_rank_route", "rank_route_names",
           "register_route", "route_names", "tie_order"]
