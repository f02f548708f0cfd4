"""The rendezvous of a forming level group: the run's store, its secret, and the arrival barrier.

Protocol
- The supervisor starts the run's store (`start_store`, on the node's address only) and hands each
  replica, per epoch, a rendezvous address `host:port/<secret>` (`rendezvous_address`: >= 128 random
  bits, so nobody outside the run can name a group's keys) and a prefix naming the run, level and
  epoch (`run/epoch7/inner/c1`).
- `await_members` is the arrival barrier `hsgd.train.comm.LevelGroup.configure` runs first: each
  member announces its rank, then waits (server-side) on the group's one decision key. The member
  that sees every rank arrived writes `formed`; the supervisor, once it knows a member of a forming
  group is dead, writes `aborted: <reason>` (`abort_rendezvous`). The first writer wins
  (compare-and-set).
- A replica of k ranks joins each level group k times (`shard_prefix`); an abort of the level group
  releases all k (see the comment above `_SHARD`).
Failures: `await_members` returns the abort reason (configure raises kind `join_aborted`), raises
TimeoutError naming the ranks that never came within its timeout, or torch's store errors when the
store is unreachable (configure raises kind `configure` for both). `abort_rendezvous` never raises.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from datetime import timedelta

SECRET_BITS = 128


# -- the run's store and its secret ----------------------------------------------------------------
def start_store(host: str, timeout_s: float):
    """The run's TCPStore (master), listening on `host` only, on a free port (`.port`). Raises
    OSError / torch's DistNetworkError when `host` is not this node's address. TCPStore alone binds
    every interface (`::`) and has no authentication, so it is handed a socket bound to (host, 0)
    (`master_listen_fd`, which only torch's default libuv server accepts) and owns it from then on."""
    from torch.distributed import TCPStore

    family, kind, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(addr)
        sock.listen(128)
        store = TCPStore(
            host_name=host,
            port=sock.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store closes the descriptor itself
    return store


def new_run_secret() -> str:
    """SECRET_BITS random bits, as hex: the run's rendezvous secret (the module's protocol)."""
    return secrets.token_hex(SECRET_BITS // 8)


def rendezvous_address(host: str, port: int, secret: str) -> str:
    """`host:port/<secret>`, the `store_addr` of `LevelGroup.configure`. The secret is in every
    group's store key prefix but never in `LevelGroup.prefix`, which errors and events name."""
    assert len(secret) * 4 >= SECRET_BITS, "the rendezvous secret needs at least 128 random bits"
    host = f"[{host}]" if ":" in host else host  # IPv6; torchft strips the brackets
    return f"{host}:{port}/{secret}"


# -- the arrival barrier of a forming group ---------------------------------------------------------
# Keys under the group's own key prefix, the one torchft's configure gives its backend (the part of
# `<store_addr>/<prefix>` after host:port); names gloo and NCCL never use.
_ARRIVED = "hsgd_rendezvous/arrived/{rank}"
_DECISION = "hsgd_rendezvous/decision"  # "formed" or "aborted: <reason>"; the first writer wins
_FORMED = "formed"
_ABORTED = "aborted: "


# A replica of k ranks (topology.gpus_per_replica) joins every level group k times: rank 0 under the
# group's prefix, rank j under `shard_prefix(prefix, j)` with rank j of every other replica. Rank j
# marks shards 1..j as present in the group's own keys before its barrier, then obeys an abort already
# written there (_SHARDS_ABORTED); `abort_rendezvous` writes that, then aborts every shard group marked
# (one store serves both, so one of the two always sees the other's write). The supervisor thus aborts
# one prefix and releases all k, even where the level group itself had formed.
_SHARD = "hsgd_rendezvous/shard/{rank}"
_SHARDS_ABORTED = "hsgd_rendezvous/shards_aborted"  # the reason; written even when the level group had formed


def shard_prefix(prefix: str, rank: int) -> str:
    """The group of rank `rank` of every replica of k ranks, for level group `prefix` (rank 0: itself)."""
    return prefix if rank == 0 else f"{prefix}/rank{rank}"


def _mark_shard(store_addr: str, prefix: str, timeout_s: float) -> str | None:
    """For a shard group's member: mark it in its level group's keys (the comment above); that group's
    abort reason when it is already aborted, else None. Not a shard group: None."""
    from torchft.process_group import create_store_client

    parent, _, last = prefix.rpartition("/rank")
    if not parent or not last.isdigit():
        return None
    keys = create_store_client(f"{store_addr}/{parent}", timeout=timedelta(seconds=timeout_s))
    for j in range(1, int(last) + 1):  # every lower shard too: the abort scans 1, 2, ... to the first unmarked
        keys.set(_SHARD.format(rank=j), "1")
    if keys.check([_SHARDS_ABORTED]):
        return keys.get(_SHARDS_ABORTED).decode("utf-8", "replace")
    return None


def await_members(store_addr: str, prefix: str, rank: int, world_size: int, timeout_s: float) -> str | None:
    """The arrival barrier (the module's protocol, step 1): None when formed (the last to announce
    always sees every rank), else the supervisor's abort reason. Raises TimeoutError naming the
    ranks that never came within `timeout_s`, torch's store errors when the store is unreachable."""
    from torch.distributed import DistStoreError
    from torchft.process_group import create_store_client

    deadline = time.monotonic() + timeout_s
    store = create_store_client(f"{store_addr}/{prefix}", timeout=timedelta(seconds=timeout_s))
    aborted = _mark_shard(store_addr, prefix, timeout_s)
    if aborted is not None:  # its level group was aborted before it came: so is its shard group
        store.compare_set(_DECISION, "", _ABORTED + aborted)
    store.set(_ARRIVED.format(rank=rank), str(os.getpid()))
    if store.check([_ARRIVED.format(rank=r) for r in range(world_size)]):
        decision = store.compare_set(_DECISION, "", _FORMED)
    else:
        try:  # the store wakes the wait when the key is written: released at once, nothing polled
            store.wait([_DECISION], timedelta(seconds=max(0.001, deadline - time.monotonic())))
        except DistStoreError as err:
            if not store.check([_DECISION]):  # (else decided just as the wait gave up)
                missing = [r for r in range(world_size) if not store.check([_ARRIVED.format(rank=r)])]
                shown = ", ".join(map(str, missing[:16])) + (", ..." if len(missing) > 16 else "")
                raise TimeoutError(f"rank(s) {shown} of {world_size} did not arrive within {timeout_s:g}s") from err
        decision = store.get(_DECISION)
    text = decision.decode("utf-8", "replace")
    return None if text == _FORMED else text.removeprefix(_ABORTED)


def abort_rendezvous(store, store_addr: str, prefix: str, reason: str) -> bool:
    """The supervisor's abort of forming group `prefix`, once a member is known dead: every member
    waiting now or arriving later raises CollectiveError kind `join_aborted` with `reason`. `store`:
    the master; `store_addr`: the members'. True when aborted (now or earlier); False when it had
    already formed (the connect is bounded by connect_timeout_s) or the store could not be reached.
    Idempotent; never raises; one store round trip, bounded by the store's timeout."""
    from torch.distributed import PrefixStore

    try:  # the key prefix torchft's create_store_client makes of it: everything after host:port
        keys = PrefixStore(f"{store_addr}/{prefix}".partition("/")[2], store)
        aborted = keys.compare_set(_DECISION, "", _ABORTED + reason).decode("utf-8", "replace").startswith(_ABORTED)
        keys.compare_set(_SHARDS_ABORTED, "", reason)  # (its shard groups: a formed level group's may not be)
        j = 1
        while keys.check([_SHARD.format(rank=j)]):
            PrefixStore(f"{store_addr}/{shard_prefix(prefix, j)}".partition("/")[2], store).compare_set(
                _DECISION, "", _ABORTED + reason
            )
            j += 1
        return aborted
    except Exception:  # noqa: BLE001 — a store that is gone or broken: nobody is waiting on it either
        return False
