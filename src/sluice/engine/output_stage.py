"""The last stage of a step (plan.py): a sequence's new tokens become what its caller sees.

Takes a row's run (one token, or a speculative round's kept guesses and one more), stops it at the
first stop token, max_tokens or stop string, detokenizes what is released (streaming.TextStream) and
records logprobs (and hands on the prompt's, with the first update). A sequence whose logits went non-finite ends with finish_reason "error" and a
message that says where (the server passes the observatory's first_nonfinite as nonfinite_origin).
"""

from __future__ import annotations

import time
from typing import Callable

from .sampling import NONFINITE
from .sequence import Seq, Update


class OutputStage:
    def __init__(self, end: Callable[[Seq, str, str | None], None],
                 nonfinite_origin: Callable[[list[int]], str] | None = None):
        self.end = end  # takes a finished sequence out of the batch (the scheduler's)
        self.nonfinite_origin = nonfinite_origin

    def __call__(self, seq: Seq, run: list[int], logprobs: list | None) -> Update:
        """seq's update for `run`, its tokens not yet in seq.ids; ends seq when a stop is reached."""
        taken, reason, text = [], None, ""
        first = seq.first_token_at is None  # the prompt is done: its logprobs go out with this update
        if first:
            seq.first_token_at = time.perf_counter()
        limit = seq.prompt_len + seq.params.max_tokens
        for tok in run:
            if tok == NONFINITE:
                reason = "error"
                break
            seq.ids.append(tok)
            taken.append(tok)
            if tok in seq.stop_ids:
                text, reason = text + seq.stream.finish(), "stop"
                break
            if seq.guide is not None and not seq.guide.advance(tok):
                reason = "violation"
                break
            text += seq.stream.push(tok)
            if seq.stream.stopped:
                reason = "stop"
                break
            if seq.guide is not None and seq.guide.done:  # its grammar is complete and can take no more
                text, reason = text + seq.stream.finish(), "stop"
                break
            if len(seq.ids) >= limit:
                text, reason = text + seq.stream.finish(), "length"
                break
        lps = logprobs[: len(taken)] if logprobs is not None else None
        if lps:
            seq.logprobs += lps
        seq.text += text
        update = Update(seq, text, taken, lps, reason is not None, seq.prompt_logprobs if first else None)
        if reason == "error":
            where = (self.nonfinite_origin(seq.ids) if self.nonfinite_origin else
                     "NaN or inf in the weights or the config? `sluice inspect` shows the layer where it starts")
            self.end(seq, "error", f"the model produced non-finite logits (NaN or inf) at step "
                                   f"{len(seq.token_ids)} of {seq.label}; {where}")
        elif reason == "violation":  # a grammar past llguidance's limits, or a bug in the mask: its error says which
            self.end(seq, "error", f"the constraint of {seq.label} failed at step {len(seq.token_ids)}: llguidance refused "
                                   f"token {taken[-1]} ({seq.guide.error}); a schema, regex or grammar past its limits "
                                   "fails so (simplify it), any other refusal is a bug in sluice's logits mask")
        elif reason is not None:
            self.end(seq, reason, None)
        seq.pending.append(update)
        return update
