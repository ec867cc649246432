"""What a run shows where users look (issue 37, items 1 and 5): at default log levels, rank 0 says
the attach line, the job's nodes and links, each route decision with its evidence, and a mode
predicted to cost time; rank 1 says nothing; no torch.compile line without compile; the report
carries the links and the last decision. Unit tests of the pieces, then one 2-rank gloo job."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from conftest import WORKERS, run_torchrun
from dad_integrations import DADConfig
from dad_integrations.codecs.error_feedback import sharded_residual_note
from dad_integrations.comm.topology import Topology
from dad_integrations.exchange.levels import Levels, describe_hops
from dad_integrations.logs import SAY_LOGGER, say
from dad_integrations.report import ParamReport, route_summary
from dad_integrations.routing.link import LinkModel
from dad_integrations.routing.mode_cost import mode_cost_line
from dad_integrations.routing.router import UnitShape
from dad_integrations.routing.two_level import TwoLevelTiming

FAST = LinkModel.from_spec({"bandwidth": "100gbit"})
SLOW = LinkModel.from_spec({"bandwidth": "1gbit", "latency_us": 300})


class _Agg:
    """What `describe_hops` reads of an aggregator (no collective)."""

    def __init__(self, world_size: int, hint=None):
        self.world_size, self.rank, self._hint = world_size, 0, hint

    def topology_hint(self):
        return self._hint


def test_say_shows_rank_zero_at_default_levels(capsys):
    """`logs.say`: on stderr with no logging configured, rank 0 only; rank None says it everywhere."""
    assert say("dAD test line one", rank=1) is None
    assert say("dAD test line two", rank=0) == "dAD test line two"
    assert say("dAD test line three", rank=None) == "dAD test line three"
    err = capsys.readouterr().err
    assert "line one" not in err and "line two" in err and "line three" in err
    assert logging.getLogger(SAY_LOGGER).propagate is False


def test_attach_line_names_nodes_links_and_levels():
    """Flat: the nodes from the launcher's hint and the one link; two levels: both hops' links."""
    flat = describe_hops(DADConfig(), _Agg(4, (0, 2)), None, SLOW)
    assert flat == "dAD across 2 nodes x 2 ranks: flat; link all-reduce 1 Gbit/s, 300 us (stated)", flat
    one = describe_hops(DADConfig(), _Agg(2, (0, 2)), None, None)
    assert one == "dAD across 1 node x 2 ranks: flat (one node); link not modelled (routes by bytes)", one
    stated = describe_hops(DADConfig(mode="exact", link={"bandwidth": "100gbit"}), _Agg(2, (0, 2)), None, None)
    assert stated.endswith("link all-reduce 100 Gbit/s, 0 us (stated)"), stated
    assert "(topology: flat)" in describe_hops(DADConfig(topology="flat"), _Agg(4, (0, 2)), None, FAST)
    measured = LinkModel.from_list(SLOW.to_list(), measured=True)
    levels = Levels(Topology.consecutive(4, 2, 0), None, None, TwoLevelTiming(FAST, measured))
    hsdp = describe_hops(DADConfig(), _Agg(4, (0, 2)), None, measured, layout="HSDP")
    assert hsdp == ("dAD across 2 nodes x 2 ranks: two levels (HSDP: its reduce-scatter inside a node, dAD's "
                    "routes between nodes); between nodes all-reduce 1 Gbit/s, 300 us (measured)"), hsdp
    two = describe_hops(DADConfig(), _Agg(4), levels, FAST)
    assert two == ("dAD across 2 nodes x 2 ranks: two levels; inside a node all-reduce 100 Gbit/s, 0 us (stated); "
                   "between nodes all-reduce 1 Gbit/s, 300 us (measured)"), two


def test_route_summary_counts_routes_per_hop_and_bytes():
    params = [ParamReport("a", "exact", (8, 8), sent_bytes=10, allreduce_bytes=100),
              ParamReport("b", "dense", (8,), sent_bytes=100, allreduce_bytes=100),
              ParamReport("c", "rank", (8, 8), sent_bytes=40, allreduce_bytes=200, level="two_level", inter_bytes=2048),
              ParamReport("dad.counts", "overhead", (2,), sent_bytes=50)]
    text = route_summary(params)
    assert text == "flat: 1 dense, 1 exact; between nodes: 1 rank; sent 0.50x all-reduce's bytes, 2.0 KB received between nodes", text


def test_exact_mode_on_a_fast_link_with_many_rows_warns():
    """Item 5: exact factors of 512 rows a rank on 100 Gbit/s cost more than the all-reduce; on
    1 Gbit/s with 4 rows they cost less (no line); mode auto is never warned about."""
    unit = UnitShape(("linear",), (256, 256), 256, torch.float32)
    many = [(unit, [[512], [512]])]
    line = mode_cost_line(DADConfig(mode="exact"), many, world_size=2, wire_dtype=torch.float32, link=FAST)
    assert line is not None and line.startswith("dAD: mode exact is predicted to slow the step here: its exchange ")
    assert "engine's own all-reduce" in line and "mode auto would take" in line and "(1 dense)" in line, line
    few = [(unit, [[4], [4]])]
    assert mode_cost_line(DADConfig(mode="exact"), few, world_size=2, wire_dtype=torch.float32, link=SLOW) is None
    assert mode_cost_line(DADConfig(mode="auto"), many, world_size=2, wire_dtype=torch.float32, link=FAST) is None


def test_watch_line_said_once_by_rank_zero(capsys):
    """The watch's "a new route trial" line comes from rank 0 only (every rank agreed on its figure)."""
    from dad_integrations.routing.trial import RouteTrial

    for rank in (1, 0):
        trial = RouteTrial(steps=4, rank=rank)
        trial.begin(0, {0: "rank"}, predicted_saving_s=0.01)
        for k, t in enumerate([0.05, 0.10, 0.10, 0.05, 0.2, 0.2, 0.2, 0.2], start=1):
            trial.end_of_step(k, t, lambda v: list(v), 1000)
        assert trial.refresh_at == 9 and not capsys.readouterr().err  # said where its refresh tries routes
        trial.begin(9, {0: "rank"}, predicted_saving_s=0.01)
        assert trial.active and trial.cause == "watch"
        err = capsys.readouterr().err
        assert ("a new route trial" in err) == (rank == 0), (rank, err)
        assert trial.news.startswith("dAD: the routes steps now take ")  # for the reports, on every rank


def test_sharded_residual_note_says_dtype_and_owners():
    """Item 6: the note counts the residuals' own dtype (fp32 for bf16 weights: itemsize 4) and,
    across nodes under ZeRO, that they live on the owners: the figure is the busiest owner's."""
    from dad_integrations.routes.layouts import RESIDUALS

    shapes = [(4096, 1024), (1024, 1024), (1024, 1024)]
    every = sharded_residual_note(DADConfig(mode="rank", rank=2), shapes, 4, 4)
    assert ("one whole m x n residual per rank-routed weight, on every rank: up to 24.0 MiB a rank (3 of 3 "
            "weights), 4.0x a rank's gradient shards of these weights (6.0 MiB)") in every, every
    where = RESIDUALS["owner"].replace("`", "")
    owners = sharded_residual_note(DADConfig(mode="rank", rank=2), shapes, 4, 4, held=shapes[:1], where=where)
    assert "on the weight's owner only" in owners and "up to 16.0 MiB a rank (1 of 3 weights), 2.7x" in owners, owners
    assert sharded_residual_note(DADConfig(mode="exact", rank=2), shapes, 4, 4) is None


def test_compile_line_only_where_compile_is_in_use(monkeypatch, caplog):
    """Dynamo imported but nothing compiled: the guard is set, nothing said at INFO; a compiled model
    (``announce``) hears of it."""
    import torch._dynamo.config as dynamo_config

    from dad_integrations.capture import compiled

    # nothing compiled in this process (a test before may have compiled: its graphs would be dropped,
    # and dropping them is said, rightly)
    monkeypatch.setattr(compiled, "_drop_compiled_graphs", lambda: 0)
    # dynamo's config by its own patch: monkeypatch's undo deletes the option from torch's config module
    before = dynamo_config.skip_nnmodule_hook_guards
    try:
        for announce in (False, True):
            monkeypatch.setattr(compiled, "_GUARDED", False)
            dynamo_config.skip_nnmodule_hook_guards = True
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="dad_integrations"):
                compiled.guard_compiled_hooks(announce=announce)
            assert dynamo_config.skip_nnmodule_hook_guards is False
            said = [r for r in caplog.records if r.levelno >= logging.INFO and "guards on module hooks" in r.getMessage()]
            assert bool(said) == announce, (announce, caplog.text)
    finally:
        dynamo_config.skip_nnmodule_hook_guards = before


@pytest.fixture(scope="module")
def visible_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("visible") / "out.json"
    proc = run_torchrun(WORKERS / "visible_worker.py", 2, [out, "trial,exact,fsdp-exact"], timeout=300)
    return json.loads(out.read_text())["ranks"], proc.stderr


def test_trial_run_shows_attach_links_and_decision_on_rank_zero_only(visible_job):
    ranks, stderr = visible_job
    r0, r1 = ranks[0]["trial"], ranks[1]["trial"]
    assert r1["said"] == [] and ranks[1]["exact"]["said"] == []
    said = r0["said"]
    assert said[0].startswith("dAD attached to DADSynchronizer: mode auto, rank 4"), said
    assert said[1] == "dAD across 1 node x 2 ranks: flat (one node); link all-reduce 1 Gbit/s, 300 us (measured)", said
    trials = [s for s in said if s.startswith("dAD route trial after step 2 (refresh): ")]
    assert len(trials) == 1 and "ms/step, all dense" in trials[0] and "routes tried: flat: " in trials[0], said
    assert "x all-reduce's bytes" in trials[0], trials
    # the last decision said: a trial's, a watch's that started another, or the refresh a watch's
    # miss asked for (under load)
    decisions = [s for s in said if " route trial after step " in s or s.endswith(": a new route trial")
                 or s.startswith("dAD routes at step ")]
    assert r0["decision"] == decisions[-1] and r0["links"]["flat"].startswith("all-reduce "), r0
    assert ranks[1]["trial"]["decision"] == decisions[-1]  # every rank's report carries it
    for line in said:  # shown at default levels, once (rank 1 prints none of them)
        assert stderr.count(line) == 1, line
    assert all(r[case]["compile"] == [] for r in ranks for case in r), "no compile in use: no compile line"


def test_exact_mode_on_a_fast_link_warns_once(visible_job):
    ranks, stderr = visible_job
    said = ranks[0]["exact"]["said"]
    assert said[1] == "dAD across 1 node x 2 ranks: flat (one node); link all-reduce 100 Gbit/s, 0 us (stated)", said
    warned = [s for s in said if s.startswith("dAD: mode exact is predicted to slow the step here")]
    assert len(warned) == 1 and "mode auto would take" in warned[0], said
    assert stderr.count("dAD: mode exact is predicted to slow the step") == 1
    assert any(s.startswith("dAD routes at step 1: flat: 4 exact; sent ") for s in said), said


def test_fsdp2_exact_on_a_fast_link_warns_from_the_first_steps_bytes(visible_job):
    ranks, stderr = visible_job
    said = ranks[0]["fsdp-exact"]["said"]
    assert said[0].startswith("dAD attached to FSDP2: mode exact"), said
    assert said[1] == "dAD across 1 node x 2 ranks: flat (one node); link all-reduce 100 Gbit/s, 0 us (stated)", said
    warned = [s for s in said if s.startswith("dAD/FSDP2: mode exact is predicted to slow the step here")]
    assert len(warned) == 1 and "the engine's own reduce-scatter" in warned[0], said
    assert any(s.startswith("dAD/FSDP2 routes at step 1: flat: 4 exact; sent ") for s in said), said
    assert ranks[1]["fsdp-exact"]["said"] == []
    assert stderr.count("dAD/FSDP2: mode exact is predicted") == 1


@pytest.fixture(scope="module")
def sharded_job(tmp_path_factory):
    """FSDP2 and ZeRO on 2 ranks; ZeRO-3 on 4 ranks as 2 nodes of 2 (``topology: 2``)."""
    pytest.importorskip("deepspeed")
    out = {}
    for nproc, cases in ((2, "fsdp-residuals,zero3-residuals,fsdp-exact-measured,zero2-exact-stated,"
                             "zero3-exact-measured"), (4, "zero3-nodes-residuals")):
        path = tmp_path_factory.mktemp(f"sharded{nproc}") / "out.json"
        proc = run_torchrun(WORKERS / "sharded_said_worker.py", nproc, [path, cases], timeout=400)
        out[nproc] = json.loads(path.read_text())["ranks"], proc.stderr
    return out


@pytest.mark.parametrize("nproc,case", [(2, "fsdp-residuals"), (2, "zero3-residuals"), (4, "zero3-nodes-residuals")])
def test_residual_warning_states_the_memory_allocated(sharded_job, nproc, case):
    """Item 6: the attach warning's figure is what error feedback holds after the steps on the
    busiest rank (every rank under FSDP2 and ZeRO on one node; the owners across nodes), where the
    layout keeps them; rank 0 says it, once."""
    ranks, stderr = sharded_job[nproc]
    said = ranks[0][case]["said_bytes"]
    held = [r[case]["held_bytes"] for r in ranks]
    assert said is not None and said == max(held), (said, held)
    warned = [w for w in ranks[0][case]["warned"] if "error feedback (fp32) keeps" in w]
    where = "on the weight's owner only" if "nodes" in case else "per rank-routed weight, on every rank"
    assert len(warned) == 1 and where in warned[0], ranks[0][case]["warned"]
    if "nodes" in case:  # the owners hold them: some rank holds less than the busiest
        assert min(held) < said and "(2 of 3 weights)" in warned[0], (held, warned)
    assert all(not r[case]["warned"] for r in ranks[1:]), [r[case]["warned"] for r in ranks[1:]]


@pytest.mark.parametrize("case,engine,link", [("fsdp-exact-measured", "FSDP2", "measured"),
                                               ("zero2-exact-stated", "ZeRO-2", "stated"),
                                               ("zero3-exact-measured", "ZeRO-3", "measured")])
def test_sharded_exact_mode_on_a_fast_link_warns(sharded_job, case, engine, link):
    """Item 5: under FSDP2 and ZeRO, on a stated link and on one measured after the first step
    (mode exact has no models of its own), rank 0 warns once; the other ranks say nothing."""
    ranks, stderr = sharded_job[2]
    said = ranks[0][case]["said"]
    warned = [s for s in said if s.startswith(f"dAD/{engine}: mode exact is predicted to slow the step here")]
    assert len(warned) == 1 and f"({link}); mode auto would take" in warned[0], said
    assert stderr.count(warned[0]) == 1
    assert all(r[case]["said"] == [] for r in ranks[1:])


# Lines said on every rank because they differ by rank (or run where there is one process), by
# (module, function): everything else the library logs or warns sits under a rank test.
EVERY_RANK = {
    ("dad_integrations/accelerate.py", "enable_dad"): "a single process",
    ("dad_integrations/transformers.py", "on_train_begin"): "a single process",
    ("dad_integrations/capture/layers/mha.py", "_post_hook"): "this process's torch function mode stack",
    ("dad_integrations/elastic.py", "warn_if_unprefixed"): "called by banner.announce, on rank 0 only",
    ("dad_integrations/engines/registry.py", "load_entry_points"): "this node's installed adapters",
    ("horovod_dad/optimizer.py", "DADOptimizer"): "Horovod's own warning, on every rank as Horovod's",
    ("horovod_dad/optimizer.py", "_synchronizing_step"): "Horovod's own warning (its ported test checks each rank)",
}


def _log_calls(path):
    """(line, function, call, gated) for every ``log.*``/``warnings.warn`` call in ``path``:
    gated where an enclosing ``if`` tests a rank (``rank``, ``is_main_process``)."""
    import ast

    found = []

    def visit(node, guards, func):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, [], child.name)
                continue
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                    and child.func.attr in ("warning", "info", "error", "warn")
                    and ast.unparse(child.func.value) in ("log", "logger", "self.log", "warnings")):
                gated = any(k in g for g in guards for k in ("rank", "is_main_process"))
                found.append((child.lineno, func, ast.unparse(child.func), gated))
            if isinstance(child, ast.If):
                test = ast.unparse(child.test)
                for part in child.body + child.orelse:
                    visit(ast.Module(body=[part], type_ignores=[]), guards + [test], func)
                continue
            visit(child, guards, func)

    visit(ast.parse(path.read_text()), [], "<module>")
    return found


def test_rank_invariant_lines_come_from_rank_zero():
    """Item 1: what every rank would say alike (the model's layout, a config's consequence, an
    agreed decision) is said by rank 0 only; the exceptions differ by rank or run alone (`EVERY_RANK`)."""
    from conftest import ROOT

    ungated = []
    for pkg in ("dad_integrations", "deepspeed_dad", "horovod_dad"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            ungated += [(rel, line, func, call) for line, func, call, gated in _log_calls(path)
                        if not gated and (rel, func) not in EVERY_RANK]
    assert not ungated, ungated


def test_once_logger_and_process_rank(monkeypatch, caplog):
    """`OnceLogger` says each line once, on rank 0 only (its ``rank``, else `process_rank`, which
    reads the launcher's variables before a process group is up)."""
    from dad_integrations.logs import OnceLogger, process_rank

    logger = logging.getLogger("dad_integrations.test_once")
    monkeypatch.setenv("RANK", "1")
    assert process_rank() == 1
    with caplog.at_level(logging.WARNING, logger="dad_integrations.test_once"):
        OnceLogger(logger, "x: ")("said on rank 1?")
        OnceLogger(logger, "x: ", rank=0)("said on rank 0")
        once = OnceLogger(logger, "x: ", rank=0)
        once("twice")
        once("twice")
    assert [r.getMessage() for r in caplog.records] == ["x: said on rank 0", "x: twice"]
    monkeypatch.setenv("RANK", "0")
    assert process_rank() == 0
