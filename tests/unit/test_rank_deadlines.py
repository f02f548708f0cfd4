"""A replica of k ranks waits for its other ranks as long as their work takes (issue 49, found by a
CI run on busy cores): a rank is a new process (Ray's worker start, torch's import) before it can
join the replica group, so its arrival gets a control call's deadline plus the rendezvous's
(`supervisor.call_timeout_s` + `comm.configure_timeout_s`), not the rendezvous's 30 s alone; a
restarted two-rank replica whose rank took longer never formed its group and restarted in a loop.
Once built, a rank answers within a phase call's deadline (its build, a spare's warm-up)."""

from types import SimpleNamespace

from omegaconf import OmegaConf

from actors import rank_group
from actors.rank_group import RankFanOut, RankOf


def _replica(rank_of=None, *, call_s=60.0, configure_s=30.0, phase_s=300.0):
    cfg = OmegaConf.create(
        {
            "comm": {"configure_timeout_s": configure_s},
            "supervisor": {"call_timeout_s": call_s, "phase_timeout_s": phase_s},
        }
    )
    replica = RankFanOut()
    replica.cfg, replica.rid, replica.incarnation, replica.rank_of = cfg, "c0r1", 2, rank_of
    replica.layout = SimpleNamespace(ranks_per_replica=2)
    replica._rank_actor = lambda rank_of: None
    return replica


def _capture(monkeypatch) -> dict:
    seen = {}

    def start(rid, k, make, arrive_s, deadline_s, incarnation):
        seen["start"] = (arrive_s, deadline_s)
        return SimpleNamespace(deadline_s=deadline_s), RankOf(0, k, "h:1/s", f"replica-group/{rid}/{incarnation}")

    def form(rank, size, store_addr, prefix, timeout_s, **kwargs):
        seen["form"] = (rank, timeout_s, kwargs["op_timeout_s"])
        return "ranks"

    monkeypatch.setattr(rank_group.RankPeers, "start", staticmethod(start))
    monkeypatch.setattr(rank_group, "form_replica_group", form)
    monkeypatch.setattr(rank_group, "replica_group_backend", lambda device: "gloo")
    return seen


def test_rank_zero_gives_its_ranks_a_process_start_plus_the_rendezvous_to_arrive(monkeypatch):
    seen = _capture(monkeypatch)
    assert _replica(call_s=60.0, configure_s=30.0, phase_s=300.0)._form_ranks("cpu") == "ranks"
    assert seen["start"] == (90.0, 300.0), "arrival: call + configure; a built rank's answers: a phase call"
    assert seen["form"] == (0, 90.0, 300.0)


def test_every_other_rank_waits_as_long_for_rank_zero_and_the_rest(monkeypatch):
    seen = _capture(monkeypatch)
    _replica(RankOf(1, 2, "h:1/s", "replica-group/c0r1/2"), call_s=20.0, configure_s=5.0)._form_ranks("cpu")
    assert "start" not in seen, "only rank 0 creates ranks"
    assert seen["form"] == (1, 25.0, 300.0)
