"""A step's model work (plan.py): the rows of a StepPlan through the model over the paged KV pool.

Every token a decoding row reads goes into one forward as a row of its own, one token long: the
plain rows' last tokens, and each verifying row's last token and guesses (a speculative step), each
at its own position over its sequence's block table. A token reads the keys and values the tokens
before it in the same forward wrote (each layer writes every row's keys and values before any row
attends), so a verifying row's k + 1 tokens give what one (1, k + 1) chunk would, and rows with
different guess counts need no padding. Only a multi-token prompt chunk runs alone, as one row, and so
does a chunk of a prompt that asks for its logprobs (prompt_logprobs.py), with all of its logits.

The native step (fast_step.py) runs the model where it can (native_check says why not: hooks, an
unsupported model, kernels=False); that is decided once per busy period (refresh()), so hooks added
between requests take effect and a request never switches paths midway. compile=True runs the torch
forward of the one-token rows through torch.compile instead of the native step.
"""

from __future__ import annotations

import torch

from ..model.layers import Transformer
from ..model.quant import Int4Linear
from .fast_step import FastStep, native_check
from .paged_cache import BlockPool, PagedView
from .mixed import compile_forward
from .plan import Row, StepPlan
from .prompt_logprobs import span

class BatchForward:
    def __init__(self, model: Transformer, pool: BlockPool, native: bool = True, compile: bool = False):
        self.model, self.pool = model, pool
        self.native = native and not compile
        self.device = model.embed.weight.device
        self.native_reason: str | None = None if self.native else (
            "compile=True (the torch forward is compiled)" if compile else "not asked for")
        self.fast: FastStep | None = None  # built at the first busy period that can use it
        self.use_fast = False  # for the current busy period
        self._compiled = compile_forward(self._torch, dynamic=True) if compile else None

    def refresh(self) -> None:
        """Decide the path for a new busy period: the native step, or (native_reason says why) torch's."""
        if self.native:
            self.native_reason, self.fast = native_check(self.model, self.fast)
        self.use_fast = self.native and self.native_reason is None

    def run(self, tables: list[list[int]], tokens: torch.Tensor, positions: torch.Tensor, want: str | None):
        """tokens, positions (B, T) of rows with these block tables -> by `want`: "last" logits (B, V),
        "all" logits (B, T, V), "hidden" final-normed states at the last token (B, C), or None (the
        chunk only writes the cache)."""
        view = PagedView(self.pool, tables, self.device)
        if self.use_fast:  # prefill too: 1.4-6x faster than torch's path on the bundled model (bench/prefill.py)
            if want == "all" or (want == "last" and tokens.shape[1] <= 2):  # a head call costs more than a second row of logits
                out = self.fast(tokens, positions, self.pool.k, self.pool.v, block_table=view.table)
                return out if want == "all" else out[:, -1]
            if want == "last" and isinstance(self.model.lm_head, Int4Linear):
                # An int4 head's torch op needs torch's own packed copy of the codes, which a model on the native
                # step never builds: the chunk's last token runs as a chunk of its own (the same numbers).
                self.fast(tokens[:, :-1], positions[:, :-1], self.pool.k, self.pool.v, hidden=True,
                          block_table=view.table)
                return self.fast(tokens[:, -1:], positions[:, -1:], self.pool.k, self.pool.v,
                                 block_table=view.table)[:, -1]
            h = self.fast(tokens, positions, self.pool.k, self.pool.v, hidden=True, block_table=view.table)
            if want == "last":  # a prompt's last chunk: the head on its last token only
                # (in the head's weight dtype, as the torch forward gives it; an int8 head has none: fp32 as is)
                head_dtype = getattr(self.model.lm_head, "weight", h).dtype
                return self.model.logits(h[:, -1:].to(head_dtype))[:, 0]
            return h[:, -1] if want == "hidden" else None
        step = self._compiled if self._compiled is not None and tokens.shape[1] == 1 else self._torch
        return step(tokens, positions, self.pool.k, self.pool.v, view.table, want)

    def _torch(self, tokens, positions, k, v, table, want):
        # The pool comes in as arguments, so a compiled forward is traced once and reused.
        view = PagedView.of(k, v, table)
        if want == "all":
            return self.model(tokens, positions, view)
        last = torch.full((tokens.shape[0],), tokens.shape[1] - 1, device=tokens.device)
        out = self.model(tokens, positions, view, logits_at=last if want == "last" else None,
                         return_hidden=want != "last")
        return None if want is None else out[:, -1]

    def __call__(self, plan: StepPlan) -> "StepOut":
        """Compute every row of the plan: {row: what its draw needs} for the final rows, as
        logits (V,), hidden states (C,) when plan.fused, or logits (1 + its guesses, V) for a
        row with guesses; and in out.prompt, the logits (n, V) of the positions whose prompt logprobs
        a row still needs. Prompt chunks are run in plan order, so a sequence's chunks stay causal."""
        out = StepOut()
        ones, guessing, chunks = [], [], []
        for r in plan.rows:
            (guessing if r.guesses else ones if len(r.tokens) == 1 and span(r) is None else chunks).append(r)
        if plan.fused and ones:  # the fused head takes hidden states: the plain rows alone
            self._ones(out, ones, self._rows(ones, [r.tokens for r in ones], "hidden"))
            ones = []
        if ones or guessing:
            # One token per row: the plain rows', then every verifying row's tokens at their positions.
            rows = ones + [Row(r.seq, r.start + i, [t], True) for r in guessing for i, t in enumerate(r.fed)]
            final = guessing or any(r.final for r in ones)
            res = self._rows(rows, [r.tokens for r in rows], "last" if final else None)
            if ones:
                self._ones(out, ones, res[:len(ones)] if guessing else res)
            at = len(ones)
            for r in guessing:
                out[r] = res[at:at + len(r.fed)]
                at += len(r.fed)
        for r in chunks:
            need = span(r)
            if need is not None:  # the scheduler keeps such a row's plan off the fused head: logits at the end
                res = self._rows([r], [r.tokens], "all")[0]  # (T, V)
                out.prompt[r] = res[need[0]:need[1]]
                if r.final:
                    out[r] = res[-1]
                continue
            res = self._rows([r], [r.tokens], ("hidden" if plan.fused else "last") if r.final else None)
            if r.final:
                out[r] = res[0]
        return out

    @staticmethod
    def _ones(out: "StepOut", ones: list[Row], res) -> None:
        if all(r.final for r in ones):  # the usual decode step: the draw takes the batch as it is
            out.batch = (ones, res)
        else:
            out.update((r, res[i]) for i, r in enumerate(ones) if r.final)

    def _rows(self, rows: list[Row], fed: list[list[int]], want: str | None):
        return self.feed(rows, fed, [r.start for r in rows], want)

    def feed(self, rows: list[Row], fed: list[list[int]] | torch.Tensor, starts: list[int], want: str | None):
        """run() for rows' sequences reading fed[i] (equal lengths; a (B, T) tensor is taken as it is)
        at positions starts[i].."""
        T = len(fed[0])
        positions = [list(range(s, s + T)) for s in starts]
        if isinstance(fed, torch.Tensor):
            return self.run([r.seq.blocks for r in rows], fed, torch.tensor(positions, device=self.device), want)
        # tokens and positions in one tensor (2, B, T): a step's host-to-tensor work is a few small calls
        both = torch.tensor([fed, positions], device=self.device)
        return self.run([r.seq.blocks for r in rows], both[0], both[1], want)


class StepOut(dict):
    """forward(plan)'s {row: tensor}. `batch` is (rows, their stacked tensor) when the step's one-token
    rows were all final: the draw takes it without stacking again, and a row of it is indexed only
    when asked for (out[row]). `prompt`: {row: logits (n, V)} of its prompt_logprobs.span."""
    batch: tuple[list[Row], torch.Tensor] | None = None

    def __init__(self):
        super().__init__()
        self.prompt: dict[Row, torch.Tensor] = {}

    def __missing__(self, row: Row) -> torch.Tensor:
        if self.batch is not None:
            for i, r in enumerate(self.batch[0]):
                if r is row:
                    return self.batch[1][i]
        raise KeyError(row)
