"""Per-token log probabilities and the most likely alternatives, as OpenAI's logprobs report them.

The numbers are log_softmax of the model's raw fp32 logits: before any penalty, temperature or
filter, as vLLM reports by default. Beside them, the entropy of that whole distribution (nats, over
every token of the vocabulary, not only the top alternatives): an extension the server reports as
"entropy" and the live page colours by. They say what the model thought, not what the sampler drew from
(a greedy row would otherwise report 0 for every token). The server turns these into OpenAI's
shapes (server/serving.py); the engine calls token_logprobs once per generated token of the rows
that asked, so this runs on the host's schedule, not inside the sync-free decode step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class TopLogprob:
    token_id: int
    token: str  # the token's text, as decode_one gave it
    logprob: float
    bytes: list[int]  # the UTF-8 bytes of `token`


@dataclass
class TokenLogprob:
    """The generated token and, in `top`, the most likely tokens at its position, best first."""
    token_id: int
    token: str
    logprob: float
    bytes: list[int]
    top: list[TopLogprob]
    entropy: float | None = None  # of the full distribution at this position, nats


def token_text(decode_one: Callable[[int], str], token_id: int) -> tuple[str, list[int]]:
    text = decode_one(token_id)
    # surrogatepass: a stray surrogate in a decoded text still gets bytes instead of an exception
    return text, list(text.encode("utf-8", "surrogatepass"))


def _top_ids(lp: torch.Tensor, n: int) -> list[int]:
    """The n highest entries of one row lp (V,), ties broken by the lower token id.

    topk alone leaves the order of equal values unspecified; every token at or above the n-th value
    is a candidate, and a stable sort of the candidates (listed in id order) settles the ties."""
    if n <= 0:
        return []
    kth = lp.topk(min(n, lp.numel())).values[-1]
    ids = (lp >= kth).nonzero()[:, 0]  # ascending ids
    order = lp[ids].sort(descending=True, stable=True).indices[:n]
    return ids[order].tolist()


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, top_n: list[int],
                   decode_one: Callable[[int], str]) -> list[TokenLogprob]:
    """One TokenLogprob per row: the chosen token's logprob and that row's top_n[row] alternatives.

    logits: (B, V) raw logits of any float dtype; chosen: (B,) the generated token ids (valid ids,
    not sampling.NONFINITE); top_n: per row, 0..V alternatives (rows may differ). The chosen token is
    reported whether or not it is among the top. decode_one(id) gives a token's text.
    """
    B, V = logits.shape
    assert chosen.shape == (B,) and len(top_n) == B, (tuple(chosen.shape), len(top_n), B)
    chosen_ids = chosen.tolist()
    lp = torch.log_softmax(logits.float(), dim=-1)  # (B, V)
    picked = lp.gather(1, chosen.reshape(B, 1).long())[:, 0]
    entropy = torch.special.entr(lp.exp()).sum(-1)  # -sum p log p, 0 for a token the model rules out
    chosen_lp, entropies = torch.stack((picked, entropy)).tolist()  # one host sync for the batch
    out = []
    for b, (tok, n) in enumerate(zip(chosen_ids, top_n, strict=True)):
        ids = _top_ids(lp[b], n)
        values = lp[b, ids].tolist()
        top = []
        for i, v in zip(ids, values, strict=True):
            text, raw = token_text(decode_one, i)
            top.append(TopLogprob(i, text, v, raw))
        text, raw = token_text(decode_one, tok)
        out.append(TokenLogprob(tok, text, chosen_lp[b], raw, top, entropies[b]))
    return out

