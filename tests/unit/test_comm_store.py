"""The run's control traffic is locked down: the supervisor's store listens on the node's address
only (read back from the listening socket, not the wildcard), and every group's store keys sit
under a per-run secret of at least 128 random bits that never appears in a group's prefix."""

import socket
from datetime import timedelta
from types import SimpleNamespace

import psutil
import pytest
import torch

from hsgd.train import comm
from tests.fakes.process_group import FakePG


def _node_address() -> str:
    """This machine's outward address (no packet is sent: a UDP connect only picks the route),
    else loopback on a machine without a route."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))
        return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        s.close()


def _listening(port: int) -> list[str]:
    return [
        c.laddr.ip
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ]


@pytest.mark.parametrize("host", ["127.0.0.1", _node_address()])
def test_the_store_listens_on_the_node_address_not_the_wildcard(host):
    store = comm.start_store(host, timeout_s=5)
    try:
        assert _listening(store.port) == [host], f"store on port {store.port} listens on {_listening(store.port)}"
        client = torch.distributed.TCPStore(
            host, store.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5)
        )
        client.set("k", "v")
        assert store.get("k") == b"v", "the store must work through the socket it was handed"
    finally:
        del store


def test_a_plain_tcpstore_would_listen_on_the_wildcard():
    """Why start_store exists: torch binds every interface by itself (if this ever changes, the
    wildcard check above stays the promise)."""
    store = torch.distributed.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5)
    )
    assert set(_listening(store.port)) & {"0.0.0.0", "::"}


def test_the_supervisor_starts_its_store_on_its_node_with_a_secret_rendezvous(monkeypatch):
    import ray

    from actors.supervisor import Supervisor

    host = _node_address()
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: host)
    sup = SimpleNamespace(cfg=SimpleNamespace(comm=SimpleNamespace(configure_timeout_s=5.0)))
    store, store_addr = Supervisor.__ray_actor_class__._start_store(sup)
    try:
        assert _listening(store.port) == [host]
        addr, _, secret = store_addr.partition("/")
        assert addr == f"{host}:{store.port}"
        assert len(secret) * 4 >= 128 and int(secret, 16) >= 0, "the rendezvous secret needs >= 128 random bits"
    finally:
        del store


def test_secrets_are_fresh_and_at_least_128_bits():
    secrets = {comm.new_run_secret() for _ in range(100)}
    assert len(secrets) == 100
    assert all(len(s) * 4 >= 128 and int(s, 16) >= 0 for s in secrets)
    with pytest.raises(AssertionError):
        comm.rendezvous_address("h", 1, "abcd")  # 16 bits: refused
    assert comm.rendezvous_address("fd00::2", 7, "a" * 32) == f"[fd00::2]:7/{'a' * 32}"


def test_group_store_keys_carry_the_secret_but_its_prefix_does_not(monkeypatch):
    """What torchft gets as the group's store address puts every key under the secret (its
    PrefixStore prefix is everything after host:port); the group's own prefix, which errors and
    events name, stays free of it."""
    pg = FakePG()
    monkeypatch.setattr(comm, "_make_torchft_group", lambda backend, timeout_s: pg)
    monkeypatch.setattr(comm, "_await_members", lambda *args: None)  # every member arrived (no store here)
    secret = comm.new_run_secret()
    group = comm.LevelGroup("outer")
    group.configure(
        comm.rendezvous_address("10.0.0.5", 29500, secret), "run-abc123/epoch4/outer", rank=1, world_size=3, epoch=4
    )
    seen = pg.configured
    _, _, key_prefix = seen["store_addr"].partition("/")  # torchft's create_store_client does this
    assert key_prefix.startswith(secret + "/") and key_prefix.endswith("run-abc123/epoch4/outer")
    assert secret not in group.prefix and secret not in seen["replica_id"]


def test_a_failed_join_does_not_repeat_the_secret(monkeypatch):
    """A store timeout names the keys it waited for; the CollectiveError (which ends up in events)
    must not carry the secret."""
    secret = comm.new_run_secret()

    def store_timeout(configured: dict) -> RuntimeError:  # as torchft words it, the keys in full
        return RuntimeError(f"Wait timeout after 30000ms, keys: /{configured['store_addr'].partition('/')[2]}/0")

    monkeypatch.setattr(comm, "_make_torchft_group", lambda backend, timeout_s: FakePG(configure=store_timeout))
    monkeypatch.setattr(comm, "_await_members", lambda *args: None)  # every member arrived (no store here)
    group = comm.LevelGroup("inner")
    with pytest.raises(comm.CollectiveError) as info:
        group.configure(
            comm.rendezvous_address("10.0.0.5", 1, secret), "run/epoch1/inner/c0", rank=0, world_size=2, epoch=1
        )
    assert secret not in str(info.value) and "<secret>/run/epoch1/inner/c0/0" in str(info.value)
