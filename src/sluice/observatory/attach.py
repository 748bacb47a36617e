"""The observatory's two entry points, `observe()` and `logit_lens()`, for a whole model or for one rank of a
tensor-parallel model (parallel.load_rank).

They sit above probes.py, lens.py and sharded.py because they choose between them: the rank versions
(sharded.py) build on the single-process ones and reduce over the ranks, so the single-process modules
never import sharded.py. sharded.py is imported only for a rank model: it brings torch.distributed and
sluice.parallel (~70 ms here), which a single-process observer never needs.
"""

from __future__ import annotations

import torch

from ..errors import ObservatoryError
from ..model.layers import Transformer
from .lens import LensResult, whole_lens
from .probes import Observation


def _is_rank(model) -> bool:
    return getattr(model, "world", 1) > 1


def observe(model: Transformer, topk: int = 4, capacity: tuple[int, int] = (1, 128),
            max_bytes: int = 2 << 30, attention: bool = True, attribution: bool = False) -> Observation:
    """Attach the valve probes to `model` (hooks stay until `remove()` or the end of a `with`).

    topk: how many largest-magnitude channels to keep per token and layer. capacity: (batch,
    tokens) to preallocate for (a larger forward re-allocates once). max_bytes: refuse statistics
    buffers larger than this. attention: per-head attention statistics (`obs.attention`, which
    recomputes each layer's scores). attribution: keep the residual's parts for `obs.attribution()`
    ((2L + 2) x B x T x hidden fp32 values). On one rank of a tensor-parallel model (parallel.load_rank) the probes
    reduce over the ranks to the single-process numbers (observatory/sharded.py)."""
    if _is_rank(model):
        from .sharded import ParallelObservation
        return ParallelObservation(model, topk=topk, capacity=capacity, max_bytes=max_bytes, attention=attention,
                                   attribution=attribution)
    return Observation(model, topk=topk, capacity=capacity, max_bytes=max_bytes, attention=attention,
                       attribution=attribution)


def logit_lens(model: Transformer, ids: torch.Tensor, topk: int = 5,
               max_bytes: int = 2 << 30, attention_mask: torch.Tensor | None = None,
               on_layer=None) -> LensResult:
    """Apply the logit lens to every layer for input ids (B, T); see lens.LensResult for what comes back.

    max_bytes: refuse (ObservatoryError, naming the size) when the captured stream plus the logits
    working set would exceed it. attention_mask (B, T): right padding, pad positions left out
    (observatory/padding.py). on_layer(l) is called as each layer is done (progress; not on a rank
    model). A tensor-parallel rank model takes observatory/sharded.py's lens."""
    if _is_rank(model):
        if attention_mask is not None:
            raise ObservatoryError("a padded batch (attention_mask) is not supported under tensor "
                                   "parallelism: lens one prompt at a time there")
        from .sharded import sharded_lens
        return sharded_lens(model, ids, topk, max_bytes)
    return whole_lens(model, ids, topk, max_bytes, attention_mask, on_layer)
