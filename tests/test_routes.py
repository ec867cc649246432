"""The route registry (`dad_integrations.routes`): one module per route, validated at registration;
unknown names and unsupported layouts raise; every byte model reads the routes' own specs."""
from __future__ import annotations

import pathlib
import re

import pytest
import torch

from dad_integrations.codecs.exact import exact_block_specs
from dad_integrations.codecs.wire import packed_size, rank_block_specs
from dad_integrations.config import DADConfig
from dad_integrations.routes import (LAYOUTS, RouteSpec, UnitSizing, UnknownRouteError, UnsupportedRouteError,
                                     get_route, rank_route_names, register_route, route_names, routes_for)
from dad_integrations.routes.registry import raise_unsupported, unregister_route
from dad_integrations.routing.costs import estimate_bytes
from dad_integrations.routing.router import allowed_routes, candidates_at

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_builtin_routes_and_their_properties():
    builtin = routes_for()  # the routes that are not opt-in (a test may have registered its own)
    assert builtin == ("dense", "exact", "rank_allreduce", "rank")  # tie order
    assert [get_route(n).lossless for n in builtin] == [True, True, False, False]
    assert [get_route(n).needs_rows for n in builtin] == [False, True, False, False]
    assert rank_route_names("allgather") == ("rank",) and rank_route_names("allreduce") == ("rank_allreduce",)
    for name in builtin:  # every built-in route runs on every layout
        assert set(get_route(name).layouts) == set(LAYOUTS)


def test_unknown_route_and_unsupported_layout_raise_naming_them():
    with pytest.raises(UnknownRouteError, match=r"'int3'.*dense, exact, rank_allreduce, rank"):
        get_route("int3")
    with pytest.raises(UnsupportedRouteError, match=r"'rank' has no exchange on the 'partitions' layout"):
        raise_unsupported("rank", "partitions")


def _spec(**kw) -> RouteSpec:
    base = dict(name="bf16_dense_test", summary="test", order=9, lossless=False, needs_rows=False,
                collectives={"flat": ("all_reduce",)},
                bytes={"flat": lambda s: 2.0 * (s.world_size - 1) / s.world_size * s.shape[0] * s.shape[1] * 2},
                compute=lambda costs, capture, rows, world, calls: 0.0)
    base.update(kw)
    return RouteSpec(**base)


@pytest.fixture
def test_route():
    spec = register_route(_spec())
    yield spec
    unregister_route(spec.name)


def test_a_route_defined_here_registers_prices_and_refuses_other_layouts(test_route):
    assert "bf16_dense_test" in route_names()
    est = estimate_bytes(kinds=("linear",), shape=(64, 32), rows_by_rank=[[8], [8]], bias_numel=0, rank=0,
                         grad_dtype=torch.float32, wire_dtype=torch.float32, world_size=2)
    assert est["bf16_dense_test"] == 64 * 32 * 2 == est["dense"] / 2
    with pytest.raises(UnsupportedRouteError, match=r"'bf16_dense_test' does not run on the 'row_shards' layout"):
        test_route.check_layout("row_shards")


@pytest.mark.parametrize("bad, message", [
    (dict(name="two words"), "identifier"),
    (dict(bytes={}), "declares no layout"),
    (dict(bytes={"ring": lambda s: 0.0}, collectives={"ring": ("all_reduce",)}), "unknown layout 'ring'"),
    (dict(collectives={"flat": ("all_reduce", "all_gather")}), "one collective per hop"),
    (dict(collectives={"flat": ("broadcast",)}), "unknown collective kinds"),
    (dict(state=("momentum",)), "unknown state"),
    (dict(lossless=True, rank_route="allgather"), "not lossless"),
])
def test_registration_validates_the_route(bad, message):
    with pytest.raises(ValueError, match=message):
        register_route(_spec(**bad))
    assert "bf16_dense_test" not in route_names()


def test_bytes_are_the_specs_the_codecs_pack():
    s = UnitSizing(("linear",), (96, 40), torch.float32, torch.float32, rank=4, rows=[[7], [11], [5]], world_size=3)
    assert get_route("exact").bytes_on("flat", s) == 2 * packed_size(exact_block_specs(("linear",), (96, 40), [11],
                                                                                        torch.float32))
    assert get_route("rank").bytes_on("flat", s) == 2 * packed_size(rank_block_specs((96, 40), 4, torch.float32))


def test_one_rule_for_every_layout():
    cfg = DADConfig(rank=4, lossless_steps=2)
    assert candidates_at(cfg, 0, route_names()) == ["dense", "exact"]           # the lossless steps
    assert set(candidates_at(cfg, 2, route_names())) == set(route_names())
    assert allowed_routes("exact", ["dense"], rank_allowed=True) == ["dense"]
    assert allowed_routes("rank", route_names(), rank_allowed=True, rank_route="allreduce") == ["rank_allreduce"]
    adaptive = DADConfig(rank=4, lossless_steps=0, adaptive_tolerance=0.1)      # adaptive means all-gather
    assert "rank_allreduce" not in candidates_at(adaptive, 0, route_names())


def test_route_name_sets_live_in_the_registry_only():
    """No hand-written set of rank routes outside `routes/` (they are `rank_route_names`), except the
    FSDP2 rank codec's check of what it was handed (codecs sit below the registry's layer)."""
    pattern = re.compile(r"""\(\s*["']rank["']\s*,\s*["']rank_allreduce["']\s*\)""")
    found = [str(p.relative_to(ROOT)) for pkg in ("dad_integrations", "deepspeed_dad", "horovod_dad")
             for p in (ROOT / pkg).rglob("*.py") if "routes" not in p.parts and pattern.search(p.read_text())]
    assert found == [] or found == ["dad_integrations/codecs/sharded_rank.py"], found
