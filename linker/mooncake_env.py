"""Mooncake's process-wide settings LayerLift defaults, and the two log lines
every client's ``setup`` prints that mean nothing.

Imported by ``layerlift.linker.mooncake_store``. If ``mooncake`` has not been
imported yet, it sets these in the process environment (where Mooncake's C++
code reads them), each only if the user has not set it:

- ``MC_LOG_LEVEL=ERROR`` and ``GLOG_minloglevel=2``: Mooncake's glog lines on
  stderr show errors only (Mooncake 0.3.13 sets glog's level from
  MC_LOG_LEVEL, default INFO, overriding ``GLOG_minloglevel``; it accepts
  TRACE, INFO, WARNING and ERROR). Set ``MC_LOG_LEVEL=INFO`` to see them all.
- ``MC_STORE_CLIENT_SETUP_RETRIES=2`` (Mooncake's default: 20): how often
  ``setup`` tries again; each try against a master that accepts connections
  but does not answer takes Mooncake's RPC timeout (30 s) with the GIL held.

While the log level is LayerLift's (the user did not set ``MC_LOG_LEVEL``),
:func:`setup_log_filter` also drops the two lines Mooncake 0.3.13 prints on
every successful ``setup`` ("Logging before InitGoogleLogging() is written
to STDERR" and the ERROR "Local segment descriptor not found"): stderr (file
descriptor 2) goes to a temporary file during the call and every other line
is written back to stderr afterwards, so nothing else is lost, only delayed
until the call returned.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator

__all__ = ["MOONCAKE_DEFAULTS", "apply_defaults", "setup_log_filter"]

MOONCAKE_DEFAULTS = {"MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "2",
                     "MC_STORE_CLIENT_SETUP_RETRIES": "2"}
_SPURIOUS = re.compile(r"Logging before InitGoogleLogging\(\) is written to STDERR"
                       r"|transfer_metadata\.cpp:\d+\] Local segment descriptor not found")
_redirect_lock = threading.Lock()  # one redirect of fd 2 at a time
_filtering = False
_applied = False


def apply_defaults() -> None:
    """Set :data:`MOONCAKE_DEFAULTS` where the user has not, if ``mooncake``
    is not imported yet (a program that imported it keeps Mooncake's own).
    Only the first call acts: a later one (the CLI's, after an import made
    the first) must not take LayerLift's own level for the user's."""
    global _filtering, _applied
    if _applied or "mooncake" in sys.modules:
        return
    _applied = True
    _filtering = "MC_LOG_LEVEL" not in os.environ
    for name, value in MOONCAKE_DEFAULTS.items():
        os.environ.setdefault(name, value)


@contextlib.contextmanager
def setup_log_filter() -> Iterator[None]:
    """Around one Mooncake ``setup`` call: capture fd 2, then write back every
    line but the two spurious ones. A no-op when the user chose the level."""
    if not _filtering:
        yield
        return
    with _redirect_lock, tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        try:
            saved = os.dup(2)
        except OSError:  # no stderr to filter (a closed fd 2)
            yield
            return
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines = tmp.read().decode(errors="replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not _SPURIOUS.search(line))
            if kept:
                os.write(2, kept.encode())
