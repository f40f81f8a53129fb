"""Hosts as Linux network namespaces, for multi-host tests and benchmarks.

:class:`NetnsHosts` builds N hosts on one switch: each host is a network
namespace with one veth link to a bridge, and the bridge lives in a namespace
of its own, so nothing is added to the caller's namespace and the test subnet
(198.18.0.0/24, RFC 2544's range for benchmarking interconnects) exists only
inside these namespaces. A host's link can be throttled with the kernel's
token bucket (``tbf``, applied at both ends) and pulled (``link_down``: the
switch-side end goes down, the host keeps its address, packets are lost, so
established connections hang until the caller's timeout).

Every name starts with ``ll-<pid>-<n>-``, where ``n`` counts the instances
made in this process (unique while the process lives, unlike an ``id()``).
``close()`` (also on leaving the ``with`` block, on failure, and at
interpreter exit) kills the processes started in the hosts and deletes the
namespaces this instance made (and only those), which deletes their veths
and the bridge. A run that crashed leaves namespaces whose pid is dead: the next
:class:`NetnsHosts` sweeps them (:func:`sweep_stale`). Needs root (or
CAP_NET_ADMIN + CAP_SYS_ADMIN) and ``iproute2``; :func:`netns_available` says
whether this machine allows it and why not.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import IO

from layerlift.linker.child import spawn_child

__all__ = [
    "PREFIX",
    "SUBNET",
    "Host",
    "NetnsHosts",
    "leftover_namespaces",
    "netns_available",
    "sweep_stale",
]

PREFIX = "ll-"
SUBNET = "198.18.0"
_NAME = re.compile(rf"^{PREFIX}(?P<pid>\d+)-")
_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|bps|kbps|mbps|gbps)$")
_instances = itertools.count()  # next() is atomic under the GIL


@dataclass(frozen=True, slots=True)
class Host:
    """One namespace host: ``netns`` is its namespace, ``address`` its IP on the
    switch, ``iface`` its interface (inside the namespace) and ``port`` the
    switch-side end of its link (in the switch namespace)."""

    label: str
    netns: str
    address: str
    iface: str
    port: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_namespace(name: str) -> None:
    """Kill every process inside namespace `name`, then delete it."""
    pids = _ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _ip("netns", "delete", name, check=False)


def sweep_stale() -> list[str]:
    """Delete namespaces named ``ll-<pid>-...`` whose pid is dead; returns their names."""
    swept = []
    for name in _namespaces():
        match = _NAME.match(name)
        if match and not _pid_alive(int(match["pid"])):
            _delete_namespace(name)
            swept.append(name)
    return swept


def leftover_namespaces(pid: int | None = None) -> list[str]:
    """Namespaces that process `pid` (default: this one) made and has not deleted."""
    prefix = f"{PREFIX}{os.getpid() if pid is None else pid}-"
    return [n for n in _namespaces() if n.startswith(prefix)]


def netns_available() -> tuple[bool, str]:
    """Whether this process can build namespace hosts, and if not, why."""
    if sys.platform != "linux":
        return False, "network namespaces are Linux-only"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"the {tool!r} command (iproute2) is missing"
    if os.geteuid() != 0:
        return False, "creating network namespaces needs root"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return False, f"'ip netns add' failed: {made.stderr.strip()}"
    _ip("netns", "delete", probe, check=False)
    return True, ""


class NetnsHosts:
    """N hosts on one switch. Thread-safe; ``close()`` is idempotent.

    ``labels`` names the hosts (``hosts["engine"]``); host ``i`` gets address
    ``198.18.0.<i+2>``. ``rates`` maps a label to a ``tbf`` rate (``"1gbit"``,
    ``"100mbit"``) applied to both ends of that host's link. ``close()``
    gives the processes started in the hosts ``grace_s`` after SIGTERM, then
    SIGKILLs them (their namespaces go away either way). Raises
    ``ValueError`` for bad labels or rates and ``RuntimeError`` (with
    iproute2's message) when the kernel refuses a step; what was built so far
    is torn down before it raises.
    """

    def __init__(
        self,
        labels: Sequence[str],
        *,
        rates: Mapping[str, str] | None = None,
        grace_s: float = 5.0,
    ) -> None:
        labels = list(labels)
        if not labels or len(labels) > 200 or len(set(labels)) != len(labels):
            raise ValueError(f"labels must be 1-200 distinct names, got {labels!r}")
        rates = dict(rates or {})
        unknown = set(rates) - set(labels)
        if unknown:
            raise ValueError(f"rates name hosts that do not exist: {sorted(unknown)}")
        bad = {k: v for k, v in rates.items() if not _RATE.match(v)}
        if bad:
            raise ValueError(f"rates must look like '1gbit' or '100mbit', got {bad!r}")
        self._labels = labels
        self._rates = rates
        self.grace_s = grace_s
        self._tag = f"{PREFIX}{os.getpid()}-{next(_instances)}"
        self.switch = f"{self._tag}-sw"
        self.hosts: dict[str, Host] = {}
        self._made: list[str] = []  # namespaces this instance created, in order
        self._procs: list[subprocess.Popen[bytes]] = []
        self._lock = threading.Lock()
        self._started = False
        self._closed = False

    def __getitem__(self, label: str) -> Host:
        return self.hosts[label]

    def start(self) -> NetnsHosts:
        """Sweep stale namespaces, then build the switch and the hosts."""
        if self._started:
            raise RuntimeError("These NetnsHosts were already started.")
        self._started = True
        sweep_stale()
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _run(self, *args: str) -> None:
        done = _ip(*args, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")

    def _tc(self, netns: str, dev: str, rate: str) -> None:
        cmd = ["ip", "netns", "exec", netns, "tc", "qdisc", "replace", "dev", dev, "root",
               "tbf", "rate", rate, "burst", "128kb", "latency", "50ms"]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")

    def _add_namespace(self, name: str) -> None:
        """``ip netns add`` and remember it as ours (only what was made here
        is ever deleted by ``close``)."""
        self._run("netns", "add", name)
        with self._lock:
            self._made.append(name)

    @property
    def tag(self) -> str:
        """The prefix of every namespace name of this instance."""
        return self._tag

    def _build(self) -> None:
        sw = self.switch
        self._add_namespace(sw)
        self._run("-n", sw, "link", "add", "br0", "type", "bridge")
        self._run("-n", sw, "link", "set", "br0", "up")
        for i, label in enumerate(self._labels):
            netns = f"{self._tag}-h{i}"
            host = Host(label, netns, f"{SUBNET}.{i + 2}", "eth0", f"p{i}")
            self.hosts[label] = host
            self._add_namespace(netns)
            self._run("-n", netns, "link", "set", "lo", "up")
            self._run("-n", sw, "link", "add", host.port, "type", "veth",
                      "peer", "name", host.iface, "netns", netns)  # fmt: skip
            self._run("-n", sw, "link", "set", host.port, "master", "br0")
            self._run("-n", sw, "link", "set", host.port, "up")
            self._run("-n", netns, "addr", "add", f"{host.address}/24", "dev", host.iface)
            self._run("-n", netns, "link", "set", host.iface, "up")
            if label in self._rates:
                self.set_rate(label, self._rates[label])

    def set_rate(self, label: str, rate: str) -> None:
        """Throttle `label`'s link to `rate` at both ends (``tbf``)."""
        if not _RATE.match(rate):
            raise ValueError(f"rate must look like '1gbit' or '100mbit', got {rate!r}")
        host = self.hosts[label]
        self._tc(host.netns, host.iface, rate)
        self._tc(self.switch, host.port, rate)

    def link_down(self, label: str) -> None:
        """Pull `label`'s cable: its switch port goes down; its packets are lost."""
        self._run("-n", self.switch, "link", "set", self.hosts[label].port, "down")

    def link_up(self, label: str) -> None:
        """Plug `label`'s cable back in."""
        self._run("-n", self.switch, "link", "set", self.hosts[label].port, "up")

    def popen(
        self,
        label: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        stdin: int | None = subprocess.DEVNULL,
        stdout: int | None = None,
        stderr: int | IO[bytes] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start `argv` inside host `label` in its own process group. It is killed
        on ``close()`` and, on Linux, when this process dies (``spawn_child``)."""
        with self._lock:
            if self._closed or not self._started:
                raise RuntimeError("NetnsHosts are not running (start() them first).")
            proc = spawn_child(
                ["ip", "netns", "exec", self.hosts[label].netns, *argv],
                name=f"netns-{label}",
                env=dict(env) if env is not None else None,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                cwd=cwd,
                start_new_session=True,
            )
            self._procs.append(proc)
            return proc

    def run(self, label: str, argv: Sequence[str], timeout_s: float = 30.0) -> str:
        """Run `argv` inside host `label` to completion; returns its stdout.
        Raises ``subprocess.CalledProcessError`` on a non-zero exit."""
        done = subprocess.run(
            ["ip", "netns", "exec", self.hosts[label].netns, *argv],
            capture_output=True, text=True, timeout=timeout_s, check=True,
        )  # fmt: skip
        return done.stdout

    @staticmethod
    def kill(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
        """Send `sig` to `proc`'s process group and reap it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def close(self) -> None:
        """Kill the processes started in the hosts and delete every namespace. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            procs, self._procs = self._procs, []
        atexit.unregister(self.close)
        for proc in reversed(procs):  # clients before the servers they were started after
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill(proc)
        with self._lock:
            made, self._made = self._made, []
        for name in reversed(made):  # only what this instance made
            _delete_namespace(name)

    def __enter__(self) -> NetnsHosts:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
