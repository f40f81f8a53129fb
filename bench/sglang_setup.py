"""What the SGLang benchmark runs on (``bench/sglang_bench.py``): its links,
the cache's layouts (small, or a real model's), the sizes and the compute
stand-in they imply, the two linkers' configurations, a producer and
consumer pair of caches, and the clean-up client that empties the store
between restores."""

from __future__ import annotations

import argparse
import random
import re
import time
from typing import Any

from layerlift.engine.model.architectures import prefill_ms_per_layer
from layerlift.testing.sglang_harness import HybridShape, SGLangHost

__all__ = ["LAYOUTS", "LEASE_S", "LINKERS", "NETNS_LEASE_S", "NETNS_SEGMENT", "SEGMENT_CAP_MIB",
           "SETTLE_S", "Sweeper", "kv_bytes", "layer_kv_bytes", "linker_config", "links_arg", "make_pair",
           "parse_link", "prefill_ms_per_layer", "random_prompt", "segment_mib", "shape_for"]

LINKERS = ("layerlift", "sglang-mooncake")
NETNS_LINK = re.compile(r"^netns:(?P<rate>\d+(?:\.\d+)?(?:kbit|mbit|gbit))"
                    r"(?:\+(?P<delay>\d+(?:\.\d+)?)ms)?$")
NETNS_SEGMENT = 1 << 30  # bytes of the storage node's segment on a namespace link


def parse_link(text: str) -> tuple[str, str | None, float]:
    """``loopback`` or ``netns:RATE[+DELAYms]`` as (kind, rate, delay_ms).
    Raises ValueError with a sentence otherwise."""
    text = text.strip().lower()
    if text == "loopback":
        return "loopback", None, 0.0
    match = NETNS_LINK.match(text)
    if match is None:
        raise ValueError(f"bad link {text!r}: use loopback or netns:RATE[+DELAYms] "
                         "(e.g. netns:1gbit, netns:1gbit+2ms)")
    return "netns", match["rate"], float(match["delay"] or 0.0)


def links_arg(text: str) -> list[str]:
    links = [x.strip().lower() for x in text.split(",") if x.strip()]
    if not links:
        raise argparse.ArgumentTypeError("name at least one link")
    for link in links:
        try:
            parse_link(link)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return links


LAYOUTS = ("small", "real")
REAL_KINDS = "F" * 15 + "S" + "F" * 15 + "M"


def shape_for(page: int, layout: str = "small", prompt_tokens: int = 1024) -> HybridShape:
    """The cache's shape of ``layout`` (see the module docstring), its pools
    sized for one prompt of ``prompt_tokens`` beside the small layout's 12288."""
    if layout == "real":
        return HybridShape(kinds=REAL_KINDS, page_size=page, window=128, head_num=8,
                           head_dim=128, kv_tokens=prompt_tokens + 2 * page, mamba_slots=8)
    return HybridShape(kinds="FSMSMF" * 2, page_size=page, window=256, head_num=8, head_dim=64,
                       kv_tokens=max(12288, prompt_tokens + 2 * page), mamba_slots=64)


def layer_kv_bytes(shape: HybridShape, tokens: int) -> int:
    """Bytes of K and V of ``tokens`` tokens in one attention layer (bf16)."""
    return 2 * shape.head_num * shape.head_dim * 2 * tokens


def kv_bytes(shape: HybridShape, tokens: int) -> int:
    """Bytes of K and V of ``tokens`` tokens in ``shape``'s attention layers (bf16)."""
    return layer_kv_bytes(shape, tokens) * sum(1 for k in shape.kinds if k != "M")


# With one master for both linkers and 2176 MiB segments, SGLang's puts failed
# here (TRANSFER_FAIL, into the other producer's segment); now each linker has
# a master of its own on loopback and segments stay under 2 GiB (which of the
# two changes cured it was not isolated).
SEGMENT_CAP_MIB = 2000
LEASE_S = 2.0  # the loopback masters' read lease
NETNS_LEASE_S = 5.0  # `layerlift master`'s (a namespace link's master)
SETTLE_S = 60.0  # how long a prompt's offloads may take (1 GiB over 1 Gbit: ~9 s)


def segment_mib(shape: HybridShape, tokens: int) -> int:
    """A producer's segment: two prompts' objects (the one being restored
    and the next one's puts) and room, at least the small layout's 256 MiB."""
    return min(SEGMENT_CAP_MIB, max(256, 2 * kv_bytes(shape, tokens) // (1 << 20) + 128))


def linker_config(linker: str, master: str, segment: int, local: str = "127.0.0.1",
            bounds: tuple[float, float] = (2.0, 5.0),
            extra: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """SGLang's linker config for a client of the master at ``master`` (its
    address), reached from ``local``; ``bounds``: LayerLift's (timeout_s, load_timeout_s);
    ``extra``: more of LayerLift's ``linker_extra_config`` (its settings)."""
    if linker == "layerlift":
        return "dynamic", {"linker": "LayerLiftLinker", "linker_module_path": "layerlift.hosts.sglang",
                           "linker_extra_config": {
                               "master_address": master, "namespace": "bench",
                               "model": "bench-hybrid", "segment_mib": segment, "staging_mib": 64,
                               "local_hostname": local, "timeout_s": bounds[0],
                               "load_timeout_s": bounds[1], **(extra or {})}}
    return "mooncake", {"master_server_address": master,
                        "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
                        "global_segment_size": segment << 20, "local_hostname": local,
                        "check_server": False}


def make_pair(linker: str, shape: HybridShape, master: str, segment_mib: int = 256,
          local: str = "127.0.0.1",
          bounds: tuple[float, float] = (2.0, 5.0),
          extra: dict[str, Any] | None = None) -> tuple[SGLangHost, SGLangHost]:
    """A producer cache (contributing ``segment_mib`` to the store) and a
    consumer (none), whose forward copies into buffers kept from one restore
    to the next (``SGLangHost``'s ``reuse_reads``: the bench checks each
    restore's bytes before the next one). ``extra``: LayerLift's settings
    beyond the benchmark's (``linker_config``)."""
    hosts = []
    for segment in (segment_mib, 0):
        backend, config = linker_config(linker, master, segment, local, bounds, extra)
        hosts.append(SGLangHost(shape, backend=backend, config=config,
                                reuse_reads=segment == 0))
    return hosts[0], hosts[1]


class Sweeper:
    """A client of the master (no segment) that empties the store after each
    restore: a real layout's round puts 2 GiB, more than Mooncake evicts in
    time (its puts would fail and the next restores miss). ``remove_all``
    without ``force``: objects still under a read lease, and puts not yet
    complete (a linker's offload may still run), stay."""

    def __init__(self, master: str, local: str, lease_s: float = 0.0) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.lease_s = lease_s
        self._client = MooncakeDistributedStore()
        rc = self._client.setup(local, "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master)
        if rc != 0:
            raise RuntimeError(f"the benchmark's clean-up client could not join the master at "
                               f"{master} (setup returned {rc})")

    def sweep(self) -> None:
        """Remove what is not leased, after the read lease of what was just read ended."""
        time.sleep(self.lease_s)
        self._client.remove_all(False)

    def close(self) -> None:
        self._client.close()


def random_prompt(rng: random.Random, n: int) -> list[int]:
    """``n`` random token ids (distinct prompts, no shared prefix by chance)."""
    return [rng.randrange(1, 1 << 30) for _ in range(n)]
