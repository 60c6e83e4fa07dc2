"""Issue 19: what ster_dist starts listens only where it was told to (127.0.0.1 locally), never on every
interface.

init_method="tcp://127.0.0.1:PORT" made rank 0's rendezvous store listen on *:PORT, and gloo's peer
sockets bound whatever address the hostname resolves to; the group and an embedded Ray cluster are
brought up for real here and the kernel's socket tables name every listening address."""

from __future__ import annotations

import os
import socket

import pytest

from ster_dist.workers.bind import _ipv4_of
from ster_dist.workers.spawn import SpawnGroup

# 127.0.0.1, ::1 and ::ffff:127.0.0.1 as /proc/net spells them
LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
LISTEN = "0A"


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed while we looked
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _listening(pids: list[int]) -> list[str]:
    """local_address:port (hex, as /proc/net/tcp{,6} print it) of each LISTEN socket the pids own."""
    inodes = set().union(*(_socket_inodes(pid) for pid in pids))
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                if fields[3] == LISTEN and fields[9] in inodes:
                    found.append(fields[1])
    return found


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def _proc_net_ipv4(address: str) -> str:
    return socket.inet_aton(address)[::-1].hex().upper()


def _public_ipv4() -> str | None:
    for _, name in socket.if_nameindex():
        address = _ipv4_of(name)
        if address is not None and not address.startswith("127."):
            return address
    return None


def test_a_two_rank_group_listens_on_loopback_only():
    with SpawnGroup(2) as group:
        group.call("ctx")  # the group is up and answering
        listening = _listening([proc.pid for proc in group.procs])
    assert listening, "the rendezvous store should be listening while the group is up"
    wide = [address for address in listening if address.split(":")[0] not in LOOPBACK]
    assert not wide, f"listening beyond loopback: {wide}"


def test_a_group_told_another_address_listens_there_alone():
    """Gloo's peer sockets follow the rendezvous address, not the hostname's (which resolves elsewhere)."""
    host = _public_ipv4()
    if host is None:
        pytest.skip("this machine has no non-loopback IPv4 address to meet on")
    with SpawnGroup(2, host=host) as group:
        assert group.call("ctx")
        listening = _listening([proc.pid for proc in group.procs])
    elsewhere = [address for address in listening if address.split(":")[0] != _proc_net_ipv4(host)]
    assert len(listening) >= 2, "the rendezvous store and gloo's sockets should be listening"
    assert not elsewhere, f"told to meet on {host}, listening on {elsewhere}"


def test_an_embedded_ray_cluster_and_its_group_listen_on_loopback_only():
    """Ray's own servers (GCS, raylet, object manager, workers) and a --tp 2 group on it."""
    import ray

    from ster_dist.workers.ray_group import RayGroup, start_ray

    if ray.is_initialized():
        ray.shutdown()
    assert start_ray(None, num_cpus=2)
    try:
        group = RayGroup(2)
        try:
            group.call("ctx")
            listening = _listening(_descendants(os.getpid()))
        finally:
            group.close()
    finally:
        ray.shutdown()
    assert len(listening) >= 4, f"Ray's servers should be listening: {listening}"
    wide = [address for address in listening if address.split(":")[0] not in LOOPBACK]
    assert not wide, f"listening beyond loopback: {wide}"

