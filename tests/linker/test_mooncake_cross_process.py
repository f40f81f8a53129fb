"""A second process with no segment of its own reads per-layer slices that this process put."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.mooncake_store import MooncakeStore

pytestmark = pytest.mark.mooncake

LAYERS, PAGES, LAYER_BYTES = 4, 8, 16 << 10

READER = """
import json, sys
import torch
from layerlift.linker.mooncake_store import MooncakeConfig, MooncakeStore

args = json.loads(sys.argv[1])
layers, pages, layer_bytes, keys = args["layers"], args["pages"], args["layer_bytes"], args["keys"]
with MooncakeStore(MooncakeConfig(
    master_address=args["master"], metadata_server=args["metadata"],
    global_segment_size=0, local_buffer_size=16 << 20, timeout_s=10.0,
)) as store:
    dst = torch.zeros(layers, pages, layer_bytes, dtype=torch.uint8)
    store.register(dst)
    with store.open_session(keys):
        for layer in range(layers):
            store.get_ranges(keys, [[dst[layer, i].data_ptr()] for i in range(pages)],
                             [[layer_bytes]] * pages, [[layer * layer_bytes]] * pages)
    with open(args["out"], "wb") as f:
        f.write(dst.numpy().tobytes())
print("reader done")
"""


def test_second_process_reads_layer_slices(
    mooncake_master: EmbeddedMaster,
    mooncake_store: MooncakeStore,
    mooncake_namespace: str,
    tmp_path: Path,
) -> None:
    src = torch.randint(0, 256, (PAGES, LAYERS * LAYER_BYTES), dtype=torch.uint8)
    mooncake_store.register(src)
    keys = [f"{mooncake_namespace}/full/0/{i:04x}" for i in range(PAGES)]
    mooncake_store.put(keys, [int(src[i].data_ptr()) for i in range(PAGES)], [src.shape[1]] * PAGES)
    out = tmp_path / "layers.bin"
    args = {
        "master": mooncake_master.master_address,
        "metadata": mooncake_master.metadata_url,
        "layers": LAYERS,
        "pages": PAGES,
        "layer_bytes": LAYER_BYTES,
        "keys": keys,
        "out": str(out),
    }
    proc = subprocess.run(
        [sys.executable, "-c", READER, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.frombuffer(bytearray(out.read_bytes()), dtype=torch.uint8)
    expected = src.view(PAGES, LAYERS, LAYER_BYTES).transpose(0, 1).contiguous().flatten()
    assert torch.equal(got, expected)
