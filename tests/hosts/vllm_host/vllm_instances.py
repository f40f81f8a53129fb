"""A vLLM instance in a child process (`layerlift.hosts.vllm_verify serve`), driven
by JSON lines. Shared by the vLLM host tests; every read is bounded."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

MARK = "LLJSON "
START_TIMEOUT_S = 180.0


class Instance:
    """One ``vllm.LLM`` in a child process. ``log`` collects its stderr and
    the non-JSON lines of its stdout (vLLM's own log lines)."""

    def __init__(self, model: str, connector: str, extra: dict[str, Any] | None,
                 log_path: Path) -> None:
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", MC_LOG_LEVEL="ERROR",
                   GLOG_minloglevel="2", PYTHONUNBUFFERED="1")
        self.log_path = log_path
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "layerlift.hosts.vllm_verify", "serve", "--model", model,
             "--connector", connector, "--extra", json.dumps(extra or {})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._expect(START_TIMEOUT_S)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self._replies.put(json.loads(line[len(MARK):]))
            else:
                self._log.write(line)
        self._replies.put(None)

    def _expect(self, timeout_s: float) -> dict[str, Any]:
        try:
            reply = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            self.kill()
            raise AssertionError(f"vLLM instance did not answer in {timeout_s:.0f} s; "
                                 f"log: {self.log_path}") from None
        if reply is None:
            raise AssertionError(f"vLLM instance exited (code {self.proc.wait(10)}); "
                                 f"log tail:\n{self.log_tail()}")
        if "error" in reply:
            raise AssertionError(f"vLLM instance failed: {reply['error']}")
        return reply

    def generate(self, prompts: list[list[int]], timeout_s: float = 120.0) -> list[dict[str, Any]]:
        """First token, top-5 logprobs, cached tokens and wall time per prompt."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "generate", "prompts": prompts}) + "\n")
        self.proc.stdin.flush()
        results: list[dict[str, Any]] = self._expect(timeout_s)["results"]
        return results

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def close(self, timeout_s: float = 60.0) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
