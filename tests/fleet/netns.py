"""Several "hosts" on one machine for the fleet tests: one Linux network namespace per host, each with
its own address on one subnet, wired by a veth pair per host to a bridge that sits in a namespace of its
own (so nothing is added to the machine's own namespace and its firewall sees none of this traffic).
Made and removed by the test: namespace names carry this process's id, so parallel runs do not collide;
interface names and addresses live inside the namespaces and may repeat between runs.

A process is put on a host with `ip netns exec` (`Host.command`); the test itself talks to a host from
a thread that has entered that host's namespace (`Host.call`): a socket belongs to the namespace of the
thread that makes it, so the test's requests travel over the veths like any other host's.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

SUBNET = "10.231.0"  # a /24 inside the run's own namespaces: it never meets the machine's networks
_CLONE_NEWNET = 0x40000000
T = TypeVar("T")


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _enter(namespace: str) -> None:
    """Move the calling thread into `namespace` (setns(2); os.setns is Python 3.12's)."""
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace}")
    finally:
        os.close(fd)


class Host:
    """One namespace with one address; `call` runs a function on a thread inside it."""

    def __init__(self, namespace: str, address: str) -> None:
        self.namespace = namespace
        self.address = address
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=namespace, initializer=_enter, initargs=(namespace,))

    def command(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *argv]

    def call(self, fn: Callable[..., T], *args: object) -> T:
        return self._thread.submit(fn, *args).result()

    def close(self) -> None:
        self._thread.shutdown(wait=True)


def unavailable() -> str | None:
    """Why this machine cannot make namespaces for the test, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) to make network namespaces"
    return None


@contextlib.contextmanager
def network(names: Sequence[str]) -> Iterator[dict[str, Host]]:
    """One host per name, at SUBNET.2, .3, ... in order, on one bridge; every namespace is removed on
    the way out (which removes its veths), whatever happened. The caller stops its processes first."""
    tag = f"hicache{os.getpid()}"
    switch = f"{tag}-switch"
    made: list[str] = []
    hosts: dict[str, Host] = {}
    try:
        _ip("netns", "add", switch)
        made.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i, name in enumerate(names):
            namespace, address, port = f"{tag}-{name}", f"{SUBNET}.{i + 2}", f"port{i}"
            _ip("netns", "add", namespace)
            made.append(namespace)
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("link", "add", "eth0", "netns", namespace, "type", "veth", "peer", "name", port, "netns", switch)
            _ip("-n", switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            hosts[name] = Host(namespace, address)
        yield hosts
    finally:
        for host in hosts.values():
            host.close()
        for namespace in reversed(made):
            with contextlib.suppress(OSError):
                _ip("netns", "del", namespace)
