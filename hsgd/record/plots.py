"""Pictures of a run (docs/outputs.md): loss.png, timeline.png, membership.png. The `*_data`
functions are pure (files in, plain data out; times in seconds since the run's first event); tests
check them, not pixels. A run still going, failed, or without faults or metrics yet draws what it has.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from hsgd.core.phases import SPAN, Phase
from hsgd.core.site_requests import RequestKind
from hsgd.core.topology import parse_replica_id, replica_id
from hsgd.record.metrics import fault_figures
from hsgd.record.rundir import read_json, read_jsonl

DOWN = "down"  # a span of a replica gone (not a phase)
SPAN_COLOURS = {
    Phase.INNER: "#4c72b0",
    Phase.INNER_SYNC: "#8fb3e0",
    Phase.OUTER: "#dd8452",
    Phase.OUTER_COMMIT: "#55a868",
    Phase.CHECKPOINT: "#8172b3",
    Phase.HEAL: "#e5c100",
    DOWN: "#555555",
}
_DOWN_STYLE = {"hatch": "//", "edgecolor": "white"}  # "down" bars: hatched, so they read as absence


def _rid_key(rid: str) -> tuple:
    with contextlib.suppress(ValueError):
        return (0, *parse_replica_id(rid))
    return (1, 0, str(rid))


def _cluster(rid: str) -> str | None:
    key = _rid_key(rid)
    return f"c{key[1]}" if key[0] == 0 else None


def read_events(run_dir: str | Path) -> list[dict]:
    """events.jsonl in time order (a line being written right now is skipped)."""
    return sorted((e for e in read_jsonl(Path(run_dir) / "events.jsonl") if "t" in e), key=lambda e: e["t"])


def known_replicas(run_dir: str | Path, events: list[dict]) -> list[str]:
    """Replica ids from config.yaml's topology (`topology.sites`, else clusters x replicas_per_cluster)
    plus any named in `events`, in c/r order."""
    rids: set[str] = set()
    with contextlib.suppress(Exception):  # absent, unreadable, or no topology: the events name them
        import yaml

        t = yaml.safe_load((Path(run_dir) / "config.yaml").read_text(encoding="utf-8"))["topology"]
        sizes = (
            [int(site["replicas"]) for site in t["sites"]]
            if t.get("sites")
            else [int(t["replicas_per_cluster"])] * int(t["clusters"])
        )
        rids |= {replica_id(c, i) for c, n in enumerate(sizes) for i in range(n)}
    for e in events:
        for key in ("rid", "target", "source"):
            if isinstance(e.get(key), str):
                rids.add(e[key])
        rids |= set(e.get("replicas") or [])
        members = e.get("members") or {}
        for group in members.values() if isinstance(members, dict) else [members]:
            rids |= set(group)
        rids |= set(e.get("standby") or [])
    return sorted((r for r in rids if _rid_key(r)[0] == 0), key=_rid_key)


def replica_states(events: list[dict]):
    """Yield (t, {rid: state}) after every event that changes a replica's state. States: "live"
    (a member), "standby" (live, its cluster below quorum), "joining" (back up, not yet a member),
    "down". An inner membership event is authoritative for who is in its cluster (an outer one, the
    leaders' group, changes nobody's state); replica_down/replica_up in between."""
    state: dict[str, str] = {}
    for e in events:
        name = e.get("event")
        if name == "membership":
            if e.get("level") == "outer":
                continue  # the leaders' group: who is in each cluster does not change
            listed = e.get("members") or {}
            # authoritative for the clusters it lists (a cluster's group: its own; an older record: all)
            clusters = set(listed) if e.get("cluster") is not None else None
            for rid, s in state.items():
                if s in ("live", "standby", "joining") and (clusters is None or _cluster(rid) in clusters):
                    state[rid] = "joining"
            for members in listed.values():
                state.update({rid: "live" for rid in members})
            state.update({rid: "standby" for rid in e.get("standby") or []})
        elif name == "replica_down" and e.get("rid"):
            state[e["rid"]] = "down"
        elif name == "replica_up" and e.get("rid"):
            state[e["rid"]] = "live" if state.get(e["rid"]) == "live" else "joining"
        else:
            continue
        yield e["t"], dict(state)


def timeline_data(run_dir: str | Path) -> dict:
    """Spans per replica: {rid: [(start_s, end_s, kind)]}, kind a phase that is a SPAN or DOWN, plus faults
    [(t, rid, kind)], recoveries [(fault t, recovery t)] and supervisor restarts [t]. A phase is
    the events `phase_begin`/`phase_end` of one (phase, cluster): clusters overlap in time."""
    run_dir = Path(run_dir)
    events = read_events(run_dir)
    fired = sorted((f for f in read_jsonl(run_dir / "faults_fired.jsonl") if "t" in f), key=lambda f: f["t"])
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    stamps = [e["t"] for e in events] or [r["t"] for r in fired + metrics if "t" in r] or [0.0]
    t0 = min(stamps)
    end = max([*stamps, *(r["t"] for r in fired + metrics if "t" in r)]) - t0
    spans = _Spans(known_replicas(run_dir, events), [f["t"] - t0 for f in fired], [f.get("rid") for f in fired])
    for e in events:
        spans.read(e, e["t"] - t0)
    spans.close_all(end, downs_too=True)
    faults = [(f["t"] - t0, f.get("rid", "?"), f.get("kind", "?")) for f in fired]
    return {
        "t0": t0,
        "end": end,
        "replicas": sorted(spans.by_rid, key=_rid_key),
        "spans": spans.by_rid,
        "faults": faults,
        "recoveries": _recoveries(run_dir, fired, events, t0),
        "supervisor_starts": [e["t"] - t0 for e in events if e.get("event") == "supervisor_start"][1:],
    }


class _Spans:
    """The timeline's spans, built one event at a time (times in seconds since the run's start)."""

    def __init__(self, replicas, fault_times: list[float], fault_rids: list[str | None]):
        self.by_rid: dict[str, list[tuple[float, float, str]]] = {rid: [] for rid in replicas}
        self.fault_times, self.fault_rids = fault_times, fault_rids
        # keyed by (phase, cluster): clusters run their own inner phases at once, so one cluster's
        # phase_begin must not end another's span (cluster None: the outer level's phases)
        self.open_phase: dict[tuple[str, int | None], tuple[float, list[str]]] = {}
        self.open_heal: dict[str, float] = {}
        self.open_down: dict[str, float] = {}
        self.last_up: dict[str, float] = {}

    def add(self, rid, start, stop, kind):
        self.by_rid.setdefault(rid, []).append((start, max(start, stop), kind))

    def close_phase(self, key, at):
        start, members = self.open_phase.pop(key)
        for rid in members:
            self.add(rid, start, at, key[0])

    def close_all(self, at, *, downs_too=False):
        for key in list(self.open_phase):
            self.close_phase(key, at)
        for rid, start in self.open_heal.items():
            self.add(rid, start, at, Phase.HEAL)
        self.open_heal.clear()
        if downs_too:  # the run's end: a replica still down stays down to the end
            for rid, start in self.open_down.items():
                self.add(rid, start, at, DOWN)

    def read(self, e: dict, t: float) -> None:
        name, key = e.get("event"), (e.get("phase"), e.get("cluster"))
        if name == "phase_begin" and e.get("phase") in Phase.having(SPAN):
            if key in self.open_phase:  # begun again without an end: the old one ended here
                self.close_phase(key, t)
            self.open_phase[key] = (t, list(e.get("replicas") or []))
        elif name == "phase_end" and key in self.open_phase:
            self.close_phase(key, t)
        elif name == "heal_begin" and e.get("target"):
            self.open_heal[e["target"]] = t
        elif name == "heal_end" and e.get("target") in self.open_heal:
            self.add(e["target"], self.open_heal.pop(e["target"]), t, Phase.HEAL)
        elif name == "supervisor_start":
            self.close_all(t)  # a restarted supervisor never ends what the old one began
        elif name == "replica_down" and e.get("rid") and e["rid"] not in self.open_down:
            rid = e["rid"]
            since = self.last_up.get(rid, float("-inf"))
            causes = [
                ft for ft, fr in zip(self.fault_times, self.fault_rids, strict=True) if fr == rid and since < ft <= t
            ]
            self.open_down[rid] = min([t, *causes])  # down from the fault that caused it
        elif name == "replica_up" and e.get("rid"):
            self.last_up[e["rid"]] = t
            if e["rid"] in self.open_down:
                self.add(e["rid"], self.open_down.pop(e["rid"]), t, DOWN)


def _recoveries(run_dir: Path, fired: list[dict], events: list[dict], t0: float) -> list[tuple[float, float]]:
    """(fault t, recovery t) from summary.json's fault figures, else computed from the logs."""
    figures = read_json(run_dir / "summary.json").get("faults") or []
    if not any("fired_at" in f for f in figures):
        figures = fault_figures(fired, events) if fired else []
    return [
        (f["fired_at"] - t0, f["fired_at"] + f["recovery_latency_s"] - t0)
        for f in figures
        if f.get("fired_at") is not None and f.get("recovery_latency_s") is not None
    ]


def site_changes(events: list[dict], t0: float) -> list[tuple[float, str, str]]:
    """Every applied join and drain (`site_request` events), and each added site taking part (`site_up`,
    kind `joined`): [(t, kind, cluster)], in time order."""
    return [
        (e["t"] - t0, "joined" if e.get("event") == "site_up" else str(e.get("kind")), str(e.get("cluster")))
        for e in events
        if (e.get("event") == "site_request" and e.get("outcome") == "applied") or e.get("event") == "site_up"
    ]


def membership_data(run_dir: str | Path) -> dict:
    """Live replicas (not down) per cluster as step series {cluster: [(t, n)]}: a point where the
    count changes, one at t=0 and one at the end; a drained cluster counts 0 from its drain on (its
    stopped replicas are in no event as down). Also epochs [(t, epoch)], faults, and `sites`: every
    applied join and drain [(t, kind, cluster)]."""
    run_dir = Path(run_dir)
    events = read_events(run_dir)
    timeline = timeline_data(run_dir)
    t0, end = timeline["t0"], timeline["end"]
    rids = known_replicas(run_dir, events)
    clusters = sorted({_cluster(r) for r in rids}, key=lambda c: int(c[1:]))
    sites = site_changes(events, t0)
    drained_at = {c: t for t, kind, c in reversed(sites) if kind == RequestKind.DRAIN}  # the first drain of each
    series: dict[str, list[tuple[float, int]]] = {c: [(0.0, 0)] for c in clusters}
    states = [(t - t0, state) for t, state in replica_states(events)]
    for t in drained_at.values():  # a point at each drain, so the count falls there
        states.append((t, next((s for ts, s in reversed(states) if ts <= t), {})))
    for t, state in sorted(states, key=lambda ts: ts[0]):
        for c in clusters:
            n = (
                0
                if c in drained_at and t >= drained_at[c]
                else sum(1 for rid, s in state.items() if s != "down" and _cluster(rid) == c)
            )
            if n != series[c][-1][1]:
                series[c].append((t, n))
    for points in series.values():
        points.append((max(end, points[-1][0]), points[-1][1]))
    size = {c: sum(1 for r in rids if _cluster(r) == c) for c in clusters}
    epochs = [(e["t"] - t0, e.get("epoch")) for e in events if e.get("event") == "membership"]
    return {
        "t0": t0,
        "end": end,
        "clusters": series,
        "size": size,
        "epochs": epochs,
        "faults": timeline["faults"],
        "sites": sites,
    }


def _fault_step(fault: dict, metrics: list[dict], spr: int) -> int:
    """The inner step a fault hit: its (round, step), else (injected from outside) the start of the
    first round that committed after it."""
    if fault.get("round") is not None:
        return fault["round"] * spr + (fault.get("step") or 0)
    later = [m for m in metrics if m.get("t", 0) >= fault["t"]]
    return later[0]["round"] * spr if later else (metrics[-1]["inner_step"] if metrics else 0)


def loss_plot_data(run_dir: str | Path) -> dict:
    """The series loss.png is drawn from."""
    run_dir = Path(run_dir)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    per_replica: dict[str, list[tuple[int, float]]] = {}
    for m in metrics:
        for rid, loss in (m.get("replica_loss") or {}).items():
            per_replica.setdefault(rid, []).append((m["inner_step"], loss))
    evals = [(m["inner_step"], m["eval_loss"]) for m in metrics if m.get("eval_loss") is not None]
    initial = [
        e["eval_loss"]
        for e in read_jsonl(run_dir / "events.jsonl")
        if e.get("event") == "initial_eval" and e.get("eval_loss") is not None
    ]
    if initial:  # the global model before any step
        evals.insert(0, (0, initial[0]))
    faults = read_jsonl(run_dir / "faults_fired.jsonl")
    spr = metrics[0]["inner_step"] // (metrics[0]["round"] + 1) if metrics else 1
    fault_steps = [(_fault_step(f, metrics, spr), f"{f['kind']} {f['rid']}") for f in faults]
    return {"replica_loss": per_replica, "eval_loss": evals, "faults": fault_steps}


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display: runs, benches and CI draw to files)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, out: Path) -> Path:
    """Lay out, write to a temp name, then rename: a reader never sees half a picture. Closes the figure."""
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp)
    pyplot().close(fig)
    tmp.replace(out)
    return out


def write_loss_png(run_dir: str | Path) -> Path:
    plt = pyplot()
    data = loss_plot_data(run_dir)
    fig, ax = plt.subplots(figsize=(9, 4.8), dpi=110)
    for rid, points in sorted(data["replica_loss"].items(), key=lambda kv: _rid_key(kv[0])):
        ax.plot(*zip(*points, strict=True), lw=1.2, alpha=0.75, marker=".", ms=4, label=f"train {rid}")
    if data["eval_loss"]:
        ax.plot(*zip(*data["eval_loss"], strict=True), "k-o", ms=3, lw=2, label="eval (global model)")
    if not data["replica_loss"] and not data["eval_loss"]:
        ax.text(0.5, 0.5, "no committed rounds yet", transform=ax.transAxes, ha="center", color="grey")
    for step, label in data["faults"]:
        ax.axvline(step, color="red", ls="--", lw=1)
        ax.annotate(
            label,
            (step, 0.98),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=8,
            color="red",
        )
    ax.set(xlabel="inner step", ylabel="cross-entropy loss")
    ax.set_title("train loss per replica (round mean) and eval loss of the global model", fontsize=10)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, ncol=2)
    return save_png(fig, Path(run_dir) / "loss.png")


def write_timeline_png(run_dir: str | Path) -> Path:
    plt = pyplot()
    data = timeline_data(run_dir)
    rows = list(data["replicas"])
    if any(rid == "supervisor" for _, rid, _ in data["faults"]) or data["supervisor_starts"]:
        rows.append("supervisor")
    rows = rows or ["(no replicas yet)"]
    end = max(data["end"], 1e-3)
    min_w = end / 400  # draw very short phases (outer, commit) wide enough to see
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.55 * len(rows)), dpi=110)
    for i, rid in enumerate(rows):
        for kind in SPAN_COLOURS:
            bars = [(s, max(e - s, min_w)) for s, e, k in data["spans"].get(rid, []) if k == kind]
            if bars:
                ax.broken_barh(
                    bars,
                    (i - 0.35, 0.7),
                    facecolors=SPAN_COLOURS[kind],
                    lw=0,
                    **(_DOWN_STYLE if kind == DOWN else {}),
                )
    for start, stop in data["recoveries"]:
        ax.axvspan(start, stop, color="red", alpha=0.15, lw=0, zorder=0)
    for t in data["supervisor_starts"]:
        ax.plot([t], [rows.index("supervisor")], marker="^", color="black", ms=8, ls="")
    _mark_faults(ax, data["faults"], rows)
    ax.set_yticks(range(len(rows)), rows)
    ax.set(ylim=(len(rows) - 0.4 + 0.3, -0.6), xlim=(0, end * 1.01), xlabel="seconds since run start")
    ax.set_title("what each replica was doing (faults: red X; fault to recovery: shaded)", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    _timeline_legend(ax, len(rows))
    return save_png(fig, Path(run_dir) / "timeline.png")


def _mark_faults(ax, faults: list[tuple[float, str, str]], rows: list[str]) -> None:
    for t, rid, kind in faults:
        y = rows.index(rid) if rid in rows else len(rows) - 1
        ax.plot([t], [y], marker="X", color="red", ms=11, mec="white", mew=1, ls="", zorder=5)
        ax.annotate(
            f"{kind} {rid}",
            (t, y),
            xytext=(8, 0),
            textcoords="offset points",
            ha="left",
            va="center",
            fontsize=8,
            color="red",
            fontweight="bold",
            zorder=6,
            bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "red", "lw": 0.5, "alpha": 0.9},
        )


def _timeline_legend(ax, n_rows: int) -> None:
    from matplotlib.patches import Patch

    handles = [
        Patch(facecolor=SPAN_COLOURS[k], label=k.replace("_", " "), **(_DOWN_STYLE if k == DOWN else {}))
        for k in SPAN_COLOURS
    ]
    handles.append(Patch(facecolor="red", alpha=0.15, label="fault → recovery"))
    ax.legend(
        handles=handles,
        fontsize=8,
        ncol=len(handles),
        loc="upper center",
        bbox_to_anchor=(0.5, -0.5 / n_rows - 0.12),
        frameon=False,
    )


def write_membership_png(run_dir: str | Path) -> Path:
    plt = pyplot()
    data = membership_data(run_dir)
    fig, ax = plt.subplots(figsize=(11, 3.6), dpi=110)
    n = max(len(data["clusters"]), 1)
    for i, (cluster, points) in enumerate(data["clusters"].items()):
        offset = (i - (n - 1) / 2) * 0.04  # keep equal counts of different clusters apart
        ax.step(
            [p[0] for p in points],
            [p[1] + offset for p in points],
            where="post",
            lw=2,
            label=f"{cluster} ({data['size'].get(cluster, '?')} replicas)",
        )
    top = max(list(data["size"].values()) or [1])
    for t, epoch in data["epochs"]:
        ax.axvline(t, color="grey", ls=":", lw=1)
        ax.annotate(f"e{epoch}", (t, top + 0.35), ha="left", fontsize=7, color="grey")
    for t, rid, kind in data["faults"]:
        ax.axvline(t, color="red", ls="--", lw=1)
        ax.annotate(f"{kind} {rid}", (t, 0.1), rotation=90, ha="right", va="bottom", fontsize=8, color="red")
    for t, kind, cluster in data["sites"]:
        ax.axvline(t, color="green", ls="-.", lw=1.2)
        ax.annotate(f"{kind} {cluster}", (t, top + 0.1), rotation=90, ha="right", va="top", fontsize=8, color="green")
    ax.set(
        ylim=(-0.2, top + 0.6),
        yticks=range(top + 1),
        xlim=(0, max(data["end"], 1e-3) * 1.01),
        xlabel="seconds since run start",
        ylabel="live replicas",
    )
    ax.set_title(
        "live replicas per cluster (dotted: membership epochs; red: faults; green: sites joining or drained)",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    if data["clusters"]:
        ax.legend(fontsize=8, loc="lower right")
    return save_png(fig, Path(run_dir) / "membership.png")


def write_run_plots(run_dir: str | Path) -> list[Path]:
    """loss.png, timeline.png and membership.png under run_dir; returns their paths."""
    return [write_loss_png(run_dir), write_timeline_png(run_dir), write_membership_png(run_dir)]
