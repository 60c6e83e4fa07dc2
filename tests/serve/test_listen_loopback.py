"""Issue 19: what ster_dist starts listens only where it was told to (127.0.0.1 locally), never on
every interface.

init_method="tcp://127.0.0.1:PORT" made rank 0's rendezvous store listen on *:PORT, and gloo's peer
sockets bound whatever address the hostname resolves to; the group and an embedded Ray cluster are
brought up for real here and the kernel's socket tables name every listening address."""

from __future__ import annotations

import os

import pytest

from ster_dist.workers.spawn import SpawnGroup
from tests.listeners import beyond_loopback, descendants, listening, proc_net_ipv4, public_ipv4


def test_a_two_rank_group_listens_on_loopback_only():
    with SpawnGroup(2) as group:
        group.call("ctx")  # the group is up and answering
        addresses = listening([proc.pid for proc in group.procs])
    assert addresses, "the rendezvous store should be listening while the group is up"
    wide = beyond_loopback(addresses)
    assert not wide, f"listening beyond loopback: {wide}"


def test_a_group_told_another_address_listens_there_alone():
    """Gloo's peer sockets follow the rendezvous address, not the hostname's (which resolves
    elsewhere)."""
    host = public_ipv4()
    if host is None:
        pytest.skip("this machine has no non-loopback IPv4 address to meet on")
    with SpawnGroup(2, host=host) as group:
        assert group.call("ctx")
        addresses = listening([proc.pid for proc in group.procs])
    elsewhere = [address for address in addresses if address.split(":")[0] != proc_net_ipv4(host)]
    assert len(addresses) >= 2, "the rendezvous store and gloo's sockets should be listening"
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
            addresses = listening(descendants(os.getpid()))
        finally:
            group.close()
    finally:
        ray.shutdown()
    assert len(addresses) >= 4, f"Ray's servers should be listening: {addresses}"
    wide = beyond_loopback(addresses)
    assert not wide, f"listening beyond loopback: {wide}"
