"""Helpers of the multi-host tests: engine processes in namespace hosts
(:class:`Agent`), the cluster around them (:class:`Cluster`), prompts and the
exactness check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import IO, Any

import torch

from layerlift.testing import KL_EXACT, NetnsHosts, kl_divergence

AGENT = str(Path(__file__).with_name("agent.py"))
RPC_PORT = 50051
TIMEOUT_S = 3.0  # the engines' store timeout: what a lost link may cost per call
STARTED: list[subprocess.Popen[bytes]] = []
"""Every process the tests started, checked at the end of the session."""


def _env() -> dict[str, str]:
    return {**os.environ, "MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "2"}


class Agent:
    """An engine process inside a namespace host (tests/netns/agent.py)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        assert proc.stdin is not None and proc.stdout is not None
        self._in: IO[bytes] = proc.stdin
        self._out: IO[bytes] = proc.stdout

    def read(self) -> dict[str, Any]:
        line = self._out.readline()
        assert line, f"the engine process exited (code {self.proc.poll()})"
        reply: dict[str, Any] = json.loads(line)
        return reply

    def send(self, **cmd: Any) -> None:
        self._in.write((json.dumps(cmd) + "\n").encode())
        self._in.flush()

    def ask(self, **cmd: Any) -> dict[str, Any]:
        self.send(**cmd)
        reply = self.read()
        assert "error" not in reply, reply["error"]
        return reply

    def prefill(self, tokens: list[int]) -> dict[str, Any]:
        return self.ask(op="prefill", tokens=tokens)


class Cluster:
    """Hosts ``master``, ``store``, ``engine`` and ``engine2``; ``rates`` throttle links."""

    def __init__(self, hosts: NetnsHosts, workdir: Path) -> None:
        self.hosts = hosts
        self.workdir = workdir
        self.master_address = f"{hosts['master'].address}:{RPC_PORT}"
        self.master: subprocess.Popen[bytes] | None = None
        self.store: subprocess.Popen[bytes] | None = None
        self.namespace = f"t{uuid.uuid4().hex[:8]}"

    def _spawn(self, label: str, argv: list[str], stdin: int | None = None) -> Any:
        with open(self.workdir / f"{label}.log", "ab") as log:  # the child keeps its copy
            proc = self.hosts.popen(
                label, argv, env=_env(), stdin=stdin, stdout=subprocess.PIPE, stderr=log,
                cwd=self.workdir,
            )  # fmt: skip
        STARTED.append(proc)
        return proc

    def start_master(self) -> None:
        cli = [sys.executable, "-m", "layerlift.cli"]
        address = self.hosts["master"].address
        self.master = self._spawn(
            "master", [*cli, "master", "--p2p", "--host", address, "--rpc-port", str(RPC_PORT)]
        )
        assert self.master.stdout is not None
        line = self.master.stdout.readline()
        assert line.startswith(b"master_address"), f"the master did not start: {line!r}"

    def start_store(self) -> None:
        cli = [sys.executable, "-m", "layerlift.cli"]
        host = self.hosts["store"].address
        self.store = self._spawn(
            "store",
            [*cli, "store-node", "--master", self.master_address, "--bytes", "256M",
             "--host", host],
        )  # fmt: skip
        assert self.store.stdout is not None
        line = self.store.stdout.readline()
        assert line.startswith(b"ready"), f"the storage node did not start: {line!r}"

    def engine(self, label: str = "engine", **settings: Any) -> Agent:
        settings = {"master": self.master_address, "timeout_s": TIMEOUT_S,
                    "namespace": self.namespace, **settings}  # fmt: skip
        agent = Agent(self._spawn(label, [sys.executable, AGENT, json.dumps(settings)],
                                  stdin=subprocess.PIPE))  # fmt: skip
        assert agent.read() == {"event": "ready"}
        return agent


def prompt(length: int, salt: int = 0) -> list[int]:
    """Deterministic token ids inside the tiny model's vocabulary."""
    return [(i * 7 + 3 + salt * 131) % 500 for i in range(length)]


def assert_exact(result: dict[str, Any], cold: dict[str, Any]) -> None:
    kl = kl_divergence(torch.tensor(cold["logprobs"]), torch.tensor(result["logprobs"]))
    assert kl <= KL_EXACT, f"not the cold distribution: KL {kl:.3g}"
