"""A build lock left by a killed build must not make every later load wait forever."""

import os
import time

from sluice.engine.native import STALE_LOCK_SECONDS, clear_stale_lock


def test_a_stale_lock_is_removed_and_a_fresh_one_kept(tmp_path, capsys):
    lock = tmp_path / "lock"
    lock.write_text("")
    assert not clear_stale_lock(tmp_path) and lock.exists()  # a live build's lock: wait on it
    old = time.time() - STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    assert clear_stale_lock(tmp_path) and not lock.exists()
    assert "stale build lock" in capsys.readouterr().err
    assert not clear_stale_lock(tmp_path)  # nothing left to remove
