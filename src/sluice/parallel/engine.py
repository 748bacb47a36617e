"""What `sluice.LLM(model, tensor_parallel=N)` changes: the hook sluice/llm.py calls.

Every rank of a torchrun launch (or of a group started with parallel.init) builds the same LLM with
the same arguments; then each rank loads only its slices (loading.load_rank), the continuous-batching
engine runs the torch forward on them, and the scheduler samples through parallel/head.ParallelHead.
Every rank gets the same requests in the same order; rank 0 alone schedules, and each step's plan
(which sequences read which tokens, in which KV blocks) is broadcast to the others (plans.py), so
every rank runs the same rows and returns the same outputs. The KV pool is sized by the smallest
rank's budget, so every rank has the blocks rank 0 hands out.

Refused under tensor parallelism, with a ConfigError before anything loads (engine/config.py checks
it with the LLM's other options): compile=True, fused_head=True, speculative decoding, quantize,
kernels=True, compute="float32" and batching=False (the static one-request path and the CPU kernels
are single-process code). The defaults
(fused_head="auto", kernels="auto", compute="auto") quietly mean off there, as they do wherever those
paths do not fit; so does the native decode step.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from ..model.config import ModelConfig
from . import group
from .head import ParallelHead
from .loading import load_rank
from .sharding import check_shardable, vocab_range


class TensorParallel:
    """This rank's part in an LLM split over `size` ranks."""

    def __init__(self, size: int, ranks: group.Ranks):
        self.size, self.ranks = size, ranks
        self.head: ParallelHead | None = None  # known once the model is loaded

    @classmethod
    def start(cls, size: int, timeout_s: float | None = None, device="cpu") -> TensorParallel:
        """Join the process group (from torchrun's environment if not started yet) and check its size,
        before the (slow) load. The LLM's options were checked already (engine/config.py)."""
        ranks = group.init(device=device) if timeout_s is None else group.init(timeout_s=timeout_s, device=device)
        if ranks.world != size:
            raise ConfigError(f"tensor_parallel={size} but the process group has {ranks.world} ranks "
                              f"(launch with torchrun --nproc-per-node {size})")
        return cls(size, ranks)

    def load(self, model_dir: Path, dtype, device):
        """This rank's model (its slices only), after checking that the model splits over the ranks."""
        cfg = ModelConfig.from_hf(model_dir)
        check_shardable(cfg, self.size)
        model = load_rank(model_dir, self.ranks, dtype, group.rank_device(device, self.ranks))
        vr = vocab_range(cfg, self.ranks.rank, self.size)
        self.head = ParallelHead(cfg.vocab_size, vr.start, vr.stop, model.embed.weight.device)
        return model

    def agree(self, budget: int | None) -> int | None:
        """The smallest rank's KV budget (None: unknown on every rank), so that every rank's pool has
        the same number of blocks and the schedulers admit and preempt alike."""
        known = [b for b in group.all_gather_object(budget) if b is not None]
        return min(known) if known else None

    def plan_channel(self):
        """How the ranks' schedulers share each step's plan: rank 0 schedules, the others follow (plans.py)."""
        from .plans import PlanChannel
        return PlanChannel(self.rank, self.ranks.timeout_s)

    @property
    def rank(self) -> int:
        return self.ranks.rank
