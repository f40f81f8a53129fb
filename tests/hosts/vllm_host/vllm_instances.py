"""Helpers of the vLLM host tests: the `Instance` client (from
`layerlift.testing.vllm_verify`), a `vllm serve` process with its HTTP client
(`Server`) and a store-level corruption."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from layerlift.linker.master import EmbeddedMaster, port_open
from layerlift.testing.vllm_verify import Instance

__all__ = ["Instance", "Server", "corrupt_object", "wait_logged"]


def corrupt_object(master: EmbeddedMaster, key: str) -> bytes:
    """Flip one byte in the middle of the object stored under ``key`` (a raw
    Mooncake client: read it, upsert the spoiled copy, read it back: the
    reads lease it); return the spoiled bytes."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    rc = client.setup("127.0.0.1", master.metadata_url, 0, 16 << 20, "tcp", "",
                      master.master_address)
    assert rc == 0, f"raw Mooncake client setup returned {rc}"
    def read() -> bytes:
        # A raw get answers b"" when the read outlived the master's lease
        # (LEASE_EXPIRED on a loaded machine: the session master's is 50 ms):
        # read again, a few times, before calling the object missing.
        for _ in range(10):
            got = bytes(client.get(key))
            if got:
                return got
        return b""

    try:
        data = bytearray(read())
        assert data, f"{key} is not in the store"
        data[len(data) // 2] ^= 0xFF
        assert client.upsert(key, bytes(data)) == 0
        assert read() == bytes(data)
    finally:
        client.close()
    return bytes(data)


def wait_logged(inst: Instance, text: str, count: int = 1, timeout_s: float = 60.0) -> None:
    """Until ``inst``'s log holds ``text`` ``count`` times (the worker logs
    from its background threads; reading the store instead would renew the
    object's read lease and keep it from being replaced)."""
    deadline = time.monotonic() + timeout_s
    while inst.log_text().count(text) < count:
        assert time.monotonic() < deadline, f"{text!r} never appeared in {inst.log_path}"
        time.sleep(0.2)


class Server:
    """A `vllm serve` child process (the OpenAI-compatible API server) and its
    HTTP client. ``argv`` is the command without ``--host``/``--port``; the
    server's output goes to ``log_path`` through a reader thread, which sets
    an event when uvicorn reports the application started (or the process
    ended), so start-up is waited for without polling. Every wait is bounded."""

    READY = "Application startup complete"

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None,
                 start_timeout_s: float = 900.0) -> None:
        from layerlift.linker.master import free_port

        self.port = free_port()
        self.log_path = log_path
        self._log = log_path.open("w")
        self._ready = threading.Event()
        env = dict(os.environ, MC_LOG_LEVEL="ERROR", GLOG_minloglevel="2",
                   PYTHONUNBUFFERED="1", **(env or {}))
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
        self.argv = [*argv, "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)  # `kill` ends its children too
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.start_timeout_s = start_timeout_s

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.write(line)
            if self.READY in line:
                self._log.flush()
                self._ready.set()
        self._log.flush()
        self._ready.set()  # exited: wait_ready reports it

    def wait_ready(self) -> None:
        """Until the server accepts requests; AssertionError (with the log's
        tail) when it exited or took longer than ``start_timeout_s``."""
        if not self._ready.wait(self.start_timeout_s):
            self.kill()
            raise AssertionError(f"vllm serve did not start in {self.start_timeout_s:.0f} s; "
                                 f"log: {self.log_path}")
        if self.proc.poll() is not None:
            raise AssertionError(f"vllm serve exited (code {self.proc.returncode}); "
                                 f"log tail:\n{self.log_tail()}")
        # uvicorn reports the application started before it listens (once, in
        # CI, a request right after that line was refused): wait, bounded,
        # until the port takes a connection.
        deadline = time.monotonic() + 60.0
        while not port_open("127.0.0.1", self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"vllm serve reported start-up but port {self.port} "
                                     f"takes no connection; log tail:\n{self.log_tail()}")
            time.sleep(0.1)

    def post(self, path: str, body: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
        """POST ``body`` as JSON to ``path``; the JSON answer (AssertionError
        with the server's message on an HTTP error)."""
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as reply:
                answer: dict[str, Any] = json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{path} answered {exc.code}: {exc.read()[:2000]!r}") from None
        return answer

    def get(self, path: str, timeout_s: float = 60.0) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}",
                                    timeout=timeout_s) as reply:
            text: str = reply.read().decode()
        return text

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def close(self, timeout_s: float = 60.0) -> None:
        """SIGINT (vLLM's orderly shutdown), then SIGKILL after ``timeout_s``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reader.join(10)
        self._log.flush()

    def kill(self) -> None:
        """SIGKILL the server's process group (its engine core and worker with it)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
