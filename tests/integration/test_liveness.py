"""A replica is `gone` only when Ray will not restart it (it raises ActorDiedError for a replica it
is about to restart too): the supervisor must never give up on a restarting replica."""

from __future__ import annotations

import time

import ray

from actors.roster import restarts_exhausted


@ray.remote(max_restarts=1, num_cpus=0)
class Mortal:
    def ping(self) -> int:
        import os

        return os.getpid()


def _state(handle):
    from ray._private.state import state as gcs

    return gcs.actor_table(handle._actor_id.hex()).get("State")


def test_a_restarting_actor_is_not_gone_and_a_dead_one_is():
    actor = Mortal.remote()
    first = ray.get(actor.ping.remote(), timeout=60)
    ray.kill(actor, no_restart=False)  # Ray restarts it (max_restarts=1)
    seen = set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        seen.add(_state(actor))
        assert not restarts_exhausted(actor), f"declared gone while Ray restarts it (state {_state(actor)})"
        try:
            if ray.get(actor.ping.remote(), timeout=5) != first:
                break
        except Exception:  # noqa: BLE001 — restarting
            time.sleep(0.1)
    else:
        raise AssertionError(f"the actor never came back: states {seen}")
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + 30
    while not restarts_exhausted(actor) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert restarts_exhausted(actor), f"a dead actor must be gone (state {_state(actor)})"
