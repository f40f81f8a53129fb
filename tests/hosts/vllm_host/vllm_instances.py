"""Helpers of the vLLM host tests: the `Instance` client (from
`layerlift.testing.vllm_verify`) and a store-level corruption."""

from __future__ import annotations

from layerlift.linker.master import EmbeddedMaster
from layerlift.testing.vllm_verify import Instance

__all__ = ["Instance", "corrupt_object", "wait_logged"]


def corrupt_object(master: EmbeddedMaster, key: str) -> bytes:
    """Flip one byte in the middle of the object stored under ``key`` (a raw
    Mooncake client: read it, upsert the spoiled copy, read it back: the
    reads lease it); return the spoiled bytes."""
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


def wait_logged(inst: Instance, text: str, count: int = 1, timeout_s: float = 60.0) -> None:
    """Until ``inst``'s log holds ``text`` ``count`` times (the worker logs
    from its background threads; reading the store instead would renew the
    object's read lease and keep it from being replaced)."""
    import time

    deadline = time.monotonic() + timeout_s
    while inst.log_text().count(text) < count:
        assert time.monotonic() < deadline, f"{text!r} never appeared in {inst.log_path}"
        time.sleep(0.2)
