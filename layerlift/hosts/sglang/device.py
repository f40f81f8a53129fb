"""The SGLang linker's device path: which device its pools live on, its streams, and the
gather/scatter of units into SGLang's slots as device operations.

SGLang's pools on the CPU take the host path (``load``'s ``ctypes`` scatter, ``offload``'s
snapshot): nothing here is used. Pools on a CUDA device (or, in tests, host tensors
standing for a simulated device, ``layerlift.testing.simdevice.SimDevice``, injected
through ``LayerLiftLinker(device=...)``) take this path, through the device seam
(``overlap/device.py``; every stream, event and copy goes through a
:class:`~layerlift.overlap.device.Device`):

* **Loads** (``load.BatchLoad``): the staged transfer's
  :class:`~layerlift.linker.staged.DeviceSink` issues each verified chunk's H2D copy
  from the pinned load ring and :func:`scatter_units` (an ``index_copy_`` into the
  unit's slot rows) on :attr:`DevicePath.load_stream`, then records an event there;
  the chunk's staging returns to the ring only once that event completed. Before a
  batch's first copy the load stream is fenced after the scheduler thread's current
  stream and the forward stream (:meth:`DevicePath.fence_load`: no host sync), so a
  copy never overtakes earlier work on the slots. A layer that did not land is zeroed
  by :func:`zero_units` on the load stream (after any of its copies).
* **The forward's waits** (``load.LoadCounter.wait_until``): once a layer's copies are
  issued, the forward stream SGLang passed (``forward_stream``; None: the calling
  thread's current stream) waits on the layer's event (:meth:`DevicePath.wait`): a
  device-side wait, no host sync.
* **Offloads** (``offload.Offloader``): ``offload`` records events on the calling
  thread's current stream and on the forward stream (:meth:`DevicePath.offload_ready`,
  as SGLang's ``record_offload_ready``); the gather (:func:`gather_units`) and its D2H
  copy into the pinned offload ring run on :attr:`DevicePath.offload_stream` after
  both, through :class:`~layerlift.linker.staged.DeviceSnapshot`, and the snapshot
  returns once the copy ran: before the store call, so before SGLang unlocks the node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from layerlift.overlap.device import Device, DeviceEvent, device_of

from .layout import LayerParts, PoolLayout

__all__ = ["DevicePath", "gather_units", "pool_device", "scatter_units", "zero_units"]


def pool_device(layouts: dict[str, PoolLayout], device: Device | None = None) -> Device | None:
    """The device of every pool tensor in ``layouts``: None for host memory (the host
    path), the :class:`~layerlift.overlap.device.CudaDevice` of their CUDA device, or
    ``device`` when given (a test's simulated device: its tensors are host tensors).
    ValueError, with a sentence, for pools on more than one device, or for ``device``
    whose tensors live elsewhere than the pools'."""
    tensors = [p.tensor for layout in layouts.values() for lp in layout.layers for p in lp.parts]
    if not tensors:
        return device
    places = {t.device for t in tensors}
    if len(places) > 1:
        raise ValueError("LayerLiftLinker needs every pool on one device; these pools are on "
                         f"{sorted(str(p) for p in places)}")
    (place,) = places
    if device is not None:
        want = device.torch_device
        if place.type != want.type or (want.index is not None and place.index != want.index):
            raise ValueError(f"the linker's device keeps its tensors on {want}, but the pools "
                             f"are on {place}")
        return device
    if place.type == "cpu":
        return None
    return device_of(tensors[0])


@dataclass(frozen=True, slots=True)
class DevicePath:
    """One linker's device, its two streams and SGLang's forward stream (see the module
    docstring). ``forward_stream`` None: the forward runs on the calling thread's
    current stream."""

    device: Device
    load_stream: Any
    offload_stream: Any
    forward_stream: Any = None

    @classmethod
    def open(cls, device: Device, forward_stream: Any = None) -> DevicePath:
        return cls(device, device.new_stream(), device.new_stream(), forward_stream)

    def _streams(self) -> list[Any]:
        """The streams that write the slots: the caller's current one and the forward's."""
        with self.device.use():
            current = self.device.current_stream()
        out = [current]
        if self.forward_stream is not None and self.forward_stream is not current:
            out.append(self.forward_stream)
        return out

    def fence_load(self) -> None:
        """Order the load stream after everything issued so far on the calling thread's
        current stream and on the forward stream (events, no host sync)."""
        for stream in self._streams():
            fence = self.device.event()
            fence.record(stream)
            fence.wait(self.load_stream)

    def wait(self, event: DeviceEvent) -> None:
        """Make the forward stream wait on ``event`` (no host sync)."""
        event.wait(self.forward_stream)

    def offload_ready(self) -> list[DeviceEvent]:
        """Events recorded now on the calling thread's current stream and the forward
        stream: an offload's gather runs after both (the slots' writers)."""
        events = []
        for stream in self._streams():
            event = self.device.event()
            event.record(stream)
            events.append(event)
        return events


def _index(starts: Sequence[int], rows: int, device: torch.device) -> torch.Tensor:
    """The slot rows of units starting at ``starts``, ``rows`` each, in unit order."""
    base = torch.as_tensor(list(starts), dtype=torch.int64)
    idx = (base[:, None] + torch.arange(rows, dtype=torch.int64)).flatten()
    if device.type == "cpu":
        return idx
    # Pinned, then an asynchronous copy on the current (load or offload) stream: torch
    # synchronises the host with the stream after a blocking copy from pageable memory.
    # The caching host allocator keeps the pinned block until that copy ran.
    return idx.pin_memory().to(device, non_blocking=True)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (contiguous, dim 0 = slot) as ``uint8[slots, row_bytes]``."""
    return tensor.reshape(tensor.shape[0], -1).view(torch.uint8)


def scatter_units(layer: LayerParts, starts: Sequence[int], rows: torch.Tensor) -> None:
    """Write ``rows`` (``uint8[n, layer.nbytes]`` on the slots' device: each unit's
    slice, its parts back to back) into the units starting at slot rows ``starts``.
    Issue it on the load stream (device work, no host sync)."""
    n = len(starts)
    at = 0
    for part in layer.parts:
        view = _bytes(part.tensor)
        src = rows[:, at : at + part.nbytes].reshape(n * part.rows, part.row_bytes)
        view.index_copy_(0, _index(starts, part.rows, view.device), src)
        at += part.nbytes


def zero_units(layers: Sequence[LayerParts], starts: Sequence[int]) -> None:
    """Zero every part of ``layers`` in the units starting at ``starts`` (device work)."""
    if not starts:
        return
    for layer in layers:
        for part in layer.parts:
            view = _bytes(part.tensor)
            view.index_fill_(0, _index(starts, part.rows, view.device), 0)


def gather_units(layers: Sequence[LayerParts], starts: Sequence[int]) -> torch.Tensor:
    """The page bytes of the units starting at ``starts`` as ``uint8[n, page_bytes]``
    (layer-major, each layer's parts back to back; LayerLift's object page), on the
    slots' device. Issue it on the offload stream."""
    n = len(starts)
    pieces = []
    for layer in layers:
        for part in layer.parts:
            view = _bytes(part.tensor)
            got = view.index_select(0, _index(starts, part.rows, view.device))
            pieces.append(got.reshape(n, part.nbytes))
    return torch.cat(pieces, dim=1)
