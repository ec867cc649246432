"""The checks of `benchmarks.scale`: each dAD method against its engine's plain run, and issue 38's
targets judged on a whole run.

Per dAD method (`method_checks`), against the plain method of its engine (DDP: allreduce, FSDP2:
fsdp2, ZeRO-3: zero3):

* step ratio: every step from the first (attach on: dAD's lossless steps and route trials count)
  against the plain run's step of the same index; the largest (and at which step) and the median.
  Where both ran in one group the steps took turns (``same_turn``), else they ran one after the other;
* peak RSS ratio: the method's peak against the plain run's, each measured alone;
* bytes per step: against the plain run's, and against PowerSGD's (DDP's measured hook where it ran
  beside, else the per-weight model of what its hook sends, summed);
* weights over PowerSGD: past the warm-up, the weights dAD sent more bytes for than PowerSGD's hook
  sends for them (`_scale_engines.powersgd_bytes`).

`targets` reads these for issue 38's targets; a target whose runs are missing is "not run".
"""
from __future__ import annotations

from typing import Dict, List, Optional

from benchmarks._scale_engines import PLAIN
from benchmarks.workload import median

RATIO_LIMIT = 1.10   # fast link: no step of dad-auto above this x the engine's
ATTACH_LIMIT_S = 5.0  # attach at 307 M
MEMORY_LIMIT = 1.25  # peak RSS under FSDP2 / ZeRO-3 with rank routes, x the engine's
WARM = 10  # dAD's lossless steps at the config's default, and PowerSGD's all-reduced steps here


def step_ratios(method: dict, plain: dict) -> dict:
    """Per step ``method``'s time over ``plain``'s (same index); the worst step and the median."""
    ratios = [a / b for a, b in zip(method["times"], plain["times"])]
    worst = max(range(len(ratios)), key=ratios.__getitem__)
    return {"ratios": ratios, "max": ratios[worst], "step": worst, "median": median(ratios),
            "same_turn": method["group"] == plain["group"],
            "detail": f"step {worst}: {method['times'][worst]:.2f} s vs {plain['times'][worst]:.2f} s"}


def method_checks(methods: Dict[str, dict]) -> Dict[str, dict]:
    """`step_ratios`, peak and byte ratios of every dAD method of one model against its engine's plain run."""
    out: Dict[str, dict] = {}
    psgd = methods.get("powersgd")
    for name, r in methods.items():
        if "routes" not in r:
            continue
        plain = methods.get(PLAIN[r["engine"]])
        c: dict = {"engine": r["engine"], "plain": PLAIN[r["engine"]] if plain else None}
        if plain:
            c["step"] = step_ratios(r, plain)
            if r["peak_rss_mb"] and plain["peak_rss_mb"]:
                c["peak_ratio"] = r["peak_rss_mb"] / plain["peak_rss_mb"]
            c["bytes_vs_plain"] = r["bytes_last"] / plain["bytes_last"] if plain["bytes_last"] else None
        if psgd and r["engine"] == "ddp":
            c["bytes_vs_powersgd"], c["powersgd_ref"] = r["bytes_last"] / psgd["bytes_last"], "measured hook"
        elif r.get("powersgd_bytes_model"):
            c["bytes_vs_powersgd"] = r["bytes_last"] / r["powersgd_bytes_model"]
            c["powersgd_ref"] = "per-weight model of the hook"
        c["compared"] = len(r["times"]) > WARM  # past dAD's lossless steps (and PowerSGD's warm-up)
        c["weights_over_powersgd"] = r.get("weights_over_powersgd", []) if c["compared"] else None
        out[name] = c
    return out


def _t(name: str, value, limit: str, met: Optional[bool], detail: str) -> dict:
    return {"target": name, "value": value, "limit": limit, "met": met, "detail": detail}


def targets(models: Dict[str, dict]) -> List[dict]:
    """Issue 38's targets over a run's models (``{model: {"methods": ..., "checks": ...}}``)."""
    out = []
    for model in ("gpt2-124m", "llama-307m"):
        c = models.get(model, {}).get("checks", {}).get("dad-auto", {}).get("step")
        name = f"fast link, {model}: no dad-auto step above {RATIO_LIMIT:.2f}x DDP's"
        if c is None:
            out.append(_t(name, None, f"<= {RATIO_LIMIT:.2f}", None, "not run"))
        else:
            turn = "same turn" if c["same_turn"] else "not in turns"
            out.append(_t(name, c["max"], f"<= {RATIO_LIMIT:.2f}", c["max"] <= RATIO_LIMIT,
                          f"worst {c['detail']} ({turn}); median {c['median']:.3f}"))
    auto = models.get("llama-307m", {}).get("methods", {}).get("dad-auto")
    out.append(_t("attach, llama-307m: dad-auto (DDP)", auto["attach_s"] if auto else None,
                  f"<= {ATTACH_LIMIT_S:.0f} s", auto["attach_s"] <= ATTACH_LIMIT_S if auto else None,
                  "slower rank" if auto else "not run"))
    for method in ("fsdp2-dad-auto-100mbit", "zero3-dad-auto-100mbit"):
        ms = models.get("llama-307m", {}).get("methods", {})
        c = models.get("llama-307m", {}).get("checks", {}).get(method, {})
        name = f"memory, llama-307m: {method} peak RSS / the engine's"
        ratio = c.get("peak_ratio")
        if ratio is None:
            out.append(_t(name, None, f"<= {MEMORY_LIMIT:.2f}", None, "not run"))
            continue
        plain = ms[c["plain"]]
        routes = ", ".join(f"{k} {v}" for k, v in sorted(ms[method]["routes"].items()))
        out.append(_t(name, ratio, f"<= {MEMORY_LIMIT:.2f}", ratio <= MEMORY_LIMIT and c["compared"],
                      f"{ms[method]['peak_rss_mb']:.0f} MB vs {plain['peak_rss_mb']:.0f} MB; routes {routes}"
                      + ("" if c["compared"] else f"; inside the {WARM} lossless steps: no rank route yet")))
    for model, m in models.items():
        for method, c in m.get("checks", {}).items():
            if not method.endswith("100mbit"):
                continue
            name = f"bytes, {model}: {method}, no weight above PowerSGD's"
            over = c["weights_over_powersgd"]
            if over is None:
                out.append(_t(name, None, "0 weights", None, f"inside the {WARM} lossless steps: not compared"))
            else:
                out.append(_t(name, len(over), "0 weights", not over,
                              ", ".join(f"{w['name']} {w['sent']:,.0f} B vs {w['powersgd']:,.0f} B"
                                        for w in over[:4]) or "none"))
    return out


def verdict(met: Optional[bool]) -> str:
    return "not run" if met is None else ("PASS" if met else "FAIL")


def target_lines(rows: List[dict]) -> List[str]:
    """The targets as printed by ``--targets``: one line each, value, limit, PASS / FAIL."""
    lines = []
    for t in rows:
        v = t["value"]
        val = "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
        lines.append(f"{verdict(t['met']):7s} {t['target']}: {val} (target {t['limit']}); {t['detail']}")
    return lines
