"""`layerlift store-node`: a segment and nothing else, until SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.mooncake_store import MooncakeStore

pytestmark = pytest.mark.mooncake


def test_a_pure_client_stores_into_the_node_and_sigterm_ends_it(tmp_path: Path) -> None:
    with EmbeddedMaster(lease_ttl_ms=5000) as master:
        node = subprocess.Popen(
            [sys.executable, "-m", "layerlift.cli", "store-node",
             "--master", master.master_address, "--metadata", master.metadata_url,
             "--bytes", "32M"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=tmp_path,
            env={**os.environ, "MC_LOG_LEVEL": "ERROR"},
        )  # fmt: skip
        try:
            assert node.stdout is not None
            line = node.stdout.readline()
            assert line.startswith(b"ready"), line
            client = MooncakeStore(master.config(global_segment_size=0, timeout_s=10.0))
            try:
                src = torch.arange(1 << 16, dtype=torch.int32).view(torch.uint8)
                dst = torch.zeros_like(src)
                client.register(src)
                client.register(dst)
                # the client contributes no memory: the bytes can only live on the node
                client.put(["node/a"], [src.data_ptr()], [src.numel()])
                assert client.get(["node/a"], [dst.data_ptr()], [dst.numel()]) == [True]
                assert torch.equal(src, dst)
            finally:
                client.close()
            node.send_signal(signal.SIGTERM)
            assert node.wait(20) == 0
        finally:
            if node.poll() is None:
                node.kill()
                node.wait()


def test_without_a_master_it_says_so(tmp_path: Path) -> None:
    from layerlift.linker.master import free_port

    done = subprocess.run(
        [sys.executable, "-m", "layerlift.cli", "store-node",
         "--master", f"127.0.0.1:{free_port()}", "--bytes", "16M", "--setup-retries", "1"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env={**os.environ, "MC_LOG_LEVEL": "ERROR"},
    )  # fmt: skip
    assert done.returncode == 1
    assert "error:" in done.stderr


def test_a_segment_below_the_minimum_is_refused_with_the_reason(tmp_path: Path) -> None:
    """Mooncake cannot mount a segment under 16 MiB; its own error blames the
    master. The node says what is wrong before connecting."""
    from layerlift.linker.master import free_port

    done = subprocess.run(
        [sys.executable, "-m", "layerlift.cli", "store-node",
         "--master", f"127.0.0.1:{free_port()}", "--bytes", "8M"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env={**os.environ, "MC_LOG_LEVEL": "ERROR"},
    )  # fmt: skip
    assert done.returncode != 0
    assert "at least 16 MiB" in done.stderr, done.stderr


def test_bad_sizes_are_refused(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "layerlift.cli", "store-node",
         "--master", "127.0.0.1:1", "--bytes", "lots"],
        capture_output=True, text=True, cwd=tmp_path, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "not a size" in done.stderr
