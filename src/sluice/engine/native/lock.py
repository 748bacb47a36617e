"""The lock a kernel build holds: an OS lock (fcntl.flock) that dies with the process holding it.

The kernel drops a flock when its holder exits, however it exits (SIGKILL included), so a killed build
never leaves a lock behind for the next one to wait on: the next build takes it at once. While held,
the lock file records who holds it (pid, when it took the lock, its nice value, what it builds), so a
process that has to wait can say on whom, and one that need not wait can say who is building.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Holder:
    """Who holds a build lock, as its holder recorded it (any field may be missing: unknown)."""

    pid: int | None = None
    since: float | None = None
    nice: int | None = None
    what: str | None = None

    def describe(self) -> str:
        """'pid 1234 (nice 10) since 21:14:03' for a message; what is known of it."""
        who = f"pid {self.pid}" if self.pid is not None else "another process"
        if self.nice is not None:
            who += f" (nice {self.nice})"
        if self.since is not None:
            who += " since " + time.strftime("%H:%M:%S", time.localtime(self.since))
        return who


def _read(fd: int) -> Holder:
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return Holder(**{k: record.get(k) for k in ("pid", "since", "nice", "what")})
    except (ValueError, TypeError):  # the holder is writing its record right now
        return Holder()


def holder(path: Path) -> Holder | None:
    """Who holds the lock at `path` now, or None when nobody does (a dead holder holds nothing)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


class BuildLock:
    """An exclusive flock on `path` (created if missing) for building `what`. `acquire()` waits for a live
    holder and says so on stderr, once, naming it; `try_acquire()` never waits."""

    def __init__(self, path: Path, what: str):
        self.path, self.what = Path(path), what
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._hold(fd)
        return True

    def acquire(self) -> None:
        if self.try_acquire():
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        print(f"sluice: waiting for {_read(fd).describe()}, which is building its {self.what}",
              file=sys.stderr, flush=True)
        fcntl.flock(fd, fcntl.LOCK_EX)  # returns the moment the holder finishes or dies
        self._hold(fd)

    def _hold(self, fd: int) -> None:
        self._fd = fd
        record = {"pid": os.getpid(), "since": time.time(), "nice": os.nice(0), "what": self.what}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # no record of a holder that is gone
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> BuildLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
