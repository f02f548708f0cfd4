"""The supervisor's roster (actors/roster.py `Roster`) without Ray, for the tests of what reads and
changes it: the restore and the checkpoint writes (actors/checkpointing.py), quarantine
(actors/quarantine.py), site changes (actors/site_changes.py) and the round runner's death log
(actors/round_runner.py). One fake for all of them, configured by keywords, recording every call."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from types import SimpleNamespace

from hsgd.core.topology import Topology

GLOO = {"inner": "gloo", "outer": "gloo"}


class FakeSpares:
    """SparePool's surface the site changes touch: `names` (cluster as str -> spare names), each
    spare's handle (None: no actor) and which are ready (all, at first); false without a spare."""

    def __init__(self, names: dict[str, list[str]]):
        self.names = names
        self.handles: dict[str, object] = {n: None for group in names.values() for n in group}
        self.ready: set[str] = set(self.handles)

    def __bool__(self) -> bool:
        return any(self.names.values())


class FakeRoster:
    """Roster's surface: its attributes (`topology`, `names`, `handles`, `live`, `gone`,
    `replica_info`, `spares`, `watch`, `drained_clusters`, `configured`, `outer_configured`,
    `on_death`) and the methods `admit`, `set_aside`, `replace`, `down`, `down_after`, `died`,
    `rejoin`, `plan`, `probe`, `promote_spare`, with the real names and signatures.

    Keywords: `names` (rid -> actor name; the dict itself is kept, as Roster keeps the durable
    identity map; default `hsgd:run-1:<rid>`), `handles` (default None each: no actor), `live` (the
    rids live, default all, each at `at` = (round, step)), `nodes` (the node id of cluster c's
    replicas is nodes[c], backends gloo: their `replica_info`; clusters past it never answered up),
    `spares` (cluster as str -> spare names, all ready), `answers` (rid -> what `probe` answers;
    default None: no answer) and `calls`, a list to share with the test's other fakes.

    Records: `calls` gets (method name, its first argument) for every method call, in order (a
    `down_after` is the `down` it makes, as in Roster); `aside` (rids set aside), `downed`,
    `promoted` (rids a spare was asked to take over), `replaced` ((rid, new actor name)) and
    `given_up` (actor names `watch.given_up` was told) keep one kind each, in order. `set_aside`,
    `replace` and `down` change `live` and `gone` as Roster does; `died` calls `on_death` and answers
    True (logged); `promote_spare` answers None (no spare took over); `plan` answers None."""

    def __init__(
        self,
        topology: Topology,
        *,
        names: dict[str, str] | None = None,
        handles: dict | None = None,
        live: Iterable[str] | None = None,
        at: tuple[int, int] = (0, 0),
        nodes: Sequence[str] = (),
        spares: dict[str, list[str]] | None = None,
        answers: Callable[[str], dict | None] = lambda rid: None,
        calls: list | None = None,
    ):
        rids = topology.replica_ids()
        self.topology = topology
        self.names = {rid: f"hsgd:run-1:{rid}" for rid in rids} if names is None else names
        self.handles = dict.fromkeys(self.names) if handles is None else handles
        self.live: dict[str, tuple[int, int]] = dict.fromkeys(rids if live is None else live, at)
        self.gone: set[str] = set()
        self.replica_info = {
            rid: {"node_id": nodes[topology.cluster_of(rid)], "backends": dict(GLOO)}
            for rid in rids
            if topology.cluster_of(rid) < len(nodes)
        }
        self.spares = FakeSpares(spares or {})
        self.given_up: list[str] = []
        self.watch = SimpleNamespace(given_up=self.given_up.append)
        self.drained_clusters: set[int] = set()
        self.configured: dict[int, tuple] = {}
        self.outer_configured = None
        self.param_bytes = 0
        self.on_death: Callable[[str], None] = lambda rid: None
        self.answers = answers
        self.calls = [] if calls is None else calls
        self.aside: list[str] = []
        self.downed: list[str] = []
        self.promoted: list[str] = []
        self.replaced: list[tuple[str, str]] = []

    def admit(self, rid: str, answer: dict) -> None:
        self.calls.append(("admit", rid))
        self.live[rid] = (int(answer["round"]), int(answer["step"]))

    def set_aside(self, rid: str) -> None:
        self.calls.append(("set_aside", rid))
        self.aside.append(rid)
        self.gone.add(rid)
        self.live.pop(rid, None)

    def replace(self, rid: str, name: str, handle) -> None:
        self.calls.append(("replace", rid))
        self.replaced.append((rid, name))
        self.names[rid], self.handles[rid] = name, handle
        self.gone.discard(rid)
        self.live.pop(rid, None)

    def down(self, rid: str, cause: str, phase: str, round_index: int, detail: str = "") -> None:
        self.calls.append(("down", rid))
        self.downed.append(rid)
        self.live.pop(rid, None)

    def down_after(self, rid: str, err: BaseException, phase: str, round_index: int) -> None:
        self.down(rid, "error", phase, round_index, str(err))

    def died(self, rid: str, cause: str, phase: str | None, round_index: int, detail: str = "") -> bool:
        self.calls.append(("died", rid))
        self.on_death(rid)
        return True

    def rejoin(self, wait_s: float) -> None:
        self.calls.append(("rejoin", wait_s))

    def plan(self, epoch: int):
        self.calls.append(("plan", epoch))
        return None

    def probe(self, rid: str, timeout_s: float) -> dict | None:
        self.calls.append(("probe", rid))
        return self.answers(rid)

    def promote_spare(self, rid: str, wait_s: float = 0.0) -> dict | None:
        self.calls.append(("promote_spare", rid))
        self.promoted.append(rid)
        return None
