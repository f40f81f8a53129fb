"""The model protocol: everything the engine reads from a model, and nothing else.

A model hands the engine four facts and one method:

* ``spec`` - the cache layout (:class:`~layerlift.pools.spec.ModelSpec`): per
  cache layer full, sliding (with its window) or recurrent (with the shapes
  and dtypes of its state tensors); KV heads, head dim and KV dtype; page size
  and checkpoint interval. The pools are built from it and its fingerprint is
  part of every store key.
* ``identity`` - names the weights in the store keys (with the layout
  fingerprint): two models that would compute different bytes for the same
  tokens must never share an identity. A name and revision the user gives, or
  a hash of the weights; never only a seed.
* ``vocab_size`` - the engine rejects token ids outside ``[0, vocab_size)``.
* ``device`` - where the model computes; the pools live there too.
* :meth:`Model.forward_batch` - one prefill step for a batch, layer by layer,
  reading and writing cached data only through the pool views it is given.

Implementations: :class:`~layerlift.engine.model.hybrid.HybridModel` (the
reference model, seeded weights) and
:class:`~layerlift.engine.model.hf.TransformersModel` (a transformers
``AutoModelForCausalLM``; optional extra ``hf``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from layerlift.engine.model.api import ForwardOutput, ForwardRequest, PoolViews
from layerlift.pools.spec import ModelSpec

__all__ = ["LayerHook", "Model"]

LayerHook = Callable[[int], None]
"""Called with a cache layer index (an index into ``spec.kinds``)."""


class Model(Protocol):
    """What the engine needs from a model (see the module docstring)."""

    spec: ModelSpec
    identity: str
    vocab_size: int

    @property
    def device(self) -> torch.device: ...

    def forward_batch(
        self,
        requests: Sequence[ForwardRequest],
        pool: PoolViews,
        before_layer: LayerHook,
        after_layer: LayerHook,
    ) -> ForwardOutput:
        """Compute the new tokens of every request and return the next-token
        log-probabilities (float32 ``[batch, vocab]``) at each one's last token.

        The contract, for every cache layer ``l`` of ``spec``:

        * ``before_layer(l)`` is called before any cached data of layer ``l``
          is read (the prefix KV in the pages, the state in ``mamba_slot`` or
          ``mamba_cow_src``): it is where the engine waits for layer ``l``'s
          restore to land. It may block; it may raise (a failed load), and the
          forward then raises that exception. The copy-on-write of a recurrent
          layer's state (``mamba_cow_src`` into ``mamba_slot``) happens after
          it. It is called at least once per layer; a model that works on a
          layer in several stretches (requests or chunks one after another)
          calls it before each of them (later calls return at once).
        * ``after_layer(l)`` ends each stretch that ``before_layer(l)``
          began; the last call comes once every request's new KV (and
          recurrent state, and the checkpoints in ``capture``) of layer ``l``
          is written into the pool. The engine times layer ``l``'s compute as
          the sum of its stretches (so a chunked model must not bracket the
          whole forward with one pair).
        * Cached data is read and written only through ``pool.kv_view(l)``
          and ``pool.mamba_view(l)``, only at the pages of the request's page
          tables and at its state slots; nothing else in the pool is touched.
        * ``capture`` positions receive every recurrent layer's state after
          exactly that many tokens; ``mamba_slot`` ends with the state after
          the last token.

        Raises ``ValueError`` for a malformed request or an index outside the
        pool, before anything is written.
        """
        ...
