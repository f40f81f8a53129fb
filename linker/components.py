"""Per-kind linkers: what each component sends, looks up and loads.

One class per kind, chosen from :data:`LINKER_TYPES` (the interface is
:class:`~layerlift.linker.component_base.ComponentLinker`):

* :class:`FullLinker` - ALL_PAGES. OFFLOAD: every page of a node not yet
  stored. LOOKUP/LOAD: pages ``[d, b)``.
* :class:`SwaLinker` - TRAILING_PAGES (N = window). OFFLOAD: the not yet
  stored pages of the trailing window before a node's checkpoint (walking up
  into ancestors). LOOKUP/LOAD: the windows ``[max(d, b - W), b)``.
* :class:`MambaLinker` - TRAILING_PAGES (N = 1). OFFLOAD: the node's
  checkpoint, keyed by the hash of its last page. LOOKUP/LOAD: one entry
  per boundary b. COMMIT yields the request's COW source.

All OFFLOADs return ``None`` when there is nothing to send: a node whose
FULL/SWA pages are stored but that gained a new checkpoint sends only MAMBA
(no hit loss, no re-sent KV).
"""

from __future__ import annotations

from layerlift.linker.component_base import ComponentLinker, CowSource
from layerlift.linker.contract import HitPolicy, LinkRequest, PoolTransfer
from layerlift.linker.keys import KeySchema
from layerlift.pools.base import KVPool
from layerlift.pools.spec import Component, ModelSpec
from layerlift.pools.tree import InsertResult, TreeNode, UnifiedRadixTree

__all__ = [
    "LINKER_TYPES", "ComponentLinker", "CowSource", "FullLinker", "MambaLinker", "SwaLinker",
    "make_linkers",
]


class FullLinker(ComponentLinker):
    """Full-attention KV: every page of the prefix."""

    component = Component.FULL
    hit_policy = HitPolicy.ALL_PAGES

    @classmethod
    def trailing(cls, spec: ModelSpec) -> int:
        return 0

    @classmethod
    def needed(cls, spec: ModelSpec, d: int, b: int) -> list[int]:
        return list(range(d, b))

    def offload_entries(self, node: TreeNode) -> list[tuple[int, bytes, int]]:
        if node.stored[Component.FULL]:
            return []
        idx = node.pages(Component.FULL).indices.tolist()
        return [(node.start_page + o, node.hashes[o], idx[o]) for o in range(node.num_pages)]


class SwaLinker(ComponentLinker):
    """Sliding-window KV: the trailing window before a boundary."""

    component = Component.SWA
    hit_policy = HitPolicy.TRAILING_PAGES

    @classmethod
    def trailing(cls, spec: ModelSpec) -> int:
        return spec.window_pages

    @classmethod
    def needed(cls, spec: ModelSpec, d: int, b: int) -> list[int]:
        return list(range(max(d, b - spec.window_pages), b))

    def offload_entries(self, node: TreeNode) -> list[tuple[int, bytes, int]]:
        if node.checkpoint is None:
            return []
        out = []
        for owner, off in self.tree.window_pages(node):
            data = owner.pages(Component.SWA)
            if bool(data.valid[off]) and not bool(data.stored[off]):
                out.append((owner.start_page + off, owner.hashes[off], int(data.indices[off])))
        return out


class MambaLinker(ComponentLinker):
    """Recurrent-state checkpoints: exactly the one at the boundary."""

    component = Component.MAMBA
    hit_policy = HitPolicy.TRAILING_PAGES

    @classmethod
    def trailing(cls, spec: ModelSpec) -> int:
        return 1

    @classmethod
    def needed(cls, spec: ModelSpec, d: int, b: int) -> list[int]:
        return [b] if b > d else []

    def key_hash(self, request: LinkRequest, entry: int) -> bytes:
        return request.hashes[entry - 1]

    def offload_entries(self, node: TreeNode) -> list[tuple[int, bytes, int]]:
        slot = node.checkpoint
        if slot is None or node.stored[Component.MAMBA]:
            return []
        return [(node.end_page, node.hashes[-1], slot)]

    def adopted_entries(self, result: InsertResult) -> list[int]:
        return list(result.adopted_checkpoints)

    def cow_source(self, result: InsertResult, transfer: PoolTransfer) -> CowSource:
        """The canonical checkpoint at the restored boundary: the tree's own
        slot if it already had one (ours was a duplicate), else ours."""
        b = transfer.pages[-1]
        node = result.node
        if node.end_page != b or node.checkpoint is None:
            raise ValueError(f"the tree holds no checkpoint at the restored boundary {b}")
        return CowSource(node.checkpoint, b in result.adopted_checkpoints)


LINKER_TYPES: dict[Component, type[ComponentLinker]] = {
    Component.FULL: FullLinker,
    Component.SWA: SwaLinker,
    Component.MAMBA: MambaLinker,
}


def make_linkers(
    spec: ModelSpec, pool: KVPool, tree: UnifiedRadixTree, schema: KeySchema
) -> dict[Component, ComponentLinker]:
    """One linker per component, sharing the tree, pool and key schema.
    Raises ``ValueError`` if the schema's fingerprint does not contain the
    spec's layout fingerprint (a prefix such as a model name is allowed)."""
    if spec.fingerprint not in schema.fingerprint:
        raise ValueError(
            f"key schema fingerprint {schema.fingerprint!r} is not this model's layout "
            f"fingerprint {spec.fingerprint!r}: keys of another layout must never match"
        )
    return {c: LINKER_TYPES[c](spec, pool, tree, schema) for c in Component}
