"""What a run reports: the per-round metrics record and the efficiency figures. Pure functions,
so the numbers in metrics.jsonl and summary.json are unit-tested, not only observed."""
from __future__ import annotations


def round_record(*, round_index: int, steps_per_round: int, losses: dict[str, list[float]], tokens: int,
                 inner_bytes: int, outer_bytes: int, phase_s: dict[str, float], eval_loss: float | None,
                 live_replicas: int, epoch: int, attempts: int, digests: dict[str, str],
                 global_digests: dict[str, str], t: float) -> dict:
    """One line of metrics.jsonl for a committed round. `losses`: every committed step's loss per
    replica in this round (steps redone after a failure count once, in the attempt that committed)."""
    all_losses = [x for v in losses.values() for x in v]
    inner_s = phase_s.get("inner", 0.0)
    return {"round": round_index, "inner_step": (round_index + 1) * steps_per_round,
            "loss": sum(all_losses) / len(all_losses) if all_losses else None,
            "replica_loss": {rid: sum(v) / len(v) for rid, v in sorted(losses.items()) if v},
            "eval_loss": eval_loss, "tokens_per_s": tokens / inner_s if inner_s > 0 else None,
            "inner_bytes": inner_bytes, "outer_bytes": outer_bytes, "live_replicas": live_replicas,
            "epoch": epoch, "attempts": attempts, "phase_s": dict(phase_s), "replica_digests": dict(digests),
            "global_digests": dict(global_digests), "t": t}


def efficiencies(committed_steps: int, attempted_steps: int, participation: list[float]) -> tuple[float, float]:
    """torchft's figures: step efficiency = committed / attempted replica-steps (work lost to
    failures lowers it); training efficiency = step efficiency x mean fraction of the replicas
    that took part in each round's inner phase (replicas down lower it)."""
    step = min(1.0, committed_steps / attempted_steps) if attempted_steps else 1.0
    mean_participation = sum(participation) / len(participation) if participation else 1.0
    return step, step * mean_participation
