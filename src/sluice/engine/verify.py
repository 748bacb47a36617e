"""Speculative decoding on the scheduler's rows: a Speculation proposes guesses for the decoding rows
of a step (proposers.py), the step's forward reads each row's last token and its guesses in one
chunk, and verify() keeps a prefix of every row's guesses by the acceptance rule (speculative.py), so
the output follows the target's distribution exactly whatever the proposer guessed.

Each row is its own: its guess count (adapted to its own keep rate with num_speculative_tokens="auto"),
its draft state (SpecState.draft_valid), its random stream (every draw, the draft's included, comes
from the sequence's own stream, so a seeded request repeats) and its penalty state (the repetition,
presence and frequency penalties see each earlier guess as a generated token, as plain decoding would
have seen it: see stacks()).
"""

from __future__ import annotations

import torch

from .plan import Row
from .sampling import NONFINITE, argmax_rows, nonfinite_rows
from .sequence import SpecState
from .spec_probs import RoundProbs
from .noise import ACCEPT, uniforms_range
from . import accept as accept_kernel
from .speculative import AUTO_GUESS_COST, AUTO_MAX_TOKENS, AUTO_ROUND_COST, DEFAULT_SPECULATIVE_TOKENS, accept


class Speculation:
    """An engine's speculative decoding: its proposer (a DraftProposer or PromptLookup) and guess count."""

    def __init__(self, mode: str, proposer, num_tokens: int | str):
        self.mode, self.proposer = mode, proposer
        self.set_k(num_tokens)

    def set_k(self, num_tokens: int | str) -> None:
        """Guesses per round for sequences added from now on: a number, or "auto" (starting at the default)."""
        self.adaptive = num_tokens == "auto"
        self.k = DEFAULT_SPECULATIVE_TOKENS if self.adaptive else num_tokens

    def new_state(self) -> SpecState:
        return SpecState(self.k, self.adaptive)

    @staticmethod
    def adapt(state: SpecState, kept: int, rejected: bool, sampled: bool = False) -> None:
        """num_speculative_tokens="auto": the sequence's next guess count (1 .. AUTO_MAX_TOKENS) from a, a running
        mean over rounds (weight 0.3 on the newest) of kept / (kept + rejected), the rate at which a checked
        guess is kept (guesses after a rejection were never checked, so they say nothing about a).
        - A greedy row guesses one more than a / (1 - a), the guesses a round keeps on average if each is kept
          with probability a. Its keeps come in runs (the draft follows the target's argmax through stretches
          of easy text), where guessing past the average pays: bench/auto_k.py's exact replay of greedy rounds
          on the bundled model's prompts puts this rule above every fixed k, and above the sampled rows' rule
          on code.
        - A sampled row takes the k that maximises a round's expected tokens, (1 - a^(k+1)) / (1 - a), over
          its cost in plain steps, 1 + AUTO_ROUND_COST + AUTO_GUESS_COST k: its keeps are draws, with no runs
          to ride, and at T = 0.8 (a ~0.5-0.7) the greedy rule guessed more than paid: on the sampled edit
          prompts it ran below k = 1 (0.87x and 0.96x against 1.02x and 1.13x, docs/results/
          bench-speculative-zen5-d74ab50.json and -ac74fb8.json)."""
        if not state.adaptive or kept + rejected == 0:
            return
        rate = kept / (kept + rejected)
        state.keep_rate = rate if state.keep_rate is None else 0.7 * state.keep_rate + 0.3 * rate
        a = min(state.keep_rate, 0.95)
        if not sampled:
            state.k = max(1, min(AUTO_MAX_TOKENS, round(a / (1 - a)) + 1))
            return
        best, reach, tokens = 0.0, 1.0, 1.0
        for k in range(1, AUTO_MAX_TOKENS + 1):
            reach *= a
            tokens += reach
            value = tokens / (1 + AUTO_ROUND_COST + AUTO_GUESS_COST * k)
            if value > best:
                best, state.k = value, k


def has_penalty_state(samplers: list) -> bool:
    """Whether penalty_state would return a seen mask or counts for these rows' samplers."""
    return any(s.uses_penalty or s.counts is not None for s in samplers)


def penalty_state(rows: list[Row]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The rows' seen masks (B, V) and generated counts (B, V), each None when no row uses it."""
    samplers = [r.seq.sampler for r in rows]
    seen = torch.cat([s.seen for s in samplers]) if any(s.uses_penalty for s in samplers) else None
    counts = None
    if any(s.counts is not None for s in samplers):
        counts = torch.cat([s.counts if s.counts is not None else torch.zeros_like(s.seen, dtype=torch.float32)
                            for s in samplers])
    return seen, counts


def grow(seen: torch.Tensor | None, counts: torch.Tensor | None, tokens: torch.Tensor):
    """The penalty state after each row generated tokens (B,)."""
    if seen is not None:
        seen = seen.scatter(1, tokens[:, None], True)
    if counts is not None:
        counts = counts.scatter_add(1, tokens[:, None], torch.ones(tokens.shape[0], 1, device=counts.device))
    return seen, counts


def stacks(seen, counts, draft: torch.Tensor):
    """(B, K+1, V) each: the penalty state before the first guess and after each of draft (B, K)."""
    if seen is None and counts is None:
        return None, None
    B, K = draft.shape
    V = (seen if seen is not None else counts).shape[1]
    hits = torch.zeros(B, K + 1, V, device=draft.device)
    hits[:, 1:].scatter_(-1, draft[..., None], 1.0)
    cum = hits.cumsum(1)
    return (None if seen is None else seen[:, None] | (cum > 0)), (None if counts is None else counts[:, None] + cum)


def verify(rows: list[Row], logits: list[torch.Tensor], probs: RoundProbs | None = None) -> list[list[int]]:
    """Each row's run: the guesses it keeps, then one more token (NONFINITE ends a run whose logits went
    non-finite). logits[i] (1 + len(rows[i].guesses), V): the target's after the row's last token and
    after each guess. probs: the caller's RoundProbs, kept across rounds (a fresh one if None)."""
    if all(r.seq.sampler.plain_greedy for r in rows):
        return _greedy_runs(rows, logits)
    probs = probs or RoundProbs()
    runs = _native_runs(rows, logits, probs)
    if runs is not None:
        return runs
    B, K = len(rows), max(len(r.guesses) for r in rows)
    V, dev = logits[0].shape[-1], logits[0].device
    lengths = [len(r.guesses) for r in rows]
    if all(n == K for n in lengths):
        x = torch.stack(logits)
    else:  # positions past a row's guesses are never read by the rule: zeros do
        x = torch.zeros(B, K + 1, V, dtype=logits[0].dtype, device=dev)
        for i, lg in enumerate(logits):
            x[i, : lg.shape[0]] = lg
    draft = torch.tensor([r.guesses + [0] * (K - len(r.guesses)) for r in rows], dtype=torch.long, device=dev)
    samplers = [r.seq.sampler for r in rows]
    seen, counts = penalty_state(rows)
    q = None
    if rows[0].q is not None and all(n == K for n in lengths):
        q = rows[0].q[None] if B == 1 else torch.stack([r.q for r in rows])
    elif rows[0].q is not None:
        q = torch.zeros(B, K, V, device=dev)
        for i, r in enumerate(rows):
            q[i, : len(r.guesses)] = r.q
    sampled = [i for i, s in enumerate(samplers) if s.params[0].temperature > 0]
    streams = [s.streams[0] for s in samplers]
    n, final = _torch_rule(x, draft, q, lengths, sampled, samplers, streams, *stacks(seen, counts, draft), probs)
    # A position whose logits hold NaN or inf ends the row's run with NONFINITE (the engine reports it).
    bad = nonfinite_rows(x)  # (B, K+1)
    first_bad = torch.where(bad.any(-1), bad.long().argmax(-1), K + 1)
    final = torch.where(first_bad <= n, NONFINITE, final)
    n = torch.minimum(n, first_bad)
    return [g[:k] + [f] for g, k, f in zip(draft.tolist(), n.tolist(), final.tolist(), strict=True)]


def _native_runs(rows: list[Row], logits: list[torch.Tensor], probs: RoundProbs) -> list[list[int]] | None:
    """verify()'s runs in one native call on the rows as they are (accept_kernel.accept_rows: no padded stack,
    no index tensors), where the kernel filters every row (temperature and top_p alone, or greedy; no
    penalties) and the rows agree on having a draft's q. The kernel reads positions 0..n of each row and
    defers on a non-finite one (the torch path then ends that run). None changed nothing."""
    samplers = [r.seq.sampler for r in rows]
    if has_penalty_state(samplers):  # (the kernel takes no penalty state)
        return None
    has_q = rows[0].q is not None
    if any((r.q is not None) != has_q for r in rows):
        return None
    logits = [lg if lg.dtype == torch.float32 and lg.is_contiguous() else lg.float().contiguous() for lg in logits]
    columns = probs.native_columns(samplers, logits[0].shape[-1], logits[0].device)
    if columns is None:
        return None
    guesses = [r.guesses for r in rows]
    q = [r.q if r.q.is_contiguous() else r.q.contiguous() for r in rows] if has_q else None
    sampled = [s.params[0].temperature > 0 for s in samplers]
    decided = accept_kernel.accept_rows(logits, q, guesses, sampled, columns[0].tolist(), columns[1].tolist(),
                                        [s.streams[0] for s in samplers])
    if decided is None:
        return None
    return [g[:k] + [f] for g, k, f in zip(guesses, *decided, strict=True)]


def _torch_rule(x, draft, q, lengths, sampled, samplers, streams, seen, counts, probs: RoundProbs):
    """verify()'s (n, final) from the target's p filtered in torch (RoundProbs), then speculative.accept."""
    B, K1, V = x.shape
    K = K1 - 1
    if probs.sorts(samplers):
        p = staged_probs(x, draft, q, lengths, sampled, samplers, seen, counts, probs)
    else:
        p = probs(x.reshape(B * (K + 1), V), samplers, K + 1, None if seen is None else seen.reshape(B * (K + 1), V),
                  None if counts is None else counts.reshape(B * (K + 1), V)).view(B, K + 1, V)
    return accept(p, q, draft, lengths, sampled, streams)


def staged_probs(x, draft, q, lengths, sampled, samplers, seen, counts, probs: RoundProbs) -> torch.Tensor:
    """The target's p (B, K+1, V) at the positions the acceptance rule reads: a row's positions 0..n for
    its n kept guesses; zeros elsewhere (never read). For rows whose filters sort the whole row (top_p,
    min_p), where a position costs a sort: guess j is decided by the rule's own test, u q(x) < p(x) in
    fp32 with the row's acceptance uniforms (read, not advanced; accept() then makes the same decisions
    from the same bits), and the next position is filtered only for the rows that kept it. A round that
    rejects its first guess sorts one position instead of K+1."""
    B, K1, V = x.shape
    K = K1 - 1
    p = x.new_zeros(B, K1, V, dtype=torch.float32)
    u = torch.zeros(B, K, device=x.device)  # greedy rows: u = 0, kept iff p(x) > 0, as in the rule
    if sampled and K:
        u[sampled] = uniforms_range([samplers[i].streams[0] for i in sampled], 0, K, ACCEPT)
    alive = list(range(B))
    for j in range(K1):
        if not alive:
            break
        pick = torch.tensor(alive)
        whole = len(alive) == B
        pj = probs(x[:, j] if whole else x[pick, j], samplers, 1,
                   None if seen is None else (seen[:, j] if whole else seen[pick, j]),
                   None if counts is None else (counts[:, j] if whole else counts[pick, j]), pick=alive)
        if whole:
            p[:, j] = pj
        else:
            p[pick, j] = pj
        alive = [i for i in alive if lengths[i] > j]
        if j == K or not alive:
            break
        at = torch.tensor(alive)
        guess = draft[at, j]
        px = p[at, j].gather(-1, guess[:, None])[:, 0]
        qx = torch.ones_like(px) if q is None else q[at, j].gather(-1, guess[:, None])[:, 0]
        kept = (u[at, j] * qx < px).tolist()
        alive = [i for i, k in zip(alive, kept, strict=True) if k]
    return p


def _greedy_runs(rows: list[Row], logits: list[torch.Tensor]) -> list[list[int]]:
    """verify() when every row is plain greedy: a guess is kept while it is the target's argmax (the
    rule at temperature 0, as accept_greedy), decided on the host from one argmax over every row's
    positions: a few small lists, where the tensor rule costs a dozen small ops a round."""
    top, bad = argmax_rows((logits[0] if len(logits) == 1 else torch.cat(logits)).float())  # no padding needed
    top, bad = top.tolist(), bad.tolist()
    runs, at = [], 0
    for r in rows:
        g, n = r.guesses, 0
        while n < len(g) and g[n] == top[at + n]:
            n += 1
        first_bad = next((j for j in range(len(g) + 1) if bad[at + j]), None)
        runs.append(g[:first_bad] + [NONFINITE] if first_bad is not None and first_bad <= n else g[:n] + [top[at + n]])
        at += len(g) + 1
    return runs
