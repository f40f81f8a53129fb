"""Keys and values of different widths per attention layer (MLA, a cached
latent, layers of different head dims): byte sizes, per-layer slices of the
page objects, views into the tri-pool and the fingerprint."""

from __future__ import annotations

import pytest
import torch

from layerlift.pools import StaticKVPool, UnifiedKVPool
from layerlift.pools.spec import Component, KVShape, ModelSpec

# F: MLA with full K/V (24-wide keys, 16-wide values, 4 heads); S: a latent
# (one 32-wide "key" head, one 8-wide "value" head); F: ordinary 2 x 16.
SHAPES = (KVShape(4, 24, 4, 16), KVShape(1, 32, 1, 8), KVShape(2, 16, 2, 16))
MIXED = ModelSpec("FSMF", page_size=16, swa_window=32, track_interval=32, kv_shapes=SHAPES)


def test_slices_add_up_each_layers_own_width() -> None:
    full0, swa, full1 = (16 * (4 * 24 + 4 * 16) * 4, 16 * (32 + 8) * 4, 16 * 2 * 32 * 4)
    assert MIXED.kv_shape(0) == SHAPES[0] and MIXED.kv_shape(3) == SHAPES[2]
    assert MIXED.layer_slice(0)[1:] == (0, 0, full0)
    assert MIXED.layer_slice(3)[1:] == (1, full0, full1)
    assert MIXED.layer_slice(1)[1:] == (0, 0, swa)
    assert MIXED.page_bytes(Component.FULL) == full0 + full1
    assert MIXED.page_bytes(Component.SWA) == MIXED.layer_bytes(Component.SWA) == swa
    with pytest.raises(ValueError, match="differ in width"):
        MIXED.layer_bytes(Component.FULL)
    with pytest.raises(ValueError, match="recurrent layer"):
        MIXED.kv_shape(2)


@pytest.mark.parametrize("pool_cls", [UnifiedKVPool, StaticKVPool])
def test_views_cover_exactly_their_slice_without_aliasing(pool_cls: type) -> None:
    pool = pool_cls(MIXED, 8 << 20)
    pages = {c: pool.alloc(c, 2) for c in (Component.FULL, Component.SWA)}
    attention = [g for g in range(MIXED.num_layers) if MIXED.kinds[g] is not Component.MAMBA]
    for value, layer in enumerate(attention):
        k, v = pool.kv_view(layer)
        s = MIXED.kv_shape(layer)
        assert k.shape[1:] == (16, s.k_heads, s.k_dim) and v.shape[1:] == (16, s.v_heads, s.v_dim)
        idx = pages[MIXED.kinds[layer]]
        assert idx is not None
        k[idx] = 10.0 * value + 1
        v[idx] = 10.0 * value + 2
    for value, layer in enumerate(attention):
        kind = MIXED.kinds[layer]
        idx = pages[kind]
        assert idx is not None
        k, v = pool.kv_view(layer)
        assert torch.all(k[idx] == 10.0 * value + 1) and torch.all(v[idx] == 10.0 * value + 2)
        # The layer's views fill exactly its slice of the page object, K then V.
        _, _, offset, size = MIXED.layer_slice(layer)
        page = pool.page_view(kind, int(idx[0])).view(torch.float32)
        lo, hi = offset // 4, (offset + size) // 4
        split = lo + 16 * MIXED.kv_shape(layer).k_elems
        assert torch.all(page[lo:split] == 10.0 * value + 1)
        assert torch.all(page[split:hi] == 10.0 * value + 2)
    pool.verify_byte_accounting()


def test_uniform_shapes_are_the_old_layout_and_fingerprint() -> None:
    plain = ModelSpec("FSMF", page_size=16, swa_window=32, track_interval=32)
    spelled = ModelSpec("FSMF", page_size=16, swa_window=32, track_interval=32,
                        kv_shapes=(KVShape.uniform(2, 16),) * 3)
    assert spelled.kv_shapes is None and spelled == plain
    assert spelled.fingerprint == plain.fingerprint
    assert plain.layer_slice(3)[2:] == (plain.layer_bytes(Component.FULL),) * 2


def test_widths_enter_the_fingerprint() -> None:
    def spec(*shapes: KVShape) -> ModelSpec:
        return ModelSpec("FSMF", page_size=16, swa_window=32, track_interval=32,
                         kv_shapes=shapes)

    a = spec(KVShape(1, 32, 1, 8), KVShape(2, 16, 2, 16), KVShape(2, 16, 2, 16))
    b = spec(KVShape(1, 8, 1, 32), KVShape(2, 16, 2, 16), KVShape(2, 16, 2, 16))  # K <-> V
    c = spec(KVShape(2, 16, 2, 16), KVShape(1, 32, 1, 8), KVShape(2, 16, 2, 16))  # other layer
    assert a.page_bytes(Component.FULL) == b.page_bytes(Component.FULL)
    assert len({a.fingerprint, b.fingerprint, c.fingerprint}) == 3


def test_bad_shapes_are_refused_with_a_sentence() -> None:
    with pytest.raises(ValueError, match="one KVShape per attention layer"):
        ModelSpec("FSMF", kv_shapes=(KVShape.uniform(2, 16),) * 2)
    with pytest.raises(ValueError, match="v_dim must be positive"):
        KVShape(1, 32, 1, 0)
