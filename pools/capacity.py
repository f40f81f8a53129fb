"""Capacity memo invalidated *by construction*.

The capacity views (``available_size``, ``can_alloc``) are read by the
scheduler far more often than the allocator state changes, and computing them
walks the sub-pool chain (and, for exactness, simulates the shortfall ladder).
So they are memoized, keyed by an *epoch* that every state change bumps.

Rather than sprinkling ``invalidate()`` calls over every mutation site (and
forgetting one), every allocator state field is a :class:`_CapacityField` data
descriptor whose ``__set__`` bumps the shared epoch. The one constraint this
buys: state fields are **rebound, never mutated in place** (numpy arrays are
stored read-only to make an accidental in-place write raise). A write that
bypasses the descriptor (``obj.__dict__[...] = x``, flipping the writeable
flag) leaves a stale memo, which ``verify_byte_accounting`` catches by
recomputing and comparing.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Generic, Protocol, TypeVar, overload

import numpy as np

__all__ = ["CapacityEpoch", "CapacityMemo", "_CapacityField"]

T = TypeVar("T")


class CapacityEpoch:
    """A counter shared by all sub-allocators of one pool.

    Bumped by :class:`_CapacityField` on every rebind; read by
    :class:`CapacityMemo`. Single-threaded (the allocator's owner thread)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def bump(self) -> None:
        self.value += 1


class _HasEpoch(Protocol):
    _epoch: CapacityEpoch


class _CapacityField(Generic[T]):
    """Data descriptor for one allocator state field.

    Assigning the attribute stores the value and bumps ``obj._epoch``; numpy
    arrays are frozen (``writeable = False``) so the rebind-only contract is
    enforced for the common mistake. Because it defines ``__set__``, even
    ``object.__setattr__`` goes through it; only a write into ``obj.__dict__``
    bypasses it (and is caught by the stale-memo check)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._key = f"_cap_{name}"
        self._name = name

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> _CapacityField[T]: ...

    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> T: ...

    def __get__(self, obj: object | None, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        try:
            return obj.__dict__[self._key]
        except KeyError:
            raise AttributeError(f"state field {self._name!r} was never set") from None

    def __set__(self, obj: _HasEpoch, value: T) -> None:
        if isinstance(value, np.ndarray) and value.flags.writeable:
            value.flags.writeable = False
        obj.__dict__[self._key] = value
        obj._epoch.bump()


class CapacityMemo:
    """Epoch-keyed cache: entries are valid only while the epoch is unchanged."""

    __slots__ = ("_entries", "_epoch", "_seen")

    def __init__(self, epoch: CapacityEpoch) -> None:
        self._epoch = epoch
        self._seen = epoch.value
        self._entries: dict[Hashable, Any] = {}

    def get(self, key: Hashable, compute: Callable[[], T]) -> T:
        """The memoized value of ``key`` at the current epoch (computed on a miss)."""
        if self._seen != self._epoch.value:
            self._entries = {}
            self._seen = self._epoch.value
        if key not in self._entries:
            self._entries[key] = compute()
        value: T = self._entries[key]
        return value

    def current_entries(self) -> dict[Hashable, Any]:
        """Entries memoized at the current epoch (for ``verify_byte_accounting``)."""
        if self._seen != self._epoch.value:
            return {}
        return dict(self._entries)
