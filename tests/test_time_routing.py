"""Objective "time": the link and compute models, the decision as a pure function, and a real
2-rank job that routes by them (fast link: dense, capture off; slow link: rank routes; a switch
flushes the error-feedback residuals into the next dense step)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import WORKERS, result, run_torchrun
from dad_integrations import DADConfig
from dad_integrations.routing.compute_model import ComputeModel, ShapeCosts
from dad_integrations.comm.link_spec import LinkCost, parse_bandwidth
from dad_integrations.routing.link import LinkModel, fit_link_cost
from dad_integrations.routing.router import SWITCH_MARGIN, UnitShape, RouteContext, UnitEvidence, route, unit_estimates
from dad_integrations.routing.timing import StepTiming

SHAPE = UnitShape(("linear",), (768, 768), 768, torch.float32)


def _timing(bandwidth: str, *, latency_us: float = 0.0, rank_s: float = 1e-3, exact_per_row: float = 1e-7,
            capture: float = 0.0) -> StepTiming:
    link = LinkModel.from_spec({"bandwidth": bandwidth, "latency_us": latency_us})
    costs = ShapeCosts(rank_allreduce=rank_s, rank=rank_s, exact_per_row=exact_per_row)
    return StepTiming(link, ComputeModel({SHAPE.shape: costs}, capture))


def _route(timing, *, world_size=2, rows=4096, rank=4, objective="time", current=None, mode="auto") -> str:
    cfg = DADConfig(mode=mode, rank=rank, objective=objective)
    return route(RouteContext(cfg, world_size=world_size, wire_dtype=torch.float32, timing=timing), SHAPE, UnitEvidence(rows_by_rank=[[rows]] * world_size, current=current)).representation


def test_parse_bandwidth():
    assert parse_bandwidth("10gbit") == pytest.approx(1.25e9)
    assert parse_bandwidth("100Mbit/s") == pytest.approx(12.5e6)
    assert parse_bandwidth("2GB/s") == pytest.approx(2e9)
    assert parse_bandwidth(5e8) == 5e8
    for bad in ("fast", "10g", -1, 0, True, float("inf")):
        with pytest.raises(ValueError):
            parse_bandwidth(bad)


def test_link_spec_and_errors():
    link = LinkModel.from_spec({"bandwidth": "8gbit", "latency_us": 20, "all_gather": {"bandwidth": "4gbit"}})
    assert link.all_reduce == LinkCost(20e-6, 1e9)
    assert link.all_gather == LinkCost(0.0, 5e8)
    assert link.seconds("all_reduce", 1e9, calls=2) == pytest.approx(1.0 + 40e-6)
    assert LinkModel.from_list(link.to_list()).to_list() == pytest.approx(link.to_list(), rel=1e-12)
    for bad, key in (({"bandwidth": "1gbit", "latncy_us": 3}, "latncy_us"), ({"latency_us": 3}, "bandwidth"),
                     ({"bandwidth": "1gbit", "latency_us": -1}, "latency_us"),
                     ({"bandwidth": "1gbit", "all_gather": 3}, "link.all_gather")):
        with pytest.raises(ValueError, match=key):
            DADConfig(link=bad)


def test_config_objective_keys(monkeypatch):
    assert DADConfig(objective="time").objective == "time"
    with pytest.raises(ValueError, match="objective"):
        DADConfig(objective="speed")
    with pytest.raises(ValueError, match="route_refresh_steps"):
        DADConfig(route_refresh_steps=0)
    monkeypatch.delenv("DAD_OBJECTIVE")
    assert DADConfig().objective == "time"            # the default
    monkeypatch.setenv("DAD_OBJECTIVE", "bytes")
    assert DADConfig().objective == "bytes"
    monkeypatch.setenv("DAD_OBJECTIVE", "quick")
    with pytest.raises(ValueError, match="DAD_OBJECTIVE"):
        DADConfig()
    cfg = DADConfig(objective="time", link={"bandwidth": "1gbit"}, route_refresh_steps=7)
    assert DADConfig.from_dict(cfg.to_dict()) == cfg


def test_fit_recovers_alpha_beta():
    samples = [(b, 30e-6 + b / 2e9) for b in (4096, 65536, 1 << 20, 4 << 20)]
    c = fit_link_cost(samples)
    assert c.alpha == pytest.approx(30e-6, rel=1e-6) and c.beta == pytest.approx(2e9, rel=1e-6)
    noisy = fit_link_cost([(4096, 5e-3), (1 << 20, 1e-3)])  # larger call faster: noise
    assert noisy.alpha == 1e-3 and noisy.beta >= 1e14 and math.isfinite(noisy.beta)  # in doubt: fast
    # a slow large call (negative latency fitted): the largest call's rate, not the small one's
    steep = fit_link_cost([(4096, 1e-6), (1 << 20, 1e-2)])
    assert steep.alpha == 0.0 and steep.beta == pytest.approx((1 << 20) / 1e-2)


def test_fast_link_goes_dense_slow_link_compresses():
    assert _route(_timing("1000gbit")) == "dense"
    assert _route(_timing("100mbit")) == "rank_allreduce"
    # bytes ignore the models: PowerSGD's route on any link
    assert _route(_timing("1000gbit"), objective="bytes") == "rank_allreduce"


def test_exact_rebuild_grows_with_sites():
    # few rows per site: exact factors are the fewest bytes at any number of sites ...
    for sites in (2, 64):
        assert _route(None, world_size=sites, rows=2, rank=None, objective="bytes") == "exact"
    # ... but their S N m n rebuild grows with the sites: by time, dense wins at 64 on a fast link
    timing = _timing("100gbit", exact_per_row=2e-5)
    assert _route(timing, world_size=2, rows=2, rank=None) == "exact"
    assert _route(timing, world_size=64, rows=2, rank=None) == "dense"


def test_latency_counts_per_exact_call():
    # exact factors pay a size exchange and an all-gather of their own; on a high-latency link the
    # bucketed dense all-reduce is faster although it moves more bytes
    assert _route(_timing("100gbit", latency_us=1), rows=16, rank=None) == "exact"
    assert _route(_timing("100gbit", latency_us=20000), rows=16, rank=None) == "dense"


def test_switch_needs_a_margin():
    # at 10 Gbit/s the dense all-reduce of a 768 x 768 weight takes ~1.9 ms on the wire
    close = _timing("10gbit", rank_s=1.7e-3)   # rank-r all-reduce predicted ~10 % faster
    assert _route(close) == "rank_allreduce"
    assert _route(close, current="dense") == "dense"              # not worth a switch
    assert _route(close, current="rank_allreduce") == "rank_allreduce"
    clear = _timing("10gbit", rank_s=0.5e-3)   # ~4x faster: switch
    assert _route(clear, current="dense") == "rank_allreduce"
    assert SWITCH_MARGIN > 0.1


@pytest.mark.parametrize("bandwidth", ["1mbit", "100mbit", "1gbit", "10gbit", "100gbit", "1000gbit"])
@pytest.mark.parametrize("sites", [2, 8, 64])
def test_predicted_never_slower_than_allreduce(bandwidth, sites):
    """Per unit, auto's predicted seconds never exceed dense all-reduce's, on any link and scale."""
    for rank_s in (1e-5, 1e-3, 1e-1):
        timing = _timing(bandwidth, latency_us=50, rank_s=rank_s, exact_per_row=1e-6, capture=2e-5)
        for rows in (1, 64, 4096):
            cfg = DADConfig(mode="auto", rank=4, objective="time")
            rep = _route(timing, world_size=sites, rows=rows)
            est = unit_estimates(cfg, SHAPE, [[rows]] * sites, sites, torch.float32)
            seconds = timing.route_seconds(est, shape=SHAPE.shape, uses=1, rows_by_rank=[[rows]] * sites,
                                           world_size=sites)
            assert seconds[rep] <= seconds["dense"]


def test_compute_model_measures_every_shape():
    from dad_integrations.routing.compute_model import measure_compute
    model = measure_compute([(32, 48), (48, 32), (32, 48)], rank=4, world_size=2, iterations=1,
                            error_feedback=True, device=torch.device("cpu"))
    assert set(model.shapes) == {(32, 48), (48, 32)}
    c = model.shapes[(32, 48)]
    assert c.rank_allreduce > 0 and c.rank > 0 and c.exact_per_row > 0
    # exact dAD's rebuild grows with the sites and rows; dense costs nothing extra
    assert model.seconds("exact", (32, 48), rows_by_rank=[[10]] * 8, world_size=8) > \
        model.seconds("exact", (32, 48), rows_by_rank=[[10]] * 2, world_size=2)
    assert model.seconds("dense", (32, 48), rows_by_rank=[[10]], world_size=2) == 0.0


@pytest.fixture(scope="module")
def time_job(tmp_path_factory):
    work = tmp_path_factory.mktemp("time")
    run_torchrun(WORKERS / "time_worker.py", 2, [work / "out.json"])
    return json.loads((work / "out.json").read_text())


def _ranks_agree(per_rank):
    assert per_rank[0]["routes"] == per_rank[1]["routes"]
    assert per_rank[0]["digest"] == per_rank[1]["digest"]  # bit-identical parameters


def test_fast_link_all_dense_capture_off_equals_allreduce(time_job):
    per_rank = result(time_job, "fast")
    _ranks_agree(per_rank)
    for r in per_rank:
        assert all(routes == ["dense"] for routes in r["routes"][1:])
        assert r["captured"][-1] == 0          # nothing captured: the step costs what DDP's does
        assert max(r["errors"]) < 1e-5         # every gradient equals the all-reduce's


def test_all_dense_ddp_step_is_ddps_own(time_job):
    """Through DDP's hook, a step whose every weight is dense sends DDP's buckets as they are (one
    collective a bucket, no packing on dAD's worker), the first step too (its routes decided ahead
    of backward, `exchange.ahead`): its gradients equal plain DDP's bit for bit."""
    per_rank = result(time_job, "fast-ddp")
    assert per_rank[0]["digest"] == per_rank[1]["digest"]
    for r in per_rank:
        assert all(n >= 1 for n in r["native_calls"]), r["native_calls"]
        assert all(routes == ["dense"] for routes in r["routes"]), r["routes"]
        assert all(r["equal"]), r["equal"]


def test_slow_link_takes_rank_routes(time_job):
    per_rank = result(time_job, "slow")
    _ranks_agree(per_rank)
    assert all("rank_allreduce" in routes for routes in per_rank[0]["routes"][1:])


def test_leaving_a_rank_route_flushes_the_residual(time_job):
    per_rank = result(time_job, "flush")
    _ranks_agree(per_rank)
    routes = per_rank[0]["routes"]
    assert "rank_allreduce" in routes[2] and routes[3] == ["dense"] and routes[4] == ["dense"]
    for r in per_rank:
        assert r["flushed"] > 0
        assert r["errors"][0] < 1e-5           # the dense step sent local gradient + residual
        assert r["residuals_after"] == 0       # nothing is owed any more


def test_residual_put_back_by_a_skipped_step_goes_with_the_next_dense_step(time_job):
    """The flush step is not finite (a NaN on one rank, skipped as a loss scaler skips it): its
    residuals are put back, and the next step, dense too, sends them (local gradient + residual,
    as the all-reduce gives it); nothing is owed after. Before, the residual stayed owed, unsent,
    because the unit's last route was already dense."""
    per_rank = result(time_job, "flush-skip")
    _ranks_agree(per_rank)
    routes = per_rank[0]["routes"]
    assert "rank_allreduce" in routes[2] and routes[3] == ["skipped"] and routes[4] == ["dense"], routes
    for r in per_rank:
        assert r["kept_after_skip"] > 0
        assert r["flushed"] == r["kept_after_skip"]
        assert r["errors"][-1] < 1e-5, r["errors"]
        assert r["residuals_after"] == 0


def test_measured_link_agreed(time_job):
    per_rank = result(time_job, "measured")
    _ranks_agree(per_rank)
    assert per_rank[0]["link"] == per_rank[1]["link"]
    assert all(v > 0 for v in per_rank[0]["link"][1::2])  # a finite bandwidth per kind


def test_leaving_a_rank_route_for_exact_factors(time_job):
    """Rows fall at a refresh and a weight moves from the rank-r all-reduce to exact factors: the
    flush step sends its residual densely, and the next step's exact factors (rows captured again)
    equal the all-reduce of the local gradients."""
    per_rank = result(time_job, "flush-exact")
    assert per_rank[0]["routes"] == per_rank[1]["routes"] and per_rank[0]["digest"] == per_rank[1]["digest"]
    routes = per_rank[0]["routes"]
    assert routes[2]["0.weight"] in ("rank", "rank_allreduce") and routes[3]["0.weight"] == "dense", routes
    assert routes[4]["0.weight"] == "exact", routes
    for r in per_rank:
        assert max(r["errors"]) < 1e-5, r["errors"]  # step 3: local + residual; step 4: exact


RANK_ROUTES = {"rank", "rank_allreduce"}
TRIAL_ARMS = ["R", "D", "D", "R"]  # steps 1-4: R D D R, decided at the end of step 4


def _check_trial_arms(routes):
    assert routes[0] and set(routes[0]) <= RANK_ROUTES, routes       # step 0: the models' routes
    for arm, r in zip(TRIAL_ARMS, routes[1:5]):
        assert (r == ["dense"]) == (arm == "D") and (arm == "D" or set(r) <= RANK_ROUTES), routes


def test_trial_all_dense_wins_and_stays(time_job):
    """The models misjudge the link and compress; the job's own steps say all-dense is faster
    (the rank routes' collectives made slow): after the trial every weight stays dense, capture off,
    every gradient the all-reduce's, and the miss is charged to the compressed routes."""
    per_rank = result(time_job, "trial-dense")
    _ranks_agree(per_rank)
    routes = per_rank[0]["routes"]
    _check_trial_arms(routes)
    assert all(r == ["dense"] for r in routes[5:]), routes
    for r in per_rank:
        (trial,) = r["trials"]
        assert trial["step"] == 0 and trial["compressed"] > 0 and not trial["kept"] and trial["conclusive"]
        assert trial["pairs"] == 2 and trial["routes_won"] == 0
        assert trial["routes_s"] > trial["dense_s"] + 0.1                # the slowed P all-reduce
        assert r["overhead_s"] == trial["overhead_s"] > 0                # calibrated: routes cost more
        assert max(r["errors"].values()) < 1e-5, r["errors"]              # steps 2, 3 (trial's D), 6, 9
        assert r["held"][1] > 0 and r["held"][2] == r["held"][3] == r["held"][1]  # residuals wait
        assert r["captured"][-1] == 0 and r["residuals_after"] == 0
    assert per_rank[0]["trials"] == per_rank[1]["trials"]               # agreed figures, one decision


def _check_kept(per_rank):
    _ranks_agree(per_rank)
    routes = per_rank[0]["routes"]
    _check_trial_arms(routes)
    assert all(r == routes[0] for r in routes[5:]), routes  # the refresh's routes, restored
    for r in per_rank:
        (trial,) = r["trials"]
        assert trial["kept"] and trial["conclusive"] and trial["routes_won"] == trial["pairs"] == 2
        assert trial["dense_s"] > trial["routes_s"] + 0.1
        # the trial's dense steps, after a routes step and after a dense one: the all-reduce's
        # gradient; the routes' residuals wait for the next routes step (a dense arm that costs
        # what a steady dense step costs, not what the step leaving the routes costs)
        assert r["errors"]["2"] < 1e-5 and r["errors"]["3"] < 1e-5, r["errors"]
        assert r["held"][1] > 0 and r["held"][2] == r["held"][3] == r["held"][1], r["held"]
    assert per_rank[0]["trials"] == per_rank[1]["trials"]


def test_trial_keeps_routes_that_measure_faster(time_job):
    """Dense buckets made slow: the trial's rank routes measure faster, so they are kept from
    step 5 on; the gradient of a dense step of the trial is the all-reduce's."""
    _check_kept(result(time_job, "trial-keep"))


def test_trial_ignores_time_between_steps(time_job):
    """The loop sleeps 0.5 s and evaluates after every step on the rank routes: timed from one
    exchange to the next, those steps would look 0.5 s slower and all-dense would win; timed from
    the forward to the end of the exchange, the routes still win."""
    per_rank = result(time_job, "trial-sleep")
    _check_kept(per_rank)
    for r in per_rank:
        assert r["trials"][0]["routes_s"] < 0.4


def test_trial_through_ddp(time_job):
    """The same trial through DDP's communication hook: the step's span starts at DDP's forward;
    the trial's dense steps send DDP's own buckets (residuals held), as a steady dense step does."""
    per_rank = result(time_job, "trial-ddp")
    _check_kept(per_rank)
    for r in per_rank:
        assert r["native"][2] > 0 and r["native"][3] > 0 and r["native"][1] == r["native"][4] == 0, r["native"]


def _agree_identity(values):
    return list(values)


def _run_trial(trial, start, times, next_refresh=1000):
    """Feed ``times`` as the steps after ``start``; returns the outcomes seen."""
    out = []
    for k, t in enumerate(times, start=start + 1):
        o = trial.end_of_step(k, t, _agree_identity, next_refresh)
        if o is not None:
            out.append(o)
    return out


def test_trial_schedule_pairs_and_decision():
    """`RouteTrial` as a pure state machine: R D D R ... per round, the decision at a round's end
    from per-pair differences; kept only beyond the margin; the overhead moves by (predicted +
    measured difference) per compressed weight, never below 0."""
    from dad_integrations.routing.trial import KEEP_MARGIN, MAX_ROUNDS, RouteTrial

    trial = RouteTrial(steps=4)
    assert trial.fits(10, 10 + 4 * MAX_ROUNDS + 1) and not trial.fits(10, 10 + 4 * MAX_ROUNDS)
    assert not RouteTrial(steps=0).fits(0, 1000)
    trial.begin(10, {0: "rank_allreduce", 1: "dense", 2: "exact"}, predicted_saving_s=0.05)
    assert [trial.arm(k) for k in range(10, 16)] == [None, "routes", "dense", "dense", "routes", None]
    # only the dense arm holds error-feedback residuals (for the next routes step)
    assert [trial.holds_residuals(k) for k in range(10, 16)] == [False, False, True, True, False, False]
    # routes slower in both pairs (0.11 vs 0.08, 0.12 vs 0.08): dense, conclusive
    (out,) = _run_trial(trial, 10, [0.11, 0.08, 0.08, 0.12])
    assert not out.kept and out.conclusive and out.pairs == 2 and out.routes_won == 0 and not trial.active
    assert out.routes_s == pytest.approx(0.115) and out.dense_s == pytest.approx(0.08)
    # predicted to save 50 ms, measured to lose 35 (median difference): 85 ms over 2 compressed weights
    assert out.compressed == 2 and out.overhead_s == pytest.approx(0.0425)
    trial.begin(50, {0: "rank"}, predicted_saving_s=0.01)
    (kept,) = _run_trial(trial, 50, [0.05, 0.09, 0.09, 0.05])  # 40 ms faster than dense
    assert kept.kept and kept.overhead_s == pytest.approx(0.0425 + 0.01 - 0.04)  # overhead falls
    trial.begin(90, {0: "rank"}, predicted_saving_s=0.0)
    inside = 0.1 * (1 - KEEP_MARGIN / 2)  # faster, but inside the margin: dense wins the pairs
    (out,) = _run_trial(trial, 90, [inside, 0.1, 0.1, inside])
    assert not out.kept and out.conclusive
    trial.begin(120, {0: "rank"}, predicted_saving_s=0.0)
    (out,) = _run_trial(trial, 120, [0.05, 0.1, 0.1, 0.05])
    assert out.overhead_s == 0.0  # never below 0
    trial.begin(150, {0: "rank"}, predicted_saving_s=0.0)
    trial.cancel()                                     # a checkpoint loaded mid-trial
    assert not trial.active and trial.arm(151) is None and trial.watch is None


def test_trial_burst_spoils_a_pair_not_the_decision():
    """A burst of load in one step (a 1 s dense step) loses one pair of four: 3 of 4 pairs still
    favour the routes, so they are kept; sequential halves summarised by their medians would have
    been misled as easily as a pair."""
    from dad_integrations.routing.trial import RouteTrial

    trial = RouteTrial(steps=8)
    # R D D R R D D R; the burst hits the first routes step
    times = [1.0, 0.10, 0.10, 0.05, 0.05, 0.10, 0.10, 0.05]
    trial.begin(0, {0: "rank"}, 0.0)
    (out,) = _run_trial(trial, 0, times)
    assert out.kept and out.conclusive and (out.routes_won, out.pairs) == (3, 4)


def test_inconclusive_trial_extends_then_goes_dense():
    """Split evidence (2 of 4 pairs each way) runs another round, up to MAX_ROUNDS; still split, the
    routes' win is inside the noise: every weight goes dense (the lower-risk arm) and the outcome
    says it was inconclusive, within noise."""
    from dad_integrations.routing.trial import MAX_ROUNDS, RouteTrial

    trial = RouteTrial(steps=4)
    trial.begin(0, {0: "rank", 1: "exact"}, predicted_saving_s=0.01)
    split = [0.05, 0.10, 0.05, 0.10]  # pair 1 (R D): routes win; pair 2 (D R): dense wins
    assert _run_trial(trial, 0, split) == [] and trial.active and trial.rounds == 2
    assert [trial.arm(k) for k in range(5, 9)] == ["routes", "dense", "dense", "routes"]
    outcomes = _run_trial(trial, 4, split * (MAX_ROUNDS - 1))
    assert len(outcomes) == 1 and not trial.active
    (out,) = outcomes
    # the pairs' differences spread by 50 ms around 0, 2/3 of the dense median: no pair beats that
    assert not out.kept and not out.conclusive and out.pairs == 2 * MAX_ROUNDS and out.routes_won == 0
    assert out.noise == pytest.approx(2 / 3)
    assert "inconclusive" in out.describe() and "within noise (±67 %)" in out.describe()
    # a round that decides ends the trial early: routes faster in all pairs of the second round
    trial.begin(100, {0: "rank"}, 0.0)
    assert _run_trial(trial, 100, split) == []
    (out,) = _run_trial(trial, 104, [0.05, 0.10, 0.10, 0.05])
    assert out.kept and out.conclusive and out.pairs == 4 and out.routes_won == 3


def test_sustained_miss_starts_a_new_trial():
    """After a decision the chosen steps are watched: their lower quartile over a watch interval
    above both arms' trial medians (by WATCH_MARGIN) makes the next step a refresh (routes chosen
    anew on the link measured again) and the trial after it has cause "watch"; a single slow step
    does not; a miss whose trial would not end before the next refresh asks for none; a
    watch-started trial that confirms the choice doubles the interval."""
    from dad_integrations.routing.trial import RouteTrial

    trial = RouteTrial(steps=4)
    trial.begin(0, {0: "rank"}, predicted_saving_s=0.01)
    (out,) = _run_trial(trial, 0, [0.05, 0.10, 0.10, 0.05])
    assert out.kept and trial.watch is not None and trial.watch.interval == 4
    assert _run_trial(trial, 4, [0.05, 2.0, 0.05, 0.05]) == [] and trial.refresh_at is None  # one burst: no miss
    assert _run_trial(trial, 8, [0.2, 0.2, 0.2, 0.2]) == [] and not trial.active     # the link slowed
    assert trial.refresh_at == 13 and trial.watch is None
    trial.begin(13, {0: "rank_allreduce"}, predicted_saving_s=0.02)  # the owner's refresh: routes anew
    assert trial.cause == "watch" and trial.start == 13 and trial.routes == {0: "rank_allreduce"}
    (again,) = _run_trial(trial, 13, [0.2, 0.4, 0.4, 0.2])  # routes still faster: confirmed
    assert again.kept and again.cause == "watch" and trial.watch.interval == 8
    # near the next refresh (step 30): no room for a trial; the refresh chooses anew anyway
    assert _run_trial(trial, 17, [0.9] * 8, next_refresh=30) == [] and trial.refresh_at == 13
    trial.stop_watching()
    assert trial.watch is None and _run_trial(trial, 25, [5.0] * 8) == [] and trial.refresh_at == 13


def test_untried_decision_is_watched_against_its_first_interval():
    """A refresh that begins no trial (the models chose all dense) is watched too: the first
    interval's agreed lower quartile plus the models' spare seconds (what the other routes were
    predicted to cost beyond dense) and WATCH_MARGIN is the limit; a paused rank (one long step an
    interval) is no miss; a slower link (every step) is, and asks for a refresh at the next step. A
    re-choice that lands on dense again takes the missed figure as its baseline (the limit only
    rises); a regular refresh measures a new one."""
    from dad_integrations.routing.trial import WATCH_MARGIN, RouteTrial

    trial = RouteTrial(steps=4)
    seen = []

    def agree(values):
        seen.append(len(values))
        return list(values)

    def feed(start, times, next_refresh=1000):
        for k, t in enumerate(times, start=start + 1):
            assert trial.end_of_step(k, t, agree, next_refresh) is None

    trial.watch_untried(0, "dense", spare_s=0.02)
    feed(0, [0.06, 0.05, 0.30, 0.05])                  # the baseline: lower quartile 0.05
    assert trial.watch.limit_s == pytest.approx((0.05 + 0.02) * (1 + WATCH_MARGIN)) and seen == [2]
    feed(4, [0.05, 3.0, 0.06, 0.05] * 2 + [0.075] * 4)  # pauses, then slower but within the spare
    assert trial.refresh_at is None and seen == [2, 1, 1, 1]  # one number an interval
    feed(16, [0.5, 0.5, 0.6, 0.5])                     # the link slowed
    assert trial.refresh_at == 21 and trial.watch is None and not trial.active
    assert trial.missed.startswith("dAD: the dense steps now take 500.0 ms (lower quartile of 4), above the "
                                   "baseline's 77.0 ms: the link measured again and routes chosen anew")
    trial.watch_untried(21, "dense", spare_s=0.02)     # the refresh chose dense again
    assert trial.watch.interval == 4 and trial.watch.since == 22 and trial.watch.baseline_s == 0.5
    feed(21, [0.5, 0.55, 0.5, 0.5] * 2)                # the slower steps are the new normal
    assert trial.watch.limit_s == pytest.approx((0.5 + 0.02) * (1 + WATCH_MARGIN))
    assert trial.refresh_at == 21 and seen[-2:] == [2, 1]  # the spare agreed at the first check
    trial.watch_untried(21, "dense", spare_s=0.02)     # (again) a link that slows in the first interval
    feed(21, [0.5, 2.0, 2.0, 2.0])                     # is caught at its first check
    assert trial.refresh_at == 26
    trial.refresh_at = None
    trial.watch_untried(50, "dense")                   # a regular refresh: a new baseline
    assert trial.watch.interval == 4 and trial.watch.limit_s is None
    trial.refresh_at = 55
    trial.begin(55, {0: "rank"}, 0.01)                 # a refresh the watch asked for began a trial
    assert trial.cause == "watch" and trial.news.endswith(": a new route trial")
    assert RouteTrial(steps=0).watch_untried(0, "dense") is None  # no trials: no watch


def test_router_spare_seconds():
    """`Route.spare_s`: by time in mode auto, where dense wins, what its fastest rival costs beyond it."""
    from dad_integrations.routing.router import spare_seconds

    assert spare_seconds({"dense": 1.0, "rank": 1.5, "exact": 3.0}, "dense") == 0.5
    assert spare_seconds({"dense": 1.0, "rank": 0.5}, "rank") == 0.0
    assert spare_seconds({"dense": 1.0}, "dense") == 0.0
    slow = route(RouteContext(DADConfig(mode="auto", rank=4, objective="time"), world_size=2, wire_dtype=torch.float32,
                              timing=_timing("100gbit")), SHAPE, UnitEvidence(rows_by_rank=[[4096]] * 2))
    assert slow.representation == "dense" and slow.spare_s > 0 and slow.saved_s == 0.0


def test_calibrated_overhead_charges_non_dense_routes():
    """`StepTiming.overhead_s` is added to every route but dense, and `Route.saved_s` reports the
    chosen route's predicted saving against dense: a slow link's rank route stops paying once the
    overhead exceeds what it saves."""
    import dataclasses

    timing = _timing("100mbit")
    cfg = DADConfig(mode="auto", rank=4, objective="time")
    decided = route(RouteContext(cfg, world_size=2, wire_dtype=torch.float32, timing=timing), SHAPE, UnitEvidence(rows_by_rank=[[4096]] * 2))
    assert decided.representation in ("rank", "rank_allreduce") and decided.saved_s > 0
    est = unit_estimates(cfg, SHAPE, [[4096]] * 2, 2, torch.float32)
    plain = timing.route_seconds(est, shape=SHAPE.shape, uses=1, rows_by_rank=[[4096]] * 2, world_size=2)
    assert decided.saved_s == pytest.approx(plain["dense"] - plain[decided.representation])
    charged = dataclasses.replace(timing, overhead_s=decided.saved_s * 2)
    again = charged.route_seconds(est, shape=SHAPE.shape, uses=1, rows_by_rank=[[4096]] * 2, world_size=2)
    assert again["dense"] == plain["dense"]
    assert all(again[k] == pytest.approx(plain[k] + decided.saved_s * 2) for k in plain if k != "dense")
    assert _route(charged) == "dense"


def test_near_ties_go_by_the_safe_order():
    """Routes predicted within `TIE_BAND` of the fastest tie, and ties go dense first, then exact,
    then PowerSGD's all-reduce: at two sites rank-dAD's all-gather and the all-reduce move the
    same bytes, and a few percent of measured compute between them is noise (it made the README's
    stated-link run pick either, run to run)."""
    from dad_integrations.routing.router import TIE_BAND

    link = LinkModel.from_spec({"bandwidth": "100mbit", "latency_us": 0})
    def timing(allreduce_s, rank_s):
        return StepTiming(link, ComputeModel({SHAPE.shape: ShapeCosts(allreduce_s, rank_s, 1e-7)}, 0.0))
    assert _route(timing(1.03e-3, 1.0e-3)) == "rank_allreduce"     # 3 % of compute apart: a tie
    assert _route(timing(40e-3, 1.0e-3)) == "rank"                 # far apart: the faster
    assert 0 < TIE_BAND < SWITCH_MARGIN


@pytest.mark.parametrize("objective", ["bytes", "time"])
def test_lossless_steps_then_rank_routes(time_job, objective):
    """A real job's first `lossless_steps` (3 here; 10 by default) go exact or dense, every gradient
    the all-reduce's; then the weights take rank routes (by time: at the refresh where the
    lossless steps end), on every rank alike."""
    per_rank = result(time_job, f"lossless-{objective}")
    _ranks_agree(per_rank)
    routes = per_rank[0]["routes"]
    assert all(r and set(r) <= {"exact", "dense"} for r in routes[:3]), routes
    assert all({"rank", "rank_allreduce"} & set(r) for r in routes[3:]), routes
    for r in per_rank:
        assert len(r["errors"]) == 3 and max(r["errors"]) < 1e-5, r["errors"]


def test_sharded_trial_holds_all_dense_until_the_next_refresh():
    """`sharded_trial.ShardedTrial` (FSDP2, ZeRO) driven as the adapters drive it, no processes: a
    refresh that compresses begins a trial, its dense arm and then all dense (decided) force the
    engine's reduce-scatter until the next refresh, which routes anew; a refresh that compresses
    nothing begins none. The real engines' trials: tests/test_fsdp2.py, tests/test_zero.py."""
    from dad_integrations.routing.trial import RouteTrial
    from dad_integrations.routing.router import Route
    from dad_integrations.routing.sharded_trial import ShardedTrial

    pieces = ShardedTrial(DADConfig(mode="auto", rank=4, objective="time", lossless_steps=0,
                                    route_trial_steps=4, route_refresh_steps=20))
    pieces.trial = RouteTrial(4)  # (`start` measures the models: a collective)
    units = [type("Unit", (), {"index": i})() for i in range(3)]
    now = [0.0]
    pieces.clock.clock = lambda: now[0]
    forced = []
    for step in range(25):
        pieces.forward()
        pieces.open(step)
        dense = pieces.dense(step)
        forced.append(dense)
        compress = not dense and step not in (20,)  # step 20: the refresh's routes are all dense
        for unit in units:
            pieces.note(unit, Route("rank" if compress else "dense", False, 0.01))
        now[0] += 1.0 if compress else 0.1  # the routes are slower
        pieces.end(step, lambda values: list(values))
    (outcome,) = pieces.outcomes
    assert not outcome.kept and outcome.pairs == 2
    assert forced[:5] == [False, False, True, True, False]    # refresh, then R D D R
    assert all(forced[5:20])                                  # all dense until the refresh at 20
    assert not any(forced[20:])                               # routed anew: nothing compressed, no trial
    assert pieces.next_refresh(3) == 20 and pieces.refresh(20) and not pieces.refresh(19)


def test_sharded_watch_trial_after_all_dense_tries_the_routes():
    """After a trial decided all dense, the watch's new trial (the dense steps slowed: a link cut)
    must send its routes-arm steps by the routes, not by the all-dense hold: under ZeRO-3 across 2
    nodes (issue 37, tried again) its routes arm ran dense ("routes tried: flat: 28 dense; sent
    1.00x") and the decision rested on two arms of dense steps."""
    from dad_integrations.routing.trial import RouteTrial
    from dad_integrations.routing.router import Route
    from dad_integrations.routing.sharded_trial import ShardedTrial

    pieces = ShardedTrial(DADConfig(mode="auto", rank=4, objective="time", lossless_steps=0,
                                    route_trial_steps=4, route_refresh_steps=100))
    pieces.trial = RouteTrial(4)
    units = [type("Unit", (), {"index": i})() for i in range(3)]
    now = [0.0]
    pieces.clock.clock = lambda: now[0]
    forced, arms = {}, {}
    for step in range(40):
        pieces.forward()
        pieces.open(step)
        forced[step], arms[step] = pieces.dense(step), pieces.arm(step)
        compress = not forced[step]
        for unit in units:
            pieces.note(unit, Route("rank" if compress else "dense", False, 0.01))
        slow = step >= 10  # the link slows: dense steps 10x, the routes' steps less so
        now[0] += (1.0 if compress else 0.1) if not slow else (1.5 if compress else 5.0)
        pieces.end(step, lambda values: list(values))
    first, *rest = pieces.outcomes
    assert not first.kept and first.cause == "refresh"
    assert rest and rest[0].cause == "watch", rest
    watch_routes = [k for k, a in arms.items() if a == "routes" and k > 5]
    assert watch_routes and not any(forced[k] for k in watch_routes), (watch_routes, forced)
    assert rest[0].kept  # the routes, really tried, were faster


def test_sharded_untried_dense_is_watched_and_a_miss_measures_the_link_again():
    """`ShardedTrial` after a refresh whose routes are all dense (no trial): the steps are watched
    against their first interval plus the models' spare seconds; a slower link (every step) makes
    the next step a refresh whose first reduction measures the link again (`ShardedTrial.models`), and
    routes that compress there begin a trial with cause "watch", said as the last decision."""
    from dad_integrations.routing.router import Route
    from dad_integrations.routing.sharded_trial import ShardedTrial
    from dad_integrations.routing.trial import RouteTrial

    pieces = ShardedTrial(DADConfig(mode="auto", rank=4, objective="time", lossless_steps=0,
                                    route_trial_steps=4, route_refresh_steps=1000))
    pieces.trial = RouteTrial(4)
    pieces.timing = _timing("10gbit")
    probed = []
    pieces.probe = lambda aggregator, device, **sizing: probed.append(1) or _timing("20mbit").link
    units = [type("Unit", (), {"index": i})() for i in range(3)]
    now = [0.0]
    pieces.clock.clock = lambda: now[0]
    for step in range(14):
        pieces.forward()
        pieces.open(step)
        assert not pieces.dense(step)
        timing = pieces.models(None, None, step)
        rep = "rank" if timing.link.all_reduce.beta < 1e8 else "dense"  # the models on the link measured
        for unit in units:
            pieces.note(unit, Route(rep, False, 0.0, 0.001 if rep == "dense" else 0.0))
        now[0] += 0.1 if step < 9 else 0.6   # the link slows after step 8
        pieces.end(step, lambda values: list(values))
        assert pieces.refresh(step + 1) == (step + 1 == 13), step  # the miss at the check of step 12
    watch_limit = (0.1 + 0.003) * 1.1
    assert probed == [1] and pieces.trial.active and pieces.trial.cause == "watch" and pieces.trial.start == 13
    assert pieces.decision.endswith(": a new route trial") and f"{watch_limit * 1e3:.1f} ms" in pieces.decision
    assert pieces.dense(15) and pieces.dense(16) and not pieces.dense(14)  # R D D R
