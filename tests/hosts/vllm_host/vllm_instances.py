"""Helpers of the vLLM host tests: the `Instance` client (from
`layerlift.testing.vllm_verify`) and a store-level corruption."""

from __future__ import annotations

from layerlift.linker.master import EmbeddedMaster
from layerlift.testing.vllm_verify import Instance

__all__ = ["Instance", "corrupt_object"]


def corrupt_object(master: EmbeddedMaster, key: str) -> None:
    """Flip one byte in the middle of the object stored under ``key`` (a raw
    Mooncake client: read it, upsert the spoiled copy, read it back)."""
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
