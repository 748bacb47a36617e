"""sluice's own CPU kernels: step.cpp (the whole-model step), gemv.cpp (the decode linear), select.cpp (the
sampler's selections), sample.cpp (the batch sampler's step), accept.cpp (speculative decoding's
acceptance rule), their shared SIMD helpers (simd.h), and how they are built (build.py: a cache keyed by
source, flags, CPU, torch and Python environment; lock.py: a lock that dies with its holder) and loaded
(extension.py: in the background while the torch path serves, or waiting when asked)."""

from .build import NATIVE_DIR, cache_root, cflags, cpu_flags, cpu_info, missing_tools, target
from .extension import BUILD_MODES, NativeExtension, build_mode, wait_for_background

__all__ = ["BUILD_MODES", "NATIVE_DIR", "NativeExtension", "build_mode", "cache_root", "cflags", "cpu_flags",
           "cpu_info", "missing_tools", "target", "wait_for_background"]
