"""overlap: per-layer readiness, lanes (CPU / CUDA), the load scheduler, link emulation.

Knows nothing of trees, pools or stores: a load is a list of `LayerJob`s whose `fetch`
callables write bytes somewhere the caller owns.
"""

from __future__ import annotations

from .base import (
    DeviceEvent,
    JobFailure,
    Landing,
    Lane,
    LayerJob,
    LayerLoadCancelled,
    LayerLoadError,
    LayerWaitTimeout,
    LoadPolicy,
    ReadinessView,
    RequestId,
)
from .combined import CombinedReadiness, wait_all
from .lanes import CpuLane, CudaLane
from .link import EmulatedLink, parse_link
from .notify import Completion
from .readiness import DEFAULT_WAIT_TIMEOUT_S, LayerReadiness
from .scheduler import LayerTiming, LoadScheduler, LoadTask

__all__ = [
    "DEFAULT_WAIT_TIMEOUT_S",
    "CombinedReadiness",
    "Completion",
    "CpuLane",
    "CudaLane",
    "DeviceEvent",
    "EmulatedLink",
    "JobFailure",
    "Landing",
    "Lane",
    "LayerJob",
    "LayerLoadCancelled",
    "LayerLoadError",
    "LayerReadiness",
    "LayerTiming",
    "LayerWaitTimeout",
    "LoadPolicy",
    "LoadScheduler",
    "LoadTask",
    "ReadinessView",
    "RequestId",
    "parse_link",
    "wait_all",
]
