"""NativeExtension: one CPU kernel as its callers see it, loaded from the build cache (build.py), or None
with a reason, and never a silent wait for a compiler.

When the kernel is not built yet, the default (SLUICE_KERNEL_BUILD=background) serves at once: callers
keep their plain torch path while one detached process builds every missing kernel of its folder at low
priority, so the build lands for the next run even if this one exits. This process picks a kernel up the
first time it asks after the build has landed; callers ask only where a switch is safe (the native step
per busy period or per request, the decode linears between requests, the selection kernel per call, whose
results are the torch functions' bit for bit). One line says so. SLUICE_KERNEL_BUILD=wait (the test
suite, benchmarks) or module(wait=True) (kernels=True) builds in the foreground instead, saying so.

Without a compiler, or on a CPU without AVX2 + FMA, or with SLUICE_NO_KERNELS set, the kernel is
unavailable and why_unavailable() says why; the first missing tool is named once, on stderr.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from ...errors import ConfigError
from .build import Target, cpu_flags, missing_tools, target
from .lock import holder

BUILD_MODES = ("background", "wait")
# a background build: the kernel asked for, then these, as a run uses them
BUILD_ORDER = ("step", "select", "sample", "gemv", "accept")
RECHECK_SECONDS = 1.0  # how often a caller on the torch path looks whether a background build has landed
# What running without the kernels costs, for the one line that says they are missing: the bundled model's
# greedy decode ran 111 tok/s on the torch path against 539 with the native step (docs/benchmarks.md).
TORCH_PATH_COST = "about 5x slower decode on small models"
# The builds this process loaded, by name (sluice_<source>_<hash of its sources, flags and CPU>), in load order: a
# benchmark's results file records them (benchmarks/common.provenance), since a build is made at first use and
# may come from sources newer than the commit the run started on.
LOADED: list[str] = []

# While kernels build in the background, the torch path leaves the compiler a core: two OpenMP threads that
# share a core with a compiler wait for each other at every parallel region (on 2 cores the bundled model's
# torch-path decode fell from ~140 to 1-10 tok/s under a nice 10 or SCHED_IDLE compile; on one thread it kept
# ~80). The thread count is lowered and put back on the thread that runs the model, at a kernel lookup.
_shared_from: int | None = None  # torch's thread count before a build took a core; None: not shared
_share_root: Path | None = None  # whose build locks say a build is still running
_share_look_after = 0.0
_share_lock = threading.Lock()  # two threads asking for two kernels must not both record the lowered count

_said: set[str] = set()  # the one-line notices this process has given
_builder: subprocess.Popen | None = None  # the background build this process started
_builder_lock = threading.Lock()


def build_mode() -> str:
    mode = os.environ.get("SLUICE_KERNEL_BUILD") or "background"
    if mode not in BUILD_MODES:
        raise ConfigError(f"SLUICE_KERNEL_BUILD must be one of {', '.join(BUILD_MODES)}, got {mode!r}")
    return mode


def _say_once(key: str, line: str) -> None:
    if key not in _said:
        _said.add(key)
        print(line, file=sys.stderr, flush=True)


def _build(sources: list[Path], root: Path, background: bool, **popen) -> subprocess.Popen:
    """Start `python -m sluice.engine.native` on `sources`: this interpreter, this copy of sluice (first on
    its path, whatever the working directory holds), run from the cache."""
    root.mkdir(parents=True, exist_ok=True)
    here = str(Path(__file__).resolve().parents[3])  # the directory that holds the sluice package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-m", "sluice.engine.native", *(["--background"] if background else []),
                             *map(str, sources)], cwd=root, env=env, stdin=subprocess.DEVNULL, **popen)


def start_background(first: Target) -> int:
    """The pid of this process's background build, started now (first's kernel, then the rest of its
    folder) unless it is running already. It outlives this process: a new session, no pipes to us."""
    global _builder
    with _builder_lock:
        if _builder is not None and _builder.poll() is None:
            return _builder.pid
        rank = {stem: i for i, stem in enumerate(BUILD_ORDER)}
        rest = sorted((p for p in first.source.parent.glob("*.cpp") if p != first.source),
                      key=lambda p: (rank.get(p.stem, len(rank)), p.name))
        first.root.mkdir(parents=True, exist_ok=True)
        with open(first.root / "background-build.log", "a") as log:
            _builder = _build([first.source, *rest], first.root, True, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
        return _builder.pid


def share_cores(root: Path) -> None:
    """Run torch on one thread fewer while a build under `root` is running (see _shared_from)."""
    global _shared_from, _share_root, _share_look_after
    import torch
    with _share_lock:
        if _shared_from is None and torch.get_num_threads() > 1:
            _shared_from, _share_root = torch.get_num_threads(), root
            _share_look_after = time.monotonic() + RECHECK_SECONDS
            torch.set_num_threads(_shared_from - 1)


def building_under(root: Path) -> bool:
    """Whether a kernel build is running: this process's builder, or any live holder of a lock under root."""
    if _builder is not None and _builder.poll() is None:
        return True
    return any(holder(lock) is not None for lock in root.glob("*.lock"))


def unshare_cores() -> None:
    """Put torch's thread count back once no build is running (looked at once a second at most)."""
    global _shared_from, _share_look_after
    if _shared_from is None or time.monotonic() < _share_look_after:
        return
    with _share_lock:
        _share_look_after = time.monotonic() + RECHECK_SECONDS
        if _shared_from is not None and not building_under(_share_root):
            import torch
            torch.set_num_threads(_shared_from)
            _shared_from = None


def wait_for_background(timeout: float | None = None) -> int | None:
    """Wait for this process's background build to end; its exit status, or None if it started none."""
    with _builder_lock:
        builder = _builder
    return None if builder is None else builder.wait(timeout)


class NativeExtension:
    """One native/*.cpp; `.module()` is the loaded extension or None (`why_unavailable()` says why: for
    good in `.failure`, or for now in `.pending` while a background build runs). The source must export
    `bool has_avx2()` (simd.h), so a build that lost -march=native is caught."""

    def __init__(self, source: Path, what: str):
        self.source, self.what = Path(source), what
        self.failure: str | None = None
        self.pending: str | None = None
        self._module = None
        self._target: Target | None = None
        self._started = False  # whether this extension asked for the background build
        self._look_after = 0.0
        self._lock = threading.Lock()

    def module(self, wait: bool | None = None):
        """The extension, or None. wait=True builds it now if it must (waiting for a build in progress,
        saying so); None follows SLUICE_KERNEL_BUILD."""
        if _shared_from is not None:
            unshare_cores()
        if self._module is not None or self.failure is not None:
            return self._module
        if self.pending is not None and not wait and time.monotonic() < self._look_after:
            return None  # cheap: the sampler asks at every step
        with self._lock:
            if self._module is None and self.failure is None:
                self._resolve(build_mode() == "wait" if wait is None else wait)
        return self._module

    def why_unavailable(self, wait: bool | None = None) -> str | None:
        """None when the extension is loaded here, else why not (looking again, or building, first)."""
        self.module(wait)
        return None if self._module is not None else self.failure or self.pending

    def _resolve(self, wait: bool) -> None:
        self.pending = None
        if os.environ.get("SLUICE_NO_KERNELS"):
            self.failure = "disabled by SLUICE_NO_KERNELS"
            return
        if not {"avx2", "fma"} <= cpu_flags():
            self.failure = "this CPU has no AVX2 + FMA"
            return
        if self._target is None:  # hashing the sources once: the sampler looks again every second
            self._target = target(self.source)
        t = self._target
        if not t.ready():
            missing = missing_tools()
            if missing:
                self.failure = "; ".join(missing)
                _say_once("missing", f"sluice: {self.failure}: sluice runs its torch path, {TORCH_PATH_COST}; "
                                     f"install {' and '.join(missing.values())} for its native kernels")
                return
            if not wait:
                self._later(t)
                return
            print(f"sluice: building its {self.what} (once per machine, about a minute)...", file=sys.stderr,
                  flush=True)
            _build([self.source], t.root, False).wait()
            if not t.ready():
                self.failure = f"could not build the {self.what} (the compiler's output is in {t.log})"
                return
        self._load(t)

    def _later(self, t: Target) -> None:
        """Leave the kernel to a background build (this process's or another's) and look again later."""
        h = holder(t.lock)
        if h is not None:
            self.pending = f"being built by {h.describe()}"
            _say_once("building", f"sluice: its native CPU kernels are being built by {h.describe()}; "
                                  "using the torch path meanwhile")
        elif self._started and _builder is not None and _builder.poll() is not None:  # ours ended without it
            self.failure = f"could not build the {self.what} (the compiler's output is in {t.log})"
            return
        else:
            pid = start_background(t)
            self._started = True
            self.pending = f"being built in the background (pid {pid})"
            _say_once("building", f"sluice: building its native CPU kernels in the background (pid {pid}, "
                                  "a few minutes at low priority); using the torch path meanwhile")
        share_cores(t.root)
        self._look_after = time.monotonic() + RECHECK_SECONDS

    def _load(self, t: Target) -> None:
        try:
            spec = importlib.util.spec_from_file_location(t.name, t.library)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except Exception as e:  # a damaged file, a foreign ABI: the plain path stays
            self.failure = f"could not load the {self.what} from {t.library}: {e}"
            return
        if not module.has_avx2():
            self.failure = f"the {self.what} was built without AVX2 + FMA"
            return
        self._module = module
        LOADED.append(t.name)
