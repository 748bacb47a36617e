"""The filtered distributions of a speculative round (verify.py's p, proposers.py's q), with the rows'
parameter tensors kept from one round to the next.

sampling.filtered_probs rebuilds them from the params at every call: each row's params copied and
validated, eight small tensors made. A round called it once per draft guess and once for the verify, with
the same rows every time: on the bundled model that rebuilding cost about as much as the softmaxes
themselves. RoundProbs runs the same operations in the same order (penalties, filter_logits, softmax, the
greedy rows' one-hot), so the probabilities are filtered_probs' bit for bit; only the tensors of the
params are kept, until the rows change. With top_p alone (the bundled model's generation_config sets
0.95), a row's nucleus is first looked for among its 64 largest logits instead of its whole sorted row
(_nucleus: the same tokens kept, or the whole sort where it cannot be sure). Rows of temperature and top_p
alone, without penalties (the bundled model's defaults), take one native call instead (native/accept.cpp's
nucleus_probs: the same operations in torch's order, so the same bits), where the kernel is built.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import accept as accept_kernel
from .filtering import filter_flags, filter_logits, penalize_counts, penalize_seen, row_tensors
from .select import top_candidates

# top_p alone, on a row much wider than this, first tries the nucleus among the row's PREFIX largest
NUCLEUS_PREFIX = 64
# and takes it where no token's mass before it is within this of top_p: torch's cumsum over its softmax of
# the whole sorted row and the prefix's here round differently, by about 1e-6 on a row of 8,192 (the sum of
# 8,192 floats in another order, then up to 64 partial sums of the same terms)
NUCLEUS_MARGIN = 1e-4


class RoundProbs:
    """filtered_probs for a batch of the scheduler's samplers (one row each), each row's params repeated
    `repeat` times in a row (verify: one row a position). Holds the last batch's samplers, compared by
    identity, so a sampler cannot be freed and its id reused while its tensors are kept."""

    def __init__(self):
        self.nucleus_calls = self.nucleus_fallbacks = 0  # top_p by the prefix, and those that needed the sort
        self._samplers: list = []
        self._repeat = 0
        self._width = 0

    def _refresh(self, samplers: list, repeat: int, width: int, device) -> None:
        same = (repeat == self._repeat and width == self._width and len(samplers) == len(self._samplers)
                and all(a is b for a, b in zip(samplers, self._samplers, strict=True)))
        if same:
            return
        params = [s.params[0] for s in samplers for _ in range(repeat)]
        self.rows = row_tensors(params, width, device)
        self.rows["native_t"] = self.rows["temperature"].masked_fill(self.rows["greedy"], 0)  # 0: greedy
        self.rows["no_top_p"] = torch.ones_like(self.rows["top_p"])
        self.flags = filter_flags(params)
        self.any_greedy = any(p.temperature == 0 for p in params)
        self.nucleus_only = all(p.temperature > 0 and p.top_p < 1 and p.top_k <= 0 and p.min_p == 0 for p in params)
        # rows the native kernel filters (with no penalty state passed): greedy, or temperature and top_p alone
        self.native = all(p.temperature == 0 or (p.top_k <= 0 and p.min_p == 0) for p in params)
        self._samplers, self._repeat, self._width = list(samplers), repeat, width

    def native_columns(self, samplers: list, width: int, device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(temperature, 0 on greedy rows; top_p) (B,) of the samplers where the native kernel filters
        every row (greedy, or temperature and top_p alone; the caller checks there are no penalties)."""
        self._refresh(samplers, 1, width, device)
        return (self.rows["native_t"], self.rows["top_p"]) if self.native else None

    @staticmethod
    def sorts(samplers: list) -> bool:
        """Whether some sampled row's filters sort it whole (top_p or min_p): then a row costs far more than
        its softmax."""
        return any(p.temperature > 0 and (p.top_p < 1 or p.min_p > 0) for p in (s.params[0] for s in samplers))

    def __call__(self, logits: torch.Tensor, samplers: list, repeat: int = 1, seen: torch.Tensor | None = None,
                 counts: torch.Tensor | None = None, tail_cuts: bool = True,
                 pick: list[int] | None = None) -> torch.Tensor:
        """(B * repeat, V) logits -> fp32 probs, as filtered_probs(logits, params, seen, counts, tail_cuts)
        with params each sampler's repeated `repeat` times. pick: logits (len(pick), V) are the rows
        `pick` of the samplers' (repeat 1), whose params are taken from the whole batch's."""
        x = logits.float()
        self._refresh(samplers, repeat, x.shape[-1], x.device)
        rows = self.rows
        if pick is not None and len(pick) < len(samplers):
            at = torch.tensor(pick, device=x.device)
            rows = {k: v.index_select(0, at) for k, v in rows.items()}
        if self.native and seen is None and counts is None:
            native = accept_kernel.nucleus_probs(x, rows["native_t"], rows["top_p" if tail_cuts else "no_top_p"])
            if native is not None:
                return native
        if seen is not None:
            x = penalize_seen(x, seen, rows["penalty"])
        if counts is not None:
            x = penalize_counts(x, counts, rows["presence"], rows["frequency"])
        top_k, top_p, min_p = self.flags
        out = None
        if tail_cuts and self.nucleus_only:
            out = self._nucleus(filter_logits(x, rows, False, False, False), rows)  # the scaled logits alone
        if out is None:
            out = filter_logits(x, rows, top_k, top_p and tail_cuts, min_p and tail_cuts)
        probs = out.softmax(-1)
        if self.any_greedy:
            probs = torch.where(rows["greedy"][:, None], F.one_hot(x.argmax(-1), x.shape[-1]).to(probs.dtype), probs)
        return probs

    def _nucleus(self, scaled: torch.Tensor, rows: dict) -> torch.Tensor | None:
        """filter_logits' top_p on temperature-scaled logits (B, V) (max 0) from each row's NUCLEUS_PREFIX
        largest instead of its whole stable sort (about half the time on a row of 8,192), or None
        where that could decide a token differently: a mass before some token within NUCLEUS_MARGIN of
        top_p, a nucleus that may reach past the prefix, or a tie across the prefix's end."""
        B, V = scaled.shape
        if V <= 4 * NUCLEUS_PREFIX:
            return None
        self.nucleus_calls += 1
        values, ids, after = top_candidates(scaled, NUCLEUS_PREFIX)  # the stable sort's first columns
        probs = scaled.softmax(-1).gather(1, ids)  # the sort's softmax, summed in vocabulary order
        mass_before = F.pad(probs.cumsum(-1)[:, :-1], (1, 0))
        top_p = rows["top_p"][:, None]
        unsure = ~((mass_before - top_p).abs() > NUCLEUS_MARGIN)  # NaN included
        if bool(unsure.any() | (mass_before[:, -1:] < top_p).any() | (after >= values[:, -1]).any()):
            self.nucleus_fallbacks += 1
            return None
        keep = mass_before < top_p
        keep[:, 0] = True
        mask = torch.zeros_like(scaled, dtype=torch.bool).scatter_(1, ids, keep)
        return scaled.masked_fill(~mask, -math.inf)
