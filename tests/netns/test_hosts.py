"""`NetnsHosts` itself: reachability, a pulled link, the kernel's rate, the sweep."""

from __future__ import annotations

import subprocess
import sys

import pytest

from layerlift.testing import NetnsHosts
from layerlift.testing.netns import PREFIX, leftover_namespaces, sweep_stale

pytestmark = pytest.mark.netns

_SERVER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5000))
s.listen()
print("ready", flush=True)
while True:
    c, _ = s.accept()
    c.sendall(b"x" * int(sys.argv[1]))
    c.close()
"""
_CLIENT = """
import socket, sys, time
t = time.monotonic()
c = socket.create_connection((sys.argv[1], 5000), timeout=float(sys.argv[2]))
n = 0
while chunk := c.recv(1 << 16):
    n += len(chunk)
print(n, time.monotonic() - t)
"""
SIZE = 1 << 20


def _fetch(hosts: NetnsHosts, timeout_s: float) -> tuple[int, float]:
    out = hosts.run("b", [sys.executable, "-c", _CLIENT, hosts["a"].address, str(timeout_s)])
    n, seconds = out.split()
    return int(n), float(seconds)


def test_hosts_reach_each_other_and_a_pulled_link_cuts_them_off() -> None:
    with NetnsHosts(["a", "b"], rates={"b": "20mbit"}, grace_s=0.5) as hosts:
        server = hosts.popen("a", [sys.executable, "-c", _SERVER, str(SIZE)],
                             stdout=subprocess.PIPE)  # fmt: skip
        assert server.stdout is not None and server.stdout.readline() == b"ready\n"
        n, seconds = _fetch(hosts, 5.0)
        assert n == SIZE
        assert seconds >= 0.8 * SIZE * 8 / 20e6  # the kernel holds the link to 20 Mbit/s
        hosts.link_down("b")
        with pytest.raises(subprocess.CalledProcessError):
            _fetch(hosts, 1.0)
        hosts.link_up("b")
        assert _fetch(hosts, 5.0)[0] == SIZE
        namespaces = [h.netns for h in hosts.hosts.values()] + [hosts.switch]
    assert server.poll() is not None  # closing killed what ran in the hosts
    assert not set(namespaces) & set(leftover_namespaces())


def test_stale_namespaces_of_dead_processes_are_swept() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"{PREFIX}{dead.pid}-stale"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in sweep_stale()
        assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                          text=True, check=True).stdout  # fmt: skip
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="distinct"):
        NetnsHosts(["a", "a"])
    with pytest.raises(ValueError, match="do not exist"):
        NetnsHosts(["a"], rates={"b": "1gbit"})
    with pytest.raises(ValueError, match="1gbit"):
        NetnsHosts(["a"], rates={"a": "fast"})


def test_a_failed_start_leaves_nothing() -> None:
    # "0bit" passes our check but tc refuses it, after the first host was built
    hosts = NetnsHosts(["a", "b"], rates={"b": "0bit"})
    with pytest.raises(RuntimeError, match="tc qdisc"):
        hosts.start()
    assert not leftover_namespaces()


def test_sweeping_spares_the_living() -> None:
    with NetnsHosts(["a"], grace_s=0.5) as hosts:
        sweep_stale()
        assert hosts["a"].netns in leftover_namespaces()
    assert not leftover_namespaces()
