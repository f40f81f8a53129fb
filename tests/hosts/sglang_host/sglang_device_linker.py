"""``SimDeviceLinker``: LayerLift's linker on a simulated device, for SGLang's own
dynamic loader in the device tests (``linker_module_path: sglang_device_linker``).

SGLang constructs a linker with fixed arguments, so the device travels through a
class attribute a test sets around the construction (``LayerLiftLinker(device=...)``
is the seam; this class only fills it in)."""

from __future__ import annotations

from typing import Any, ClassVar

from layerlift.hosts.sglang import LayerLiftLinker
from layerlift.overlap.device import Device


class SimDeviceLinker(LayerLiftLinker):
    device: ClassVar[Device | None] = None  # set by the test while SGLang builds the linker

    def __init__(self, server_args: Any, params: Any, **kwargs: Any) -> None:
        if SimDeviceLinker.device is None:
            raise RuntimeError("set SimDeviceLinker.device before SGLang builds the linker")
        super().__init__(server_args, params, device=SimDeviceLinker.device, **kwargs)
