"""Typed per-layer views into a pool's byte buffer.

Every sub-pool indexes its pages *physically*: page ``i`` of component ``c``
occupies bytes ``[i * page_bytes(c), (i + 1) * page_bytes(c))`` of the one
shared buffer, whichever end of the buffer that pool grows from. Views are
plain strided tensors over the buffer (no copies); which indices are valid is
the allocator's business, not the view's.
"""

from __future__ import annotations

import torch

from layerlift.pools.spec import Component, ModelSpec

__all__ = ["kv_layer_view", "mamba_layer_view"]


def _typed(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if buf.dtype is not torch.uint8 or buf.dim() != 1:
        raise ValueError("the pool buffer must be a 1-D uint8 tensor")
    elem = torch.empty((), dtype=dtype).element_size()
    usable = buf.numel() - buf.numel() % elem
    return buf[:usable].view(dtype)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def kv_layer_view(
    buf: torch.Tensor, spec: ModelSpec, component: Component, local_layer: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the ``local_layer``-th layer of ``component`` (FULL or SWA),
    ``[max_pages, page_size, k_heads, k_dim]`` and ``[max_pages, page_size,
    v_heads, v_dim]`` (the layer's :meth:`ModelSpec.kv_shape`; usually
    ``num_kv_heads x head_dim`` both) indexed by page."""
    if component is Component.MAMBA:
        raise ValueError("kv_layer_view is for FULL and SWA layers; use mamba_layer_view")
    n_layers = len(spec.layers_of(component))
    if not 0 <= local_layer < n_layers:
        raise ValueError(f"{component.value} has {n_layers} layers, no layer {local_layer}")
    layer = spec.layers_of(component)[local_layer]
    kv = spec.kv_shape(layer)
    typed = _typed(buf, spec.kv_dtype)
    page_bytes = spec.page_bytes(component)
    elem = typed.element_size()
    page_elems = page_bytes // elem
    max_pages = buf.numel() // page_bytes
    base = typed.storage_offset() + spec.layer_slice(layer).offset // elem
    k = typed.as_strided((max_pages, spec.page_size, kv.k_heads, kv.k_dim),
                         (page_elems, kv.k_elems, kv.k_dim, 1), base)
    v = typed.as_strided((max_pages, spec.page_size, kv.v_heads, kv.v_dim),
                         (page_elems, kv.v_elems, kv.v_dim, 1),
                         base + spec.page_size * kv.k_elems)
    return k, v


def mamba_layer_view(
    buf: torch.Tensor, spec: ModelSpec, local_layer: int
) -> tuple[torch.Tensor, ...]:
    """Every state tensor of the ``local_layer``-th recurrent layer, in
    ``spec.mamba.tensors`` order, each ``[max_slots, *shape]`` in its own
    dtype and indexed by slot (Mamba-2: conv, ssm)."""
    n_layers = len(spec.layers_of(Component.MAMBA))
    if not 0 <= local_layer < n_layers:
        raise ValueError(f"mamba has {n_layers} layers, no layer {local_layer}")
    m = spec.mamba
    slot_bytes = spec.page_bytes(Component.MAMBA)
    max_slots = buf.numel() // slot_bytes
    base = local_layer * m.layer_slot_bytes
    views = []
    for t, offset in zip(m.tensors, m.offsets, strict=True):
        typed = _typed(buf, t.dtype)
        elem = typed.element_size()
        # Offsets and slot sizes are multiples of every element size (MambaSpec).
        assert slot_bytes % elem == 0 and (base + offset) % elem == 0
        views.append(typed.as_strided(
            (max_slots, *t.shape), (slot_bytes // elem, *_contiguous_strides(t.shape)),
            typed.storage_offset() + (base + offset) // elem,
        ))
    return tuple(views)
