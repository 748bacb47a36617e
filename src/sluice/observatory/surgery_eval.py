"""What `surgery.compare` measures on one model state: bits per byte, logits, entropy, overflow.

Bits per byte = sum over scored tokens of -log2 p(token | prefix) / UTF-8 bytes those tokens spell.
Every token but the first is scored (the first has no prefix; a BOS the tokenizer adds spells no
bytes, so then every byte of the text counts). The text runs in windows of
min(max_position_embeddings, WINDOW) tokens, each predicting the next W tokens; the context restarts
at each window, as in the training code's evaluation.

log p(token) = z_token - log Z, where Z is the normaliser the chosen softmax method computed in the
chosen dtype (softmax.py): in fp32 with the safe method that is the ordinary cross-entropy; with
naive exp() in fp16 an overflowed sum makes log Z (and so bits per byte) inf, which is the point.
Entropy is the model's: from the fp32 logits with torch's (max-subtracting) fp32 log-softmax, whatever
the method.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ObservatoryError
from .softmax import naive_softmax, online_softmax, overflow_threshold, safe_softmax

SCHEMA = "sluice.surgery/1"
DEFAULT_TEXT_BYTES = 8 << 10  # the default held-out text: its first 8 KiB, cut at a line end
MAX_TEXT_BYTES = 256 << 10  # a text given by the user: refused above this
MAX_NEW_TOKENS = 256
WINDOW = 2048  # scoring window cap, tokens (logits of one window: WINDOW x V fp32)
PROMPT_BYTES = 200  # the default prompt: the text's start, up to this many bytes, cut at a line end
SOFTMAX = {"naive": naive_softmax, "safe": safe_softmax, "online": online_softmax}


def _cut(text: str, limit: int) -> str:
    """At most `limit` UTF-8 bytes of text, ending at a line end when there is one."""
    head = text.encode("utf-8")[:limit].decode("utf-8", errors="ignore")
    if len(head) < len(text) and "\n" in head.rstrip("\n"):
        head = head[:head.rstrip("\n").rindex("\n") + 1]
    return head


def default_text(model) -> tuple[str, str, str | None]:
    """(text, where it came from, a note or None): the held-out split of the recipe.toml next to the
    model's weights, or, for a model without one, the bundled model's (with a note saying so)."""
    from ..model.loading import bundled_model_dir
    from ..training.corpus import Corpus, load_corpus
    from ..training.recipe import Recipe
    model_dir = getattr(model, "model_dir", None)
    recipe_path, note = Path(model_dir or ".") / "recipe.toml", None
    if model_dir is None or not recipe_path.is_file():
        recipe_path = bundled_model_dir() / "recipe.toml"
        note = (f"{Path(model_dir).name if model_dir else 'this model'} has no recipe.toml: scored "
                "the bundled model's held-out text (Python standard library source) instead; pass "
                "text= (--text FILE) to score your own")
    corpus = load_corpus(Recipe.load(recipe_path).corpus)
    if not corpus.heldout:
        raise ObservatoryError(f"the recipe {recipe_path} has an empty held-out split: pass a text")
    parts, size = [], 0
    for path in corpus.heldout:
        parts.append(Corpus.read(path))
        size += len(parts[-1].encode("utf-8")) + 1
        if size >= DEFAULT_TEXT_BYTES:
            break
    text = _cut("\n".join(parts), DEFAULT_TEXT_BYTES)
    names = [p.relative_to(corpus.root).as_posix() for p in corpus.heldout[:len(parts)]]
    return text, (f"held-out split of {recipe_path} (corpus {corpus.root}): the first "
                  f"{len(text.encode('utf-8')):,} bytes of {', '.join(names)}"), note


@dataclass
class Inputs:
    """The checked, tokenized inputs both model states are measured on."""

    text: str
    ids: list[int]
    scored_bytes: int
    window: int
    prompt: str
    prompt_ids: list[int]
    max_new_tokens: int
    source: str
    note: str | None


def prepare(model, tokenizer, text, prompt, max_new_tokens) -> Inputs:
    """Check every size and tokenize, before any forward (and so before anything is allocated)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or not 0 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise ObservatoryError(f"max_new_tokens must be an integer in [0, {MAX_NEW_TOKENS}], "
                               f"got {max_new_tokens!r}")
    source, note = "the text given", None
    if text is None:
        text, source, note = default_text(model)
    if not isinstance(text, str) or not text:
        raise ObservatoryError("the text to score is empty: pass some text (--text FILE)")
    n_bytes = len(text.encode("utf-8"))
    if n_bytes > MAX_TEXT_BYTES:
        raise ObservatoryError(f"the text to score is {n_bytes:,} bytes, over the limit of "
                               f"{MAX_TEXT_BYTES:,}: pass a shorter text (its first "
                               f"{MAX_TEXT_BYTES:,} bytes, say)")
    ids = tokenizer.encode(text)
    if len(ids) < 2:
        raise ObservatoryError(f"the text {text!r} is {len(ids)} token(s): scoring needs at least 2")
    # the first token is context only; the bytes it spells are not scored (a BOS spells none)
    scored_bytes = n_bytes - len(tokenizer.decode(ids[:1]).encode("utf-8"))
    ctx = model.config.max_position_embeddings
    if prompt is None:  # the text's start, shortened to leave room for the continuation
        prompt_ids = tokenizer.encode(_cut(text, PROMPT_BYTES))[:max(ctx - max_new_tokens, 1)]
        prompt = tokenizer.decode(prompt_ids)
    else:
        prompt_ids = tokenizer.encode(prompt, max_tokens=ctx) if isinstance(prompt, str) and prompt else []
    if not prompt_ids:
        raise ObservatoryError("the prompt to continue is empty: give some text")
    if len(prompt_ids) + max_new_tokens > ctx:
        raise ObservatoryError(f"the prompt is {len(prompt_ids):,} tokens; with max_new_tokens "
                               f"{max_new_tokens} that is over the model's context of {ctx:,} "
                               "tokens (max_position_embeddings): shorten the prompt")
    return Inputs(text, ids, max(scored_bytes, 1), min(ctx, WINDOW), prompt, prompt_ids,
                  max_new_tokens, source, note)


class _Totals:
    """Running sums over all scored positions; every count is over (position, vocab) entries
    unless it says rows."""

    def __init__(self):
        self.nats, self.entropy, self.rows = 0.0, 0.0, 0
        self.zmax, self.zmin = -math.inf, math.inf
        self.over = self.exp_inf = self.nonfinite_probs = self.broken = self.nonfinite_logits = 0

    def add(self, z: torch.Tensor, y: torch.Tensor, method: str, dtype: torch.dtype) -> None:
        """z (n, V) fp32 logits, y (n,) the tokens that came next."""
        out = SOFTMAX[method](z, dtype)
        z_y = z.to(dtype).double().gather(1, y[:, None])[:, 0]  # the logit as the method saw it
        self.nats += float((out.log_z - z_y).sum())  # -log p(y) = log Z - z_y
        logp = torch.log_softmax(z, -1)  # (n, V) fp32: the model's own distribution
        self.entropy += float(-(logp.exp() * logp).nan_to_num(0.0, posinf=0.0, neginf=0.0).sum()
                              if torch.isfinite(z).all() else math.nan)
        self.rows += z.shape[0]
        self.zmax, self.zmin = max(self.zmax, float(z.max())), min(self.zmin, float(z.min()))
        self.over += int((z > overflow_threshold(dtype)).sum())
        self.exp_inf += int(out.exp_inf.sum())
        bad = ~torch.isfinite(out.probs)
        self.nonfinite_probs += int(bad.sum())
        self.broken += int((bad.any(-1) | out.denom_inf | out.denom_zero).sum())
        self.nonfinite_logits += int((~torch.isfinite(z)).sum())


@torch.inference_mode()
def measure(model, tokenizer, inp: Inputs, method: str = "safe",
            dtype: torch.dtype = torch.float32) -> dict:
    """Every number of one side of the comparison, for the model as it is now."""
    t = _Totals()
    ids, W = inp.ids, inp.window
    rows = max(1, (8 << 20) // model.config.vocab_size)  # ~64 MiB per fp64 (rows, V) block
    for start in range(0, len(ids) - 1, W):
        y = torch.tensor(ids[start + 1:start + W + 1])  # (T,) the tokens to predict
        logits = model(torch.tensor([ids[start:start + len(y)]]))[0]  # (T, V) fp32
        for r in range(0, len(y), rows):
            t.add(logits[r:r + rows], y[r:r + rows], method, dtype)
    out_ids = greedy(model, inp.prompt_ids, inp.max_new_tokens, tokenizer.eos_token_ids)
    return {"softmax": method, "softmax_dtype": str(dtype).removeprefix("torch."),
            "bits_per_byte": t.nats / math.log(2) / inp.scored_bytes,
            "logit_max": t.zmax, "logit_min": t.zmin, "mean_entropy_nats": t.entropy / t.rows,
            "overflow_threshold": overflow_threshold(dtype), "logits_over_threshold": t.over,
            "exp_overflow": t.exp_inf, "nonfinite_probs": t.nonfinite_probs,
            "rows_broken": t.broken, "nonfinite_logits": t.nonfinite_logits,
            "continuation": tokenizer.decode(out_ids), "continuation_ids": out_ids}


def greedy(model, prompt_ids: list[int], n: int, stop_ids=()) -> list[int]:
    """argmax decoding by full recompute (no cache: surgery may change anything), <= n new tokens."""
    ids, new = list(prompt_ids), []
    for _ in range(n):
        logits = model(torch.tensor([ids]), logits_at=torch.tensor([len(ids) - 1]))  # (1, 1, V)
        nxt = int(logits[0, -1].argmax())
        ids.append(nxt)
        new.append(nxt)
        if nxt in stop_ids:
            break
    return new


def report(model, inp: Inputs, applied, before: dict, after: dict) -> dict:
    cfg = model.config
    return {"schema": SCHEMA,
            "model": {"name": Path(getattr(model, "model_dir", "model")).name,
                      "architecture": cfg.architecture, "num_layers": cfg.num_layers,
                      "vocab_size": cfg.vocab_size,
                      "dtype": str(model.embed.weight.dtype).removeprefix("torch.")},
            "surgeries": [str(s) for s in applied.surgeries], "notes": list(applied.notes),
            "text": {"source": inp.source, "note": inp.note, "bytes": len(inp.text.encode("utf-8")),
                     "tokens": len(inp.ids), "scored_tokens": len(inp.ids) - 1,
                     "scored_bytes": inp.scored_bytes, "window": inp.window},
            "prompt": inp.prompt, "max_new_tokens": inp.max_new_tokens,
            "before": before, "after": after}
