"""Every restored byte verified (issue 21): a page object carries a CRC-32C per
layer slice (`linker/integrity.py`); a slice whose bytes do not match fails
its layer, which recomputes exactly.

Corruptions: a flipped byte in one layer's slice, another object's bytes
under a key, a truncated object, a corrupted Mamba checkpoint, a footer that
lies; on the per-layer (overlap) and the whole-object (barrier) reads; on the
in-process store and, for a foreign object, on a real Mooncake master. Each
case: the restore fails over to a recompute (it says so), the result equals
a cold run, the engine is quiescent, and once the object is healthy again
the prefix restores.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from layerlift import Component, Engine, EngineConfig, HybridModel, ModelSpec
from layerlift.engine.results import PrefillResult
from layerlift.linker.integrity import CHECK_BYTES, component_slices, encode_object
from layerlift.linker.memory_store import MemoryStore
from layerlift.linker.mooncake_store import MooncakeStore
from layerlift.pools.hashing import page_hashes
from layerlift.testing import assert_quiescent, kl_divergence, offload_and_drop
from layerlift.testing.reference import cold_prefills

KL_TOL = 1e-6
POOL = 32 << 20


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return HybridModel(ModelSpec.preset("tiny"), seed=0)


def prompt(model: HybridModel, seed: int = 3, n: int = 300) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, model.vocab_size, n, dtype=np.int64)


def exact(got: PrefillResult, ref: PrefillResult) -> None:
    kl = kl_divergence(ref.next_token_logprobs, got.next_token_logprobs)
    assert kl <= KL_TOL, f"restored result differs from the cold run: KL {kl}"


def keys_of(store: MemoryStore, component: Component) -> list[str]:
    return sorted(c.keys[i] for c in store.calls if c.method == "put_parts"
                  for i in range(len(c.keys)) if f"/{component.value}/" in c.keys[i])


Corrupt = Callable[[MemoryStore, ModelSpec], None]


def flip_byte(component: Component, layer_index: int) -> Corrupt:
    """One bit of every object of ``component`` (the restore reads only some
    of them: the SWA window, the checkpoint at its boundary)."""
    def corrupt(store: MemoryStore, spec: ModelSpec) -> None:
        for key in keys_of(store, component):
            data = bytearray(store.object_bytes(key))
            offset, size = component_slices(spec, component)[layer_index]
            data[offset + size // 2] ^= 0x01
            store.replace_object(key, bytes(data))
    return corrupt


def foreign_object(store: MemoryStore, spec: ModelSpec) -> None:
    """Object 0's key holds object 1's bytes (page and footer: self-consistent)."""
    keys = keys_of(store, Component.FULL)
    store.replace_object(keys[0], store.object_bytes(keys[1]))


def truncated(store: MemoryStore, spec: ModelSpec) -> None:
    key = keys_of(store, Component.FULL)[0]
    store.replace_object(key, store.object_bytes(key)[: spec.page_bytes(Component.FULL) // 2])


def lying_footer(store: MemoryStore, spec: ModelSpec) -> None:
    """The page bytes are intact but the checksum of its last layer is wrong."""
    for key in keys_of(store, Component.SWA):
        data = bytearray(store.object_bytes(key))
        data[-CHECK_BYTES] ^= 0xFF
        store.replace_object(key, bytes(data))


CASES: dict[str, Corrupt] = {
    "flip-full-layer0": flip_byte(Component.FULL, 0),
    "flip-full-layer1": flip_byte(Component.FULL, 1),
    "flip-swa": flip_byte(Component.SWA, 2),
    "flip-mamba": flip_byte(Component.MAMBA, 1),
    "foreign-object": foreign_object,
    "truncated": truncated,
    "lying-footer": lying_footer,
}


@pytest.mark.parametrize("policy", ["overlap", "barrier"])
@pytest.mark.parametrize("case", sorted(CASES))
async def test_a_corrupted_object_is_recomputed_exactly(model: HybridModel, case: str,
                                                        policy: str) -> None:
    p = prompt(model)
    (ref,) = await cold_prefills(model, [p], pool_bytes=POOL)
    store = MemoryStore()
    cfg = EngineConfig(store="memory", pool_bytes=POOL, policy=policy)
    async with Engine(model, cfg, store=store) as engine:
        await engine.prefill([p])
        await offload_and_drop(engine)
        healthy = {k: store.object_bytes(k) for c in Component for k in keys_of(store, c)}
        CASES[case](store, model.spec)
        got = (await engine.prefill([p]))[0]
        exact(got, ref)
        assert got.recomputed_after_failure, "the corruption was not detected"
        assert got.restored_tokens == 0
        await engine.wait_offloads()
        assert_quiescent(engine)
        for key, data in healthy.items():  # heal the store: the prefix restores again
            store.replace_object(key, data)
        engine.drop_device_cache()
        engine.pool.buffer.zero_()
        again = (await engine.prefill([p]))[0]
        exact(again, ref)
        assert again.restored_tokens > 0 and not again.recomputed_after_failure, \
            again.fallback_reason


def test_encode_object_matches_what_the_engine_stores() -> None:
    spec = ModelSpec.preset("tiny")
    page = bytes(range(256)) * (spec.page_bytes(Component.FULL) // 256)
    obj = encode_object(spec, Component.FULL, page, "k")
    assert obj[: len(page)] == page
    assert len(obj) == len(page) + CHECK_BYTES * len(spec.layers_of(Component.FULL))
    assert encode_object(spec, Component.FULL, page, "other")[len(page):] != obj[len(page):]
    with pytest.raises(ValueError, match="page is"):
        encode_object(spec, Component.FULL, page[:-1], "k")


@pytest.mark.mooncake
async def test_a_foreign_object_in_mooncake_is_recomputed(
        model: HybridModel, mc_client: MooncakeStore, namespace: str) -> None:
    """On a real master: one FULL key is overwritten with another object's
    bytes and footer (self-consistent, but not this key's); the restore detects it."""
    p = prompt(model, seed=11)
    (ref,) = await cold_prefills(model, [p], pool_bytes=POOL)
    cfg = EngineConfig(store="memory", pool_bytes=POOL, namespace=namespace)
    async with Engine(model, cfg, store=mc_client) as engine:
        await engine.prefill([p])
        await offload_and_drop(engine)
        probe = torch.zeros(1 << 20, dtype=torch.uint8)
        mc_client.register(probe)
        schema = engine.linkers[Component.FULL].schema
        hashes = page_hashes(p, model.spec.page_size)
        stored = [schema.key(Component.FULL.value, h) for h in hashes[:2]]
        assert mc_client.exists(stored) == [True, True]
        size = model.spec.page_bytes(Component.FULL) + CHECK_BYTES * len(
            model.spec.layers_of(Component.FULL))
        assert mc_client.get([stored[1]], [probe.data_ptr()], [size]) == [True]
        # overwrite in place (Mooncake's upsert; `remove` is refused within a lease)
        codes = mc_client._client.batch_upsert_from([stored[0]], [probe.data_ptr()], [size])
        assert codes == [0], codes
        got = (await engine.prefill([p]))[0]
        exact(got, ref)
        assert got.recomputed_after_failure, "the foreign object was not detected"
        await engine.wait_offloads()
        assert_quiescent(engine)


@pytest.mark.parametrize("order", ["layer order", "reversed"])
def test_every_layer_verifies_whatever_order_its_fetches_run(order: str) -> None:
    """A component's first layer reads its objects' footers whole; a later
    layer that runs first (several fetches in flight) reads its own footer
    entries instead. Both verify: the bytes land, and a flipped byte in any
    layer's slice fails that layer only."""
    from layerlift.engine.loads import BatchLoad
    from layerlift.linker.store_base import StoreIntegrityError
    from layerlift.pools import UnifiedKVPool

    spec = ModelSpec.preset("tiny")
    pool = UnifiedKVPool(spec, 8 << 20)
    store = MemoryStore()
    store.register(pool.buffer)
    idx = {c: pool.alloc(c, 3) for c in Component}
    src = {c: torch.randint(0, 255, (3, spec.page_bytes(c)), dtype=torch.uint8) for c in Component}
    keys = {c: [f"ns/fp.l3/{c.value}/0/{c.value}{i}" for i in range(3)] for c in Component}
    for c in Component:
        objs = torch.stack([torch.frombuffer(bytearray(encode_object(
            spec, c, r.numpy().tobytes(), k)), dtype=torch.uint8)
            for r, k in zip(src[c], keys[c], strict=True)])
        store.register(objs)
        store.put(keys[c], [int(r.data_ptr()) for r in objs], [objs.shape[1]] * 3)
    bad_layer = spec.layers_of(Component.SWA)[1]
    offset = spec.layer_slice(bad_layer)[2]
    key = keys[Component.SWA][2]
    data = bytearray(store.object_bytes(key))
    data[offset + 7] ^= 0x40
    store.replace_object(key, bytes(data))
    load = BatchLoad(pool, store, None)
    for c in Component:
        load.items[c].add(keys[c], [int(i) for i in idx[c]], 0)
    jobs = load.jobs()
    failed = []
    for job in (jobs if order == "layer order" else jobs[::-1]):
        try:
            job.fetch()
        except StoreIntegrityError:
            failed.append(job.layer)
    assert failed == [bad_layer]
    for c in Component:
        for r in range(3):
            got = pool.page_view(c, int(idx[c][r]))
            if c is Component.SWA and r == 2:
                want = src[c][r].clone()
                want[offset + 7] ^= 0x40
                assert torch.equal(got, want)
            else:
                assert torch.equal(got, src[c][r])
    load.close_staging()


@pytest.mark.parametrize("policy", ["overlap", "barrier"])
async def test_negative_control_without_verification_the_corruption_is_served(
        model: HybridModel, policy: str) -> None:
    """``verify_restores=False``: the same flipped bit is restored and served
    (the result differs from the cold run): the check is what catches it."""
    p = prompt(model)
    (ref,) = await cold_prefills(model, [p], pool_bytes=POOL)
    store = MemoryStore()
    cfg = EngineConfig(store="memory", pool_bytes=POOL, policy=policy, verify_restores=False)
    async with Engine(model, cfg, store=store) as engine:
        await engine.prefill([p])
        await offload_and_drop(engine)
        for key in keys_of(store, Component.FULL):  # a high bit: a large, visible error
            data = bytearray(store.object_bytes(key))
            for offset, size in component_slices(model.spec, Component.FULL):
                data[offset : offset + size : 2] = bytes(0x7F for _ in range(0, size, 2))
            store.replace_object(key, bytes(data))
        got = (await engine.prefill([p]))[0]
        assert got.restored_tokens > 0 and not got.recomputed_after_failure
        assert kl_divergence(ref.next_token_logprobs, got.next_token_logprobs) > 1e-3
