"""``linker_extra_config`` of LayerLift's SGLang linker (the launch flag's JSON object)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

__all__ = ["LinkerSettings"]


@dataclass(frozen=True, slots=True)
class LinkerSettings:
    """``linker_extra_config`` of the launch flag. Raises ValueError naming a bad field.

    ``timeout_s`` bounds each store call of loads and offloads; ``load_timeout_s``
    a whole load batch; ``lookup_timeout_s`` one lookup on SGLang's scheduler
    thread, ``lookup_breaker_s`` how long lookups are misses after one timed
    out, ``lookup_share`` the share of the scheduler's time lookups may spend
    (``lookup``). ``staging_mib`` sizes the load ring, ``offload_staging_mib``
    the offload ring (None: twice ``staging_mib``; an offload holds two
    chunks of half its ring at once: one put while the next is staged).
    ``in_place_min_kib``: host pools whose every part of a unit (one layer's
    K or V rows of a page, a Mamba state) is at least this large are
    offloaded from the slots themselves, without a copy (None: never;
    ``offload_in_place.py``). ``in_place_load_min_kib``: the same for loads
    read straight into the slots (``load_in_place.py``): each part is a
    range of the store call, and below 256 KiB the store's per-range cost
    outweighed the copy it saves. ``ordered_reads``: a load batch's store
    reads run one at a time, the lowest layer first, while the other layers
    in flight prepare and verify (``linker/read_order.py``): the first layer
    lands after one read's time instead of ``depth`` reads', for a forward
    whose layers' compute outlasts their reads; where the transfer bounds
    the load, it is about a tenth slower. ``"auto"`` (the default): the
    first batch's reads go as they come, each next batch's in turn if the
    last batch that landed whole had a forward whose compute of a layer
    outlasted a layer's read (``read_order.order_pays``)."""

    master_address: str | None = None
    embedded_master: bool = False
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    local_hostname: str = "127.0.0.1"
    namespace: str = "sglang"
    model: str | None = None
    timeout_s: float = 5.0
    load_timeout_s: float = 30.0
    lookup_timeout_s: float = 0.5
    lookup_breaker_s: float = 5.0
    lookup_share: float = 0.25
    depth: int = 4
    ordered_reads: bool | str = "auto"
    staging_mib: int = 64
    offload_staging_mib: int | None = None
    segment_mib: int = 256
    local_buffer_mib: int = 16
    in_place_min_kib: int | None = 128
    in_place_load_min_kib: int | None = 256

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> LinkerSettings:
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = set(extra) - known
        if unknown:
            raise ValueError(f"LayerLiftLinker: unknown linker_extra_config fields "
                             f"{sorted(unknown)}; known: {sorted(known)}")
        settings = cls(**extra)
        if (settings.master_address is None) == (not settings.embedded_master):
            raise ValueError("LayerLiftLinker needs exactly one of master_address "
                             "('HOST:PORT' of a mooncake_master) or embedded_master: true")
        for name in ("timeout_s", "load_timeout_s", "lookup_timeout_s", "lookup_breaker_s"):
            if not _number(getattr(settings, name)) > 0:
                raise ValueError(f"LayerLiftLinker: {name} must be a positive number of seconds")
        if not 0 < _number(settings.lookup_share) <= 1:
            raise ValueError("LayerLiftLinker: lookup_share (the share of the scheduler's time "
                             "lookups may spend) must be a number in (0, 1]")
        if not (isinstance(settings.ordered_reads, bool) or settings.ordered_reads == "auto"):
            raise ValueError(f"LayerLiftLinker: ordered_reads must be true, false or \"auto\", "
                             f"got {settings.ordered_reads!r}")
        for name in ("depth", "staging_mib", "offload_staging_mib", "segment_mib",
                     "local_buffer_mib", "in_place_min_kib", "in_place_load_min_kib"):
            value = getattr(settings, name)
            if value is None and name in ("offload_staging_mib", "in_place_min_kib",
                                          "in_place_load_min_kib"):
                continue  # twice staging_mib; never in place
            least = 0 if name in ("segment_mib", "in_place_min_kib",
                                  "in_place_load_min_kib") else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"LayerLiftLinker: {name} must be an integer >= {least}, "
                                 f"got {value!r}")
        return settings

    @property
    def offload_ring_mib(self) -> int:
        """The offload ring's size in MiB (``offload_staging_mib``, or twice ``staging_mib``)."""
        if self.offload_staging_mib is not None:
            return self.offload_staging_mib
        return 2 * self.staging_mib


def _number(value: object) -> float:
    """``value`` as a float; NaN (fails every bound) for what is not a number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return float("nan")
    return float(value)
