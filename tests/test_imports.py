"""The packages' import rules hold: no circle inside `dad_integrations/`, `deepspeed_dad/`,
`horovod_dad/` (but for the start-up trampoline, named below), no import from a lower layer of
`dad_integrations` to a higher one, no engine imported below the adapters, nothing in
`dad_integrations` importing the engine packages built on it, and no adapter over 250 lines.

Every import is read with `ast`, those inside functions too (a lazy import is still a dependency),
and none is executed. The layers, lowest first (docs/architecture.md draws them):

0. ``comm``, ``config``, ``logs``, ``report``, ``rng``, ``builtin_routes``: collectives, the config, plain data;
1. ``capture``: hooks, rows, units, sinks, layer kinds;
2. ``codecs``: one per representation, with wire packing, error feedback, low-rank kernels;
3. ``routes`` (the route registry, one module per route) and ``routing``: router, costs, link and compute models, trials, the planner's library;
4. ``exchange``: the exchangers (per step, and sharded) and their checks;
5. ``engines`` and the adapters (``synchronizer``, ``ddp_hook``, ``fsdp``, ``accelerate``,
   ``transformers``, the ``plan`` command), and the package's face.
"""
from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Set

PACKAGE = "dad_integrations"
ENGINE_PACKAGES = ("deepspeed_dad", "horovod_dad")  # built on dad_integrations, never imported by it
# The one import circle allowed, by name: ``deepspeed_dad_hook`` is the trampoline that
# ``deepspeed_dad_hook.pth`` runs at start-up. It must import nothing but ``sys`` and ``os`` there,
# so it lives outside ``deepspeed_dad`` and jumps into it lazily (``deepspeed_dad.initialize``) only
# when a config holds a ``"dad"`` block, while ``deepspeed_dad`` reads its constants back from it.
TRAMPOLINE = "deepspeed_dad_hook"
MAX_ADAPTER_LINES = 250
ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = {"comm": 0, "config": 0, "builtin_routes": 0, "logs": 0, "report": 0, "rng": 0, "capture": 1, "codecs": 2, "routes": 3, "routing": 3, "exchange": 4}
ADAPTER_LAYER = 5
# what the algorithms (layers 0-4) never import: the engines and their adapters
# (a layer kind may import a model library's layer class: `transformers.pytorch_utils.Conv1D`)
ENGINE_PREFIXES = ("deepspeed", "horovod", "accelerate", "transformers.trainer", "transformers.training_args",
                   "transformers.integrations", "torch.distributed.fsdp", "torch.nn.parallel",
                   "dad_integrations.engines")


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> Dict[str, pathlib.Path]:
    """Every module of the three packages, and the trampoline."""
    found = {module_name(p): p for pkg in (PACKAGE, *ENGINE_PACKAGES) for p in sorted((ROOT / pkg).rglob("*.py"))}
    found[TRAMPOLINE] = ROOT / f"{TRAMPOLINE}.py"
    return found


def imports_of(name: str, path: pathlib.Path, known: Set[str]) -> Set[str]:
    """Every module ``name`` imports (at any depth of its code): package modules resolved to the
    module (or subpackage) they name, others as written."""
    is_package = path.name == "__init__.py"
    out: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:  # `from pkg import submodule` depends on the submodule
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in known else target)
    return out


def layer_of(name: str) -> int:
    parts = name.split(".")
    if len(parts) == 1:  # the package's face
        return ADAPTER_LAYER
    return LAYERS.get(parts[1], ADAPTER_LAYER)


def graph() -> Dict[str, Set[str]]:
    mods = modules()
    known = set(mods)
    return {m: {i for i in imports_of(m, p, known)} for m, p in mods.items()}


def circles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module, or a module importing itself
    (Tarjan's algorithm)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def inside(edges: Dict[str, Set[str]]) -> Dict[str, Set[str]]:
    return {m: {t for t in ts if t in edges} for m, ts in edges.items()}


def in_package(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def without_trampoline_jumps(edges: Dict[str, Set[str]]) -> Dict[str, Set[str]]:
    """The graph less the trampoline's lazy jumps into ``deepspeed_dad`` (see `TRAMPOLINE`)."""
    return {m: ({t for t in ts if not in_package(t, "deepspeed_dad")} if m == TRAMPOLINE else ts)
            for m, ts in edges.items()}


def adapters() -> Dict[str, pathlib.Path]:
    """The top layer: dad_integrations' adapters and engines, and every module of the engine packages."""
    return {m: p for m, p in modules().items() if m != TRAMPOLINE and p.name != "__init__.py"
            and (not in_package(m, PACKAGE) or layer_of(m) == ADAPTER_LAYER)}


def test_no_import_circles():
    assert circles(without_trampoline_jumps(inside(graph()))) == []


def test_the_trampoline_is_the_only_circle():
    """The exception is needed (else drop it) and is the trampoline's alone."""
    found = circles(inside(graph()))
    assert found and all(TRAMPOLINE in c for c in found)


def test_no_import_from_a_lower_layer_to_a_higher_one():
    edges = inside(graph())
    upward = sorted(f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
                    for m, ts in edges.items() if in_package(m, PACKAGE)
                    for t in ts if in_package(t, PACKAGE) and layer_of(t) > layer_of(m))
    assert upward == []


def test_algorithms_never_import_an_engine():
    bad = sorted(f"{m} imports {t}" for m, ts in graph().items()
                 if in_package(m, PACKAGE) and layer_of(m) < ADAPTER_LAYER
                 for t in ts if t.startswith(ENGINE_PREFIXES))
    assert bad == []


def test_dad_integrations_never_imports_the_engine_packages():
    bad = sorted(f"{m} imports {t}" for m, ts in graph().items() if in_package(m, PACKAGE)
                 for t in ts if any(in_package(t, e) for e in ENGINE_PACKAGES + (TRAMPOLINE,)))
    assert bad == []


def test_adapters_are_short():
    """Every adapter at most `MAX_ADAPTER_LINES` lines: split a longer one by concern."""
    long = sorted(f"{p.relative_to(ROOT)}: {n} lines" for p in adapters().values()
                  if (n := len(p.read_text().splitlines())) > MAX_ADAPTER_LINES)
    assert long == [], f"adapters over {MAX_ADAPTER_LINES} lines: {long}"


def test_the_checks_see_a_circle_and_an_upward_import():
    """The test's own machinery: a two-module circle is found, and layers are read from names."""
    assert circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert layer_of("dad_integrations.codecs.rank") < layer_of("dad_integrations.routing.router")
    assert layer_of("dad_integrations.fsdp") == ADAPTER_LAYER
    assert circles(without_trampoline_jumps({TRAMPOLINE: {"deepspeed_dad.initialize"},
                                             "deepspeed_dad.initialize": {TRAMPOLINE}})) == []
    assert "dad_integrations.synchronizer" in adapters() and "horovod_dad.optimizer" in adapters()
    assert "dad_integrations.config" not in adapters() and "deepspeed_dad" not in adapters()


def test_public_imports_keep_their_paths():
    """What the README and examples import, the planner's command, and layer-kind registration
    (tests/test_public_surface.py reads every documented import; old paths warn there)."""
    import importlib

    for name in ("dad_integrations.ddp_hook", "dad_integrations.fsdp", "dad_integrations.accelerate",
                 "dad_integrations.transformers", "dad_integrations.plan", "dad_integrations.config",
                 "horovod_dad", "deepspeed_dad", "deepspeed_dad_hook"):
        importlib.import_module(name)
    from dad_integrations import Claim, DADConfig, DADSynchronizer, LayerKind, TorchDistributedAggregator  # noqa: F401
    from dad_integrations import register_kind  # noqa: F401
    assert callable(importlib.import_module("dad_integrations.plan").main)
