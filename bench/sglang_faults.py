"""The SGLang benchmark's fault cases (``bench/sglang_bench.py``, item 2):
per linker, a ranged read that lands one flipped byte in layer 5's slice, a
master stopped just before the layer-wise load and the storage node holding
the only segment killed just before it; what each linker lets through and
how long until the batch's verdict."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from layerlift.bench.sglang_setup import LINKERS, make_pair, random_prompt, shape_for
from layerlift.linker.master import EmbeddedMaster
from layerlift.testing.sglang_harness import Restore, SGLangHost, is_zero, same_bytes

__all__ = ["STALL_CAP_S", "fault_points"]

STALL_CAP_S = 15.0  # a forward still blocked this long is released by resuming the master


def store_node(master: EmbeddedMaster) -> subprocess.Popen[str]:
    """A ``layerlift store-node`` process holding the store's only segment."""
    node = subprocess.Popen(
        [sys.executable, "-m", "layerlift.cli", "store-node", "--master", master.master_address,
         "--bytes", "256M"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert node.stdout is not None
    line = node.stdout.readline()
    if not line.startswith("ready"):
        node.kill()
        raise RuntimeError(f"the storage node did not start: {line!r}")
    return node


def _run_capped(fn: Callable[[], Restore], cap_s: float,
                release: Callable[[], None]) -> tuple[Restore | None, float, bool]:
    """Run ``fn`` on a thread. If it has not returned within ``cap_s``, call
    ``release`` (resume the master) and wait for it again. Returns its result,
    the seconds until it returned, and whether it outlived the cap."""
    box: list[Restore] = []
    started = time.perf_counter()
    thread = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    thread.start()
    thread.join(cap_s)
    hung = thread.is_alive()
    release()
    thread.join(120.0)
    return (box[0] if box else None), time.perf_counter() - started, hung


def _classify(host: SGLangHost, r: Restore, tokens: list[int]) -> tuple[int, int]:
    """(layers holding bytes that are neither the offloaded ones nor zero,
    layers zeroed)."""
    done = tokens[: r.loaded_tokens]
    wrong = zero = 0
    for layer in sorted(r.layers):
        got = r.layers[layer]
        if all(same_bytes(g, e) for g, e in
               zip(got, host.expected_layer(done, layer), strict=True)):
            continue
        if all(is_zero(g) for g in got):
            zero += 1
        else:
            wrong += 1
    return wrong, zero


def _flip_layer5(name: str, host: SGLangHost) -> Callable[[], None]:
    """Install, on the consumer's own ranged-read call, a fault that flips one
    byte of what layer 5's read landed (storage that returns a corrupted
    slice). Returns the undo."""
    if name == "layerlift":
        store = host.linker.store
        inner = store.get_ranges
        offset5 = host.linker.layouts["kv"].slices[1][0]

        def faulty(keys: Any, dst: Any, sizes: Any, offsets: Any) -> None:
            inner(keys, dst, sizes, offsets)
            if keys and "/full/" in keys[0] and offsets[0][0] == offset5:
                _flip(dst[0][0])

        store.get_ranges = faulty
        return lambda: setattr(store, "get_ranges", inner)
    client = host.linker.storage.store
    real = client.batch_get_into_multi_buffer_ranges
    calls = [0]

    class _Client:
        def __getattr__(self, attr: str) -> Any:
            return getattr(client, attr)

        def batch_get_into_multi_buffer_ranges(self, keys: Any, ptrs: Any, sizes: Any,
                                               offsets: Any) -> Any:
            result = real(keys, ptrs, sizes, offsets)
            calls[0] += 1
            if calls[0] == 6:  # one call per layer here: the 6th is layer 5
                _flip(ptrs[0][0])
            return result

    host.linker.storage.store = _Client()
    return lambda: setattr(host.linker.storage, "store", client)


def _flip(ptr: int) -> None:
    import ctypes

    b = ctypes.c_uint8.from_address(ptr + 3)
    b.value ^= 0x40


def _fault_case(name: str, fault: str, producer: SGLangHost, consumer: SGLangHost,
                rng: random.Random, before: Callable[[], None] | None,
                release: Callable[[], None]) -> dict[str, Any]:
    tokens = random_prompt(rng, 512)
    producer.compute(tokens, [512])
    producer.settle_offloads()
    undo = _flip_layer5(name, consumer) if fault == "corrupted slice" else (lambda: None)
    r, took, hung = _run_capped(partial(consumer.restore, [*tokens, 1], before_start=before),
                                STALL_CAP_S, release)
    undo()
    wrong, zero = _classify(consumer, r, tokens) if r and r.loaded_tokens else (None, None)
    return {"linker": name, "fault": fault, "verdict_s": round(took, 3),
            "hit_tokens": r.hit_tokens if r else None,
            "hung_past_s": STALL_CAP_S if hung else None,
            "load_reported_failed": (not r.ok) if r else None,
            "layers_with_wrong_bytes": wrong, "layers_zeroed": zero,
            "output_used": bool(r and r.ok)}


def fault_points(master: EmbeddedMaster, rng: random.Random) -> list[dict[str, Any]]:
    """Per linker: a corrupted slice and a stopped master on ``master``; a
    killed storage node on a master of its own (the dead node's segment stays
    listed there until its lease lapses, which would fail later puts)."""
    from layerlift.testing.faults import ProcessStall

    shape = shape_for(64)
    out = []
    assert master.pid is not None
    stall = ProcessStall(master.pid)
    for name in LINKERS:
        producer, consumer = make_pair(name, shape, master.master_address)
        try:
            out.append(_fault_case(name, "corrupted slice", producer, consumer, rng, None,
                                   lambda: None))
            out.append(_fault_case(name, "stopped master", producer, consumer, rng, stall.stop,
                                   stall.release))
        finally:
            stall.release()
            consumer.close()
            producer.close()
    for name in LINKERS:
        with EmbeddedMaster(http_metadata=False, lease_ttl_ms=5000) as own:
            node = store_node(own)
            producer, consumer = make_pair(name, shape, own.master_address, segment_mib=0)
            try:
                out.append(_fault_case(name, "killed storage node", producer, consumer, rng,
                                       node.kill, lambda: None))
            finally:
                node.kill()
                node.wait()
                consumer.close()
                producer.close()
    return out
