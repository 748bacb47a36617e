"""Native kernel builds never block a run on a dead or silent holder: the build lock dies with its
holder, a waiter names whom it waits for, builds of different environments never share a directory,
a background build lands for a later call, and a machine without a compiler runs the torch path."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from sluice.engine.native import NativeExtension, build, extension, lock
from sluice.engine.native.build import target
from sluice.engine.native.lock import BuildLock, holder

HANG = 120  # s: only stops a hung test (the steps below take well under a second on a quiet machine)

# The smallest extension build.py can make: pybind11 alone compiles in seconds, torch/extension.h in a minute.
TINY = """#include <pybind11/pybind11.h>
bool has_avx2() { return true; }
int answer() { return 42; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("has_avx2", &has_avx2); m.def("answer", &answer); }
"""

# A child that takes a build lock, says so, and holds it until its stdin closes (or it is killed).
HOLD = """import sys
from sluice.engine.native.lock import BuildLock
BuildLock(sys.argv[1], "a test kernel").acquire()
print("held", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private build cache and a fresh notice state, in wait mode unless a test says otherwise."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SLUICE_KERNEL_BUILD", "wait")
    monkeypatch.setattr(extension, "_said", set())
    monkeypatch.setattr(extension, "_builder", None)
    monkeypatch.setattr(extension, "_shared_from", None)
    threads = torch.get_num_threads()
    yield tmp_path / "cache"
    torch.set_num_threads(threads)  # a test that left a build's core share behind must not slow the rest


@pytest.fixture
def tiny(tmp_path):
    src = tmp_path / "src" / "tiny.cpp"
    src.parent.mkdir()
    src.write_text(TINY)
    return src


def hold(path, nice=0):
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, preexec_fn=(lambda: os.nice(nice)) if nice else None)
    assert child.stdout.readline() == "held\n"
    return child


def test_a_dead_holders_lock_is_taken_over_at_once(cache, tiny, capfd):
    t = target(tiny)
    cache.mkdir()
    child = hold(t.lock)
    try:
        assert holder(t.lock).pid == child.pid
        assert not BuildLock(t.lock, "x").try_acquire()  # held by a live process
    finally:
        child.send_signal(signal.SIGKILL)  # killed mid-build: nothing gets to clean up
        child.wait(HANG)
    assert holder(t.lock) is None
    build.build(t, "tiny kernel")  # takes the lock without waiting, and builds
    assert t.ready() and "waiting" not in capfd.readouterr().err
    ext = NativeExtension(tiny, "tiny kernel")
    assert ext.module() is not None, ext.why_unavailable()
    assert ext.module().answer() == 42


def test_a_live_holder_makes_a_waiter_say_who_and_since(tmp_path, capsys):
    path = tmp_path / "k.lock"
    child = hold(path, nice=3)
    since = time.strftime("%H:%M:%S", time.localtime(holder(path).since))
    waiter = BuildLock(path, "whole-step CPU kernel")
    got = threading.Thread(target=waiter.acquire, daemon=True)
    got.start()
    err, deadline = "", time.monotonic() + HANG
    while "waiting" not in err and time.monotonic() < deadline:
        time.sleep(0.05)
        err += capsys.readouterr().err
    assert f"waiting for pid {child.pid} (nice {min(19, os.nice(0) + 3)}) since {since}" in err
    assert "whole-step CPU kernel" in err and got.is_alive()  # it waits on the live holder
    child.stdin.close()  # the holder finishes
    child.wait(HANG)
    got.join(HANG)
    assert not got.is_alive() and holder(path).pid == os.getpid()
    waiter.release()
    assert holder(path) is None


def test_builds_for_different_environments_get_different_directories(tiny, monkeypatch, cache):
    here = target(tiny)
    assert target(tiny) == here and here.dir.parent == cache
    others = []
    for obj, name, value in ((sys, "prefix", "/some/other/venv"), (torch, "__version__", "0.0.0+other"),
                             (os.environ, "SLUICE_KERNEL_FLAGS", "-mno-avx512f")):
        with monkeypatch.context() as m:
            m.setitem(obj, name, value) if obj is os.environ else m.setattr(obj, name, value)
            others.append(target(tiny))
    (tiny.parent / "simd.h").write_text("// a header the source may include\n")
    others.append(target(tiny))
    assert len({here.dir, *(o.dir for o in others)}) == 5 and all(o.dir.parent == cache for o in others)
    assert all(o.name.startswith("sluice_tiny_") for o in others)


def test_a_background_build_lands_and_a_later_call_picks_it_up(cache, tiny, monkeypatch, capfd):
    monkeypatch.setenv("SLUICE_KERNEL_BUILD", "background")
    monkeypatch.setattr(extension, "RECHECK_SECONDS", 0.0)
    torch.set_num_threads(2)  # a 2-core machine's count, whatever this one has
    ext = NativeExtension(tiny, "tiny kernel")
    assert ext.module() is None  # served at once, on the torch path
    assert torch.get_num_threads() == 1  # leaving the compiler a core
    pid = extension._builder.pid
    assert ext.why_unavailable() == f"being built in the background (pid {pid})"
    assert NativeExtension(tiny, "another view of it").module() is None
    err = capfd.readouterr().err.splitlines()
    assert err == [f"sluice: building its native CPU kernels in the background (pid {pid}, a few minutes at "
                   "low priority); using the torch path meanwhile"]
    assert extension.wait_for_background(HANG) == 0
    assert ext.module().answer() == 42 and ext.why_unavailable() is None
    assert torch.get_num_threads() == 2  # given back once the build ended
    assert target(tiny).ready() and not list(cache.glob(".sluice_tiny_*"))  # landed whole, no leftovers


def test_without_a_compiler_the_torch_path_runs_and_says_so_once(cache, tiny, monkeypatch, capfd):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    ext = NativeExtension(tiny, "tiny kernel")
    assert ext.module() is None and ext.why_unavailable().startswith("no C++ compiler found (/nonexistent/c++)")
    assert NativeExtension(tiny, "a second kernel").module() is None
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 1 and "no C++ compiler found (/nonexistent/c++)" in err[0]
    assert "torch path" in err[0] and "install g++" in err[0]


def test_an_engine_without_a_compiler_generates_on_the_torch_path(tiny_dir, tmp_path):
    code = ("import sluice; from sluice.engine import fast_step, select; llm = sluice.LLM(%r); "
            "print(len(llm.generate(['def f():'], sluice.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0].token_ids)); "
            "print(fast_step.why_unavailable()); print(select.why_unavailable())" % str(tiny_dir))
    env = {**os.environ, "CXX": "/nonexistent/c++", "TORCH_EXTENSIONS_DIR": str(tmp_path / "empty"),
           "SLUICE_KERNEL_BUILD": "background"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=HANG * 5)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["4"] + ["no C++ compiler found (/nonexistent/c++)"] * 2
    assert len([line for line in r.stderr.splitlines() if line.startswith("sluice:")]) == 1


def test_the_torch_path_gives_a_running_build_a_core_until_no_build_lock_is_held(cache, monkeypatch):
    """Two OpenMP threads sharing a core with a compiler stall each other at every parallel region, so
    while any build under the cache holds its lock (another process's too) torch runs one thread fewer."""
    monkeypatch.setattr(extension, "RECHECK_SECONDS", 0.0)
    torch.set_num_threads(2)
    cache.mkdir(parents=True)
    child = hold(cache / "sluice_other_0123.lock")
    try:
        extension.share_cores(cache)
        assert torch.get_num_threads() == 1
        extension.unshare_cores()
        assert torch.get_num_threads() == 1  # the build is still running
    finally:
        child.stdin.close()
        child.wait(HANG)
    extension.unshare_cores()
    assert torch.get_num_threads() == 2
    torch.set_num_threads(1)
    extension.share_cores(cache)  # one thread: nothing to give
    assert torch.get_num_threads() == 1 and extension._shared_from is None
