"""The site-change decisions in hsgd/core/site_plan.py, pure (issue 45, Build 1): when a starting site
joins, waits or is abandoned, what a resumed run's queue starts, and that actors/site_changes.py keeps
only the carrying out."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from hsgd.core.site_plan import JoinProgress, SiteLedger, SitePlan
from hsgd.core.site_requests import APPLIED, Decision, SiteRequest, mark_done, write_request
from hsgd.core.topology import Topology


def _starting() -> JoinProgress:
    """c2, two replicas, started at t=100 s."""
    return JoinProgress("r1", 2, Topology(2, 2).with_site(2), started=100.0)


def test_a_starting_site_waits_until_each_replica_is_up_or_lost_then_joins_with_those_up():
    site = _starting()
    site.answered("c2r0", {"round": 0, "step": 0, "phase": "idle"})
    site.answered("c2r1", {"round": 0, "step": 0, "phase": "build"})  # not up yet: not kept
    assert site.verdict(default_floor=1, now=101.0, timeout_s=600.0) == ("wait", "")
    site.lost.add("c2r1")
    assert site.verdict(default_floor=1, now=101.0, timeout_s=600.0) == ("join", "")
    verdict, reason = site.verdict(default_floor=2, now=101.0, timeout_s=600.0)
    assert verdict == "abandon" and "below its floor of 2" in reason and "\n" not in reason


def test_a_replica_dead_for_good_is_started_again_until_the_sites_re_creations_are_spent():
    site = _starting()
    assert site.dead_for_good("c2r1", 2)[0] and site.dead_for_good("c2r1", 2)[0]  # re-creations 1 and 2
    again, line = site.dead_for_good("c2r1", 2)
    assert not again and site.lost == {"c2r1"} and "re-creation(s) are spent" in line


def test_a_site_not_up_by_the_join_deadline_is_abandoned_even_with_some_replicas_up():
    site = _starting()
    site.answered("c2r0", {"round": 0, "step": 0, "phase": "idle"})
    assert site.verdict(default_floor=1, now=699.9, timeout_s=600.0) == ("wait", "")
    verdict, reason = site.verdict(default_floor=1, now=700.0, timeout_s=600.0)
    assert verdict == "abandon" and "supervisor.join_timeout_s=600" in reason and "1 of 2" in reason


def test_a_resumed_runs_queue_starts_in_order_widens_by_a_drained_site_and_strands_past_a_gap(tmp_path):
    for cluster, now in ((2, 1.0), (3, 2.0), (4, 3.0)):
        request = write_request(tmp_path, "add-site", replicas=1, now=now)
        mark_done(tmp_path, request, Decision(APPLIED, "", cluster), cluster)
    drain = write_request(tmp_path, "drain", "c2", now=9.0)
    mark_done(tmp_path, drain, Decision(APPLIED, "", 2), 8)
    supervisor = SimpleNamespace(min_clusters=1, min_replicas_per_cluster=1)
    plan = SitePlan.read(tmp_path, "run2", Topology(2, 2), supervisor)
    what, record = plan.next_queued()
    assert (what, record.cluster, plan.topology.clusters) == ("widen", 2, 3)  # drained: its index kept, not started
    what, record = plan.next_queued()
    assert (what, record.cluster) == ("start", 3)
    plan.joining = JoinProgress(record.id, 3, plan.topology.with_site(1))
    assert plan.next_queued() is None  # one site starts at a time
    plan.joining = None  # c3 abandoned: c4 can no longer take its index
    what, record = plan.next_queued()
    assert (what, record.cluster, [d.site for d in plan.stranded]) == ("strand", 4, ["c4"])
    add = SiteRequest(id="x", kind="add-site", cluster="", t=0.0, replicas=1)
    decision = plan.decide(add, live={}, resources=lambda: ([], {}, {}), strategy="STRICT_PACK")
    assert decision.outcome == "refused" and "could never start" in decision.reason
    # a resume too small for c2: every added site stranded, said in one line
    assert SiteLedger.read(tmp_path, "run2").stranded_notice(1).startswith("train.resume: added site(s) c3, c4")


def test_the_site_changes_actor_keeps_only_the_carrying_out():
    path = Path(__file__).resolve().parents[2] / "actors" / "site_changes.py"
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= 350, (
        f"actors/site_changes.py has {lines} lines (cap 350): decisions belong in hsgd/core/site_plan.py"
    )
