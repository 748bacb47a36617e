"""Speculative decoding: a cheap proposer guesses k tokens, the target checks them all in one forward.

The output is the target's own distribution, token for token (Leviathan et al. 2023, Chen et al.
2023): draft token x, drawn from the proposer's q, is accepted with probability min(1, p(x)/q(x)); at
the first rejection the row's next token is drawn from norm(max(0, p - q)) and the rest of the guess
is dropped; when every guess is accepted a bonus token is drawn from the target's next p. p is the
distribution plain sampling would draw from (sampling.filtered_probs: repetition penalty, temperature,
top-k, top-p, min-p), so speculation changes the speed, never the output's law. The rule holds for any
q that x was drawn from: the draft's leaves out top-p and min-p (proposers.py says why). A proposer
without a distribution (prompt lookup) is a point mass: q(x) = 1. Temperature 0 is exact
greedy: a guess is kept iff it is the target's argmax, and the correction is the argmax.

The repetition penalty depends on the context, which grows inside a round: the target's p after
guesses x1..xi and the draft's q for x(i+1) both see x1..xi as seen tokens (verify.stacks); so do the
presence and frequency penalties, which count them as generated.

The rounds run on the continuous-batching scheduler's rows (verify.py, proposers.py): a round feeds each
row's last token and its guesses at positions pos .. pos+K; a row that keeps n guesses has n+1 more
computed tokens, so every slot below them holds an accepted token and the slots above are rewritten
before they are read (the blocks that hold only rejected slots go back to the pool).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ConfigError
from . import accept as accept_kernel
from .noise import ACCEPT, RowStream, log_exp_noise, uniforms_range

MODES = ("off", "draft", "prompt-lookup")
MAX_SPECULATIVE_TOKENS = 16  # past this a guess is almost never kept whole, and the verify forward grows
DEFAULT_SPECULATIVE_TOKENS = 4
AUTO_MAX_TOKENS = 8  # num_speculative_tokens="auto" guesses between 1 and this many per round
# "auto"'s price of a sampled row's round in plain decode steps (verify.Speculation.adapt): this much more than a
# plain step, and this much a guess. The bundled model and its draft in fp32 on a Zen 5 (tokens per round over the
# speedup at k = 1 and 2, docs/results/bench-speculative-zen5-ac74fb8.json): a sampled round of k guesses cost
# ~1.13 + 0.26-0.35 k plain steps.
AUTO_ROUND_COST = 0.15
AUTO_GUESS_COST = 0.3


# ---------------------------------------------------------------- the acceptance rule, alone


def draw(probs: torch.Tensor, rows: list[int], streams: list[RowStream]) -> torch.Tensor:
    """One token per row from probs (B, V), each sampled row with its own stream (the exponential race of
    sampling.py, in log space, one draw of the row's stream); rows not listed (greedy: probs is one-hot)
    take the argmax. One native call (engine/accept.py) where its kernel can prove the same tokens."""
    native = accept_kernel.draw(probs, rows, streams)
    if native is not None:
        return native
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
    decide by argmax. Returns (n (B,) guesses kept, final (B,) the token after them). One native call
    (engine/accept.py) where its kernel can prove the same decisions; the tensor rule below elsewhere."""
    native = accept_kernel.accept(p, q, draft, lengths, rows, streams)
    if native is not None:
        return native
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
