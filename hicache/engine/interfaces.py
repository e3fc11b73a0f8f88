"""Which network interface a rank's gloo binds (docs/DESIGN.md, "engine"): the one that reaches the
rendezvous host.

Left to itself, gloo binds the address the machine's hostname resolves to, which on many hosts (and in
every network namespace) is 127.0.0.1 or an address of another interface: the ranks of another node are
then told to connect to an address they cannot reach, and the job hangs until --dist-timeout. The
interface the kernel routes to the --dist-init-addr host is the one every node can reach this one by
(node 0 included: its own address there is local). GLOO_SOCKET_IFNAME, when the user sets it, wins.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct

GLOO_INTERFACE_VAR = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
_IFNAMSIZ = 16

logger = logging.getLogger(__name__)


def route_source(host: str, port: int) -> str:
    """The local IPv4 address the kernel picks to reach (host, port); no packet is sent (a UDP connect)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), port))
        return probe.getsockname()[0]


def interface_with_address(address: str) -> str | None:
    """The name of the interface holding the IPv4 `address`, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[: _IFNAMSIZ - 1])
            try:
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(answer[20:24]) == address:
                return name
    return None


def choose_gloo_interface(init_method: str) -> None:
    """Before joining a tcp://HOST:PORT rendezvous: point gloo at the interface that reaches HOST,
    unless the user chose one (or the rendezvous is env://, torchrun's, where MASTER_ADDR's node
    configures its own)."""
    if GLOO_INTERFACE_VAR in os.environ or not init_method.startswith("tcp://"):
        return
    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    name = interface_with_address(route_source(host.strip("[]"), int(port)))
    if name is not None:
        os.environ[GLOO_INTERFACE_VAR] = name
        logger.info("gloo binds %s, the interface that reaches the rendezvous host %s", name, host)
