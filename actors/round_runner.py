"""Carrying out one round machine's actions for the supervisor: issue the Ray calls of each action,
turn answers (or Ray's errors) into PhaseResults, ask replicas in an inner phase for their step
every tick, ask replicas that are down whether they are back (rejoin `fast`), kill whom the machine
finds hung (after a hang report with every stack of its group), hand a dead replica's identity to a
hot spare. Keeps the round's numbers (losses, tokens, bytes, seconds) for metrics.jsonl.

It decides nothing: every decision is hsgd.core.round.RoundMachine's.
"""
from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError

from actors.hang import dump_replica
from hsgd.core.round import Action, Outcome, PhaseResult, RoundMachine, forms_group
from hsgd.record.hangs import hang_report, stuck_function
from hsgd.train import state_stream

TICK_S = 0.5  # how often the machine's clock ticks and in-flight replicas are asked for progress
IDLE_POLL_S = 2.0  # how often live replicas with no call in flight are asked whether they still run
STATUS_MIN_S = 0.1  # status.json is rewritten at most this often (it is O(replicas) to build)


class RoundRunner:
    """`sup` is the Supervisor actor's instance (its handles, log, injector, durable state).
    Carries out one round machine's actions: issues calls, collects answers, polls progress,
    ticks. Keeps the round's numbers (losses, tokens, bytes, seconds) for metrics.jsonl."""

    def __init__(self, sup, machine: RoundMachine | None, round_index: int):
        self.sup, self.machine, self.r = sup, machine, round_index
        self.refs: dict[Any, tuple[int, str, str]] = {}  # ref -> (action id, rid, kind)
        self.actions: dict[int, tuple[Action, float, set]] = {}  # id -> (action, started, pending)
        self.outcomes: dict[int, dict[str, str]] = {}
        self.progress_refs: dict[Any, tuple[str, float]] = {}
        self.up_refs: dict[Any, str] = {}  # progress probes of replicas that are down (fast rejoin)
        # progress probes of live replicas with no call in flight -> (rid, the pid known when asked)
        self.idle_refs: dict[Any, tuple[str, int | None]] = {}
        self.last_idle_poll = 0.0
        self.losses: dict[str, list[float]] = {}
        self.tokens = self.inner_bytes = self.outer_bytes = self.attempted_steps = 0
        self.seconds = {"inner": 0.0, "inner_sync": 0.0, "outer": 0.0, "outer_commit": 0.0, "heal_configure": 0.0}
        self.inner_participants: set[str] = set()
        self.commit_digests: dict[str, str] = {}
        self.global_digests: dict[str, str] = {}
        self.attempts = 1
        self.inner_started = None
        self.heal_sizes: dict[str, int] = {}
        self.heal_states: dict[tuple[int, str], Any] = {}  # (heal action, source) -> its state's object ref
        self.state_refs: dict[Any, tuple[int, str]] = {}  # the same, pending: watched so a dead source is seen
        # `full` heals over the process group: (heal action, source) -> the (round, step) it was chosen
        # holding (its object-store fallback checks it); target refs -> (action id, target, source)
        self.group_heals: dict[tuple[int, str], tuple[int, int] | None] = {}
        self.group_refs: dict[Any, tuple[int, str, str]] = {}
        self.heal_transports: dict[str, str] = {}  # target -> group | object_store
        self._heal_prefix: dict[tuple[int, str], str] = {}  # (heal action, source) -> its group's prefix
        self.logged_down: set[str] = set()  # replica_down logged this round
        self.steps_run: dict[int, int] = {}  # run_inner action id -> steps its members ran
        self.join_s: dict[int, float] = {}  # action id -> the longest its members took to form their group
        self.non_finite_what: dict[str, str] = {}  # rid -> what its non_finite answer named (loss | grad_norm | ...)
        self.logged_void: set[int] = set()  # clusters whose void round (non_finite) is logged
        self.logged_benched: set[int] = set()

    def drive(self) -> None:
        m, sup = self.machine, self.sup
        self._carry_out(m.start(time.monotonic()))
        last_poll = last_status = 0.0
        stale = True  # the view changed since status.json was last written
        while not m.done:
            waiting = list(self.refs) + list(self.progress_refs) + list(self.up_refs) + list(self.state_refs) \
                + list(self.idle_refs)
            ready = ray.wait(waiting, num_returns=1, timeout=TICK_S)[0] if waiting else time.sleep(TICK_S) or []
            if ready and len(waiting) > 1:  # and every other answer already in: the machine takes them at once
                ready = ray.wait(waiting, num_returns=len(waiting), timeout=0)[0]
            answers = []
            for ref in ready:
                if ref in self.state_refs:
                    self._state_answer(ref)
                elif ref in self.progress_refs:
                    self._progress_answer(ref)
                elif ref in self.up_refs:
                    self._up_answer(ref)
                elif ref in self.idle_refs:
                    self._idle_answer(ref)
                elif ref in self.group_refs:  # a heal over the group: its answer, or a fallback issued
                    if (answer := self._group_heal_answer(ref)) is not None:
                        answers.append(answer)
                else:
                    answers.append(self._answer(ref))
            moved = False
            if answers:
                actions = m.on_results(answers, time.monotonic())
                moved = bool(actions)
                self._carry_out(actions)
            now = time.monotonic()
            if now - last_poll >= TICK_S:
                last_poll = now
                self._poll_progress()
                self._probe_down()
                if now - self.last_idle_poll >= IDLE_POLL_S:
                    self.last_idle_poll = now
                    self._watch_idle()
                if sup.roster.spares:
                    sup.roster.spares.check(sup.log)
                self._carry_out(m.on_tick(now))
                moved = True
            self._log_deaths()
            self._log_non_finite(final=False)
            stale = stale or moved  # a change inside the throttle window is written on a later pass, not dropped
            if stale and now - last_status >= STATUS_MIN_S:
                last_status, stale = now, False
                sup._set_status(epoch=m.epoch, **_view(m))
        self._log_deaths()
        self._log_non_finite(final=True)
        for c in m.void:  # a void cluster's work is not the round's: its steps were not committed
            for rid in sup.topology.cluster_members(c):
                self.inner_participants.discard(rid)
                self.losses.pop(rid, None)
        sup._set_status(epoch=m.epoch, **_view(m))  # the round's final view, before its commit is logged
        sup.roster.live = dict(m.progress)

    # -- issuing -----------------------------------------------------------------------------------------
    def _carry_out(self, actions: list[Action]) -> None:
        sup = self.sup
        for a in actions:
            if a.kind == "kill":
                self._kill(a)
                continue
            if a.kind == "reap":
                # not killed: its process is gone and Ray is restarting it already — a kill now
                # could hit the new process and cost a second restart
                (rid, _), = a.calls.items()
                sup.log.event("presumed_dead", rid=rid, reason=a.reason)
                self._forget(rid)
                continue
            if a.kind == "yield":
                sup.log.event("yield_requested", cluster=a.cluster, round=self.r, reason=a.reason,
                              at_step=next(iter(a.calls.values()))[2], replicas=sorted(a.calls))
                for rid, (epoch, round_index, at) in a.calls.items():
                    sup.roster.handles[rid].request_yield.remote(epoch, round_index, at)  # control channel, no wait
                continue
            if a.kind == "outer_reduce":
                sup.injector.supervisor_faults(self.r, "outer")
            if a.kind == "outer_commit":
                sup.log.event("commit_decision", round=self.r, clusters=sorted({sup.topology.cluster_of(x) for x in a.calls}))
                sup.injector.supervisor_faults(self.r, "outer_commit")
            phase = {"run_inner": "inner", "cluster_average": "inner_sync", "outer_reduce": "outer",
                     "outer_commit": "outer_commit", "heal": "heal"}.get(a.kind)
            involved = set(a.calls) | ({src for src, _ in a.calls.values()} if a.kind == "heal" else set())
            phases = _FAULT_PHASES.get(a.kind, ())
            armed = sup.injector.arm(self.r, phases, self.machine.plan(), only=involved, handles=sup.roster.handles) \
                if phase and sup.injector.pending(self.r, phases) else {}
            self.actions[a.id] = (a, time.monotonic(), set(a.calls))
            sup.log.event("phase_begin", phase=_PHASE_NAME.get(a.kind, a.kind), round=self.r, cluster=a.cluster,
                          epoch=a.epoch, replicas=sorted(a.calls), reason=a.reason or None)
            forms = forms_group(a)
            if forms:
                self._membership_event(a)
                if a.epoch > sup.durable["epoch"]:  # before the groups exist: a successor never reuses an epoch
                    sup.durable["epoch"] = a.epoch
                    sup._save_durable()
            if forms and a.kind == "run_inner" and a.reason and a.reason != "round start":
                sup.log.event("cluster_reform", cluster=a.cluster, round=self.r, epoch=a.epoch,
                              members=sorted(a.calls), reason=a.reason)
            if a.kind == "run_inner" and self.inner_started is None:
                self.inner_started = time.monotonic()
            for rid, args in a.calls.items():
                ref = self._issue(a, rid, args, armed)
                self.refs[ref] = (a.id, rid, a.kind)

    def _issue(self, a: Action, rid: str, args: tuple, armed: dict):
        h, sup = self.sup.roster.handles[rid], self.sup
        faults = armed.get(rid)
        if a.kind == "heal":
            source, scope = args
            if scope == "full":
                return self._issue_group_heal(a, rid, source, faults, armed)
            key = (a.id, source)  # one state per source and heal, however many targets it heals
            if key not in self.heal_states:
                self.heal_states[key] = (sup.roster.handles[source].get_state.remote(armed.get(source)) if scope == "full"
                                         else sup.roster.handles[source].global_state.remote())
                self.state_refs[self.heal_states[key]] = key
            state = self.heal_states[key]
            sup.log.event("heal_begin", target=rid, source=source, scope=scope)
            return h.load_state.remote(state, scope, faults)
        # (prefix, rank, world_size): the call forms its level's group first
        join = (a.epoch, sup.store_addr, f"{sup.run_id}/{args[0]}", args[1], args[2]) if args and a.kind != "outer_commit" \
            else None
        if a.kind == "run_inner":
            self.inner_participants.add(rid)
            return h.run_inner.remote(a.round, faults, join)
        if a.kind == "cluster_average":
            return h.cluster_average.remote(a.round, a.epoch, faults)
        if a.kind == "outer_reduce":
            return h.outer_reduce.remote(a.round, a.epoch, faults, join)
        if a.kind == "outer_commit":
            return h.outer_commit.remote(a.round, args[0], faults)
        raise ValueError(f"unknown action {a.kind}")

    def heal_now(self, action: Action) -> None:
        """A heal outside a round (the final heal): issue and wait for it."""
        self.actions[action.id] = (action, time.monotonic(), set(action.calls))
        refs = {rid: self._issue(action, rid, args, {}) for rid, args in action.calls.items()}
        timeout = self.sup.cfg.supervisor.call_timeout_s
        for rid, ref in refs.items():
            self.refs[ref] = (action.id, rid, "heal")
            if ref in self.group_refs:
                ref = self._group_heal_outcome(ref, timeout)
            self._answer(ref, timeout=timeout)

    # -- heals over the process group ------------------------------------------------------------
    def _issue_group_heal(self, a: Action, rid: str, source: str, faults, armed: dict):
        """A `full` heal streams the source's state over a group of the source (rank 0) and every
        target it heals in this action (hsgd.train.state_stream): one send_state on the source,
        one receive_state per target, under a fresh prefix naming the run, the epoch and the heal
        (the store address carries the run's secret). The source's call is watched like a
        get_state: its death is the source's loss."""
        sup = self.sup
        key = (a.id, source)
        targets = sorted(t for t, (s, scope) in a.calls.items() if s == source and scope == "full")
        world = 1 + len(targets)
        if key not in self.group_heals:  # the first target issued: the group's prefix and the source's call
            prefix = self._heal_prefix[key] = f"{sup.run_id}/epoch{a.epoch}/heal/r{self.r}/{source}/{secrets.token_hex(4)}"
            live = self.machine.progress if self.machine is not None else sup.roster.live
            self.group_heals[key] = live.get(source)
            send = sup.roster.handles[source].send_state.remote(a.round, (a.epoch, sup.store_addr, prefix, 0, world),
                                                                state_stream.CHUNK_MB, armed.get(source))
            self.state_refs[send] = key
        prefix = self._heal_prefix[key]
        sup.log.event("heal_begin", target=rid, source=source, scope="full")
        ref = sup.roster.handles[rid].receive_state.remote(
            a.round, (a.epoch, sup.store_addr, prefix, 1 + targets.index(rid), world), faults)
        self.group_refs[ref] = (a.id, rid, source)
        return ref

    def _group_heal_answer(self, ref) -> PhaseResult | None:
        """A target's heal over the group answered: the heal's answer, or None when it failed and
        the same target is healed again through the object store (the machine waits on that)."""
        after = self._group_heal_outcome(ref, 1.0)
        return self._answer(after) if after is ref else None

    def _group_heal_outcome(self, ref, timeout: float):
        """`collective_failed` (the group did not form, a peer died, a chunk timed out, a bad
        stream): heal this target once more, through the object store, within the same action —
        from the source's `heal_state`, which refuses if the source is no longer the process it
        was chosen as. Returns the ref whose answer is the heal's (the fallback's, or `ref` itself:
        done, or the target died or raised)."""
        action_id, rid, source = self.group_refs.pop(ref)
        try:
            value = ray.get(ref, timeout=timeout)
        except Exception:  # noqa: BLE001 — the target died or raised: _answer classifies it
            return ref
        if value.get("outcome") != Outcome.COLLECTIVE_FAILED.value or action_id not in self.actions \
                or rid not in self.actions[action_id][2]:
            return ref
        sup, key = self.sup, (action_id, source)
        self.refs.pop(ref, None)
        sup.log.event("heal_fallback", target=rid, source=source, round=self.r,
                      detail=str(value.get("error", ""))[:300])
        if key not in self.heal_states:
            self.heal_states[key] = sup.roster.handles[source].heal_state.remote(self.group_heals.get(key))
            self.state_refs[self.heal_states[key]] = key
        fallback = sup.roster.handles[rid].load_state.remote(self.heal_states[key], "full", None)
        self.refs[fallback] = (action_id, rid, "heal")
        return fallback

    # -- answers -----------------------------------------------------------------------------------------
    def _answer(self, ref, timeout: float = 5.0) -> PhaseResult:
        action_id, rid, kind = self.refs.pop(ref)
        sup = self.sup
        try:
            value = ray.get(ref, timeout=timeout)
            outcome = Outcome(value.get("outcome", "done"))
            detail = value.get("error", "")
        except GetTimeoutError:
            value, outcome, detail = {}, Outcome.COLLECTIVE_FAILED, "answer not fetched in time"
        except Exception as err:  # noqa: BLE001 — classified below
            value, detail = {}, f"{type(err).__name__}: {str(err)[-300:]}"
            if kind == "heal" and self._source_failed(action_id, rid):
                outcome = Outcome.COLLECTIVE_FAILED  # its heal source failed, not this target
            elif isinstance(err, (ActorDiedError, ActorUnavailableError, RayActorError)):
                outcome, detail = Outcome.DIED, type(err).__name__
            else:  # the replica raised (OOM, I/O, a bug): its own failure, never the job's
                outcome = Outcome.ERROR
                try:
                    ray.kill(sup.roster.handles[rid], no_restart=False)  # restart it clean
                except Exception:  # noqa: BLE001
                    pass
        self._account(action_id, kind, rid, value, outcome)
        if action_id in self.actions and rid in self.actions[action_id][2]:
            action, started, pending = self.actions[action_id]
            pending.discard(rid)
            self.outcomes.setdefault(action_id, {})[rid] = outcome.value if outcome in (Outcome.DONE, Outcome.YIELDED) \
                else f"{outcome.value}: {detail[:200]}"
            if outcome == Outcome.NON_FINITE:
                self.non_finite_what.setdefault(rid, str(value.get("what", "")))  # logged once per cluster
            elif outcome not in (Outcome.DONE, Outcome.DIED, Outcome.YIELDED):
                sup.log.event("collective_failed" if outcome == Outcome.COLLECTIVE_FAILED else "replica_error",
                              rid=rid, phase=_PHASE_NAME.get(kind, kind), round=self.r, cluster=action.cluster,
                              outcome=outcome.value, detail=detail[:300])
            if not pending:
                self._phase_end(action, started)
        return PhaseResult(action_id, rid, outcome, int(value.get("round", -1)), int(value.get("step", -1)), detail)

    def _state_answer(self, ref) -> None:
        """A heal source's state arrived (its targets are now the ones to watch), or the source
        failed: then it is lost, and its targets' calls fail through no fault of their own."""
        action_id, source = self.state_refs.pop(ref)
        try:
            value = ray.get(ref, timeout=1.0)
        except Exception as err:  # noqa: BLE001 — the source died or raised while giving its state
            self.sup.log.event("heal_source_lost", source=source, round=self.r, detail=type(err).__name__)
            self._carry_out(self.machine.on_lost(source, time.monotonic(), "died"))
            return
        if value.get("outcome") == Outcome.COLLECTIVE_FAILED.value:
            return  # its heal over the group broke: its targets fall back to the object store
        self.machine.on_heal_state(action_id, source, time.monotonic())

    def _source_failed(self, action_id: int, target: str) -> bool:
        action = self.actions.get(action_id, (None,))[0]
        if action is None or action.kind != "heal":
            return False
        ref = self.heal_states.get((action_id, action.calls[target][0]))
        if ref is None or not ray.wait([ref], timeout=0)[0]:
            return False
        try:
            ray.get(ref, timeout=1.0)
            return False
        except Exception:  # noqa: BLE001
            return True

    def _account(self, action_id: int, kind: str, rid: str, value: dict, outcome: Outcome) -> None:
        if value.get("join_s"):
            self.join_s[action_id] = max(self.join_s.get(action_id, 0.0), value["join_s"])
        if kind == "run_inner" and "report" in value:
            rep = value["report"]
            self.steps_run[action_id] = max(self.steps_run.get(action_id, 0), rep["steps_done"])
            self.tokens += rep["tokens"]
            self.inner_bytes += rep["inner_bytes"]
            self.attempted_steps += rep["steps_done"]
            self.losses.setdefault(rid, []).extend(rep["losses"])
        if kind == "outer_reduce":
            self.outer_bytes += value.get("outer_bytes", 0)
        if kind == "outer_commit" and outcome == Outcome.DONE:
            self.inner_bytes += value.get("inner_bytes", 0)
            self.commit_digests[rid] = value["digest"]
            self.global_digests[rid] = value["global_digest"]
        if kind == "heal" and outcome == Outcome.DONE:
            self.heal_sizes[rid] = value.get("bytes", 0)
            self.heal_transports[rid] = value.get("transport", "object_store")

    def _phase_end(self, action: Action, started: float) -> None:
        self.actions.pop(action.id, None)
        seconds = time.monotonic() - started
        join_s = min(seconds, self.join_s.pop(action.id, 0.0))  # forming the group, in the same call
        outcomes = self.outcomes.pop(action.id, {})
        failed = {rid: o.split(": ", 1) for rid, o in outcomes.items() if o not in ("done", "yielded")}
        ok = sorted(rid for rid, o in outcomes.items() if o == "done")
        yielded = sorted(rid for rid, o in outcomes.items() if o == "yielded")
        self.sup.log.event("phase_end", phase=_PHASE_NAME.get(action.kind, action.kind), round=self.r,
                           cluster=action.cluster, seconds=seconds, ok=ok, failed=failed,
                           **({"yielded": yielded} if yielded else {}))
        key = {"run_inner": "inner", "cluster_average": "inner_sync", "outer_reduce": "outer",
               "outer_commit": "outer_commit"}.get(action.kind, "heal_configure")
        work_s = seconds - join_s
        self.seconds[key] = max(self.seconds[key], work_s) if key == "inner" else self.seconds[key] + work_s
        self.seconds["heal_configure"] += join_s
        if action.kind == "heal":
            for rid in ok:
                source, scope = action.calls[rid]
                nbytes = self.heal_sizes.get(rid)
                self.sup.log.event("heal_end", target=rid, source=source, scope=scope, seconds=seconds,
                                   bytes=nbytes, gbps=round(nbytes * 8 / 1e9 / seconds, 4) if nbytes and seconds else None,
                                   transport=self.heal_transports.get(rid, "object_store"))
        if not failed and action.kind in ("outer_reduce", "outer_commit"):
            self.sup.clock.observe(action.kind.replace("_reduce", ""), work_s, 1)
        steps_run = self.steps_run.pop(action.id, 0)
        if action.kind == "run_inner" and not failed and steps_run:
            # the step deadline's sure sample: progress polls may never land inside a short phase,
            # and without samples the deadline is the ceiling (a hang would go unseen for minutes)
            self.sup.clock.observe("inner_step", work_s, steps_run)
        if action.kind == "run_inner" and failed:
            self.attempts += 1

    # -- progress and hangs ------------------------------------------------------------------------------
    def _poll_progress(self) -> None:
        """Ask every replica in an inner phase for its step (control channel; answers mid-phase)."""
        asked = {rid for rid, _ in self.progress_refs.values()}
        for action, _, pending in self.actions.values():
            if action.kind != "run_inner":
                continue
            for rid in pending - asked:
                self.progress_refs[self.sup.roster.handles[rid].progress.remote()] = (rid, time.monotonic())

    def _probe_down(self) -> None:
        """Rejoin `fast`: ask replicas that are down whether they are back (a restarting actor's
        call waits until it is up, so one probe per replica is outstanding at a time)."""
        if self.machine.settings.rejoin != "fast":
            return
        asked = set(self.up_refs.values())
        for rid in self.sup.topology.replica_ids():
            if rid not in self.machine.progress and rid not in self.sup.roster.gone and rid not in asked:
                self.up_refs[self.sup.roster.handles[rid].progress.remote()] = rid

    def _watch_idle(self) -> None:
        """Ask live replicas with no call in flight (a cluster ready and waiting for the others, a
        non-leader during the outer exchange) whether their process still runs: one killed from
        outside while idle is otherwise learned of only when its next call fails, after its
        cluster's commit broadcast broke. One probe per replica is outstanding at a time."""
        m, handles, pids = self.machine, self.sup.roster.handles, self.sup.roster.pids
        asked = {rid for rid, _ in self.idle_refs.values()}
        for rid in list(m.progress):
            if rid not in m.busy and rid not in asked:
                self.idle_refs[handles[rid].progress.remote()] = (rid, pids.get(rid))

    def _idle_answer(self, ref) -> None:
        """Lost: the call died with the process (Ray says the actor died), or a new process answers
        (Ray restarted it). No answer in time, or the actor briefly unreachable, is not a loss."""
        rid, known_pid = self.idle_refs.pop(ref)
        if self.sup.roster.pids.get(rid) != known_pid:
            return  # rid was found lost and came back meanwhile: this probe was about the old process
        try:
            answer = ray.get(ref, timeout=1.0)
        except ActorUnavailableError:  # unreachable for now, not known dead: asked again at the next poll
            return
        except RayActorError as err:  # (ActorDiedError among them) its process is gone
            lost = f"died while idle ({type(err).__name__})"
        except Exception:  # noqa: BLE001 — no answer in time: asked again at the next poll
            return
        else:
            if known_pid is None or answer.get("pid") == known_pid:
                return
            lost = f"restarted while idle (pid {known_pid} -> {answer.get('pid')})"
        if rid in self.machine.progress:
            self.sup.log.event("idle_replica_lost", rid=rid, round=self.r, detail=lost)
            self._carry_out(self.machine.on_lost(rid, time.monotonic(), "died"))

    def _up_answer(self, ref) -> None:
        rid = self.up_refs.pop(ref)
        try:
            answer = ray.get(ref, timeout=1.0)
        except Exception:  # noqa: BLE001 — still down (or restarting): asked again next tick
            return
        if answer.get("phase", "idle") != "idle" or rid in self.machine.progress:
            return
        self.sup.roster.note_up(rid, answer)
        self._carry_out(self.machine.on_up(rid, int(answer["round"]), int(answer["step"]), time.monotonic()))

    def _progress_answer(self, ref) -> None:
        rid, _ = self.progress_refs.pop(ref)
        try:
            answer = ray.get(ref, timeout=1.0)
        except Exception:  # noqa: BLE001 — no answer is no sign of life; the machine's limit decides
            return
        now = time.monotonic()
        step_s = self.machine.on_progress(rid, int(answer["step"]), now)
        if step_s:
            self.sup.clock.observe("inner_step", step_s, 1)
        self.sup.roster.replica_info[rid] = {"pid": answer.get("pid"), "node_id": answer.get("node_id")}

    def _kill(self, a: Action) -> None:
        """The machine found a replica silent and not advancing: report with stacks, then kill it
        (restartable); its call in flight becomes stale."""
        sup = self.sup
        (rid, (why, silent_s)), = a.calls.items()
        group = sorted(x for x in (sup.topology.cluster_members(a.cluster) if a.cluster is not None else sup.roster.handles)
                       if x in self.machine.progress or x == rid)
        dumps = {}
        if sup.cfg.watchdog.stack_dumps:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=8) as pool:
                futures = {p: pool.submit(dump_replica, sup.roster.handles[p], sup.roster.replica_info.get(p, {}), sup.run_dir, p)
                           for p in group}
                for p, fut in futures.items():
                    try:
                        dumps[p] = fut.result(timeout=30.0)
                    except Exception as err:  # noqa: BLE001 — a dump that failed is reported as such
                        dumps[p] = f"(no stack: {err})"
        peers = {p: ("stuck" if p == rid else "in its group") for p in group}
        text = hang_report(rid=rid, phase=why, round_index=self.r, waited_s=silent_s, deadline_s=a.deadline_s, peers=peers,
                           dumps=dumps, view={"epoch": self.machine.epoch, "leaders": self.machine.leaders})
        path = Path(sup.run_dir) / "hangs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{rid}.txt"
        sup.log.write_file(path, text, make_parent=True)  # with a deadline; a failure is the folder's health
        sup.log.event("hang_detected", rid=rid, phase=_PHASE_NAME.get(why, why), round=self.r, cluster=a.cluster,
                      reason=a.reason, waited_s=silent_s, deadline_s=a.deadline_s,
                      stuck_in=stuck_function(dumps.get(rid, "")), report=str(path),
                      waiting=[p for p in group if p != rid])
        sup.log.event("kill", rid=rid, reason=a.reason)
        try:
            ray.kill(sup.roster.handles[rid], no_restart=False)
        except Exception as err:  # noqa: BLE001 — already dead is fine
            sup.log.event("kill_failed", rid=rid, error=str(err))
        self._forget(rid, "hung: killed")

    def _forget(self, rid: str, outcome: str = "died: presumed, its peers saw its connection close") -> None:
        """The machine gave up on rid's calls: close them in the record."""
        for action_id, (action, started, pending) in list(self.actions.items()):
            if rid in pending:
                pending.discard(rid)
                self.outcomes.setdefault(action_id, {})[rid] = outcome
                if not pending:
                    self._phase_end(action, started)

    def _log_deaths(self) -> None:
        """Each replica the machine lost is logged once; with hot spares, one takes over its id."""
        sup = self.sup
        self.logged_down &= self.machine.dead.keys()  # one that came back and died again is logged again
        for rid, cause in list(self.machine.dead.items()):
            if rid not in self.logged_down:
                self.logged_down.add(rid)
                sup.log.event("replica_down", rid=rid, cluster=sup.topology.cluster_of(rid), cause=cause,
                              phase=self.sup.status_view.get("phase"), round=self.r)
                if sup.roster.spares:
                    answer = sup.roster.promote_spare(rid)
                    if answer is not None:
                        self.up_refs = {ref: r for ref, r in self.up_refs.items() if r != rid}
                        sup.roster.note_up(rid, answer)
                        self._carry_out(self.machine.on_up(rid, int(answer["round"]), int(answer["step"]),
                                                           time.monotonic()))

    def _log_non_finite(self, *, final: bool) -> None:
        """Each cluster the machine found non-finite is logged once (one `non_finite` per cluster
        and round, however many members reported it), and a benched one with a console warning.
        Logged once the cluster's call has ended (it sits out), so `rids` names every member that
        reported it, not only the first answer."""
        m, log = self.machine, self.sup.log
        for c, nf in m.void.items():
            if c not in self.logged_void and (final or m.clusters[c].stage == "out"):
                self.logged_void.add(c)
                log.event("non_finite", rid=nf.rids[0], rids=list(nf.rids), cluster=c, round=self.r,
                          phase=_PHASE_NAME.get(nf.phase, nf.phase), what=self.non_finite_what.get(nf.rids[0], ""),
                          detail=nf.detail[:300])
        for c, reason in m.benched_now.items():
            if c not in self.logged_benched:
                self.logged_benched.add(c)
                log.event("cluster_benched", cluster=c, round=self.r, reason=reason)
                print(f"[hsgd] WARNING: cluster c{c} benched: {reason}", flush=True)

    def _membership_event(self, a: Action) -> None:
        m = self.machine
        members = {f"c{c}": list(m.members(c)) for c in m.participating() if m.members(c)}
        self.sup.log.event("membership", epoch=a.epoch, members=members,
                           leaders={f"c{c}": r for c, r in m.leaders.items()}, standby=[],
                           level="inner" if a.kind == "run_inner" else "outer", cluster=a.cluster)


_PHASE_NAME = {"run_inner": "inner", "cluster_average": "inner_sync", "outer_reduce": "outer",
               "outer_commit": "outer_commit", "heal": "heal"}
_FAULT_PHASES = {"run_inner": ("inner", "inner_sync"), "cluster_average": ("inner_sync",), "outer_reduce": ("outer",),
                 "outer_commit": ("outer_commit",), "heal": ("heal",)}


def _view(m: RoundMachine) -> dict:
    stages = {st.stage for st in m.clusters.values() if st.stage != "out"}
    phase = "outer" if m.outer_stage == "reduce" else "outer_commit" if m.outer_stage == "commit" \
        else "inner" if "inner" in stages else sorted(stages)[0] if stages else "idle"
    return {"phase": phase, "round": m.round,
            "members": {f"c{c}": list(m.members(c)) for c in m.participating() if m.members(c)},
            "leaders": {f"c{c}": r for c, r in m.leaders.items()}}
