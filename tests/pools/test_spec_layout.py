"""The cache layout: recurrent state as any list of tensors, kinds a model
lacks, and the split between layout and the reference model's dims."""

from __future__ import annotations

import pytest
import torch

from layerlift.pools import UnifiedKVPool
from layerlift.pools.spec import (
    PLACEHOLDER_PAGE_BYTES,
    Component,
    MambaSpec,
    ModelDims,
    ModelSpec,
    StateTensorSpec,
)

# A bf16 conv state of odd size before an fp32 recurrent state: the second
# tensor must still start at a multiple of 4 bytes in every layer and slot.
MIXED = MambaSpec((StateTensorSpec("conv", (5, 3), torch.bfloat16),
                   StateTensorSpec("recurrent", (2, 3, 4), torch.float32)))


def test_state_tensors_are_aligned_and_sized() -> None:
    assert MIXED.offsets == (0, 32)  # 30 bytes of bf16, padded to the fp32 boundary
    assert MIXED.layer_slot_bytes == 32 + 96
    short_conv = MambaSpec((StateTensorSpec("conv", (64, 3), torch.float32),))
    assert short_conv.layer_slot_bytes == 64 * 3 * 4


def test_mamba_view_returns_one_view_per_tensor_without_aliasing() -> None:
    spec = ModelSpec("MFMS", state=MIXED, page_size=16, swa_window=32, track_interval=32)
    pool = UnifiedKVPool(spec, 1 << 20)
    slots = pool.alloc(Component.MAMBA, 3)
    assert slots is not None
    for value, layer in enumerate(spec.layers_of(Component.MAMBA)):
        conv, rec = pool.mamba_view(layer)
        assert conv.dtype == torch.bfloat16 and conv.shape[1:] == (5, 3)
        assert rec.dtype == torch.float32 and rec.shape[1:] == (2, 3, 4)
        for s in slots.tolist():
            conv[s].fill_(value + 1)
            rec[s].fill_(10 * (value + 1) + s)
    for value, layer in enumerate(spec.layers_of(Component.MAMBA)):
        conv, rec = pool.mamba_view(layer)
        for s in slots.tolist():
            assert torch.all(conv[s] == value + 1)
            assert torch.all(rec[s] == 10 * (value + 1) + s)
    # The views cover exactly the layer's slice of the slot object.
    layer = spec.layers_of(Component.MAMBA)[1]
    _, _, offset, size = spec.layer_slice(layer)
    page = pool.page_view(Component.MAMBA, int(slots[0]))
    before = page.clone()
    pool.mamba_view(layer)[1][int(slots[0])].zero_()
    changed = torch.nonzero(page != before).flatten()
    assert offset <= int(changed.min()) and int(changed.max()) < offset + size
    pool.verify_byte_accounting()


def test_a_kind_without_layers_keeps_a_placeholder_page() -> None:
    spec = ModelSpec("FSFS", page_size=16, swa_window=32, track_interval=32)
    assert spec.page_bytes(Component.MAMBA) == PLACEHOLDER_PAGE_BYTES
    assert spec.layers_of(Component.MAMBA) == ()
    pool = UnifiedKVPool(spec, 1 << 20)
    got = pool.alloc_many({Component.FULL: 2, Component.SWA: 2, Component.MAMBA: 2})
    assert got is not None
    pool.verify_byte_accounting()


def test_fingerprint_is_the_layout_not_the_dims() -> None:
    a = ModelSpec.preset("tiny")
    b = ModelSpec.preset("tiny", vocab_size=1000, intermediate_size=64)
    assert a.dims != b.dims and a.fingerprint == b.fingerprint and a == b
    c = ModelSpec.preset("tiny", mamba_d_state=8)  # a different state shape
    assert c.fingerprint != a.fingerprint
    d = ModelSpec("FSMSFSMM", state=MIXED)
    assert d.fingerprint != a.fingerprint


def test_presets_split_dims_from_layout() -> None:
    spec = ModelSpec.preset("small")
    assert spec.dims.hidden_size == 256 and spec.num_kv_heads == 4
    assert spec.mamba == ModelDims(mamba_heads=8, mamba_head_dim=32, mamba_d_state=32).mamba_state()
    with pytest.raises(ValueError, match="hidden_size"):
        ModelSpec.preset("tiny", hidden_size=0)
    with pytest.raises(ValueError, match="non-empty positive shape"):
        StateTensorSpec("conv", (0, 3), torch.float32)
