"""Speculative decoding: a cheap proposer guesses k tokens, the target checks them all in one forward.

The output is the target's own distribution, token for token (Leviathan et al. 2023, Chen et al.
2023): draft token x, drawn from the proposer's q, is accepted with probability min(1, p(x)/q(x)); at
the first rejection the row's next token is drawn from norm(max(0, p - q)) and the rest of the guess
is dropped; when every guess is accepted a bonus token is drawn from the target's next p. p and q are
the distributions plain sampling would draw from (sampling.filtered_probs: repetition penalty,
temperature, top-k, top-p, min-p), so speculation changes the speed, never the output's law. A
proposer without a distribution (prompt lookup) is a point mass: q(x) = 1. Temperature 0 is exact
greedy: a guess is kept iff it is the target's argmax, and the correction is the argmax.

The repetition penalty depends on the context, which grows inside a round: the target's p after
guesses x1..xi and the draft's q for x(i+1) both see x1..xi as seen tokens (_seen_stack).

Cache bookkeeping (slots are positions, see Transformer.attention_mask): a round feeds each row's last
emitted token and its guesses at positions pos .. pos+K; a row that keeps n guesses moves pos by n+1,
so every slot below pos holds an accepted token and the slots above are rewritten before they are read.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ConfigError
from .runner import Runner
from .noise import ACCEPT, RowStream, log_exp_noise, uniforms_range
from .sampling import NONFINITE, Sampler, filtered_probs, nonfinite_rows

MODES = ("off", "draft", "prompt-lookup")
MAX_SPECULATIVE_TOKENS = 16  # past this a guess is almost never kept whole, and the verify forward grows
DEFAULT_SPECULATIVE_TOKENS = 4
AUTO_MAX_TOKENS = 8  # num_speculative_tokens="auto" guesses between 1 and this many per round


# ---------------------------------------------------------------- the acceptance rule, alone


def draw(probs: torch.Tensor, rows: list[int], streams: list[RowStream]) -> torch.Tensor:
    """One token per row from probs (B, V), each sampled row with its own stream (the exponential race of
    sampling.py, in log space, one draw of the row's stream); rows not listed (greedy: probs is one-hot)
    take the argmax."""
    tokens = probs.argmax(-1)
    if rows:
        mine = [streams[i] for i in rows]
        tokens[rows] = (probs[rows].float().log() - log_exp_noise(uniforms_range(mine, 0, probs.shape[-1]))).argmax(-1)
        for s in mine:
            s.advance()
    return tokens


def accept(p: torch.Tensor, q: torch.Tensor | None, draft: torch.Tensor, lengths: list[int],
           rows: list[int], streams: list[RowStream]) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance rule for a batch. p (B, K+1, V): the target's probabilities after the last token
    and after each guess; q (B, K, V): the draft's, or None for a point mass on each guess; draft (B, K)
    the guesses, of which row b proposed lengths[b]; rows: the sampled (non-greedy) rows, the others
    decide by argmax. Returns (n (B,) guesses kept, final (B,) the token after them)."""
    B, K = draft.shape
    px = p[:, :K].gather(-1, draft[..., None])[..., 0]  # (B, K) target probability of each guess
    qx = torch.ones_like(px) if q is None else q.gather(-1, draft[..., None])[..., 0]
    u = torch.zeros_like(px)  # greedy rows: u = 0 keeps a guess iff p(x) > 0, i.e. x is the argmax
    if rows:  # a draw of each row's stream in its own domain: uniforms for guesses 0..lengths[i] - 1
        drawn = uniforms_range([streams[i] for i in rows], 0, K, ACCEPT)
        for r, i in enumerate(rows):
            u[i, : lengths[i]] = drawn[r, : lengths[i]]
            streams[i].advance()
    # u < min(1, p/q) is u < p/q for u in [0, 1); multiplied out, since q(x) > 0 for a drawn x.
    ok = (u * qx < px) & (torch.arange(K, device=p.device) < torch.tensor(lengths, device=p.device)[:, None])
    n = ok.long().cumprod(-1).sum(-1)  # (B,) leading run of kept guesses
    at = torch.arange(B, device=p.device)
    target = p[at, n]  # (B, V): p after the last kept token
    rejected = (n < torch.tensor(lengths, device=p.device))[:, None]
    if q is None:  # max(0, p - onehot(x)) = p without x
        residual = target.scatter(-1, draft.gather(-1, n.clamp(max=max(K - 1, 0))[:, None]), 0.0) if K else target
    else:
        residual = (target - q[at, n.clamp(max=max(K - 1, 0))]).clamp_min(0) if K else target
    # p == q in exact arithmetic never rejects; rounding can, with a residual of zeros: then p itself.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, target)
    final = draw(torch.where(rejected, residual, target), rows, streams)
    return n, final


def accept_greedy(argmax: torch.Tensor, draft: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule at temperature 0 for a batch of greedy rows, from the target's argmax (B, K+1) alone."""
    K = draft.shape[1]
    ok = (draft == argmax[:, :K]) & (torch.arange(K) < torch.tensor(lengths)[:, None]).to(draft.device)
    n = ok.long().cumprod(-1).sum(-1)
    return n, argmax.gather(-1, n[:, None])[:, 0]


# ---------------------------------------------------------------- the decode rounds


class Speculator:
    """One request's speculative rounds over a prefilled target Runner: round() returns the tokens each
    active row emits (its kept guesses, then one more), at one target forward per round.

    The sampler is the request's: its per-row params, streams (every random draw of a row, the
    draft's included, comes from the row's own stream, so a seeded request repeats) and penalty mask
    (the tokens seen so far, which round() extends with what it emits)."""

    def __init__(self, runner: Runner, proposer, sampler: Sampler, num_tokens: int | str):
        self.runner, self.proposer, self.sampler = runner, proposer, sampler
        self.adaptive = num_tokens == "auto"
        self.k = DEFAULT_SPECULATIVE_TOKENS if self.adaptive else num_tokens
        self.keep_rate: float | None = None  # "auto": running estimate of P(a guess is kept | it is checked)
        self.params = sampler.params
        self.streams = sampler._streams  # the rows' own streams, shared with the first (prefill) token
        self.sampled_rows = [i for i, p in enumerate(self.params) if p.temperature > 0]
        self.penalty = any(p.repetition_penalty != 1 for p in self.params)
        # Temperature 0 everywhere and no penalty: q would be one-hot and the rule compares argmaxes only.
        self.greedy = not self.sampled_rows and not self.penalty
        self.history: list[list[int]] = []  # per row: prompt + emitted tokens, the last not yet in the cache
        self.proposed = self.accepted = self.forwards = self.row_forwards = 0

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], num_slots: int) -> torch.Tensor:
        """Prefill the target and the proposer; return the target's last logits (B, V)."""
        self.history = [list(p) for p in prompts]
        self.proposer.prefill(prompts, num_slots)
        return self.runner.prefill(prompts, num_slots)

    def start(self, first: list[int]) -> None:
        """The first generated tokens (sampled from prefill's logits by the plain sampler)."""
        for b, tok in enumerate(first):
            self.history[b].append(tok)
            if tok != NONFINITE:
                self.sampler.add_context(b, [tok])

    def seen_stack(self, draft: torch.Tensor) -> torch.Tensor | None:
        """(B, K+1, V): the penalty's seen tokens after the history and after each guess; None if unused."""
        if not self.penalty:
            return None
        B, K = draft.shape
        hits = torch.zeros(B, K + 1, self.sampler.vocab_size, dtype=torch.bool, device=draft.device)
        hits[:, 1:].scatter_(-1, draft[..., None], True)
        return self.sampler.seen[:, None] | (hits.cumsum(1) > 0)

    def probs(self, logits: torch.Tensor, seen: torch.Tensor | None) -> torch.Tensor:
        """(B, T, V) logits -> the filtered probabilities plain sampling would draw from, per position."""
        B, T, V = logits.shape
        params = [p for p in self.params for _ in range(T)]
        flat = filtered_probs(logits.reshape(B * T, V), params, None if seen is None else seen.reshape(B * T, V))
        return flat.view(B, T, V)

    @torch.inference_mode()
    def round(self, active: list[int]) -> list[list[int]]:
        B = len(self.history)
        draft, q, lengths = self.proposer.propose(self, self.k, active)  # (B, k), (B, k, V) | None, list
        lengths = [lengths[b] if b in active else 0 for b in range(B)]
        K = max(lengths)
        draft, q = draft[:, :K], None if q is None else q[:, :K]
        dev = self.runner.pos.device
        last = torch.tensor([h[-1] if h[-1] != NONFINITE else 0 for h in self.history], device=dev)
        if K == 0:  # nothing proposed: a plain decode step, which may be faster than a forward of one token
            logits = self.runner.step(last)[:, None]
            self.runner.advance(-1)  # the rows move below, by what they emit
        else:
            logits = self.runner.verify(torch.cat([last[:, None], draft], 1))  # (B, K+1, V)
        if self.greedy:
            n, final = accept_greedy(logits.argmax(-1), draft, lengths)
        else:
            n, final = accept(self.probs(logits, self.seen_stack(draft)), q, draft, lengths,
                              [i for i in self.sampled_rows if i in active], self.streams)
        # A position whose logits hold NaN or inf ends the row's run with NONFINITE (the engine reports it).
        bad = nonfinite_rows(logits)  # (B, K+1)
        first_bad = torch.where(bad.any(-1), bad.long().argmax(-1), K + 1)
        final = torch.where(first_bad <= n, NONFINITE, final)
        n = torch.minimum(n, first_bad)
        n_host, final_host, draft_host = n.tolist(), final.tolist(), draft.tolist()
        runs: list[list[int]] = [[] for _ in range(B)]
        moves = [0] * B
        for b in active:
            run = draft_host[b][: n_host[b]] + [final_host[b]]
            runs[b], moves[b] = run, len(run)
            self.history[b].extend(run)
            self.sampler.add_context(b, [t for t in run if t != NONFINITE])
            self.proposed += lengths[b]
            self.accepted += n_host[b]
        self.runner.advance(torch.tensor(moves, device=dev))
        self.forwards += 1
        self.row_forwards += len(active)
        if self.adaptive:
            self._adapt(sum(n_host[b] for b in active), sum(n_host[b] < lengths[b] for b in active))
        return runs

    def _adapt(self, kept: int, rejections: int) -> None:
        """num_speculative_tokens="auto": if each checked guess is kept with probability a, a round keeps
        a / (1 - a) guesses on average; guess one more than that (1 .. AUTO_MAX_TOKENS). a is a running
        mean over rounds (weight 0.3 on the newest) of kept / (kept + rejected): guesses after a rejection
        were never checked, so they say nothing about a."""
        if kept + rejections == 0:
            return
        rate = kept / (kept + rejections)
        self.keep_rate = rate if self.keep_rate is None else 0.7 * self.keep_rate + 0.3 * rate
        a = min(self.keep_rate, 0.95)
        self.k = max(1, min(AUTO_MAX_TOKENS, round(a / (1 - a)) + 1))

    def release(self) -> None:
        self.proposer.release()


# ---------------------------------------------------------------- choosing and checking a draft


def check_num_tokens(k, name: str = "num_speculative_tokens") -> int | str:
    if isinstance(k, str) and k == "auto":
        return k
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ConfigError(f"{name} must be an integer in [1, {MAX_SPECULATIVE_TOKENS}] or 'auto', got {k!r}")
    return k


def resolve_mode(speculative, draft_model, num_tokens, target_is_bundled: bool) -> tuple[str, object, int]:
    """LLM(speculative=, draft_model=, num_speculative_tokens=) -> (mode, draft to load or None, k).

    speculative=None means "draft" when a draft_model is given, else "off"; "draft" without a draft_model
    takes the bundled draft for the bundled model. Contradictions are refused, not guessed at."""
    if speculative is None:
        speculative = "draft" if draft_model is not None else "off"
    if not isinstance(speculative, str) or speculative not in MODES:
        raise ConfigError(f"speculative must be one of {', '.join(map(repr, MODES))} (or None), got {speculative!r}")
    if draft_model is not None and speculative != "draft":
        raise ConfigError(f"draft_model={draft_model!r} is only used with speculative='draft', not {speculative!r}")
    if speculative == "off":
        if num_tokens is not None:
            raise ConfigError("num_speculative_tokens needs speculative decoding: pass speculative='draft' "
                              "(with draft_model=) or 'prompt-lookup'")
        return "off", None, 0
    if speculative == "draft" and draft_model is None:
        if not target_is_bundled:
            raise ConfigError("speculative='draft' needs draft_model= (a smaller checkpoint with the same "
                              "tokenizer); the bundled draft only serves the bundled model")
        draft_model = "bundled"
    k = check_num_tokens(DEFAULT_SPECULATIVE_TOKENS if num_tokens is None else num_tokens)
    return speculative, draft_model, k


def draft_dir(draft_model) -> Path:
    from ..model.hub import resolve_model_dir
    from ..model.loading import bundled_draft_dir
    if isinstance(draft_model, str) and draft_model == "bundled":
        return bundled_draft_dir()  # refuses a missing one by name
    if not isinstance(draft_model, (str, Path)):
        raise ConfigError(f"draft_model must be a checkpoint directory, repo id or 'bundled', got {draft_model!r}")
    return resolve_model_dir(draft_model)


def check_draft(target_cfg, target_tok, target_dir, draft_cfg, draft_tok, draft_path, max_model_len: int) -> None:
    """Refuse a draft whose token ids do not mean what the target's mean: a different vocabulary size,
    or a tokenizer that maps some id to another token (compared by content, not by path)."""
    where = f"the draft model ({draft_path}) and the target ({target_dir})"
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise ConfigError(f"{where} have different vocabulary sizes ({draft_cfg.vocab_size} vs "
                          f"{target_cfg.vocab_size}); a draft must share the target's tokenizer and vocabulary")
    if draft_tok.vocab_size != target_tok.vocab_size:
        raise ConfigError(f"{where} have different tokenizers ({draft_tok.vocab_size} vs {target_tok.vocab_size} "
                          "tokens); a draft must share the target's tokenizer")
    for i in range(target_tok.vocab_size):
        a, b = draft_tok.id_to_token(i), target_tok.id_to_token(i)
        if a != b:
            raise ConfigError(f"{where} have different tokenizers: token id {i} is {a!r} in the draft's and "
                              f"{b!r} in the target's; a draft must share the target's tokenizer")
    if draft_cfg.max_position_embeddings < max_model_len:
        raise ConfigError(f"the draft model ({draft_path}) has a context of {draft_cfg.max_position_embeddings} "
                          f"tokens, shorter than max_model_len={max_model_len}; pass max_model_len <= "
                          f"{draft_cfg.max_position_embeddings}")
