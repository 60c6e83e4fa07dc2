"""Where a rank's collectives listen: the network interface that holds the rendezvous address.

Gloo's peer sockets do not follow the rendezvous: unless GLOO_SOCKET_IFNAME names an interface,
each rank binds the address its hostname resolves to, which on most hosts is a public one, so a
group told to meet on 127.0.0.1 still accepted connections from the network. Naming the interface
that holds the rendezvous address keeps every socket of the group where the user put the group."""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

from ster_dist.errors import Refusal

_SIOCGIFADDR = 0x8915


def _ipv4_of(interface: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(
                sock.fileno(), _SIOCGIFADDR, struct.pack("256s", interface.encode()[:15])
            )
        except OSError:  # no IPv4 address on it
            return None
    return socket.inet_ntoa(packed[20:24])


def _ipv6_interfaces() -> dict[str, str]:
    """IPv6 address (compressed) -> interface, as /proc/net/if_inet6 lists them (Linux)."""
    found = {}
    try:
        with open("/proc/net/if_inet6") as table:
            for row in table:
                fields = row.split()
                if len(fields) == 6:
                    found[str(ipaddress.IPv6Address(int(fields[0], 16)))] = fields[5]
    except OSError:
        pass
    return found


def interface_holding(host: str) -> str:
    """The name of the interface whose address `host` is (a name is resolved first); a refusal when
    none is."""
    try:
        address = ipaddress.ip_address(socket.getaddrinfo(host, None)[0][4][0].split("%")[0])
    except (OSError, ValueError, IndexError):
        raise Refusal(
            f"the rendezvous host {host!r} does not resolve to an address; "
            "give this node's own address (STER_RENDEZVOUS_HOST)"
        ) from None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if isinstance(address, ipaddress.IPv4Address):
        for _, name in socket.if_nameindex():
            if _ipv4_of(name) == str(address):
                return name
    else:
        name = _ipv6_interfaces().get(str(address))
        if name is not None:
            return name
    raise Refusal(
        f"no network interface of this node holds the rendezvous address {address}; "
        "give this node's own address (STER_RENDEZVOUS_HOST) or set GLOO_SOCKET_IFNAME"
    )


def bind_collectives_to(host: str) -> None:
    """Make gloo groups created from now on in this process listen on the interface holding `host`
    (GLOO_SOCKET_IFNAME), unless the user named interfaces already."""
    if not os.environ.get("GLOO_SOCKET_IFNAME"):
        os.environ["GLOO_SOCKET_IFNAME"] = interface_holding(host)
