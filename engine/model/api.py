"""Types of the batched forward API and their validation.

The engine describes one prefill step as a list of :class:`ForwardRequest`;
:meth:`Model.forward_batch` reads cached data and writes new data only
through the :class:`PoolViews` it is given, so any pool (the unified tri-pool,
a static pool, a test array) works.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from layerlift.pools.spec import Component, ModelSpec

__all__ = [
    "ForwardOutput",
    "ForwardRequest",
    "PoolViews",
    "check_pool_indices",
    "validate_requests",
]


class PoolViews(Protocol):
    """What the model needs from a pool: typed per-layer views of its bytes."""

    def kv_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of FULL/SWA ``layer``, each ``[max_pages, page_size, kv_heads, head_dim]``."""
        ...

    def mamba_view(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Every state tensor of MAMBA ``layer``, in ``spec.mamba.tensors``
        order, each ``[max_slots, *shape]`` (Mamba-2: conv, ssm)."""
        ...


@dataclass
class ForwardRequest:
    """One request's share of a batched forward.

    ``tokens`` (int64 ``[n_new]``) are computed at absolute positions
    ``prefix_len .. prefix_len + n_new - 1``; the first ``prefix_len`` tokens'
    KV is already in the pages (``prefix_len`` is a multiple of ``page_size``).
    ``full_pages`` / ``swa_pages`` are the page tables (int64, at least
    ``ceil((prefix_len + n_new) / page_size)`` entries) of the FULL and SWA
    layers; SWA entries for pages wholly outside every new token's window are
    never read. ``mamba_slot`` is the request's own writable state slot.

    ``mamba_cow_src``: if set, each Mamba layer first copies its state from this
    slot into ``mamba_slot`` (copy-on-write from a cached checkpoint, done only
    after ``before_layer`` of that layer). If ``None`` and ``prefix_len == 0``
    the state starts at zero; if ``None`` and ``prefix_len > 0`` the slot
    already holds the state at ``prefix_len``.

    ``capture`` maps an absolute position ``p`` (``prefix_len < p <=
    prefix_len + n_new``, a multiple of ``page_size``: grid checkpoints and
    the engine's branch checkpoints) to a slot that
    receives every Mamba layer's state after ``p`` tokens.
    """

    tokens: torch.Tensor
    prefix_len: int
    full_pages: torch.Tensor
    swa_pages: torch.Tensor
    mamba_slot: int
    mamba_cow_src: int | None = None
    capture: dict[int, int] = field(default_factory=dict)
    want_token_logprobs: bool = False

    @property
    def n_new(self) -> int:
        return int(self.tokens.numel())

    @property
    def total(self) -> int:
        return self.prefix_len + self.n_new


@dataclass
class ForwardOutput:
    """``next_token_logprobs``: float32 ``[batch, vocab]`` at every request's
    last position. ``token_logprobs[i]``: float32 ``[n_new, vocab]`` (the
    distribution after each new token) if request ``i`` asked, else ``None``."""

    next_token_logprobs: torch.Tensor
    token_logprobs: list[torch.Tensor | None]


def _check_table(name: str, i: int, table: torch.Tensor, need: int) -> None:
    if table.dtype != torch.int64 or table.dim() != 1:
        raise ValueError(f"request {i}: {name} must be a 1-D int64 tensor")
    if table.numel() < need:
        raise ValueError(
            f"request {i}: {name} has {table.numel()} entries but positions "
            f"[0, total) need {need} pages"
        )


def _check_capture(spec: ModelSpec, i: int, req: ForwardRequest) -> None:
    for pos, slot in req.capture.items():
        if not req.prefix_len < pos <= req.total:
            raise ValueError(
                f"request {i}: capture position {pos} is outside the computed range "
                f"({req.prefix_len}, {req.total}]"
            )
        if pos % spec.page_size:
            raise ValueError(
                f"request {i}: capture position {pos} is not a multiple of "
                f"page_size ({spec.page_size})"
            )
        if slot < 0 or slot == req.mamba_slot:
            raise ValueError(
                f"request {i}: capture slot {slot} must be a valid slot other than mamba_slot"
            )


def validate_requests(
    spec: ModelSpec, vocab_size: int, requests: Sequence[ForwardRequest]
) -> None:
    """Raise ``ValueError`` with a readable sentence on any malformed request
    (token ids checked against ``vocab_size``)."""
    if not requests:
        raise ValueError("forward_batch needs at least one request")
    slots: set[int] = set()
    for i, req in enumerate(requests):
        if req.tokens.dtype != torch.int64 or req.tokens.dim() != 1:
            raise ValueError(f"request {i}: tokens must be a 1-D int64 tensor")
        if req.n_new == 0:
            raise ValueError(f"request {i}: tokens is empty; there is nothing to compute")
        lo, hi = int(req.tokens.min()), int(req.tokens.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"request {i}: token ids must lie in [0, {vocab_size})")
        if req.prefix_len < 0 or req.prefix_len % spec.page_size:
            raise ValueError(
                f"request {i}: prefix_len {req.prefix_len} is not a non-negative multiple "
                f"of page_size ({spec.page_size})"
            )
        need = -(-req.total // spec.page_size)
        _check_table("full_pages", i, req.full_pages, need)
        _check_table("swa_pages", i, req.swa_pages, need)
        if req.mamba_slot < 0 or req.mamba_slot in slots:
            raise ValueError(
                f"request {i}: mamba_slot {req.mamba_slot} is negative or shared with "
                "another request of the batch"
            )
        slots.add(req.mamba_slot)
        if req.mamba_cow_src is not None and req.mamba_cow_src < 0:
            raise ValueError(f"request {i}: mamba_cow_src must be a slot index or None")
        _check_capture(spec, i, req)


def _check_range(what: str, i: int, values: torch.Tensor, limit: int) -> None:
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= limit):
        raise ValueError(f"request {i}: {what} holds an index outside the pool's [0, {limit})")


def check_pool_indices(
    spec: ModelSpec, requests: Sequence[ForwardRequest], pool: PoolViews
) -> None:
    """Raise ``ValueError`` if a page or slot the forward would touch lies
    outside the pool, before anything is written. Only views are created; no
    cached data is read (so this may run before any ``before_layer``)."""
    # A kind the model has no layer of is never touched: nothing to check.
    limits: dict[Component, int] = {}
    for kind in (Component.FULL, Component.SWA):
        if spec.layers_of(kind):
            limits[kind] = pool.kv_view(spec.layers_of(kind)[0])[0].shape[0]
    if spec.layers_of(Component.MAMBA):
        limits[Component.MAMBA] = pool.mamba_view(spec.layers_of(Component.MAMBA)[0])[0].shape[0]
    ps = spec.page_size
    for i, req in enumerate(requests):
        need = -(-req.total // ps)
        if Component.FULL in limits:
            _check_range("full_pages", i, req.full_pages[:need], limits[Component.FULL])
        if Component.SWA in limits:
            first = max(0, req.prefix_len - spec.swa_window + 1) // ps  # older pages never read
            _check_range("swa_pages", i, req.swa_pages[first:need], limits[Component.SWA])
        if Component.MAMBA in limits:
            slots = [req.mamba_slot, *req.capture.values()]
            if req.mamba_cow_src is not None:
                slots.append(req.mamba_cow_src)
            _check_range("a mamba slot", i, torch.tensor(slots), limits[Component.MAMBA])
