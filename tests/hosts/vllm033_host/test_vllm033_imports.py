"""LayerLift against vLLM 0.33.0's own classes, import level: the connector is a
complete v1 connector with hybrid-allocator support that vLLM's factory
loads by module path, it declines sleep mode (which 0.33 asks and then
refuses), the scheduler class subclasses 0.33's `Scheduler` whose private
hooks take the parameters `compat` names, and every other release is
refused with a sentence naming the supported ones."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import vllm
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA
from vllm.v1.core.sched.scheduler import Scheduler

import layerlift.hosts.vllm as package
from layerlift.hosts.vllm import compat
from layerlift.hosts.vllm.connector import (
    LayerLiftConnector,
    check_vllm_version,
    uses_layerlift_scheduler,
)
from layerlift.hosts.vllm.scheduler import LayerLiftScheduler

pytestmark = pytest.mark.vllm033

SUPPORTED = "0.32.x and 0.33.x"


def test_this_is_vllm_0_33() -> None:
    """The environment holds the release these tests are for."""
    assert vllm.__version__.startswith("0.33."), vllm.__version__
    assert check_vllm_version(vllm.__version__).series == "0.33"


def test_the_connector_is_a_complete_hybrid_v1_connector() -> None:
    """Subclass of 0.33's `KVConnectorBase_V1` and `SupportsHMA` with no
    abstract method left, and the lazy package name is the same class."""
    assert issubclass(LayerLiftConnector, KVConnectorBase_V1)
    assert issubclass(LayerLiftConnector, SupportsHMA)
    assert not inspect.isabstract(LayerLiftConnector), LayerLiftConnector.__abstractmethods__
    assert package.LayerLiftConnector is LayerLiftConnector
    assert package.LayerLiftScheduler is LayerLiftScheduler
    assert issubclass(LayerLiftScheduler, Scheduler)


def test_vllms_factory_loads_it_by_module_path_and_it_declines_sleep_mode() -> None:
    """vLLM 0.33's factory resolves ``kv_connector_module_path`` to the class,
    and the class answers 0.33's sleep-mode question with False (the base
    class says True), so vLLM refuses ``enable_sleep_mode`` with it."""
    config = KVTransferConfig(kv_connector="LayerLiftConnector", kv_role="kv_both",
                              kv_connector_module_path="layerlift.hosts.vllm")
    cls = KVConnectorFactory.get_connector_class(config)
    assert cls is LayerLiftConnector
    assert KVConnectorBase_V1.supports_sleep_mode(config) is True  # vLLM's default
    assert cls.supports_sleep_mode(config) is False


def test_the_0_33_scheduler_hooks_take_the_parameters_layerlift_passes() -> None:
    """vLLM 0.33's `Scheduler` passes `compat`'s hook check; so does
    `LayerLiftScheduler`'s own override of the split hook."""
    rel = compat.release(vllm.__version__)
    compat.check_scheduler_hooks(Scheduler, rel)
    compat.check_scheduler_hooks(LayerLiftScheduler, rel)
    split = inspect.signature(Scheduler._mamba_block_aligned_split).parameters
    assert [p for p in split if p != "self"] == list(rel.hooks["_mamba_block_aligned_split"])


def test_a_scheduler_whose_hook_changed_is_refused() -> None:
    """The negative control of the check: a `Scheduler` whose preemption
    hook lost ``drop_stale_output``, or lacks the split hook, is refused
    with the method named."""
    class Changed(Scheduler):  # type: ignore[misc]
        def _preempt_request(self, request: Any, timestamp: float) -> None:
            raise AssertionError("never called")

    rel = compat.release("0.33.0")
    with pytest.raises(ValueError, match="_preempt_request"):
        compat.check_scheduler_hooks(Changed, rel)

    class Missing:
        _preempt_request = Scheduler._preempt_request

    with pytest.raises(ValueError, match="no _mamba_block_aligned_split"):
        compat.check_scheduler_hooks(Missing, rel)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.3", "0.33.0", "0.33.1"])
def test_0_32_and_0_33_releases_are_accepted(version: str) -> None:
    assert check_vllm_version(version).series == version[:4]


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0", "0.3.3", "0.330.0", "dev"])
def test_every_other_release_is_refused_with_the_supported_versions(version: str) -> None:
    with pytest.raises(ValueError, match=r"supports vLLM 0\.32\.x and 0\.33\.x") as info:
        check_vllm_version(version)
    assert f"this is vLLM {version}." in str(info.value)
    assert compat.supported() == SUPPORTED


def test_the_scheduler_class_refuses_another_release_at_start_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With vLLM's version reading 0.34.0 `LayerLiftScheduler` raises before
    vLLM's own ``__init__`` runs (its arguments are never looked at), and the
    connector's check of ``scheduler_cls`` raises the same sentence."""
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    with pytest.raises(ValueError, match=SUPPORTED.replace(".", r"\.")):
        LayerLiftScheduler(vllm_config=None, kv_cache_config=None)

    class Config:
        class scheduler_config:  # vLLM's attribute name
            scheduler_cls = "layerlift.hosts.vllm.LayerLiftScheduler"

    with pytest.raises(ValueError, match=r"this is vLLM 0\.34\.0"):
        uses_layerlift_scheduler(Config)
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    assert uses_layerlift_scheduler(Config) is True
