"""``TransformersModel``: a transformers ``AutoModelForCausalLM`` behind the model protocol.

The model's own forward runs; LayerLift only fills and reads its cache, one
decoder layer at a time, through hooks:

* before the forward, every attention layer of a fresh ``DynamicCache`` gets
  a placeholder of its restored length (position ids and masks are computed
  from the first full and sliding layers' lengths before any layer runs),
  sliding layers their cumulative length ``P``, recurrent layers zeroed state
  tensors with ``has_previous_state`` set (else the mixer restarts);
* a forward pre-hook on decoder layer ``i`` calls ``before_layer`` for its
  cache layers (the engine's per-layer wait on the first call; every chunk
  calls it, and ``after_layer`` after it, so the engine times each layer's
  compute per chunk), performs the copy-on-write of the recurrent state and
  copies the pages / slot into the placeholders in place;
* a forward hook writes what the layer computed into the pool: the new
  tokens' KV (recorded as it enters the cache, because a sliding layer keeps
  only its last ``W - 1`` positions) and, at capture boundaries and at the
  end, clones of the recurrent state (the cache updates it in place).

Requests run one at a time (batch 1, no padding), and a request whose
capture boundaries fall inside its new tokens runs in chunks split at them:
continuing from a cache is exact for the supported architectures, so the
chunks compute what one pass would. The 2-D attention mask spans ``P + S``
and ``position_ids`` are passed explicitly.
"""

from __future__ import annotations

import hashlib
import itertools
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from layerlift.engine.model.api import (
    ForwardOutput,
    ForwardRequest,
    PoolViews,
    check_pool_indices,
    validate_requests,
)
from layerlift.engine.model.base import LayerHook
from layerlift.engine.model.hf_layout import (
    HFLayout,
    UnsupportedModelError,
    architecture,
    decoder_layers,
    derive_layout,
    hf_config,
    running_layer,
)
from layerlift.pools.spec import Component, ModelSpec

__all__ = ["TransformersModel", "UnsupportedModelError"]

_UNSAFE = re.compile(r"[^A-Za-z0-9._:+=@-]")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


@dataclass
class _Pass:
    """One forward call (one chunk of one request) and what its hooks need."""

    req: ForwardRequest
    pool: PoolViews
    cache: Any
    start: int  # absolute position of the chunk's first token
    stop: int
    first: bool  # first chunk of this request: fill the cache from the pool
    wait: LayerHook
    after_layer: LayerHook
    new_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


class TransformersModel:
    """A transformers causal LM (``AutoModelForCausalLM``) as a LayerLift model.

    ``identity`` keys its store objects, so it must change whenever the
    bytes a prefill computes may change: with an explicit ``revision`` it is
    ``name@revision`` (the user vouches for it); otherwise it is a digest of
    the weights and the config (``name`` then only prefixes it for
    readability; ``weights_digest``, when given, stands for the weights'
    digest, e.g. :meth:`from_pretrained`'s digest of the weight files).
    ``page_size`` and ``track_interval`` choose the paging (a sliding window
    must be a multiple of ``page_size``).

    Raises :class:`UnsupportedModelError` (a ``ValueError`` naming the
    architecture, the layer, the reason and what support would take) for a
    model that cannot be restored exactly: a cache class of its own, layers
    whose state LayerLift cannot map or see, a forward that cannot continue
    from a filled cache, or a torch path known to be inexact (Jamba, Zamba,
    Mamba1, FalconMamba, RecurrentGemma). Nothing is refused later, at a
    prefill.
    """

    def __init__(self, hf_model: nn.Module, *, name: str | None = None,
                 revision: str | None = None, page_size: int = 16,
                 track_interval: int = 64, weights_digest: str | None = None) -> None:
        self.hf = hf_model.eval()
        self.layout: HFLayout = derive_layout(hf_model, page_size, track_interval)
        self.spec: ModelSpec = self.layout.spec
        text = hf_config(hf_model).get_text_config(decoder=True)
        self.vocab_size = int(text.vocab_size)
        self.identity = _identity(hf_model, name, revision, weights_digest)
        self._layers = decoder_layers(hf_model, len(self.layout.groups))
        self._lock = threading.Lock()
        self._pass: _Pass | None = None
        for i, module in enumerate(self._layers):
            module.register_forward_pre_hook(self._pre_hook(i), with_kwargs=True)
            module.register_forward_hook(self._post_hook(i))
        self._check_continuation()

    @classmethod
    def from_pretrained(cls, path: str | Path, *, name: str | None = None,
                        revision: str | None = None, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", page_size: int = 16,
                        track_interval: int = 64) -> TransformersModel:
        """Load ``AutoModelForCausalLM`` from a local directory (nothing is
        downloaded). Without ``revision`` the identity is a digest of the
        directory's weight files and ``config.json`` (two checkpoints saved
        under the same directory name never share store keys); ``name``
        (default: the directory's name) only prefixes it. Raises
        ``ValueError`` when the directory holds no weight file."""
        from transformers import AutoModelForCausalLM

        digest = None if revision else _file_digest(Path(path))
        hf: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype,
                                                       local_files_only=True)
        return cls(hf.to(device), name=name or Path(path).name, revision=revision,
                   page_size=page_size, track_interval=track_interval, weights_digest=digest)

    @property
    def decoder_layers(self) -> nn.ModuleList:
        """The decoder layers LayerLift hooks (``layout.groups[i]`` are layer
        ``i``'s cache layers)."""
        return self._layers

    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device

    # ---- the forward ---------------------------------------------------------------
    def forward_batch(self, requests: Sequence[ForwardRequest], pool: PoolViews,
                      before_layer: LayerHook | None = None,
                      after_layer: LayerHook | None = None) -> ForwardOutput:
        """The model protocol's prefill (see :class:`~layerlift.engine.model.base.Model`):
        requests one after another, each in chunks split at its capture
        positions; ``before_layer(l)`` and ``after_layer(l)`` around every
        chunk's pass over cache layer ``l`` (the engine waits on the first
        ``before_layer(l)`` only and sums the stretches)."""
        validate_requests(self.spec, self.vocab_size, requests)
        check_pool_indices(self.spec, requests, pool)
        wait = before_layer or (lambda layer: None)
        done = after_layer or (lambda layer: None)
        with self._lock, torch.inference_mode():
            nxt, rows = [], []
            for req in requests:
                lp = self._request(req, pool, wait, done)
                nxt.append(lp[-1])
                rows.append(lp if req.want_token_logprobs else None)
        return ForwardOutput(torch.stack(nxt), rows)

    def _request(self, req: ForwardRequest, pool: PoolViews, wait: LayerHook,
                 done: LayerHook) -> torch.Tensor:
        cache = self._prepared_cache(req.prefix_len)
        cuts = sorted({req.prefix_len, req.total, *req.capture})
        dev = self.device
        out = []
        for a, b in itertools.pairwise(cuts):
            self._pass = _Pass(req, pool, cache, a, b, a == req.prefix_len, wait, done)
            try:
                ids = req.tokens[a - req.prefix_len : b - req.prefix_len].to(dev)[None]
                logits = self.hf(
                    input_ids=ids, cache=cache, use_cache=True,
                    attention_mask=torch.ones(1, b, dtype=torch.int64, device=dev),
                    position_ids=torch.arange(a, b, device=dev)[None],
                    logits_to_keep=0 if req.want_token_logprobs else 1,
                ).logits
            finally:
                self._pass = None
            out.append(torch.log_softmax(logits[0].float(), dim=-1))
        return torch.cat(out) if req.want_token_logprobs else out[-1]

    def _check_continuation(self) -> None:
        """Run two tokens after a zeroed placeholder cache of a window's
        length (hooks idle), so a model that cannot continue from a cache
        LayerLift fills is refused here, not at its first prefill."""
        p = max(self.spec.page_size, self.spec.swa_window)
        dev = self.device
        try:
            with self._lock, torch.inference_mode(), running_layer(self._layers) as at:
                self.hf(input_ids=torch.zeros(1, 2, dtype=torch.int64, device=dev),
                        cache=self._prepared_cache(p), use_cache=True,
                        attention_mask=torch.ones(1, p + 2, dtype=torch.int64, device=dev),
                        position_ids=torch.arange(p, p + 2, device=dev)[None], logits_to_keep=1)
        except Exception as e:
            raise UnsupportedModelError(
                architecture(self.hf), f"its forward cannot continue from a cache of {p} tokens "
                f"filled layer by layer ({type(e).__name__}: {e})",
                "cache layers whose placeholders engine/model/hf.py can size (their keys, "
                "values and lengths)", layer=at[0]) from e

    # ---- cache placeholders --------------------------------------------------------
    def _prepared_cache(self, p: int) -> Any:
        """A fresh cache whose layers already have the restored lengths (zeros)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=hf_config(self.hf))
        layers: list[Any] = cache.layers
        spec, dev = self.spec, self.device
        for layer, group in zip(layers, self.layout.groups, strict=True):
            kinds = {spec.kinds[g] for g in group}
            if Component.FULL in kinds or Component.SWA in kinds:
                _record_updates(layer, self, group)
            if p == 0:
                continue
            if Component.MAMBA in kinds:
                self._placeholder_state(layer, dev)
            for g in group:
                kind = spec.kinds[g]
                if kind is Component.MAMBA:
                    continue
                n = p if kind is Component.FULL else min(p, spec.swa_window - 1)
                kv = spec.kv_shape(g)
                zk = torch.zeros(1, kv.k_heads, n, kv.k_dim, dtype=spec.kv_dtype, device=dev)
                zv = torch.zeros(1, kv.v_heads, n, kv.v_dim, dtype=spec.kv_dtype, device=dev)
                layer.lazy_initialization(zk, zv)
                layer.keys, layer.values = zk, zv
                if kind is Component.SWA:
                    layer.cumulative_length = p
        return cache

    def _placeholder_state(self, layer: Any, dev: torch.device) -> None:
        for (attr, j), t in zip(self.layout.states, self.spec.mamba.tensors, strict=True):
            getattr(layer, f"{attr}_states")[j] = torch.zeros(1, *t.shape, dtype=t.dtype,
                                                              device=dev)
            getattr(layer, f"is_{attr}_states_initialized")[j] = True
            if attr == "conv":
                layer.conv_kernel_size[j] = t.shape[-1]
            layer.has_previous_state[j] = True
            layer.device, layer.dtype = dev, t.dtype

    # ---- hooks ---------------------------------------------------------------------
    def _pre_hook(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            ps = self._pass
            if ps is None:
                return
            for layer in self.layout.groups[index]:
                ps.wait(layer)  # every chunk: starts its stretch (waits the first time)
                if ps.first:
                    self._fill(ps, ps.cache.layers[index], layer)

        return hook

    def _post_hook(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            ps = self._pass
            if ps is None:
                return
            for layer in self.layout.groups[index]:
                self._capture(ps, ps.cache.layers[index], layer)
                ps.after_layer(layer)

        return hook

    def _fill(self, ps: _Pass, cl: Any, layer: int) -> None:
        """Copy layer ``layer``'s restored data from the pool into the cache."""
        req, p = ps.req, ps.req.prefix_len
        if self.spec.kinds[layer] is Component.MAMBA:
            views = ps.pool.mamba_view(layer)
            if req.mamba_cow_src is not None:
                for v in views:
                    v[req.mamba_slot].copy_(v[req.mamba_cow_src])
            if p == 0 and req.mamba_cow_src is None:
                return  # a fresh sequence: the layer starts from zero by itself
            for (attr, j), v in zip(self.layout.states, views, strict=True):
                getattr(cl, f"{attr}_states")[j][0].copy_(v[req.mamba_slot])
            return
        if p == 0:
            return
        lo = 0 if self.spec.kinds[layer] is Component.FULL else max(0, p - self.spec.swa_window + 1)
        pages = self._pages(req, layer, lo, p)
        k, v = ps.pool.kv_view(layer)
        cl.keys[0].copy_(k[pages[0], pages[1]].transpose(0, 1))
        cl.values[0].copy_(v[pages[0], pages[1]].transpose(0, 1))

    def _capture(self, ps: _Pass, cl: Any, layer: int) -> None:
        """Write what layer ``layer`` computed in this chunk into the pool."""
        req = ps.req
        if self.spec.kinds[layer] is Component.MAMBA:
            slots = [s for pos, s in req.capture.items() if pos == ps.stop]
            if ps.stop == req.total:
                slots.append(req.mamba_slot)
            views = ps.pool.mamba_view(layer)
            for (attr, j), v in zip(self.layout.states, views, strict=True):
                state = getattr(cl, f"{attr}_states")[j][0].clone()
                for slot in slots:
                    v[slot].copy_(state)
            return
        new_k, new_v = ps.new_kv.pop(layer)
        pages = self._pages(req, layer, ps.start, ps.stop)
        k, v = ps.pool.kv_view(layer)
        k[pages[0], pages[1]] = new_k[0].transpose(0, 1).to(k.dtype)
        v[pages[0], pages[1]] = new_v[0].transpose(0, 1).to(v.dtype)

    def _pages(self, req: ForwardRequest, layer: int, lo: int,
               hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, offset) of positions ``[lo, hi)`` in ``layer``'s page table."""
        table = req.full_pages if self.spec.kinds[layer] is Component.FULL else req.swa_pages
        pos = torch.arange(lo, hi)
        ps = self.spec.page_size
        return table[pos // ps].to(self.device), (pos % ps).to(self.device)


def _record_updates(cache_layer: Any, model: TransformersModel, group: tuple[int, ...]) -> None:
    """Make the cache layer hand the new tokens' K/V to the running pass as
    they enter it (the cache itself may keep only the window)."""
    attention = [g for g in group if model.spec.kinds[g] is not Component.MAMBA]
    inner = cache_layer.update

    def update(key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> Any:
        ps = model._pass
        if ps is not None:
            for g in attention:
                ps.new_kv[g] = (key_states, value_states)
        return inner(key_states, value_states, *args, **kwargs)

    cache_layer.update = update


def _identity(hf_model: nn.Module, name: str | None, revision: str | None,
              digest: str | None) -> str:
    """``name@revision`` when the user names a revision; otherwise a digest
    of what determines the bytes: the weights (``digest`` of the files they
    were loaded from, or of the state dict) and the config."""
    dtype = str(next(hf_model.parameters()).dtype).removeprefix("torch.")
    if name and revision:
        return _UNSAFE.sub("_", f"hf-{name}@{revision}-{dtype}")
    if digest is None:
        h = hashlib.blake2b(digest_size=8)
        cfg = hf_config(hf_model).to_dict()
        for volatile in ("_name_or_path", "transformers_version", "dtype", "torch_dtype"):
            cfg.pop(volatile, None)
        h.update(repr(sorted(cfg.items())).encode())
        for key, tensor in sorted(hf_model.state_dict().items()):
            h.update(key.encode())
            h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        digest = h.hexdigest()
    return _UNSAFE.sub("_", f"hf-{name or 'weights'}-{digest}-{dtype}")


def _file_digest(path: Path) -> str:
    """A digest of a checkpoint directory's weight files and ``config.json``
    (names and bytes). Raises ``ValueError`` when it holds no weight file."""
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory holding a saved model")
    weights = sorted(f for f in path.iterdir() if f.is_file() and f.suffix in _WEIGHT_SUFFIXES)
    if not weights:
        raise ValueError(f"{path} holds no weight file ({', '.join(_WEIGHT_SUFFIXES)}): nothing "
                         "to identify the model by")
    h = hashlib.blake2b(digest_size=8)
    config = path / "config.json"
    for f in ([config] if config.is_file() else []) + weights:
        h.update(f.name.encode())
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()
