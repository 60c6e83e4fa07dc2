"""Issue 19: a --tp 2 group listens only where it was told to (127.0.0.1), never on every interface.

init_method="tcp://127.0.0.1:PORT" made rank 0's rendezvous store listen on *:PORT; the group
is brought up for real here and the kernel's socket tables name every listening address."""

from __future__ import annotations

import os

from ster_dist.workers.spawn import SpawnGroup

LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1 and ::1 as /proc/net spells them
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


def test_a_two_rank_group_listens_on_loopback_only():
    with SpawnGroup(2) as group:
        group.call("ctx")  # the group is up and answering
        listening = _listening([proc.pid for proc in group.procs])
    assert listening, "the rendezvous store should be listening while the group is up"
    wide = [address for address in listening if address.split(":")[0] not in LOOPBACK]
    assert not wide, f"listening beyond loopback: {wide}"
