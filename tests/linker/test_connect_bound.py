"""Connecting fails fast and clearly, and a cancelled open leaves nothing running.

Against real sockets: a closed port (refused), a name that does not resolve,
and a listener whose accept queue is full (no answer); each must fail within
the connect bound with one sentence naming the address (a bound check, not a
timing benchmark). Cancelling ``open_store_owned`` (``task.cancel()``,
``asyncio.wait_for``) while its thread is mid-flight, against a real
embedded master, must close the client and stop the master. Mooncake's glog
lines are quiet for a library user unless asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from layerlift import Engine, EngineConfig, HybridModel, ModelSpec
from layerlift.engine import stores
from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.mooncake_config import check_reachable
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.linker.store_base import StoreUnavailable

BOUND_S = 15.0  # the bound on the whole failure, connect included


@contextlib.contextmanager
def closed_port() -> Iterator[int]:
    """A loopback port held (bound, not listening): a connect is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@contextlib.contextmanager
def full_listener() -> Iterator[int]:
    """A loopback listener that never accepts, its accept queue filled until a
    connect gets no answer: the next connect hangs like one to a black hole."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    fill: list[socket.socket] = []
    try:
        while len(fill) < 64:
            sock = socket.socket()
            sock.settimeout(0.3)
            fill.append(sock)
            try:
                sock.connect(("127.0.0.1", port))
            except TimeoutError:
                break
        else:
            pytest.fail("the listener's accept queue never filled")
        yield port
    finally:
        for sock in fill:
            sock.close()
        srv.close()


def _model() -> HybridModel:
    return HybridModel(ModelSpec.preset("tiny"), seed=0)


async def _start_fails(url: str) -> tuple[str, float]:
    engine = Engine(_model(), EngineConfig(store=url, connect_timeout_s=5.0))
    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as exc:
        await asyncio.wait_for(engine.start(), 60)
    return str(exc.value), time.monotonic() - started


async def test_a_refused_master_fails_within_the_bound_naming_it() -> None:
    with closed_port() as port:
        message, took = await _start_fails(f"mooncake://127.0.0.1:{port}")
    assert took < BOUND_S, f"took {took:.1f} s"
    assert f"127.0.0.1:{port}" in message and "refused" in message
    assert message.count(". ") == 0 and "\n" not in message  # one sentence


@pytest.mark.parametrize("host", ["nonexistent", "nonexistent.invalid"])
async def test_a_name_that_does_not_resolve_fails_within_the_bound(host: str) -> None:
    message, took = await _start_fails(f"mooncake://{host}:1")
    assert took < BOUND_S, f"took {took:.1f} s"
    assert f"{host}:1" in message
    # .invalid never resolves (RFC 6761); a bare name might, through a search
    # domain or a resolver that answers everything: then port 1 refuses
    reasons = ("does not resolve",) if host.endswith(".invalid") else (
        "does not resolve", "refused", "no answer")
    assert any(r in message for r in reasons), message


def test_no_answer_fails_at_the_connect_bound_and_names_it() -> None:
    with full_listener() as port:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match=r"no answer within 1 s \(connect_timeout_s=1\)"):
            check_reachable("the Mooncake master", f"127.0.0.1:{port}", 1.0)
        took = time.monotonic() - started
    assert 1.0 <= took < 1.0 + 5.0, f"took {took:.1f} s"


def test_an_unreachable_metadata_server_is_named() -> None:
    from layerlift.linker.mooncake_config import MooncakeConfig

    with closed_port() as port, closed_port() as meta:
        cfg = MooncakeConfig(master_address=f"127.0.0.1:{port}",
                             metadata_server=f"http://127.0.0.1:{meta}/metadata")
        assert [a for _, a in cfg.endpoints()] == [f"127.0.0.1:{port}", f"127.0.0.1:{meta}"]
        with pytest.raises(StoreUnavailable, match=f"metadata server at 127.0.0.1:{meta}"):
            check_reachable(*cfg.endpoints()[1], 1.0)


def test_a_listening_master_passes_the_check(mooncake_master: EmbeddedMaster) -> None:
    check_reachable("the Mooncake master", mooncake_master.master_address, 1.0)


# ---- a cancelled open leaves no client and no master running (real embedded master)
class _Recorder:
    """Patches the store and master classes ``open_store`` uses to record
    their instances; ``gate`` (when given) holds the store's constructor
    until the test sets it, after signalling ``entered``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, gate: bool) -> None:
        self.entered, self.proceed = threading.Event(), threading.Event()
        self.stores: list[MooncakeStore] = []
        self.masters: list[EmbeddedMaster] = []
        rec = self
        if not gate:
            self.proceed.set()

        class Store(MooncakeStore):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                rec.entered.set()
                rec.proceed.wait(60)
                super().__init__(*args, **kwargs)
                rec.stores.append(self)

        class Master(EmbeddedMaster):
            def start(self) -> EmbeddedMaster:
                rec.masters.append(self)
                return super().start()

        real = stores.open_store
        self.cancel = threading.Event()  # replaced by the open's own event
        self.opening = threading.Event()  # set once it was

        def spy(cfg: EngineConfig, cancel: threading.Event | None = None) -> stores.StoreHandle:
            if cancel is not None:
                self.cancel = cancel
            self.opening.set()
            return real(cfg, cancel)

        monkeypatch.setattr(stores, "MooncakeStore", Store)
        monkeypatch.setattr(stores, "EmbeddedMaster", Master)
        monkeypatch.setattr(stores, "open_store", spy)

    def assert_nothing_runs(self, client_made: bool = True) -> None:
        assert self.masters, "the open never got as far as the master"
        assert self.stores or not client_made, "the open never got as far as the client"
        assert all(s._closed for s in self.stores), "a client was left running"
        assert not any(m.running for m in self.masters), "a master was left running"


@pytest.mark.mooncake
async def test_task_cancel_mid_open_closes_client_and_master(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rec = _Recorder(monkeypatch, gate=True)
    task = asyncio.ensure_future(stores.open_store_owned(EngineConfig(segment_bytes=16 << 20)))
    assert await anyio.to_thread.run_sync(rec.entered.wait, 60)  # the thread is mid-open
    task.cancel()
    assert await anyio.to_thread.run_sync(rec.cancel.wait, 60)  # the open was told to stop
    assert not task.done(), "the open returned before its thread did"
    rec.proceed.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    rec.assert_nothing_runs()


@pytest.mark.mooncake
async def test_wait_for_timeout_mid_open_closes_client_and_master(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rec = _Recorder(monkeypatch, gate=True)
    opening = stores.open_store_owned(EngineConfig(segment_bytes=16 << 20))

    async def release_once_timed_out() -> None:
        assert await anyio.to_thread.run_sync(rec.opening.wait, 60)
        assert await anyio.to_thread.run_sync(rec.cancel.wait, 60)  # the timeout is held
        rec.proceed.set()

    # The timeout lands while the master starts or while the client is held:
    # either way the open stops at its next step and closes what it started.
    releaser = asyncio.ensure_future(release_once_timed_out())
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(opening, 0.1)
    await releaser
    rec.assert_nothing_runs(client_made=False)


@pytest.mark.mooncake
async def test_a_cancel_after_the_last_step_still_closes_the_handle(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread finished opening before it could see the cancellation: the
    handle it returns is closed, not dropped."""
    rec = _Recorder(monkeypatch, gate=False)
    returned, go = threading.Event(), threading.Event()
    real = stores.open_store

    def open_then_hold(cfg: EngineConfig, cancel: threading.Event | None = None) -> Any:
        handle = real(cfg, None)  # never sees the event
        returned.set()
        go.wait(60)
        return handle

    monkeypatch.setattr(stores, "open_store", open_then_hold)
    task = asyncio.ensure_future(stores.open_store_owned(EngineConfig(segment_bytes=16 << 20)))
    assert await anyio.to_thread.run_sync(returned.wait, 60)
    task.cancel()
    await asyncio.sleep(0)  # one loop step: the cancellation is delivered and held
    assert not task.done()
    go.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    rec.assert_nothing_runs()


# ---- Mooncake's glog lines are quiet for a library user unless asked for
_CLIENT = """
from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.mooncake_store import MooncakeStore
with EmbeddedMaster(http_metadata=False) as m:
    MooncakeStore(m.config(global_segment_size=16 << 20, local_buffer_size=16 << 20)).close()
print("done")
"""
_GLOG = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d", re.M)


@pytest.mark.mooncake
@pytest.mark.parametrize("user_level", [None, "INFO"], ids=["default", "asked-for"])
def test_glog_lines_are_quiet_unless_asked_for(user_level: str | None) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MC_LOG_LEVEL", "GLOG_minloglevel")}
    if user_level is not None:
        env["MC_LOG_LEVEL"] = user_level
    proc = subprocess.run([sys.executable, "-c", _CLIENT], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-2000:]
    lines = _GLOG.findall(proc.stderr)
    if user_level is None:
        assert not lines, f"Mooncake logged to a library user's terminal:\n{proc.stderr[-2000:]}"
    else:
        assert lines, "MC_LOG_LEVEL=INFO set by the user was overridden"


def test_the_setup_filter_drops_only_the_two_spurious_lines(
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    from layerlift.linker import mooncake_env

    monkeypatch.setattr(mooncake_env, "_filtering", True)
    with mooncake_env.setup_log_filter():
        os.write(2, b"WARNING: Logging before InitGoogleLogging() is written to STDERR\n"
                    b"E1201 17:36:37.683929 21986 transfer_metadata.cpp:1098] Local segment "
                    b"descriptor not found\n"
                    b"E1201 17:36:37.683930 21986 real_client.cpp:1] Total size must be at "
                    b"least 16777216\n")
    err = capfd.readouterr().err
    assert err == ("E1201 17:36:37.683930 21986 real_client.cpp:1] Total size must be at "
                   "least 16777216\n")
    monkeypatch.setattr(mooncake_env, "_filtering", False)  # the user chose the level
    with mooncake_env.setup_log_filter():
        os.write(2, b"WARNING: Logging before InitGoogleLogging() is written to STDERR\n")
    assert "InitGoogleLogging" in capfd.readouterr().err
