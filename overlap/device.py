"""The device seam: every stream, event and host<->device copy the GPU path makes.

The engine, the lanes, the forward's per-layer waits and the offloader reach the
accelerator only through a :class:`Device`. :class:`CudaDevice` implements it with
``torch.cuda`` (production); ``layerlift.testing.simdevice.SimDevice`` implements the
same contract on the CPU with streams that really run late, so an ordering bug gives
wrong bytes in CI. A CPU-only engine has no `Device` at all (``device_of`` gives None):
fetches write the pool directly and nothing is asynchronous.

Ordering rules the engine relies on (CUDA's, and exactly what the simulation enforces;
nothing else orders anything):

1. Work issued on one stream runs in issue order; work on different streams is not
   ordered at all. ``launch(stream, work)`` issues ``work``'s copies/kernels on
   ``stream`` and returns before they ran.
2. ``event.record(stream)`` completes once everything issued on ``stream`` before it
   ran; ``event.wait(stream)`` makes work issued on ``stream`` *after* the call wait for
   that completion (no host sync). An event never recorded counts as complete.
3. The *current* stream is per thread (``use(stream)`` sets it; by default it is the
   device's default stream). Work a thread does with ordinary torch calls on device
   tensors is issued on its current stream: the forward's kernels, the pool's
   relocation copies (``pools/``) and the offloader's gather all run on the default
   stream, so they are ordered after one another, but NOT before or after the lane's
   load stream. Hence the engine's three explicit orderings:
   * the load stream waits on a fence recorded on the current stream at the start of
     each load (``Lane.begin_load``): a load never overwrites a page before the
     relocation copy that vacated it read it;
   * before layer ``l`` the forward makes its stream wait on layer ``l``'s event,
     recorded on the load stream after the layer's H2D copies (``LayerReadiness.wait``);
   * a lane's event is recorded on the stream that carried the copies (the load
     stream), never on the caller's.
4. ``event.synchronize()`` and ``Device.synchronize()`` block the host; ``to_host``
   returns once its copy finished. Host memory handed to a ``launch`` (pinned staging)
   must stay untouched until an event recorded after it completed.
"""

from __future__ import annotations

import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch

__all__ = ["CudaDevice", "Device", "DeviceEvent", "bind", "device_of"]


class DeviceEvent(Protocol):
    """A device event (``torch.cuda.Event`` or a simulated one); see the module rules."""

    def record(self, stream: Any = None) -> None: ...

    def wait(self, stream: Any = None) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end_event: Any) -> float: ...


class Device(ABC):
    """One accelerator: streams, events, asynchronous copies, pinned staging.

    ``torch_device`` is where its tensors live (``cuda:N``; the CPU for the simulation).
    Methods may be called from any thread; streams are opaque handles of this device.
    """

    torch_device: torch.device

    @abstractmethod
    def new_stream(self) -> Any:
        """A new stream of this device (a load stream)."""

    @abstractmethod
    def current_stream(self) -> Any:
        """The calling thread's current stream on this device."""

    @abstractmethod
    def event(self, *, timing: bool = False, blocking: bool = False) -> DeviceEvent:
        """A new event; ``timing`` enables ``elapsed_time``, ``blocking`` makes
        ``synchronize`` sleep instead of spinning."""

    @abstractmethod
    @contextmanager
    def use(self, stream: Any = None) -> Iterator[Any]:
        """Run the block under this device (the calling thread's device context) with
        ``stream`` as its current stream (None: keep the current one); yields it."""

    @abstractmethod
    def launch(self, stream: Any, work: Callable[[], None]) -> None:
        """Issue ``work``'s device operations (copies, scatters) on ``stream``; returns
        before they ran. ``work`` must not read device results on the host."""

    @abstractmethod
    def pinned(self, nbytes: int) -> torch.Tensor:
        """A page-locked host uint8 tensor of ``nbytes`` (staging for H2D copies)."""

    @abstractmethod
    def to_host(self, views: Sequence[torch.Tensor]) -> torch.Tensor:
        """Gather ``views`` (device tensors) into one pinned host tensor, ordered after
        the calling thread's current stream; returns once the copy finished."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block until every stream of this device ran everything issued so far."""

    def stream_handle(self, stream: Any) -> int | None:
        """The raw driver handle of ``stream`` (for ``cuLaunchHostFunc``), or None
        where there is none (then completion is learnt by a watcher thread)."""
        return None

    def attach_pool(self, pool: Any) -> None:
        """Called once the engine's pool lives on this device (its buffer is bound to
        this device, see :func:`bind`). A device may watch the pool's relocations."""
        bind(pool.buffer, self)


class CudaDevice(Device):
    """The production seam: ``torch.cuda`` on ``cuda:N`` (``device`` as torch takes it)."""

    def __init__(self, device: str | torch.device | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaDevice needs a CUDA device; run the engine on 'cpu' here")
        dev = torch.device("cuda" if device is None else device)
        if dev.type != "cuda":
            raise ValueError(f"CudaDevice needs a cuda device, got {dev}")
        self.torch_device = torch.device("cuda", torch.cuda.current_device()
                                         if dev.index is None else dev.index)

    def new_stream(self) -> Any:
        return torch.cuda.Stream(device=self.torch_device)  # type: ignore[no-untyped-call]

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.torch_device)

    def event(self, *, timing: bool = False, blocking: bool = False) -> DeviceEvent:
        ev: DeviceEvent = torch.cuda.Event(  # type: ignore[no-untyped-call]
            enable_timing=timing, blocking=blocking)
        return ev

    @contextmanager
    def use(self, stream: Any = None) -> Iterator[Any]:
        with torch.cuda.device(self.torch_device):
            chosen = torch.cuda.current_stream(self.torch_device) if stream is None else stream
            with torch.cuda.stream(chosen):
                yield chosen

    def launch(self, stream: Any, work: Callable[[], None]) -> None:
        with torch.cuda.device(self.torch_device), torch.cuda.stream(stream):
            work()

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def to_host(self, views: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(views)).cpu().pin_memory()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def stream_handle(self, stream: Any) -> int | None:
        return int(stream.cuda_stream)


# A tensor knows its device; a simulated device's tensors are CPU tensors, so the
# seam remembers which buffers a Device owns (by identity, until the buffer dies).
_bound: dict[int, Device] = {}
_bound_lock = threading.Lock()


def bind(buffer: torch.Tensor, device: Device) -> None:
    """Record that ``buffer`` (the pool's memory) lives on ``device``."""
    key = id(buffer)
    with _bound_lock:
        _bound[key] = device
    weakref.finalize(buffer, _unbind, key)


def _unbind(key: int) -> None:
    with _bound_lock:
        _bound.pop(key, None)


_cuda_devices: dict[int, CudaDevice] = {}


def device_of(buffer: torch.Tensor) -> Device | None:
    """The :class:`Device` that ``buffer`` lives on: the one it was bound to, the
    ``CudaDevice`` of its index for a CUDA tensor, None for plain host memory."""
    with _bound_lock:
        bound = _bound.get(id(buffer))
    if bound is not None:
        return bound
    if buffer.device.type == "cuda":
        index = buffer.device.index if buffer.device.index is not None else 0
        with _bound_lock:
            if index not in _cuda_devices:
                _cuda_devices[index] = CudaDevice(torch.device("cuda", index))
            return _cuda_devices[index]
    return None
