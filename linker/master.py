"""`EmbeddedMaster`: run a private `mooncake_master` on loopback (tests, benchmarks, CLI).

It binds what it can to `host` (default 127.0.0.1): the RPC server
(`--rpc_address`) and the metrics server (`--metrics_host`). The HTTP metadata
server is told the same host (`--http_metadata_server_host`) but Mooncake
0.3.13 binds it to 0.0.0.0 regardless (seen with `ss -ltnp`): pass
`http_metadata=False` where clients can use "P2PHANDSHAKE" instead (the
engine's embedded default does), and the master listens on `host` only.

The master runs in its own process group with its output in a log file. It is
stopped on `stop()`, on leaving the `with` block (also on exceptions and
KeyboardInterrupt) and, on Linux, killed by the kernel if the Python parent
dies abruptly (PR_SET_PDEATHSIG). That signal fires when the *thread* that
forked the master exits, so the master is forked from a keeper thread that
lives as long as it does (``linker/child.py``): ``start()`` may run in any
thread, a short-lived worker included.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, NoReturn

from layerlift.linker.child import spawn_child
from layerlift.linker.mooncake_config import MooncakeConfig
from layerlift.linker.store_base import StoreUnavailable

_BINARY = "mooncake_master"
# strerror(EAGAIN): what a master's log ends with when the system refused it a
# thread (Go's "runtime/cgo: pthread_create failed: ...", glog's own lines).
_REFUSED = "Resource temporarily unavailable"


class _TransientExit(StoreUnavailable):
    """The master exited during startup because the system refused it a resource."""


def find_master_binary() -> str:
    """Path of `mooncake_master`: next to `sys.executable`, in the installed `mooncake`
    package, then on PATH. Raises FileNotFoundError naming the places searched."""
    candidates = [Path(sys.executable).parent / _BINARY]
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / _BINARY for p in spec.submodule_search_locations]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    found = shutil.which(_BINARY)
    if found:
        return found
    raise FileNotFoundError(
        f"Cannot find the {_BINARY} binary (looked in {', '.join(map(str, candidates))} and "
        "on PATH); install LayerLift with the 'cpu' or 'cuda' extra, which ships it."
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def port_open(host: str, port: int) -> bool:
    """True when ``host:port`` takes a TCP connection now (0.2 s at most)."""
    try:
        socket.create_connection((host, port), timeout=0.2).close()
    except OSError:
        return False
    return True


class EmbeddedMaster:
    """A `mooncake_master` child process on `host`. Not thread-safe; `stop()` is idempotent.

    Ports left as None are picked free. `host` is the address it binds and
    clients dial (127.0.0.1; a namespace host's address across namespaces).
    `http_metadata=False` runs no HTTP metadata server (clients then use
    "P2PHANDSHAKE"; `metadata_url` is that string). `lease_ttl_ms` is the master's
    `--default_kv_lease_ttl` (milliseconds): how long a read's lease holds an
    object against `remove`. The default, 5000, is what the CLI, the engine's
    `store="embedded"`, the SGLang adapter and the benchmarks pass
    (`mooncake_master`'s own default is 10 s in 0.3.13); a read that takes
    longer than the lease fails with LEASE_EXPIRED (-707) unless the store
    renews the session. The test suite's session master passes 50 ms so that
    tests can `remove` soon after a read. `start()`
    raises FileNotFoundError if the binary is missing and StoreUnavailable
    (with the log's last lines) if the master does not accept connections
    within `start_timeout_s`; a start the system refused a thread is tried
    again (`start_attempts` in all; `restarts` counts them).
    """

    def __init__(
        self,
        *,
        rpc_port: int | None = None,
        http_port: int | None = None,
        metrics_port: int | None = None,
        log_path: str | os.PathLike[str] | None = None,
        lease_ttl_ms: int = 5000,
        start_timeout_s: float = 20.0,
        stop_timeout_s: float = 5.0,
        binary: str | None = None,
        host: str = "127.0.0.1",
        http_metadata: bool = True,
        start_attempts: int = 3,
    ) -> None:
        if lease_ttl_ms <= 0 or start_timeout_s <= 0 or stop_timeout_s <= 0:
            raise ValueError("lease_ttl_ms, start_timeout_s and stop_timeout_s must be positive.")
        if start_attempts < 1:
            raise ValueError(f"start_attempts must be at least 1, got {start_attempts}.")
        self.start_attempts = start_attempts
        self.restarts = 0
        self._log_start = 0
        self.host = host
        self.http_metadata = http_metadata
        self.rpc_port = rpc_port or free_port(host)
        self.http_port = http_port or free_port(host)
        self.metrics_port = metrics_port or free_port(host)
        if log_path is None:
            log_path = Path(tempfile.mkdtemp(prefix="layerlift-master-")) / "mooncake_master.log"
        self.log_path = Path(log_path)
        self.lease_ttl_ms = lease_ttl_ms
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._binary = binary
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def master_address(self) -> str:
        """The RPC address clients pass as `MooncakeConfig.master_address`."""
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        """What clients pass as `MooncakeConfig.metadata_server`: the HTTP metadata
        server's URL, or "P2PHANDSHAKE" when the master runs none."""
        if not self.http_metadata:
            return "P2PHANDSHAKE"
        return f"http://{self.host}:{self.http_port}/metadata"

    @property
    def pid(self) -> int | None:
        """The master's process id while started, else None."""
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def config(self, **overrides: Any) -> MooncakeConfig:
        """A `MooncakeConfig` for a client of this master; keyword arguments override fields."""
        fields: dict[str, Any] = {
            "master_address": self.master_address,
            "metadata_server": self.metadata_url,
        }
        fields.update(overrides)
        return MooncakeConfig(**fields)

    def command(self) -> list[str]:
        metadata = [
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host", self.host,
            "--http_metadata_server_port", str(self.http_port),
        ] if self.http_metadata else ["--enable_http_metadata_server=false"]  # fmt: skip
        return [
            self._binary or find_master_binary(),
            "--rpc_address", self.host,
            "--rpc_port", str(self.rpc_port),
            *metadata,
            "--metrics_host", self.host,
            "--metrics_port", str(self.metrics_port),
            "--default_kv_lease_ttl", str(self.lease_ttl_ms),
        ]  # fmt: skip

    def start(self) -> EmbeddedMaster:
        """Start the master and wait until its RPC and metadata ports accept connections.

        A master that dies during startup because the system refused it a
        thread or memory for the moment (its log says "Resource temporarily
        unavailable": EAGAIN from ``pthread_create``, seen on a machine
        running two test lanes), or whose fork was refused (EAGAIN), is started again, `start_attempts` times in
        all, after 0.5 s, 1 s, ...: such a refusal passes once the other
        processes' threads ended. Any other exit, and a master that never
        accepts connections, raise at once."""
        if self._proc is not None:
            raise RuntimeError("This EmbeddedMaster was already started.")
        command = self.command()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        for attempt in range(1, self.start_attempts + 1):
            try:
                self._spawn(command, append=attempt > 1)
                self._wait_ready()
            except (_TransientExit, BlockingIOError) as exc:  # BlockingIOError: fork's EAGAIN
                self.stop()
                if attempt == self.start_attempts:
                    raise StoreUnavailable(
                        f"mooncake_master was refused resources at each of its "
                        f"{self.start_attempts} starts; the last: {exc}"
                    ) from None
                time.sleep(0.5 * attempt)
            except BaseException:
                self.stop()
                raise
            else:
                self.restarts = attempt - 1
                return self
        raise AssertionError("unreachable")  # pragma: no cover

    def _spawn(self, command: list[str], *, append: bool) -> None:
        self._log = open(self.log_path, "ab" if append else "wb")  # noqa: SIM115 — closed in stop()
        if append:
            self._log.write(b"\n== started again: the start before was refused resources ==\n")
            self._log.flush()
        self._log_start = self._log.tell()  # this start's own lines begin here
        # From a keeper thread of its own: start() often runs in a worker
        # thread, whose exit would fire the parent-death signal (linker/child.py).
        self._proc = spawn_child(
            command,
            name="mooncake_master",
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        ports = (self.rpc_port, self.http_port) if self.http_metadata else (self.rpc_port,)
        for port in ports:
            while not port_open(self.host, port):
                if self._proc.poll() is not None:
                    message = (
                        f"mooncake_master exited with code {self._proc.returncode} during "
                        f"startup. Last lines of {self.log_path}:\n{self.log_tail()}"
                    )
                    if _REFUSED in self._own_log():
                        raise _TransientExit(message)
                    raise StoreUnavailable(message)
                if time.monotonic() > deadline:
                    raise StoreUnavailable(
                        f"mooncake_master did not accept connections on port {port} within "
                        f"{self.start_timeout_s:g} s. Last lines of {self.log_path}:\n"
                        f"{self.log_tail()}"
                    )
                time.sleep(0.02)

    def _own_log(self) -> str:
        """What this start of the master wrote to the log (not the starts before)."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_start)
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 20) -> str:
        """The last `lines` lines of the master's log ("" if there is none yet)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM the master's process group, SIGKILL after `stop_timeout_s`, wait. Idempotent."""
        proc, self._proc = self._proc, None
        try:
            if proc is not None and proc.poll() is None:
                self._signal(proc, signal.SIGTERM)
                try:
                    proc.wait(self.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    self._signal(proc, signal.SIGKILL)
                    proc.wait()
        finally:
            if proc is not None and proc.poll() is None:  # interrupted above: make sure
                self._signal(proc, signal.SIGKILL)
                proc.wait()
            if self._log is not None:
                self._log.close()
                self._log = None

    @staticmethod
    def _signal(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)

    def __enter__(self) -> EmbeddedMaster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class OneLineParser(argparse.ArgumentParser):
    """argparse with the CLI's convention: a usage error is one line on
    stderr (``PROG: error: ...``) and exit status 2 (``layerlift master``,
    ``layerlift store-node``; the benchmarks' parser does the same)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} "
                     f"(see {self.prog} --help)\n")


def main(argv: Sequence[str] | None = None) -> int:
    """`layerlift master`: run a master in the foreground until Ctrl-C or SIGTERM."""
    parser = OneLineParser(prog="layerlift master", description=main.__doc__)
    parser.add_argument("--rpc-port", type=int, default=None, help="RPC port (default: free)")
    parser.add_argument("--http-port", type=int, default=None, help="metadata HTTP port")
    parser.add_argument("--metrics-port", type=int, default=None, help="metrics port")
    parser.add_argument("--log", default=None, help="log file (default: in a temp dir)")
    parser.add_argument("--lease-ttl-ms", type=int, default=5000, help="object read lease")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind and advertise (default 127.0.0.1)"
    )
    parser.add_argument(
        "--p2p",
        action="store_true",
        help="run no HTTP metadata server (Mooncake binds it to 0.0.0.0 whatever --host "
        "says); clients then use metadata 'P2PHANDSHAKE'",
    )
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    master = EmbeddedMaster(
        rpc_port=args.rpc_port,
        http_port=args.http_port,
        metrics_port=args.metrics_port,
        log_path=args.log,
        lease_ttl_ms=args.lease_ttl_ms,
        host=args.host,
        http_metadata=not args.p2p,
    )
    try:
        with master:
            print(f"master_address  {master.master_address}", flush=True)
            print(f"metadata_server {master.metadata_url}", flush=True)
            print(f"log             {master.log_path}   (Ctrl-C to stop)", flush=True)
            while master.running:
                time.sleep(0.5)
            print(f"mooncake_master exited:\n{master.log_tail()}", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        return 0
    except (FileNotFoundError, StoreUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
