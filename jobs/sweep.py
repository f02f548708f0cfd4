"""The summary table of a Hydra multirun sweep (docs/operations.md, "Sweeps"): `python -m jobs.sweep <sweep dir>`
rebuilds the `sweep.csv` and `sweep.md` that jobs.train rewrites after every job.
"""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path

from hsgd.record.rundir import atomic_write_text, read_json, read_jsonl

COLUMNS = (
    "job",
    "overrides",
    "status",
    "rounds_committed",
    "final_eval_loss",
    "outer_bytes",
    "wall_s",
    "job_s",
    "run_dir",
)


def _job_overrides(job_dir: Path) -> list[str]:
    import yaml

    path = job_dir / ".hydra" / "overrides.yaml"
    return [str(o) for o in (yaml.safe_load(path.read_text()) or [])] if path.is_file() else []


def sweep_rows(sweep_dir: Path | str) -> list[dict]:
    """One row per job folder (a numbered subfolder with Hydra's overrides or a summary.json)."""
    root = Path(sweep_dir)
    jobs = [
        d
        for d in (root.iterdir() if root.is_dir() else [])
        if d.is_dir() and ((d / ".hydra").is_dir() or (d / "summary.json").is_file())
    ]
    jobs.sort(key=lambda d: (0, int(d.name)) if d.name.isdigit() else (1, d.name))
    overrides = {d: _job_overrides(d) for d in jobs}
    common = set.intersection(*(set(o) for o in overrides.values())) if len(jobs) > 1 else set()
    rows = []
    for d in jobs:
        summary, run_info = read_json(d / "summary.json"), read_json(d / "run.json")
        rows.append(
            {
                "job": d.name,
                "overrides": " ".join(o for o in overrides[d] if o not in common),
                "status": summary.get("status", "no summary"),
                "rounds_committed": summary.get("rounds_committed"),
                "final_eval_loss": summary.get("final_eval_loss"),
                "outer_bytes": sum(int(m.get("outer_bytes") or 0) for m in read_jsonl(d / "metrics.jsonl")),
                "wall_s": summary.get("wall_s"),
                "job_s": run_info.get("job_s"),
                "run_dir": str(d.resolve()),
            }
        )
    return rows


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 1e6 else f"{value:.4g}"
    return str(value)


def markdown_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(" --- " for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(_cell(row[c]).replace("|", "\\|") for c in COLUMNS) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_sweep_table(sweep_dir: Path | str) -> list[dict]:
    """(Re)write sweep.csv (full-precision floats) and sweep.md in the sweep folder."""
    rows = sweep_rows(sweep_dir)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if v is None else repr(v) if isinstance(v, float) else v) for k, v in row.items()})
    atomic_write_text(Path(sweep_dir) / "sweep.csv", buf.getvalue())
    atomic_write_text(Path(sweep_dir) / "sweep.md", markdown_table(rows))
    return rows


def main() -> None:
    if len(sys.argv) != 2:
        print("usage: python -m jobs.sweep <sweep dir>", file=sys.stderr)
        sys.exit(2)
    print(markdown_table(write_sweep_table(sys.argv[1])), end="")


if __name__ == "__main__":
    main()
