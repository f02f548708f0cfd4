"""Live console view of a run, read from its files only (no Ray).
docs/operations.md, "Watching, hangs and diagnosis".

Refreshes until the run is done (summary.json, status.json's `status`, or a run_end event) or
--timeout passes. Exit 0; 2 if the run dir does not exist.

The view lists every site request with what became of it, in the order asked (`site_requests`).

`python -m jobs.status <run> drain-site c2` writes one site request into `<run>/requests/`
(hsgd/core/site_requests.py; docs/sites.md, "Sites that come and go") and exits: the supervisor decides it
at the next round's start. `... add-site replicas=N [label=L] [name=S]` asks for a new site the same
way (the supervisor picks its c<k>). Exit 0 with the request's id printed; 2 (one line on stderr,
nothing written): a folder that is no running hsgd run (`request_folder_problem`), or a request that
cannot be valid.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from hsgd.config.compose import is_hsgd_run_folder
from hsgd.core.site_requests import (
    APPLIED,
    RequestError,
    abandoned,
    joined,
    outcomes,
    pending,
    requests_dir,
    write_request,
)
from hsgd.record.metrics import link_bytes_per_cluster
from hsgd.record.plots import known_replicas, read_events, replica_states
from hsgd.record.rundir import read_json as _read_json
from hsgd.record.rundir import read_jsonl
from hsgd.record.runlock import LOCK_NAME, read_lock, stale_reason

RECENT = 8
_REQUEST_STYLE = {"pending": "yellow", "refused": "red", "abandoned": "red", "joined": "green", "applied": "green"}
_STYLE = {"live": "green", "standby": "yellow", "joining": "cyan", "down": "bold red", "drained": "dim", "?": "dim"}


def collect_state(run_dir: str | Path) -> dict:
    """Everything the view shows, from events/metrics, overridden by status.json where it has a value."""
    run_dir = Path(run_dir)
    events, metrics = read_events(run_dir), read_jsonl(run_dir / "metrics.jsonl")
    summary, live = _read_json(run_dir / "summary.json"), _read_json(run_dir / "status.json")
    history = list(replica_states(events))
    states = history[-1][1] if history else {}
    ms = [e for e in events if e.get("event") == "membership"]
    last_m, last_p = (ms or [{}])[-1], next((e for e in reversed(events) if e.get("event") == "phase_begin"), {})
    last = metrics[-1] if metrics else {}
    run_end = next((e for e in reversed(events) if e.get("event") == "run_end"), {})
    state = {
        "run_dir": str(run_dir),
        "epoch": last_m.get("epoch"),
        "leaders": last_m.get("leaders") or {},
        "phase": last_p.get("phase"),
        "round": last_p.get("round"),
        "inner_step": last.get("inner_step"),
        "last_loss": last.get("loss"),
        "last_eval_loss": next((m["eval_loss"] for m in reversed(metrics) if m.get("eval_loss") is not None), None),
        "tokens_per_s": last.get("tokens_per_s"),
        "status": summary.get("status") or run_end.get("status"),
        "updated": events[-1]["t"] if events else None,
    }
    state.update({k: v for k, v in live.items() if v is not None and k in state})
    if live.get("members") and not states:  # no membership event seen yet: trust status.json
        states = {rid: "live" for members in live["members"].values() for rid in members}
    drained = {
        e.get("cluster")
        for e in events
        if e.get("event") == "site_request" and e.get("kind") == "drain" and e.get("outcome") == "applied"
    }  # stopped on purpose: neither live nor down
    clusters: dict[str, list[dict]] = {}
    for rid in known_replicas(run_dir, events) or sorted(states):
        cluster = rid.split("r")[0]
        clusters.setdefault(cluster, []).append(
            {
                "rid": rid,
                "state": "drained" if cluster in drained else states.get(rid, "?"),
                "leader": state["leaders"].get(cluster) == rid,
            }
        )
    state["clusters"] = clusters
    state["link_bytes"] = link_bytes_per_cluster(metrics)  # each cluster's slow-link bytes, sent + received
    state["requests"] = site_requests(run_dir)
    state["done"] = bool(summary) or bool(live.get("status")) or live.get("phase") == "done" or bool(run_end)
    state["recent"] = [_line(e, events[0]["t"]) for e in events if e.get("event") not in ("phase_begin", "phase_end")][
        -RECENT:
    ]
    return state


def site_requests(run_dir: str | Path) -> list[dict]:
    """Every site request in the run folder with what became of it, in the order asked: `id`, `t`,
    `kind`, `cluster` (an applied add-site's new c<K>), `outcome` (pending | applied | refused, and for
    an applied add-site joined | abandoned), `round` (of that outcome; None while pending), `reason`,
    and `line`, one line for the view. Read from the files hsgd/core/site_requests.py defines."""
    done = outcomes(run_dir)
    joins, gone = joined(run_dir), abandoned(run_dir)
    rows = [_pending_row(r) for r in pending(run_dir, done)]
    rows += [_decided_row(run_dir, rid, d, joins.get(rid), gone.get(rid)) for rid, d in done.items()]
    return sorted(rows, key=lambda r: (r["t"] if math.isfinite(r["t"]) else 0.0, r["id"]))


def _row(rid: str, t: float, kind: str, cluster: str, asked: dict) -> dict:
    """A request's row before its outcome; `line` begins '<time> <id>: <kind> <what it asks>: '."""
    what = (
        cluster if kind == "drain" else " ".join(f"{k}={asked[k]}" for k in ADD_SITE_KEYS if asked.get(k) is not None)
    )
    try:
        clock = time.strftime("%H:%M:%S", time.localtime(t))
    except (OverflowError, OSError, ValueError):  # a request file's time edited by hand
        clock = "--:--:--"
    return {
        "id": rid,
        "t": t,
        "kind": kind,
        "cluster": cluster,
        "line": f"{clock} {rid}: {kind} {what}: " if what else f"{clock} {rid}: {kind}: ",
    }


def _pending_row(request) -> dict:
    row = _row(request.id, request.t, request.kind, request.cluster, vars(request))
    row.update(outcome="pending", round=None, reason=request.problem or "")
    row["line"] += (
        f"pending: {_flat(request.problem)}; refused at the next round's start"
        if request.problem
        else "pending: decided at the next round's start"
    )
    return row


def _decided_row(run_dir, rid: str, done: dict, joined_at: dict | None, abandoned_at: dict | None) -> dict:
    """A request with an outcome (`<id>.done`); an applied add-site's joined or abandoned after it."""
    asked = _read_json(requests_dir(run_dir) / f"{rid}.json")  # what was asked, and when
    asked, done = (x if isinstance(x, dict) else {} for x in (asked, done))  # files edited by hand: never a crash
    head = rid.split("-", 1)[0]  # ids begin with the time asked, in ms: where the request file is gone
    t = asked.get("t") if isinstance(asked.get("t"), (int, float)) else int(head) / 1000 if head.isdigit() else 0.0
    row = _row(rid, float(t), str(done.get("kind") or "?"), str(done.get("cluster") or ""), asked)
    outcome, at, reason = done.get("outcome") or "?", done.get("round"), _flat(done.get("reason"))
    if row["kind"] == "add-site" and outcome == APPLIED:
        end = abandoned_at or joined_at
        row["line"] += f"applied at round {at} as {row['cluster']}"
        if end is None:  # still starting
            row["line"] += f": {reason}"
        else:
            outcome, at = ("abandoned" if abandoned_at else "joined"), end.get("round")
            reason = _flat(end.get("reason")) or reason
            row["line"] += f", {outcome} at round {at}" + (f": {reason}" if abandoned_at else "")
    else:
        row["line"] += f"{outcome} at round {at}: {reason}"
    row.update(outcome=outcome, round=at, reason=reason)
    return row


def _flat(text) -> str:
    """One line, whatever a request file says."""
    return " ".join(str(text or "").split())


def _line(e: dict, t0: float) -> str:
    fields = " ".join(
        f"{k}={format(v, '.4g') if isinstance(v, float) else v}"
        for k, v in e.items()
        if k not in ("t", "event") and v not in (None, [], {})
    )
    return f"+{e['t'] - t0:6.1f}s {e.get('event')} {fields}"


def _fmt(x, spec=".4f"):
    return "-" if x in (None, "") else format(x, spec)


def render(state: dict):
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Column, Table
    from rich.text import Text

    done = f" [{state['status']}]" if state.get("status") else (" [done]" if state["done"] else " [running]")
    table = Table(
        "cluster",
        "replicas (* leader)",
        Column("live", justify="right"),
        Column("slow link", justify="right"),
        title=escape(f"hsgd run {state['run_dir']}{done}"),
        title_justify="left",
        expand=False,
    )
    for cluster, reps in state["clusters"].items():
        text = Text()
        for r in reps:
            text.append(f"{r['rid']}{'*' if r['leader'] else ''} ", style="bold" if r["leader"] else None)
            text.append(r["state"], style=_STYLE.get(r["state"], ""))
            text.append("  ")
        n = sum(r["state"] in ("live", "standby", "joining") for r in reps)
        index = int(cluster[1:]) if cluster[1:].isdigit() else -1
        sent = state.get("link_bytes") or []
        table.add_row(
            cluster, text, f"{n}/{len(reps)}", f"{sent[index] / 1e6:.1f} MB" if 0 <= index < len(sent) else "-"
        )
    info = Table.grid(padding=(0, 2))
    info.add_row(
        "epoch",
        _fmt(state.get("epoch"), ""),
        "round",
        _fmt(state.get("round"), ""),
        "phase",
        _fmt(state.get("phase"), ""),
        "inner step",
        str(state.get("inner_step") or "-"),
    )
    info.add_row(
        "loss",
        _fmt(state.get("last_loss")),
        "eval loss",
        _fmt(state.get("last_eval_loss")),
        "tokens/s",
        _fmt(state.get("tokens_per_s"), ".0f"),
        "",
        "",
    )
    recent = [Text(line, style="dim", no_wrap=True, overflow="ellipsis") for line in state["recent"]]
    asked = [Text(r["line"], style=_REQUEST_STYLE.get(r["outcome"], "")) for r in state.get("requests") or []]
    return Group(
        table,
        info,
        *([Text("site requests:", style="bold"), *asked] if asked else []),
        Text("last events:", style="bold"),
        *(recent or [Text("(no events yet)")]),
    )


ADD_SITE_KEYS = ("replicas", "label", "name")


def parse_add_site(args: list[str]) -> dict:
    """`replicas=N [label=L] [name=S]` -> write_request's keywords. RequestError, one line naming the
    argument and what is valid, on anything else (a field's value is checked by write_request)."""
    fields: dict = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or key not in ADD_SITE_KEYS:
            raise RequestError(f"add-site: argument {arg!r} unknown; valid: replicas=N [label=L] [name=S]")
        if key in fields:
            raise RequestError(f"add-site: {key} given twice")
        fields[key] = value
    if "replicas" not in fields:
        raise RequestError("add-site: replicas=N missing; valid: replicas=N [label=L] [name=S]")
    try:
        fields["replicas"] = int(fields["replicas"])
    except ValueError:
        raise RequestError(
            f"add-site: replicas={fields['replicas']!r} is not a replica count; valid: an integer >= 1"
        ) from None
    return fields


def request_folder_problem(run_dir: Path) -> str | None:
    """Why no site request may go into `run_dir`, one line; None for the folder of a running hsgd run:
    hsgd's own marks (compose.is_hsgd_run_folder), its lock live, and no summary.json written since
    the lock was taken (a resumed run's folder keeps the summary of the run it resumed). Read-only."""
    if not run_dir.is_dir():
        return f"no run dir at {run_dir}"
    if not is_hsgd_run_folder(run_dir):
        return (
            f"{run_dir} is not an hsgd run folder (no {LOCK_NAME}, no run.json of an hsgd run); "
            f"valid: the run.dir of a running run"
        )
    lock = read_lock(run_dir)
    stale = None if lock is None else stale_reason(lock, run_dir / LOCK_NAME)
    live = lock is not None and stale is None
    summary = run_dir / "summary.json"
    if summary.is_file() and (not live or _written_since(summary, lock)):
        info = _read_json(summary)
        status = (info.get("status") if isinstance(info, dict) else None) or "?"
        return f"the run in {run_dir} has ended ({status}, summary.json); a request is decided only by a running run"
    if not live:
        why = f"no {LOCK_NAME}" if lock is None else f"its {LOCK_NAME} is stale: {stale}"
        return (
            f"the run in {run_dir} is not running ({why}); a request is decided only by a running run "
            f"(train.resume=true resumes it)"
        )
    return None


def _written_since(path: Path, lock: dict) -> bool:
    """Whether `path` was written after the lock was taken (True when either time cannot be read)."""
    try:
        return path.stat().st_mtime >= float(lock.get("started_at"))
    except (OSError, TypeError, ValueError):
        return True


def request_site_change(run_dir: Path, kind: str, cluster: str = "", **fields) -> int:
    """Write one site request file (no Ray); print its id. 2 on a request that cannot be valid."""
    try:
        request = write_request(run_dir, kind, cluster, **fields)
    except RequestError as err:
        print(f"jobs.status: {err}", file=sys.stderr)
        return 2
    what = cluster or " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
    print(f"site request {request.id} written: {kind} {what} (decided at the next round's start)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and argv[1] == "drain-site":  # `<run> drain-site c2`: a request, not a view
        request = argparse.ArgumentParser(prog="python -m jobs.status <run_dir> drain-site")
        request.add_argument("cluster", help="the cluster to drain, as c<k>")
        args = request.parse_args(argv[2:])
        if (problem := request_folder_problem(Path(argv[0]))) is not None:
            print(f"jobs.status: {problem}", file=sys.stderr)
            return 2
        return request_site_change(Path(argv[0]), "drain", args.cluster)
    if len(argv) >= 2 and argv[1] == "add-site":  # `<run> add-site replicas=2 [label=..] [name=..]`
        if (problem := request_folder_problem(Path(argv[0]))) is not None:
            print(f"jobs.status: {problem}", file=sys.stderr)
            return 2
        try:
            fields = parse_add_site(argv[2:])
        except RequestError as err:
            print(f"jobs.status: {err}", file=sys.stderr)
            return 2
        return request_site_change(Path(argv[0]), "add-site", **fields)
    parser = argparse.ArgumentParser(
        prog="python -m jobs.status",
        description=__doc__.splitlines()[0],
        epilog="python -m jobs.status <run_dir> drain-site c<k> | add-site replicas=N "
        "[label=L] [name=S]: ask the run to drain or add a site at its next "
        "round's start",
    )
    parser.add_argument("run_dir")
    parser.add_argument("--once", action="store_true", help="print once and exit")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    parser.add_argument("--timeout", type=float, default=None, help="stop refreshing after this many seconds")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"jobs.status: no run dir at {run_dir}", file=sys.stderr)
        return 2
    from rich.console import Console
    from rich.live import Live

    console = Console()
    if args.once:
        console.print(render(collect_state(run_dir)))
        return 0
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    with Live(render(collect_state(run_dir)), console=console, refresh_per_second=4) as view:
        while True:
            state = collect_state(run_dir)
            view.update(render(state))
            if state["done"] or (deadline is not None and time.monotonic() >= deadline):
                return 0
            time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
