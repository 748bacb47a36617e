"""Under tensor parallelism rank 0 alone schedules: each step's plan (engine/plan.py) is broadcast to
the other ranks, which run its forward and draw on their part of the model.

A follower keeps no scheduling state of its own: it does not admit, preempt, chunk or allocate KV
blocks, and its pool's free lists are never touched. A plan row names its sequence by number (the
count of adds before it, the same on every rank, since every rank adds the same requests in the
same order) and carries the row's start, its token count, whether it is final, and the sequence's
block table, so a follower writes and reads the same blocks rank 0 does. What the follower still
keeps per sequence is what its own part of the draw needs: the prompt and tokens so far, and the
sampler (its random stream and penalty state), all of which every rank updates alike from the
step's tokens.

Each row also carries rank 0's token count for its sequence; a follower whose count differs (or
that does not know the sequence) is out of step, a bug, and raises ParallelError before its
forward, rather than feed wrong tokens into collectives.

A plan is sent as two int64 broadcasts on a gloo group: its length, then the numbers.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from ..engine.plan import Row, StepPlan
from .group import ParallelError, collective_failed

ROW_HEAD = 6  # number, start, tokens, final, len(ids) on rank 0, blocks; then the block ids


def encode(plan: StepPlan) -> torch.Tensor:
    """The plan as int64: fused, then per row ROW_HEAD numbers and its block ids."""
    flat = [int(plan.fused)]
    for r in plan.rows:
        if r.guesses:  # speculative decoding is refused under tensor parallelism (engine/config.py)
            raise ValueError("a plan with guesses cannot be shared between ranks")
        s = r.seq
        flat += [s.number, r.start, len(r.tokens), int(r.final), len(s.ids), len(s.blocks), *s.blocks]
    return torch.tensor(flat, dtype=torch.int64)


def decode(flat: torch.Tensor, seqs: dict, rank: int | str = "?") -> StepPlan:
    """The plan rank 0 encoded, over this rank's sequences ({number: Seq}); their block tables are set
    from it. ParallelError if a row does not match this rank's sequences."""
    values = flat.tolist()
    fused, i, rows = bool(values[0]), 1, []
    while i < len(values):
        number, start, n, final, length, nb = values[i:i + ROW_HEAD]
        blocks = values[i + ROW_HEAD:i + ROW_HEAD + nb]
        i += ROW_HEAD + nb
        seq = seqs.get(number)
        if seq is None or len(seq.ids) != length or start + n > length or bool(final) != (start + n == length):
            have = "unknown here" if seq is None else f"{len(seq.ids)} tokens here"
            raise ParallelError(f"rank {rank} is out of step with rank 0: sequence {number} has {length} tokens "
                                f"on rank 0, {have} (a bug in sluice)")
        seq.blocks = blocks
        rows.append(Row(seq, start, seq.ids[start:start + n], bool(final)))
    return StepPlan(rows, fused)


class PlanChannel:
    """Rank 0 sends each step's plan; the other ranks receive it (share())."""

    def __init__(self, rank: int, timeout_s: float):
        self.rank = rank
        # On gloo the default group carries it; beside NCCL a gloo group does, since the plan is host data.
        self.group = None if dist.get_backend() == "gloo" else dist.new_group(
            backend="gloo", timeout=timedelta(seconds=timeout_s))

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def share(self, plan: StepPlan | None, seqs: dict) -> StepPlan:
        """Rank 0: send `plan` and return it. Others: the plan rank 0 sent, over `seqs`."""
        if self.leads:
            flat = encode(plan)
            self._broadcast(torch.tensor([flat.numel()], dtype=torch.int64))
            self._broadcast(flat)
            return plan
        size = torch.zeros(1, dtype=torch.int64)
        self._broadcast(size)
        flat = torch.empty(int(size[0]), dtype=torch.int64)
        self._broadcast(flat)
        return decode(flat, seqs, self.rank)

    def _broadcast(self, t: torch.Tensor) -> None:
        try:
            dist.broadcast(t, src=0, group=self.group)
        except RuntimeError as e:  # gloo: "Connection closed by peer", "Timed out waiting ..."
            raise collective_failed("broadcast of the step's plan", e) from None
