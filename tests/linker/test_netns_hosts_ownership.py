"""`NetnsHosts` names are unique per process and cleanup touches only what an
instance made (issue 21, finding 5): a tag built from ``id(self) % 100000``
could repeat between live instances (ids are reused), and a failed build's
cleanup deleted every namespace with its tag's prefix, another instance's
included."""

from __future__ import annotations

import subprocess

import pytest

from layerlift.testing import NetnsHosts
from layerlift.testing.netns import leftover_namespaces


def _exists(name: str) -> bool:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                         check=True).stdout
    return any(line.split()[0] == name for line in out.splitlines() if line.strip())


def test_tags_are_unique_within_a_process() -> None:
    """Instances made and dropped one after another (their ids are reused)
    still get distinct tags."""
    tags = [NetnsHosts(["a"]).tag for _ in range(200)]
    assert len(set(tags)) == len(tags)


@pytest.mark.netns
def test_a_failed_build_deletes_only_what_it_made() -> None:
    """B's build fails at its second host (the name is taken by a namespace
    someone else made); B's cleanup removes B's switch and first host only:
    A's hosts and the foreign namespace stay."""
    with NetnsHosts(["x", "y"]) as a:
        b = NetnsHosts(["p", "q"])
        foreign = f"{b.tag}-h1"
        subprocess.run(["ip", "netns", "add", foreign], check=True)
        try:
            with pytest.raises(RuntimeError, match="netns add"):
                b.start()
            assert _exists(foreign), "B deleted a namespace it did not make"
            assert not _exists(b.switch) and not _exists(f"{b.tag}-h0")
            assert all(_exists(h.netns) for h in a.hosts.values()) and _exists(a.switch)
        finally:
            subprocess.run(["ip", "netns", "delete", foreign], check=False)
    assert not leftover_namespaces()
