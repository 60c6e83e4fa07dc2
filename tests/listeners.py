"""Which addresses processes listen on, read from the kernel's socket tables (/proc/net/tcp{,6})."""

from __future__ import annotations

import os
import socket

from ster_dist.workers.bind import _ipv4_of

# 127.0.0.1, ::1 and ::ffff:127.0.0.1 as /proc/net spells them
LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
LISTEN = "0A"


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # gone, or not ours to read
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed while we looked
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def listening(pids: list[int]) -> list[str]:
    """local_address:port (hex, as /proc/net/tcp{,6} print it) of each LISTEN socket the pids
    own."""
    inodes = set().union(*(socket_inodes(pid) for pid in pids))
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                if fields[3] == LISTEN and fields[9] in inodes:
                    found.append(fields[1])
    return found


def descendants(pid: int) -> list[int]:
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


def proc_net_ipv4(address: str) -> str:
    return socket.inet_aton(address)[::-1].hex().upper()


def public_ipv4() -> str | None:
    for _, name in socket.if_nameindex():
        address = _ipv4_of(name)
        if address is not None and not address.startswith("127."):
            return address
    return None


def beyond_loopback(addresses: list[str]) -> list[str]:
    return [address for address in addresses if address.split(":")[0] not in LOOPBACK]


def who_listens_beyond_loopback(pids: list[int]) -> dict[str, list[str]]:
    """Each process (pid and command) with a listener beyond loopback, and those listeners."""
    found = {}
    for pid in pids:
        wide = beyond_loopback(listening([pid]))
        if wide:
            try:
                with open(f"/proc/{pid}/cmdline") as cmdline:
                    command = cmdline.read().replace("\0", " ")[:80]
            except OSError:
                command = "?"
            found[f"{pid} {command}"] = wide
    return found
