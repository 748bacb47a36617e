"""Prompt logprobs (SamplingParams.prompt_logprobs): the log-probability of every prompt token given the
tokens before it, and its most likely alternatives, as vLLM's prompt_logprobs and OpenAI's legacy
`echo` report them. What lm-evaluation-harness scores a multiple-choice answer or a perplexity with.

The logits at position p give the logprob of prompt token p + 1, so a sequence that asks needs the logits
of every prompt position but the last (whose logits draw the first new token, as for any request), while
a plain prefill computes only the last. The forward (batch_forward.py) runs such a row alone with all of
its logits; this module says which of a row's positions it still needs (`span`) and records them
(`record`), from the raw fp32 logits, as the generated tokens' logprobs are (logprobs.py).

What this costs a request: its prompt's keys and values are computed, never taken from the prefix cache
(a cached block was never run through the head), until its prompt logprobs are complete; its blocks are
still keyed for others. Its chunks run one row to a forward, and the plan that draws its first token does
not take the fused head. A chunked prefill records its positions chunk by chunk, so the numbers do not
depend on max_num_batched_tokens; a sequence preempted mid-prompt keeps what it recorded and skips it
when it is computed again.
"""

from __future__ import annotations

from typing import Callable

import torch

from .plan import Row


def pending(seq) -> bool:
    """Whether seq asked for prompt logprobs and some are still missing."""
    return seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.prompt_len


def span(row: Row) -> tuple[int, int] | None:
    """The indices [lo, hi) into row.tokens whose logits give prompt logprobs not yet recorded, or None."""
    seq = row.seq
    if not pending(seq):
        return None
    # seq.prompt_logprobs holds positions 0 .. done - 1; the logits at p - 1 give position p's.
    lo = max(row.start, len(seq.prompt_logprobs) - 1)
    hi = min(row.start + len(row.tokens), seq.prompt_len - 1)
    return (lo - row.start, hi - row.start) if lo < hi else None


def record(found: dict[Row, torch.Tensor], head, decode_one: Callable[[int], str]) -> None:
    """Append to each row's seq.prompt_logprobs the TokenLogprobs of its span, from found[row]: the
    logits (hi - lo, V) of its span. One head.logprobs call for the step (one host sync; under tensor
    parallelism every rank makes it, over its shard of the vocabulary)."""
    if not found:
        return
    rows, chosen, top_n = list(found), [], []
    for r in rows:
        lo, hi = span(r)
        chosen += r.seq.ids[r.start + lo + 1:r.start + hi + 1]
        top_n += [r.seq.params.prompt_logprobs] * (hi - lo)
    logits = torch.cat([found[r] for r in rows])  # (N, V)
    lps = head.logprobs(logits, torch.tensor(chosen, device=logits.device), top_n, decode_one)
    at = 0
    for r in rows:
        n = found[r].shape[0]
        r.seq.prompt_logprobs += lps[at:at + n]
        at += n
