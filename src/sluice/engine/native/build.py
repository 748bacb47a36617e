"""Building sluice's CPU kernels (native/*.cpp) once per machine and Python environment.

Each kernel is compiled with the compiler torch's cpp_extension uses (CXX, else c++) for this machine
(-march=native) into sluice's own cache: $TORCH_EXTENSIONS_DIR when set, else ~/.cache/sluice/kernels
($XDG_CACHE_HOME respected). A build's directory is named by a hash of everything that decides what it
is: the source and the shared header, the compiler and its flags, the CPU's flags, torch's version and
where it lives, and the Python environment (prefix, version, ABI). So a cache shared between CPUs,
torch builds or virtual environments never hands one of them another's build.

A build runs in its own process (`python -m sluice.engine.native SOURCE...`), under the kernel's
BuildLock (lock.py: it dies with its holder), into a private temporary directory that is renamed into
place whole when it is done: a reader sees a finished build or none, and two builders of one key
cannot trample each other. extension.py decides when to build (in the background, or waiting).
SLUICE_KERNEL_FLAGS adds compiler flags (part of the key): "-mno-avx512f" builds the AVX2 paths on an
AVX-512 CPU, to test or time what an AVX2-only machine runs.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import sysconfig
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

from .lock import BuildLock

NATIVE_DIR = Path(__file__).resolve().parent
# -fopenmp: at::parallel_for splits work across torch's OpenMP threads only when the extension itself
# is compiled with OpenMP; without it the pragma is dropped and the kernel runs on one core (what the
# first measurements in docs/benchmarks.md saw: 9-10 GB/s against 13-16 with two threads).
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)  # tuples: cpp_extension.load appends to the lists it is given
BACKGROUND_NICE = 10  # a background build yields the CPU to the run that serves meanwhile


def cflags() -> list[str]:
    """CFLAGS plus the extra flags in SLUICE_KERNEL_FLAGS (whitespace-separated), if any."""
    return [*CFLAGS, *os.environ.get("SLUICE_KERNEL_FLAGS", "").split()]


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_info(cpuinfo: str | None = None) -> dict:
    """The CPU a result was measured on: its model name, logical CPUs, family and model numbers, and the flags that
    decide which kernels run (AVX-512 and AMX have bf16 dot-product instructions, AVX2 has not). cpuinfo: the
    text of /proc/cpuinfo (read here when None)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            import platform
            return {"model": platform.processor() or "?"}
    lines = cpuinfo.splitlines()

    def field(key: str) -> str:  # the first CPU's value of a "key : value" line, or ""
        return next((v.strip() for k, _, v in (ln.partition(":") for ln in lines) if k.strip() == key), "")

    flags = set(field("flags").split())
    info = {"model": field("model name") or "?", "logical_cpus": sum(ln.startswith("processor") for ln in lines),
            "avx2": "avx2" in flags, "avx512f": "avx512f" in flags,
            "avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags}
    # A VM's model name often hides the generation ("AMD EPYC" is Zen 2 to Zen 5); the family and model numbers
    # tell CPUs with the same flags apart (AMD's family 25 is Zen 3 and Zen 4, family 26 Zen 5)
    for key, name in (("family", "cpu family"), ("model_number", "model")):
        if (value := field(name)).isdigit():
            info[key] = int(value)
    return info


def cache_root() -> Path:
    """Where builds live: $TORCH_EXTENSIONS_DIR (tests and CI point it at their own), else the user's cache."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sluice" / "kernels"


def compiler() -> str:
    """The C++ compiler torch's cpp_extension will call."""
    return os.environ.get("CXX", "c++")


def missing_tools() -> dict[str, str]:
    """What a build needs and this machine lacks, as {what is missing: what to install}: the compiler,
    and ninja (cpp_extension drives the build with it)."""
    missing = {} if shutil.which(compiler()) else {f"no C++ compiler found ({compiler()})": "g++"}
    return missing | ({} if shutil.which("ninja") else {"no ninja found": "ninja"})


def environment() -> list[str]:
    """The facts about this Python environment that an extension module is bound to."""
    import torch
    return [os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix), sys.version,
            sys.implementation.cache_tag or "", sysconfig.get_config_var("EXT_SUFFIX") or "",
            torch.__version__, os.path.dirname(os.path.realpath(torch.__file__)),
            compiler(), shutil.which(compiler()) or ""]


@dataclass(frozen=True)
class Target:
    """One kernel's build for this machine and environment: its module name and its paths."""

    source: Path
    name: str
    root: Path

    @property
    def dir(self) -> Path:
        return self.root / self.name

    @property
    def library(self) -> Path:
        return self.dir / f"{self.name}.so"

    @property
    def lock(self) -> Path:
        return self.root / f"{self.name}.lock"

    @property
    def log(self) -> Path:
        return self.root / f"{self.name}.log"

    def ready(self) -> bool:
        return self.library.is_file()


def target(source: Path) -> Target:
    """The build of `source` (a native/*.cpp) this machine and environment would load."""
    source = Path(source)
    h = hashlib.sha256()
    for part in ([source, *sorted(source.parent.glob("*.h"))]):
        h.update(part.name.encode() + b"\0" + part.read_bytes() + b"\0")
    for part in (cflags(), LDFLAGS, sorted(cpu_flags()), environment()):
        h.update("\0".join(part).encode() + b"\1")
    return Target(source, f"sluice_{source.stem}_{h.hexdigest()[:16]}", cache_root())


def build(t: Target, what: str) -> None:
    """Build t unless it is there, holding its lock (waiting for a live holder, saying so). The compiler's
    output goes to t.log; a failure raises with the first line of the error."""
    t.root.mkdir(parents=True, exist_ok=True)
    with BuildLock(t.lock, what):
        if t.ready():  # built by whoever held the lock before us
            return
        for stale in t.root.glob(f".{t.name}.*"):  # a killed build's half: only a lock holder makes one
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{t.name}.", dir=t.root))
        try:
            _compile(t, tmp)
            os.chmod(tmp, 0o755)  # mkdtemp's 0o700 is for while it is private
            try:
                os.rename(tmp, t.dir)  # atomic: a reader sees the whole build or none
            except OSError:
                if not t.ready():  # not a build of the same key that landed first: a real failure
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _compile(t: Target, into: Path) -> None:
    from torch.utils.cpp_extension import load
    with open(t.log, "w") as log:
        try:
            load(name=t.name, sources=[str(t.source)], extra_cflags=cflags(), extra_ldflags=list(LDFLAGS),
                 extra_include_paths=[str(t.source.parent)], build_directory=str(into), verbose=False)
        except Exception:
            traceback.print_exc(file=log)
            raise


def main(argv: list[str]) -> int:
    """Build the kernel sources in argv in order, each under its lock; "--background" first lowers this
    process's priority. Internal (extension.py runs it), so no parser: a user never types it."""
    if argv[:1] == ["--background"]:
        os.nice(BACKGROUND_NICE)
        argv = argv[1:]
    failed = 0
    for source in map(Path, argv):
        t = target(source.resolve())
        try:
            build(t, f"{source.name} kernel")
        except Exception as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            print(f"sluice: could not build {source.name}: {first} (the compiler's output is in {t.log})",
                  file=sys.stderr, flush=True)
            failed += 1
    return 1 if failed else 0
