"""A replica's state in and out: heals (a source's `global_state`/`heal_state` through the object
store, `send_state`/`receive_state` over a heal group of their own, a target's `load_state`;
actors/heals.py issues them) and checkpoints (`save_checkpoint`, `save_model`, `load_checkpoint`,
`reach_checkpoints`; actors/checkpointing.py and actors/startup.py call them). Mixed into
actors/replica.py's Replica: each is a phase (or control) call of it, answering as its phases do.
"""

from __future__ import annotations

import os
import socket
import time

import ray

from actors.rank_group import rank_prefix
from hsgd.core.faults import FaultSpec
from hsgd.core.phases import Phase
from hsgd.core.round import GroupJoin, Outcome, PhaseAnswer
from hsgd.train import checkpoint, dcp_checkpoint, sharding, state_stream
from hsgd.train.comm import LevelGroup
from hsgd.train.trainer import Behind, param_digest


class StateCalls:
    """Replica's heal and checkpoint calls (the module's docstring)."""

    @ray.method(concurrency_group="control", num_returns=2)
    def global_state(self) -> tuple[PhaseAnswer, dict | None]:
        """(meta, state) for a `global` heal; answers while the donor's inner phase runs (outer_commit changes it)."""
        return self._with_ranks("global_state", self._with_meta(self.trainer.global_state()))

    def _with_meta(self, state: dict) -> tuple[PhaseAnswer, dict]:
        """A heal source's two objects: a small meta, at the state's own (round, step), and the state."""
        return PhaseAnswer(
            self.rid,
            Outcome.DONE,
            int(state["round"]),
            int(state["step"]),
            result={"pid": os.getpid(), "bytes": _state_bytes(state)},
        ), state

    @ray.method(concurrency_group="phase")
    def load_state(self, state: dict | None, scope: str, faults: list[FaultSpec] | None = None) -> PhaseAnswer:
        """Become the source (`full`) or take its global state (`global`) from `state`, the second
        object of the source's answer. Answers `done` with `bytes`, or `collective_failed`, untouched,
        when the source refused (`state` None). A source that died or raised fails this call."""
        own = state["ranks"][0] if self.peers is not None and state is not None else state

        def run():
            if state is None:  # this replica is fine: its heal is to be planned again
                return {
                    "outcome": Outcome.COLLECTIVE_FAILED,
                    "error": f"{self.rid}: its heal source refused to give its state",
                }
            self._load(own, scope)
            return {"bytes": _state_bytes(own)}  # (k > 1: each rank counts its own; the answers add up)

        # k > 1: a source's state is {"ranks": [rank 0's, ...]} (heal_state, global_state); rank j loads its own
        refs = self._fan_out("load_state", lambda j: (None if state is None else state["ranks"][j], scope))
        return self._merged(self._phase(Phase.HEAL, run, faults, hook_round=self.trainer.round), refs)

    @ray.method(concurrency_group="phase")
    def send_state(
        self, round_index: int, join: GroupJoin, chunk_mb: float, faults: list[FaultSpec] | None = None
    ) -> PhaseAnswer:
        """A `full` heal's source (faults as of `round_index`): join heal group `join` as rank 0 and
        stream its state to every target (hsgd.train.state_stream). Answers `done` with `bytes`, or
        `collective_failed` (a target never joined, a peer died, a chunk timed out): the supervisor
        then heals the targets through the object store."""
        refs = self._fan_out("send_state", lambda j: (round_index, rank_prefix(join, j), chunk_mb))
        return self._merged(
            self._over_heal_group(
                round_index,
                join,
                faults,
                lambda group: {
                    "bytes": state_stream.send_state(
                        group, self.trainer.live_state(), chunk_mb=chunk_mb, device=self.trainer.device
                    ),
                    "pid": os.getpid(),
                },
            ),
            refs,
        )

    @ray.method(concurrency_group="phase")
    def receive_state(self, round_index: int, join: GroupJoin, faults: list[FaultSpec] | None = None) -> PhaseAnswer:
        """A heal target (faults as of `round_index`): join heal group `join` (rank >= 1), receive the
        source's whole state, load it `full`. Answers `done` (`bytes`, `transport: group`), or
        `collective_failed` with its state untouched (nothing loads before the last chunk)."""

        def transfer(group: LevelGroup) -> dict:
            state, nbytes = state_stream.receive_state(group, device=self.trainer.device)
            return {"bytes": nbytes, "transport": "group", "state": state}

        refs = self._fan_out("receive_state", lambda j: (round_index, rank_prefix(join, j)))
        return self._merged(self._over_heal_group(round_index, join, faults, transfer), refs)

    def _over_heal_group(
        self, round_index: int, join: GroupJoin, faults: list[FaultSpec] | None, transfer
    ) -> PhaseAnswer:
        """A `heal` phase in its own group (never the standing one), dropped after; answers `transfer(group)`,
        timed. A received `state` is loaded after the group is dropped: the load may wait out an outer reduce."""

        def run():
            group = self._level_group("inner")

            def over_group():  # (k > 1: every rank of the replica fails its part, or none does)
                join_s = self._join(group, join, Phase.HEAL)
                t0 = time.monotonic()
                return join_s, t0, transfer(group)

            try:
                join_s, t0, answer = sharding.agreed(over_group, self.trainer.ranks, f"{self.rid}: heal transfer")
            finally:
                group.abort()
            if "state" in answer:
                self._load(answer.pop("state"), "full")
            return {**answer, "join_s": join_s, "transfer_s": time.monotonic() - t0}

        return self._phase(Phase.HEAL, run, faults, hook_round=round_index)

    @ray.method(concurrency_group="phase", num_returns=2)
    def heal_state(self, expect: tuple[int, int] | None) -> tuple[PhaseAnswer, dict | None]:
        """(meta, state): a group heal's object-store fallback, only while this replica holds `expect`
        = (round, step), as when chosen as source; else meta `collective_failed`, state None: a source
        restarted meanwhile (Ray runs a queued call on the new process) never hands out fresh state."""
        if expect is not None and (self.trainer.round, self.trainer.step) != tuple(expect):
            return self._answer(
                Outcome.COLLECTIVE_FAILED,
                f"{self.rid}: heal source holds round {self.trainer.round} step {self.trainer.step}, "
                f"not round {expect[0]} step {expect[1]} (restarted since it was chosen)",
                pid=os.getpid(),
                bytes=0,
            ), None
        return self._with_ranks("heal_state", self._with_meta(self.trainer.state_dict()), expect)

    @ray.method(concurrency_group="phase")
    def save_checkpoint(self, directory: str, round_index: int, faults: list[FaultSpec] | None = None) -> dict:
        """Its part of the checkpoint of round `round_index`: its `<rid>.pt` file (one rank), or k > 1 its
        `<rid>/` folder, one DCP checkpoint written by every rank of it (hsgd.train.dcp_checkpoint; the
        sha256 answered is that of its manifest.json). `behind` unless it holds exactly that round. A
        write storage refuses (full disk, quota, read-only remount: any exception type) answers
        `io_error`, never raises: the run's problem. Taking the state may still raise."""

        def run():
            if self.trainer.round != round_index:
                raise Behind(
                    f"{self.rid}: checkpoint of round {round_index}, but this replica holds round {self.trainer.round}"
                )
            ranks = self.trainer.ranks
            state = self.trainer.state_dict() if ranks is None else self.trainer.sharded_state()
            # what a load of it must give back (the manifest's `param_digests`); k > 1: rank 0 combines its
            # ranks' through Ray, as `digests` does (no collective: a rank's failure must not hang the others)
            if not self.rank:
                digest = {"param_digest": param_digest(state["params"]) if ranks is None else self.digests()["param"]}
            else:
                digest = {}
            try:
                if ranks is None:
                    return {"sha256": checkpoint.save_replica_state(directory, self.rid, state), **digest}
                dcp_checkpoint.save_sharded(
                    state,
                    checkpoint.join_url(directory, self.rid),
                    group=ranks.group,
                    manifest_extra={"round": round_index, "rid": self.rid},
                    timeout_s=float(self.cfg.supervisor.phase_timeout_s),
                )
                return {
                    "sha256": checkpoint.sharded_replica_sha256(directory, self.rid) if not self.rank else "",
                    **digest,
                }
            except Exception as err:  # noqa: BLE001 — storage's failure, see above
                return {
                    "outcome": Outcome.IO_ERROR,
                    "error": f"{self.rid} writing {directory}: {type(err).__name__}: {err}",
                }

        # k > 1: every rank writes its shards (its faults are rank 0's alone)
        refs = self._fan_out("save_checkpoint", lambda j: (directory, round_index))
        # its faults are those of the checkpoint taken after round round_index - 1; answered as a wire
        # dict, as actors/checkpointing.py reads it (load_checkpoint's too, for actors/startup.py)
        return self._merged(self._phase(Phase.CHECKPOINT, run, faults, hook_round=round_index - 1), refs).wire()

    @ray.method(concurrency_group="phase")
    def save_model(self, path: str) -> dict:
        """The committed global model to `path` (model.safetensors); OSError when storage refuses: the run's problem."""
        refs = self._fan_out("save_model", lambda j: (path,))  # (every rank gathers the whole tensors)
        saved = {"rid": self.rid, **self.trainer.save_model(path)}
        self._ranks_done(refs)
        return saved

    @ray.method(concurrency_group="phase")
    def load_checkpoint(
        self,
        directory: str,
        sha256: str | None,
        faults: list[FaultSpec] | None = None,
        fmt: str = checkpoint.FILE_FORMAT,
    ) -> dict:
        """Load a checkpoint the caller verified (resume, restore), after its `startup` faults; `fmt` is
        its format (checkpoint.format_of). "file": its `<rid>.pt` (k > 1: each rank cuts its own shards
        out of the whole tensors, ReplicaTrainer.rank_slice). "dcp": its `<rid>/` folder, checked
        against `sha256` and every file against its manifest, then loaded by DCP on every rank,
        resharded to this replica's k (k=1: a world of one). Raises CheckpointError (this replica's
        failure) naming it and its node: a file unreadable or unfit; its state is then untouched."""
        self._fire_startup(faults)
        refs = self._fan_out("load_checkpoint", lambda j: (directory, sha256, None, fmt))
        try:
            if fmt == checkpoint.DCP_FORMAT:
                self._load_sharded(directory, sha256)
            else:
                state = checkpoint.load_replica_state(directory, self.rid, sha256)
                self._load(self.trainer.rank_slice(state), "full")
        except Exception as err:  # noqa: BLE001 — read, sha, unpickling and shape errors alike
            raise checkpoint.CheckpointError(
                f"replica {self.rid} on node {_node_name()} cannot load {directory}: {type(err).__name__}: {err}"
            ) from err
        return self._merged(self._answer(), refs).wire()

    def _load_sharded(self, directory: str, sha256: str | None) -> None:
        """Its DCP folder of a "dcp" checkpoint into this trainer: verified (its manifest against
        `sha256` here; every file by dcp_checkpoint on every rank together), loaded into a template
        (the trainer untouched until DCP read every byte), then applied."""
        ranks = self.trainer.ranks
        # the run manifest's hash of its manifest, on every rank (so all refuse together, none waits in DCP)
        _check_sha(checkpoint.sharded_replica_sha256(directory, self.rid), sha256, directory, self.rid)
        self._settle()  # a background reduce reads the state being replaced
        target = self.trainer.sharded_template()
        dcp_checkpoint.load_sharded(
            target,
            checkpoint.join_url(directory, self.rid),
            group=None if ranks is None else ranks.group,
            timeout_s=float(self.cfg.supervisor.phase_timeout_s),
        )
        self.trainer.load_sharded_state(target)

    @ray.method(concurrency_group="control")
    def reach_checkpoints(self, url: str, nonce: str, faults: list[FaultSpec] | None = None) -> dict:
        """At start: can this replica read the nonce the driver wrote under checkpoint.dir?
        {"rid", "node", "problem": None or why not}. `faults`: its `startup` faults."""
        self._fire_startup(faults)
        return {"rid": self.rid, "node": _node_name(), "problem": checkpoint.read_reach_nonce(url, nonce)}


def _check_sha(actual: str, expected: str | None, directory: str, rid: str) -> None:
    if expected and actual != expected:
        raise checkpoint.CheckpointError(
            f"checkpoint file {checkpoint.join_url(directory, rid)}/manifest.json "
            f"does not match the run manifest's sha256 (corrupt or replaced)"
        )


def _state_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state_stream.split_state(state)[1])


def _node_name() -> str:
    """This node as a person finds it: host name, IP address and Ray node id (short)."""
    return f"{socket.gethostname()} ({ray.util.get_node_ip_address()}, {ray.get_runtime_context().get_node_id()[:8]})"
