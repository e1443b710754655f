"""Owner locks: an instance's death on this node is visible at once, however it died.

Real processes hold real `flock`s on real files; a process killed with SIGKILL
has its lock dropped by the kernel, and only then is its owner reported dead.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.jobs.owners import OwnerLock

_HOLDER = """
import sys, time
from pathlib import Path
from runtime.jobs.owners import OwnerLock
lock = OwnerLock(Path(sys.argv[1]), sys.argv[2])
assert lock.hold()
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holders() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes holding an owner lock; every one is killed when the test ends."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def hold_in_process(
    holders: list[subprocess.Popen[str]], directory: Path, owner: str
) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(directory), owner],
        stdout=subprocess.PIPE,
        text=True,
    )
    holders.append(proc)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.process
def test_a_killed_owner_is_dead_and_a_living_one_is_not(
    tmp_path: Path, holders: list[subprocess.Popen[str]]
) -> None:
    directory = tmp_path / "owners"
    living = hold_in_process(holders, directory, "node-a1")
    doomed = hold_in_process(holders, directory, "node/b2 odd:name")
    me = OwnerLock(directory, "node-me")
    assert me.hold()
    assert me.dead() == []

    os.kill(doomed.pid, signal.SIGKILL)
    doomed.wait(10)
    dead = me.dead()
    assert [d.owner for d in dead] == ["node/b2 odd:name"]
    # While this instance handles the dead owner, nobody else can take it.
    other = OwnerLock(directory, "node-other")
    assert other.hold()
    assert other.dead() == []
    dead[0].release(delete=True)
    assert me.dead() == [] and other.dead() == []
    assert living.poll() is None
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        [me.path.name, other.path.name, "node-a1.lock"]
    )
    other.release()
    me.release()
    assert [p.name for p in directory.iterdir()] == ["node-a1.lock"]


def test_a_dead_owner_kept_for_later_is_found_again(tmp_path: Path) -> None:
    directory = tmp_path / "owners"
    gone = OwnerLock(directory, "node-gone")
    assert gone.hold()
    gone.release(delete=False)  # as the process exit would, leaving its file behind
    me = OwnerLock(directory, "node-me")
    assert me.hold()
    first = me.dead()
    assert [d.owner for d in first] == ["node-gone"]
    first[0].release(delete=False)  # the store failed: try at the next pass
    again = me.dead()
    assert [d.owner for d in again] == ["node-gone"]
    again[0].release(delete=True)
    assert me.dead() == []
    me.release()


def test_an_abandoned_pending_lock_file_is_removed(tmp_path: Path) -> None:
    directory = tmp_path / "owners"
    directory.mkdir()
    (directory / ".0123abcd.pending").write_text("")  # its creator died before renaming it
    me = OwnerLock(directory, "node-me")
    assert me.hold()
    assert me.dead() == []
    assert [p.name for p in directory.iterdir()] == [me.path.name]
    me.release()


def test_an_unusable_state_dir_turns_recovery_off_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "state"
    blocker.write_text("a file where the state dir should be")
    lock = OwnerLock(blocker / "owners", "node-me")
    with caplog.at_level(logging.WARNING, logger="thaw.jobs"):
        assert not lock.hold()
        assert not lock.hold()
        assert lock.dead() == []
    assert len([r for r in caplog.records if "dead-owner recovery is off" in r.message]) == 1
    assert not lock.held
    lock.release()
