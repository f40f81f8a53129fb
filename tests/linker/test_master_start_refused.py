"""A master the system refused a thread at startup is started again.

CI once saw ``runtime/cgo: pthread_create failed: Resource temporarily
unavailable`` from a master starting while two test lanes ran (EAGAIN; the
master aborted, code -6). The refusal passes once other processes' threads
end, so ``EmbeddedMaster.start`` tries again, a bounded number of times;
every other startup failure still raises at once. A wrapper script stands in
for the binary: it fails its first N starts the way that master did, then
runs the real ``mooncake_master`` with the same arguments.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from layerlift.linker import master as master_module
from layerlift.linker.master import EmbeddedMaster, find_master_binary, port_open
from layerlift.linker.store_base import StoreUnavailable

REFUSED = "runtime/cgo: pthread_create failed: Resource temporarily unavailable"


def wrapper(tmp_path: Path, *, failures: int, message: str = REFUSED,
            then: str | None = None) -> tuple[Path, Path]:
    """A stand-in binary failing its first `failures` starts with `message` (SIGABRT,
    as Go's runtime does), then running `then` (a shell line; by default exec-ing
    the real master with the same arguments); and its count file."""
    count = tmp_path / "starts"
    count.write_text("0")
    script = tmp_path / "mooncake_master"
    script.write_text(
        "#!/bin/bash\n"
        f'n=$(( $(cat "{count}") + 1 )); echo $n > "{count}"\n'
        f'if (( n <= {failures} )); then echo "{message}" >&2; kill -ABRT $$; fi\n'
        + (then if then is not None else f'exec "{find_master_binary()}" "$@"') + "\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script, count


def test_a_refused_start_is_tried_again_and_serves(tmp_path: Path) -> None:
    script, count = wrapper(tmp_path, failures=2)
    master = EmbeddedMaster(binary=str(script), log_path=tmp_path / "log", http_metadata=False)
    with master:
        assert master.running and port_open(master.host, master.rpc_port)
        assert master.restarts == 2
        assert count.read_text().strip() == "3"
        log = master.log_path.read_text()
        assert log.count(REFUSED) == 2 and "started again" in log  # both refusals kept
    assert master.pid is None


def test_refused_at_every_start_raises_naming_the_attempts(tmp_path: Path) -> None:
    script, count = wrapper(tmp_path, failures=5)
    master = EmbeddedMaster(binary=str(script), log_path=tmp_path / "log", start_attempts=2)
    with pytest.raises(StoreUnavailable, match=r"refused resources at each of its 2 starts"):
        master.start()
    assert count.read_text().strip() == "2"
    assert master.pid is None and not master.running


@pytest.mark.parametrize("message", ["ERROR: unknown command line flag 'x'", ""])
def test_any_other_startup_exit_raises_at_once(tmp_path: Path, message: str) -> None:
    script, count = wrapper(tmp_path, failures=1, message=message)
    master = EmbeddedMaster(binary=str(script), log_path=tmp_path / "log")
    with pytest.raises(StoreUnavailable, match=r"exited with code -6 during startup") as info:
        master.start()
    assert not str(info.value).startswith("mooncake_master was refused")
    assert count.read_text().strip() == "1"  # not started again
    assert master.pid is None


def test_a_start_after_a_refusal_that_fails_otherwise_raises_at_once(tmp_path: Path) -> None:
    """The refusal of the start before stays in the log: only this start's
    own lines decide whether it is tried again."""
    script, count = wrapper(tmp_path, failures=1,
                            then='echo "ERROR: unknown command line flag" >&2; exit 1')
    master = EmbeddedMaster(binary=str(script), log_path=tmp_path / "log", start_attempts=3)
    with pytest.raises(StoreUnavailable, match=r"exited with code 1 during startup") as info:
        master.start()
    assert not str(info.value).startswith("mooncake_master was refused")
    assert count.read_text().strip() == "2"  # refused once, then a plain failure: no third
    assert master.pid is None


def test_a_refused_fork_is_tried_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fork() itself refused (EAGAIN: BlockingIOError in this process)."""
    real, forks = master_module.spawn_child, []

    def spawn(*args: object, **kwargs: object) -> object:
        forks.append(1)
        if len(forks) == 1:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(master_module, "spawn_child", spawn)
    with EmbeddedMaster(log_path=tmp_path / "log", http_metadata=False) as master:
        assert master.restarts == 1 and port_open(master.host, master.rpc_port)
    assert len(forks) == 2


def test_start_attempts_must_be_positive() -> None:
    with pytest.raises(ValueError, match="start_attempts must be at least 1"):
        EmbeddedMaster(start_attempts=0)


def test_the_wrapper_really_runs_the_master(tmp_path: Path) -> None:
    """Control: with no failures the stand-in is the real master, started once."""
    script, count = wrapper(tmp_path, failures=0)
    with EmbeddedMaster(binary=str(script), log_path=tmp_path / "log") as master:
        assert master.restarts == 0 and port_open(master.host, master.rpc_port)
        assert os.path.exists(master.log_path)
    assert count.read_text().strip() == "1"
