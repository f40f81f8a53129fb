"""`layerlift bench transfer-vllm` with vLLM 0.32's own MooncakeStoreConnector
as rows (issue 42): its scheduler and worker sides in a child process
(`transfer_vllm_msc`) beside LayerLift's worker and the raw rows, run small
on a real Mooncake master. Its restores are checked byte-exact in the child:
a flipped byte (the child's negative control) ends the run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from layerlift.bench import transfer_vllm
from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.mooncake_store import MooncakeStore

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.slow]


def test_vllms_connector_rows_beside_layerlifts(tmp_path: Path) -> None:
    out = tmp_path / "transfer_vllm.json"
    assert transfer_vllm.main(["--tokens", "512", "--block-sizes", "128", "--repeats", "1",
                               "--json", str(out)]) == 0
    case = json.loads(out.read_text())["links"]["mooncake-tcp-loopback"]["512 tokens, block 128"]
    assert "MooncakeStoreConnector load" in case["loads"]
    assert "MooncakeStoreConnector save" in case["offloads"]
    paired = case["LayerLift / MooncakeStoreConnector"]
    assert set(paired) == {"LayerLift per layer", "LayerLift whole request", "LayerLift save"}
    assert all(r["median"] > 0 for r in paired.values())
    # the child's steps carry the machine's cores (kept where every round read a tick)
    for kind in ("loads", "offloads"):
        for row, busy in case[kind + " machine cores"].items():
            assert row in case[kind] and 0 < busy["median"] <= os.cpu_count(), (kind, row)


def test_a_wrong_byte_in_vllms_restore_ends_the_run() -> None:
    with EmbeddedMaster(lease_ttl_ms=5000, http_metadata=False) as master, \
            MooncakeStore(master.config(global_segment_size=256 << 20, timeout_s=30.0)), \
            MooncakeStore(master.config(global_segment_size=0, local_buffer_size=16 << 20,
                                        timeout_s=30.0)) as client:
        command = transfer_vllm.msc_command(master.master_address, master.metadata_url)
        assert command is not None, "vLLM is importable in the vLLM suite"
        case = transfer_vllm.Case(256, 128, client, 30.0, [*command, "--spoil"])
        try:
            with pytest.raises(RuntimeError, match="restored wrong bytes"):
                case.msc_unit()
        finally:
            case.close()
