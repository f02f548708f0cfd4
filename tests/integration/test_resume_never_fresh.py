"""Issue 45 finding 1 (Acceptance 1, its resume half): a resume whose newest checkpoint no replica
of the resumed run holds (c0r0 was killed in the last round, so c1r0 saved it alone; the run
resumes without c1) loads the newest checkpoint c0r0 can load, its params digest equal to the
manifest's, and its first round is that checkpoint's next one — never a fresh model from round 0."""

from __future__ import annotations

import json

from tests.integration.invariants import check_run
from tests.integration.runs import events, metrics, train

SPR = 4
RUN = [
    "topology.clusters=2",
    "topology.replicas_per_cluster=1",
    "supervisor.rejoin=boundary",  # c0r0, back mid-round 3, waits for round 4: it never saves round 4
    f"sync.outer_every={SPR}",
    "checkpoint.every=1",
    "train.eval_batches=1",
]


def test_a_resume_loads_the_newest_checkpoint_its_replicas_hold_and_never_trains_a_fresh_model(tmp_path, capsys):
    run_dir = tmp_path / "run"
    first = train(run_dir, [*RUN, "train.rounds=4", "faults.schedule=[{kind:kill,target:c0r0,round:3,step:1}]"])
    assert first["status"] == "completed", first.get("reason")
    root = run_dir / "checkpoints"
    held = {d.name: sorted(json.loads((d / "manifest.json").read_text())["files"]) for d in sorted(root.iterdir())}
    assert held == {"round_000003": ["c0r0", "c1r0"], "round_000004": ["c1r0"]}, held
    manifest = json.loads((root / "round_000003" / "manifest.json").read_text())
    digest = manifest["param_digests"]["c0r0"]
    capsys.readouterr()

    # resumed on site c0 alone: round 4 holds no file of c0r0, round 3 does
    resumed = train(run_dir, [*RUN, "topology.clusters=1", "train.rounds=5", "train.resume=true"])
    out = capsys.readouterr().out
    assert resumed["status"] == "completed" and resumed["rounds_committed"] == 5, resumed.get("reason")
    assert f"resumed from {root / 'round_000003'} (round 3)" in out and digest[:12] in out, out[-3000:]
    fallback = [e for e in events(run_dir) if e["event"] == "checkpoint_fallback"]
    assert [e["path"] for e in fallback] == [str(root / "round_000004")] and "c0r0" in fallback[0]["reason"]
    # the resumed job's first commit is round 3 (from round 3's params), none of rounds 0-2 again
    starts = [i for i, e in enumerate(events(run_dir)) if e["event"] == "supervisor_start" and e["starts"] == 1]
    commits = [e["round"] for e in events(run_dir)[starts[-1] :] if e["event"] == "commit"]
    assert commits == [3, 4], commits
    assert [m["round"] for m in metrics(run_dir)] == [0, 1, 2, 3, 4]
    check_run(run_dir, rounds=5, steps_per_round=SPR)
