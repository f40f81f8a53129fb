"""Helpers of the vLLM host tests: the `Instance` client (from
`layerlift.testing.vllm_verify`) and a store-level corruption."""

from __future__ import annotations

from layerlift.linker.master import EmbeddedMaster
from layerlift.testing.vllm_verify import Instance

__all__ = ["Instance", "corrupt_object", "wait_replaced"]


def corrupt_object(master: EmbeddedMaster, key: str) -> bytes:
    """Flip one byte in the middle of the object stored under ``key`` (a raw
    Mooncake client: read it, upsert the spoiled copy, read it back); return
    the spoiled bytes."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    rc = client.setup("127.0.0.1", master.metadata_url, 0, 16 << 20, "tcp", "",
                      master.master_address)
    assert rc == 0, f"raw Mooncake client setup returned {rc}"
    try:
        data = bytearray(client.get(key))
        assert data, f"{key} is not in the store"
        data[len(data) // 2] ^= 0xFF
        assert client.upsert(key, bytes(data)) == 0
        assert bytes(client.get(key)) == bytes(data)
    finally:
        client.close()
    return bytes(data)


def wait_replaced(master: EmbeddedMaster, key: str, spoiled: bytes,
                  timeout_s: float = 60.0) -> None:
    """Until the object under ``key`` is there and no longer ``spoiled``
    (replaced by another put; a raw client polls it: offloads are put in the background)."""
    import time

    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    rc = client.setup("127.0.0.1", master.metadata_url, 0, 16 << 20, "tcp", "",
                      master.master_address)
    assert rc == 0, f"raw Mooncake client setup returned {rc}"
    try:
        deadline = time.monotonic() + timeout_s
        while bytes(client.get(key)) in (spoiled, b""):  # b"": removed, not put yet
            assert time.monotonic() < deadline, f"{key} was never replaced"
            time.sleep(0.2)
    finally:
        client.close()
