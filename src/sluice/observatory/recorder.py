"""What observe()'s per-forward recorders share (attention.py's AttentionProbe, attribution.py's
BranchRecorder): buffers sized for the largest forward seen so far, grown at a forward's start by the
model's pre-hook, and refused with the sizes named when they would pass the memory limit."""

from __future__ import annotations

from ..errors import ObservatoryError


class GrowingRecorder:
    """Subclasses set max_bytes and _capacity, and define bytes_for(B, T) and _allocate(B, T)."""

    def _check_bytes(self, B: int, T: int, what: str, options: str) -> None:
        """what: the refusal's subject and verb, with {B} and {T} for the forward's shape."""
        need = self.bytes_for(B, T)
        if need > self.max_bytes:
            raise ObservatoryError(f"{what.format(B=B, T=T)} {need / 2**20:,.0f} MiB, over the limit of {self.max_bytes / 2**20:,.0f} MiB "
                                   f"(pass max_bytes= to observe() to allow more, {options}or a shorter input)")

    def _reserve(self, args, kwargs) -> tuple[int, int]:
        """The forward's (B, T), the buffers grown to hold it; also kept as self.shape."""
        ids = args[0] if args else kwargs["input_ids"]
        B, T = ids.shape
        if B > self._capacity[0] or T > self._capacity[1]:
            self._allocate(max(B, self._capacity[0]), max(T, self._capacity[1]))
        self.shape = (B, T)
        return B, T
