"""Engine fixtures: small models, a real Mooncake master for engine tests and
stores that record or fault what the engine sends (see ``layerlift.testing``)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator, Sequence

import pytest

from layerlift import HybridModel, ModelSpec
from layerlift.linker.master import EmbeddedMaster
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.linker.store_base import Store
from layerlift.testing import FaultyStore


class RecordingStore(FaultyStore):
    """A :class:`FaultyStore` that also records the keys of every successful put."""

    def __init__(self, inner: Store, spec: ModelSpec) -> None:
        super().__init__(inner, spec)
        self._put_lock = threading.Lock()
        self.put_keys: list[str] = []

    def put(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> None:
        super().put(keys, ptrs, sizes)
        with self._put_lock:
            self.put_keys.extend(keys)

    def put_parts(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                  sizes: Sequence[Sequence[int]]) -> None:
        super().put_parts(keys, ptrs, sizes)
        with self._put_lock:
            self.put_keys.extend(keys)

    def take_puts(self) -> list[str]:
        """The keys put since the last call (and forget them)."""
        with self._put_lock:
            out, self.put_keys = self.put_keys, []
        return out


@pytest.fixture(scope="session")
def tiny_model() -> HybridModel:
    return HybridModel(ModelSpec.preset("tiny"), seed=0)


@pytest.fixture(scope="session")
def tiny128_model() -> HybridModel:
    return HybridModel(ModelSpec.preset("tiny128"), seed=0)


@pytest.fixture(scope="session")
def engine_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedMaster]:
    """A mooncake_master for the engine tests, with a 5 s read lease: the
    session master's 50 ms lease can expire under a gated (deliberately
    delayed) layer read (LEASE_EXPIRED, -707), which would turn a negative
    control into an unrelated failure. Never skipped: fails if it cannot start."""
    log = tmp_path_factory.mktemp("engine-mooncake") / "mooncake_master.log"
    with EmbeddedMaster(log_path=log, lease_ttl_ms=5000) as master:
        yield master


@pytest.fixture
def namespace() -> str:
    """A key namespace unique to this test (tests share one master)."""
    return f"e2e-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def mc_client(engine_master: EmbeddedMaster) -> Iterator[MooncakeStore]:
    """A real Mooncake client with a 64 MiB segment (objects live in it)."""
    store = MooncakeStore(engine_master.config(
        global_segment_size=64 << 20, local_buffer_size=16 << 20, timeout_s=10.0))
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def mc_tiny(mc_client: MooncakeStore, tiny_model: HybridModel) -> RecordingStore:
    """The real Mooncake client wrapped for fault injection (tiny layout)."""
    return RecordingStore(mc_client, tiny_model.spec)


@pytest.fixture
def mc_tiny128(mc_client: MooncakeStore, tiny128_model: HybridModel) -> RecordingStore:
    """The real Mooncake client wrapped for fault injection (tiny128 layout)."""
    return RecordingStore(mc_client, tiny128_model.spec)


@pytest.fixture
def mem_tiny128(tiny128_model: HybridModel) -> RecordingStore:
    """An in-process store (exact ``remove``, no leases) wrapped for recording."""
    return RecordingStore(MemoryStore(), tiny128_model.spec)
