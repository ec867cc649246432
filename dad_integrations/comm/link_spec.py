"""The config's ``link`` block: bandwidths and latencies per collective kind, parsed and checked.

Plain data, below everything that uses it: `DADConfig` validates its ``link`` key here, and
`routing.link.LinkModel` builds its per-kind costs from what this returns.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

KINDS = ("all_reduce", "all_gather", "all_to_all")
LEVELS = ("intra", "inter")  # a link per hop: inside a node, between nodes (`comm.topology`)
_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_bandwidth(value: Any) -> float:
    """Bytes per second from ``"10gbit"``, ``"100mbit"``, ``"1.5GB/s"``-like strings or a number
    (already bytes per second)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        out = float(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?)(bit|b|byte|bytes)?(?:/s|ps)?\s*",
                         value.lower())
        if not m or (m.group(3) is None and m.group(2)):
            raise ValueError(f"bandwidth {value!r}: write e.g. '10gbit', '100mbit', '2GB/s' or bytes per second")
        scale = _UNITS[m.group(2)]
        out = float(m.group(1)) * scale / (8.0 if m.group(3) == "bit" else 1.0)
    else:
        raise ValueError(f"bandwidth must be a number or a string like '10gbit', got {value!r}")
    if not out > 0 or out == float("inf"):
        raise ValueError(f"bandwidth must be finite and positive, got {value!r}")
    return out


@dataclass(frozen=True)
class LinkCost:
    """``seconds(nbytes) = alpha + nbytes / beta`` for one collective kind."""

    alpha: float   # seconds per call
    beta: float    # bytes per second

    def seconds(self, nbytes: float) -> float:
        return self.alpha + nbytes / self.beta


def parse_link_spec(spec: Mapping[str, Any]) -> Dict[str, LinkCost]:
    """One `LinkCost` per kind (`KINDS`) from a config's ``link``: ``{"bandwidth": ...,
    "latency_us": ...}`` for every kind, and/or per kind ``{"all_gather": {"bandwidth": ...,
    "latency_us": ...}, ...}`` (a kind not named takes the top level's figures). Bad keys raise
    `ValueError` naming them."""
    if not isinstance(spec, Mapping):
        raise ValueError(f"dad config key 'link': must be a dict, got {type(spec).__name__}")
    levels = level_link_specs(spec)
    if levels is not None:  # the flat group spans the nodes: its collectives run at the slow hop's pace
        for level in LEVELS:
            parse_link_spec(levels[level])
        return parse_link_spec(levels["inter"])
    allowed = {"bandwidth", "latency_us", *KINDS}
    bad = sorted(set(spec) - allowed, key=str)
    if bad:
        raise ValueError(f"dad config key 'link': unknown key(s) {bad}; known: {sorted(allowed)}")
    top = _cost(spec, "link") if "bandwidth" in spec else None
    costs = {}
    for kind in KINDS:
        if kind in spec:
            sub = spec[kind]
            if not isinstance(sub, Mapping) or set(sub) - {"bandwidth", "latency_us"} or "bandwidth" not in sub:
                raise ValueError(f"dad config key 'link.{kind}': must be a dict with 'bandwidth' and "
                                 f"optionally 'latency_us', got {sub!r}")
            costs[kind] = _cost(sub, f"link.{kind}")
        elif top is not None:
            costs[kind] = top
        else:
            raise ValueError(f"dad config key 'link': give 'bandwidth' (for every kind) or one for {kind!r}")
    return costs


def level_link_specs(spec: Mapping[str, Any]) -> Optional[Dict[str, Mapping[str, Any]]]:
    """A ``link`` that states each hop, ``{"intra": {...}, "inter": {...}}`` (each a link spec as
    above), as that dict; None for a one-level spec. Both levels and nothing else, or a
    `ValueError` naming the key."""
    if not any(level in spec for level in LEVELS):
        return None
    bad = sorted(set(spec) ^ set(LEVELS), key=str)
    if bad:
        raise ValueError(f"dad config key 'link': a link per hop takes exactly {list(LEVELS)}; "
                         f"wrong or missing: {bad}")
    for level in LEVELS:
        if not isinstance(spec[level], Mapping):
            raise ValueError(f"dad config key 'link.{level}': must be a dict, got {spec[level]!r}")
    return {level: spec[level] for level in LEVELS}


def _cost(spec: Mapping[str, Any], key: str) -> LinkCost:
    try:
        beta = parse_bandwidth(spec["bandwidth"])
    except ValueError as e:
        raise ValueError(f"dad config key '{key}.bandwidth': {e}") from None
    latency = spec.get("latency_us", 0.0)
    if isinstance(latency, bool) or not isinstance(latency, (int, float)) or not 0 <= latency < float("inf"):
        raise ValueError(f"dad config key '{key}.latency_us': must be a finite number >= 0, got {latency!r}")
    return LinkCost(float(latency) / 1e6, beta)
