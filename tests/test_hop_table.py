"""The per-engine hop table in the docs is the one the code's declarations produce
(`dad_integrations.routes.hop_table`), and those declarations are what the adapters run."""
from __future__ import annotations

import pathlib

from dad_integrations.routes import hop_table, layouts
from dad_integrations.routes.registry import routes_for, get_route

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "docs" / "guides" / "multi-node.md", ROOT / "docs" / "concepts" / "routes.md"]


def test_committed_tables_equal_the_render():
    """Regenerate with ``python -m dad_integrations.routes.hop_table docs/guides/multi-node.md
    docs/concepts/routes.md``."""
    parts = set()
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        parts.update(m.group("part") for m in hop_table.BLOCK.finditer(text))
        assert hop_table.update(text) == text, f"{page.relative_to(ROOT)}: the hop table is stale; regenerate it"
    assert parts == {"engines", "hops"}, parts
    assert hop_table.main(["--check", *map(str, PAGES)]) == 0


def test_table_follows_the_declarations():
    """Every layout and every engine appears, and each hop's cells are the registry's collectives."""
    engines, hops = hop_table.render("engines"), hop_table.render("hops")
    for layout in layouts.LAYOUTS.values():
        assert f"`{layout.name}`" in engines and f"| `{layout.name}` | 1. " in hops, layout.name
    for engine in layouts.ENGINES.values():
        assert engine.engines[0] in engines
    row = next(line for line in hops.splitlines() if line.startswith("| `two_level` | 2. between nodes"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    want = [get_route(n).collectives["two_level"][1].replace("_", "-") for n in routes_for()]
    assert cells[3:3 + len(want)] == want, (cells, want)


def test_adapters_run_the_declared_layouts():
    """The exchanges' calls run the layouts `layouts.ENGINES` declares for their adapters."""
    from dad_integrations.exchange.node_partitions import NodePartitionCall
    from dad_integrations.exchange.partitions import PartitionCall
    from dad_integrations.exchange.replicate_hop import ReplicateHopCall
    from dad_integrations.exchange.row_shards import RowShardCall

    assert layouts.layout_for("zero") is PartitionCall.LAYOUT
    assert layouts.layout_for("zero", across_nodes=True) is NodePartitionCall.LAYOUT
    assert layouts.layout_for("fsdp2") is layouts.layout_for("fsdp2", across_nodes=True) is RowShardCall.LAYOUT
    assert layouts.layout_for("hsdp", across_nodes=True) is ReplicateHopCall.LAYOUT
    assert [lay.name for _, lay in layouts.ENGINES["synchronizer"].levels] == ["flat", "two_level"]
    for engine in layouts.ENGINES.values():  # each adapter asks for its own layouts
        module = engine.adapter.replace(".", "/") + ".py"
        text = (ROOT / module).read_text()
        assert "layout_for(" in text and f'"{engine.key}"' in text, (engine.key, module)
