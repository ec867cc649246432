"""The per-engine hop table of the docs, generated from the code's declarations.

Nothing in it is written by hand: each engine's layouts, what a rank keeps and where residuals live
come from `layouts.ENGINES` and `layouts.LAYOUTS` (which the adapters read through
`layouts.layout_for`), the routes and their collective on each hop from the route registry
(`registry.RouteSpec.collectives`), and a route of one's own from `codec.codec_route`.

A docs page holds a generated block between ``<!-- hop-table:engines -->`` (or ``:hops``) and
``<!-- /hop-table -->``. ``python -m dad_integrations.routes.hop_table PAGE...`` rewrites the blocks
in place (``--check``: exit 1, naming the page, where one differs); the docs build does the same
(``docs/hooks/hop_table.py``) and ``tests/test_hop_table.py`` fails where a committed block differs
from `render`.
"""
from __future__ import annotations

import re
import sys
from typing import List, Optional, Sequence

from dad_integrations.routes import dense, exact, rank, rank_allreduce  # noqa: F401  (registers them)
from dad_integrations.routes.codec import codec_route
from dad_integrations.routes.layouts import ENGINES, LAYOUTS, RESIDUALS, Layout
from dad_integrations.routes.registry import RouteSpec, get_route, routes_for

HOP_NAMES = {"group": "the exchange", "to_owner": "to the owner", "between": "between nodes",
             "from_owner": "from the owner"}
BLOCK = re.compile(r"(<!-- hop-table:(?P<part>engines|hops) -->\n)(?P<body>.*?)(<!-- /hop-table -->)", re.DOTALL)


class _AnyCodec:
    """What `codec_route` reads of a codec to declare its layouts and collectives."""

    collective = "codec"


def _own_route() -> RouteSpec:
    return codec_route("your_codec", _AnyCodec(), summary="a route of one's own")


def _collective(kind: str) -> str:
    return {"none": "-", "codec": "the codec's"}.get(kind, kind.replace("_", "-"))


def _routes(layout: Layout) -> str:
    specs = [get_route(n) for n in routes_for() if get_route(n).supports(layout)]
    text = ", ".join(f"`{s.name}`" for s in specs if not s.is_rank)
    ranked = [f"`{s.name}`" for s in specs if s.is_rank]
    if ranked:
        text += f"; with a `rank`: {', '.join(ranked)}"
    if _own_route().supports(layout):
        text += "; a `codec_route` of one's own"
    return text


def _hops(layout: Layout) -> str:
    steps = " → ".join(HOP_NAMES[h] if HOP_NAMES[h] == link else f"{HOP_NAMES[h]} ({link})"
                       for h, link in zip(layout.hops, layout.links))
    return f"{steps}; inside a node: {layout.engine_inside}" if layout.engine_inside else steps


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_engines() -> str:
    """One row per engine adapter and level: the engines it serves, when the level applies, its
    layout, hops, what a rank keeps, where residuals live, the routes it may take."""
    rows = ["| engines | where | layout | hops (link) | a rank keeps | error-feedback residuals | routes |",
            "|---|---|---|---|---|---|---|"]
    for engine in ENGINES.values():
        for i, (when, layout) in enumerate(engine.levels):
            names = "<br>".join(engine.engines) if i == 0 else "(the same)"
            cells = [names, when, f"`{layout.name}`", _hops(layout), layout.keeps, RESIDUALS[layout.residuals],
                     _routes(layout)]
            rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(rows)


def render_hops() -> str:
    """One row per layout and hop: its link and each route's collective there (the registry's)."""
    specs = [get_route(n) for n in routes_for()] + [_own_route()]
    head = ["layout", "hop", "link"] + [f"`{s.name}`" if s.name != "your_codec" else "`codec_route`" for s in specs]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = [f"`{x.name}`: inside a node, {x.engine_inside}." for x in LAYOUTS.values() if x.engine_inside]
    for layout in LAYOUTS.values():
        for k, (hop, link) in enumerate(zip(layout.hops, layout.links)):
            kinds = [_collective(s.collectives[layout.name][k]) if s.supports(layout) else "(refused)" for s in specs]
            rows.append(f"| `{layout.name}` | {k + 1}. {HOP_NAMES[hop]} | {link} | " + " | ".join(kinds) + " |")
    legend = "; ".join(f"`{s.name}`: {s.summary}" for s in specs[:-1])
    return "\n".join(rows + ["", f"{legend}. `-`: no collective of dAD's on that hop. {' '.join(notes)}"])


def render(part: str) -> str:
    return {"engines": render_engines, "hops": render_hops}[part]()


def update(text: str) -> str:
    """``text`` with every generated block rendered anew."""
    return BLOCK.sub(lambda m: m.group(1) + render(m.group("part")) + "\n" + m.group(4), text)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    check = "--check" in args
    stale: List[str] = []
    for path in (a for a in args if a != "--check"):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        new = update(text)
        if new != text:
            stale.append(path)
            if not check:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(new)
    if stale:
        print(("stale hop table in: " if check else "rewrote: ") + ", ".join(stale), file=sys.stderr)
    return 1 if check and stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
