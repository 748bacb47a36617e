"""Fitting the tuned lens's translators (tuned_lens.py) on a corpus: what `sluice lens train` runs.

The model runs once over the training text, its streams x_0..x_L kept (lens.capture_stream, the
logit lens's own capture, so both lenses read the same x_0). Then each step draws a batch of token
positions and, for every layer l < L, minimises

    KL(p_L || softmax(head(final_norm(W_l x_l + b_l))))

with p_L the model's own distribution at that position, as Belrose et al. (2023) do; the final norm
and the LM head stay frozen. The translators are independent (layer l's loss reads only W_l, b_l),
so each layer's loss is backpropagated on its own, and in chunks of positions: at most one chunk of
one layer's logits and their gradient are alive at once, whatever the depth and vocabulary.

Adam, a short linear warm-up then a cosine decay to zero. The text: the training split of the
recipe.toml beside the model (the corpus it was trained on; for the bundled model, the Python
standard library), or the bundled model's when the model has none, or a text file. The translators
are judged on text they were not fitted on: the held-out split (or the file's last tenth).
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import torch

from ..errors import ObservatoryError
from .lens import capture_stream, head_logits
from .tuned_lens import TunedLens, fingerprint

SEQ_LEN = 512  # tokens per forward (capped by the model's context)
PER_FILE = 2  # sequences taken from one corpus file at most, so that many files are seen
BATCH = 512  # token positions per step
CHUNK_LOGITS = 16 << 20  # logits alive at once in a step (64 MiB fp32), as the logit lens's chunks
LR, WARMUP = 1e-3, 10


def _recipe_corpus(model):
    """The corpus of the recipe.toml beside the model, else of the bundled model; a note in that case."""
    from ..model.loading import bundled_model_dir
    from ..training.corpus import load_corpus
    from ..training.recipe import Recipe
    model_dir = getattr(model, "model_dir", None)
    recipe, note = Path(model_dir or ".") / "recipe.toml", None
    if model_dir is None or not recipe.is_file():
        recipe = bundled_model_dir() / "recipe.toml"
        note = (f"{Path(model_dir).name if model_dir else 'this model'} has no recipe.toml: fitted on the bundled "
                "model's corpus (Python standard library source); pass --text FILE for your own")
    return load_corpus(Recipe.load(recipe).corpus), recipe, note


def _windows(ids: list[int], seq: int, limit: int) -> list[list[int]]:
    return [ids[i:i + seq] for i in range(0, len(ids) - 1, seq)][:limit]


def corpus_sequences(model, tokenizer, tokens: int, heldout_tokens: int, text=None, seed: int = 0) -> dict:
    """Token sequences for fitting and for judging: {"train": [[ids]], "heldout": [[ids]], "source",
    "note"}. From `text` (a file) its first nine tenths and its last tenth; from the corpus, files of
    the training split, then of the held-out split, in an order shuffled with `seed`."""
    seq = min(SEQ_LEN, model.config.max_position_embeddings)
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False, what="the tuned lens's text")  # noqa: E731
    if text is not None:
        path = Path(text)
        try:
            ids = encode(path.read_bytes().decode("utf-8", errors="replace"))
        except OSError as e:
            raise ObservatoryError(f"--text {path}: {e.strerror or e}") from None
        cut = len(ids) * 9 // 10
        if cut < 2 or len(ids) - cut < 2:
            raise ObservatoryError(f"--text {path} has {len(ids)} tokens: too few to fit and judge a tuned lens")
        return {"train": _windows(ids[:cut][:tokens], seq, 10**9),
                "heldout": _windows(ids[cut:][:heldout_tokens], seq, 10**9),
                "source": f"{path} (first 9/10 fitted, last 1/10 held out)", "note": None}
    from ..model.loading import bundled_model_dir
    corpus, recipe, note = _recipe_corpus(model)
    if not corpus.heldout:
        raise ObservatoryError(f"the recipe {recipe} has an empty held-out split: pass --text FILE")
    out = {}
    for split, files, want in (("train", corpus.train, tokens), ("heldout", corpus.heldout, heldout_tokens)):
        order = list(files)
        random.Random(seed).shuffle(order)
        seqs, have = [], 0
        for path in order:
            if have >= want:
                break
            # a few windows per file: encode only the bytes they can need (~8 per token is generous)
            head = corpus.read(path)[:seq * PER_FILE * 8]
            for w in _windows(encode(head), seq, PER_FILE):
                seqs.append(w[:want - have])
                have += len(seqs[-1])
                if have >= want:
                    break
        out[split] = [s for s in seqs if len(s) >= 2]
    recipe_name = "the bundled model's recipe.toml" if recipe.parent.resolve() == bundled_model_dir().resolve() else recipe
    return {**out, "source": f"{corpus.root} ({recipe_name}: training split fitted, held-out split judged)",
            "note": note}


def capture(model, sequences: list[list[int]]) -> torch.Tensor:
    """Every sequence through the model -> its streams x_0..x_L, (L+1, N, C) with N all their tokens,
    in the weights' dtype. Under no_grad, not inference_mode: the fit differentiates through them."""
    L, C = model.config.num_layers, model.config.hidden_size
    w = model.embed.weight
    N = sum(len(s) for s in sequences)
    out = torch.empty(L + 1, N, C, dtype=w.dtype, device=w.device)
    at = 0
    with torch.no_grad():
        for s in sequences:
            buf = torch.empty(L + 1, 1, len(s), C, dtype=w.dtype, device=w.device)
            capture_stream(model, torch.tensor([s], device=w.device), buf)
            out[:, at:at + len(s)] = buf[:, 0]
            at += len(s)
    return out


def _chunk(V: int) -> int:
    return max(1, CHUNK_LOGITS // V)


def layer_kl(model, stream: torch.Tensor, lens: TunedLens | None = None) -> list[float]:
    """Mean KL(final || layer l) in nats over the N positions of stream (L+1, N, C), l = 0..L, through
    `lens` (None: the logit lens)."""
    L, N = stream.shape[0] - 1, stream.shape[1]
    n = _chunk(model.config.vocab_size)
    total = [0.0] * (L + 1)
    with torch.no_grad():
        for a in range(0, N, n):
            logp_final = head_logits(model, stream[L, a:a + n]).log_softmax(-1)
            p_final = logp_final.exp()
            for l in range(L + 1):
                x = stream[l, a:a + n] if lens is None else lens.translate(l, stream[l, a:a + n])
                logq = head_logits(model, x).log_softmax(-1)
                total[l] += float((p_final * (logp_final - logq)).sum())
    return [t / N for t in total]


def fit(model, stream: torch.Tensor, steps: int, batch: int = BATCH, lr: float = LR, seed: int = 0,
        on_step=None) -> tuple[TunedLens, list[float]]:
    """Translators for x_0..x_{L-1} fitted on stream (L+1, N, C); returns them and the loss of every
    step (the sum over layers of the batch's mean KL, nats). on_step(step, loss): progress."""
    if steps < 1 or batch < 1:
        raise ObservatoryError(f"steps and batch must be at least 1, got steps={steps}, batch={batch}")
    L, N, C = stream.shape
    L -= 1
    if L < 1:
        raise ObservatoryError("the model has no layer before the last: nothing to translate")
    lens = TunedLens.identity(L, C)
    weight = lens.weight.to(stream.device).requires_grad_()
    bias = lens.bias.to(stream.device).requires_grad_()
    lens.weight, lens.bias = weight, bias
    opt = torch.optim.Adam([weight, bias], lr=lr)
    warm = min(WARMUP, max(1, steps // 10))
    schedule = lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm)))  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    gen = torch.Generator().manual_seed(seed)
    n, losses = _chunk(model.config.vocab_size), []
    with torch.enable_grad():
        for step in range(steps):
            rows = torch.randint(N, (min(batch, N),), generator=gen).to(stream.device)
            opt.zero_grad(set_to_none=False)
            loss = 0.0
            for a in range(0, len(rows), n):
                part = rows[a:a + n]
                with torch.no_grad():
                    logp_final = head_logits(model, stream[L, part]).log_softmax(-1)
                    p_final = logp_final.exp()
                for l in range(L):
                    logq = head_logits(model, lens.translate(l, stream[l, part])).log_softmax(-1)
                    kl = (p_final * (logp_final - logq)).sum() / len(rows)
                    kl.backward()
                    loss += float(kl.detach())
            opt.step()
            sched.step()
            losses.append(loss)
            if on_step is not None:
                on_step(step, loss)
    lens.weight, lens.bias = weight.detach().cpu(), bias.detach().cpu()
    return lens, losses


def train(model, tokenizer, tokens: int = 32768, steps: int = 200, text=None, seed: int = 0,
          batch: int = BATCH, lr: float = LR, on_step=None, say=None) -> TunedLens:
    """Fit a tuned lens for `model` on `tokens` tokens of text (module doc) and judge it on held-out
    text: the result's meta holds the provenance and the mean KL per layer of both lenses there."""
    if tokens < 2:
        raise ObservatoryError(f"--tokens must be at least 2, got {tokens}")
    say = say or (lambda _msg: None)
    t0 = time.perf_counter()
    heldout_tokens = max(2, min(8192, tokens // 4))
    data = corpus_sequences(model, tokenizer, tokens, heldout_tokens, text=text, seed=seed)
    if not data["train"] or not data["heldout"]:
        raise ObservatoryError(f"no usable text in {data['source']}")
    train_stream = capture(model, data["train"])
    held = capture(model, data["heldout"])
    say(f"captured {train_stream.shape[1]:,} training and {held.shape[1]:,} held-out tokens' streams "
        f"({time.perf_counter() - t0:.1f} s); fitting {model.config.num_layers} translators, {steps} steps "
        f"of {min(batch, train_stream.shape[1])} positions")
    t1 = time.perf_counter()
    lens, losses = fit(model, train_stream, steps, batch=batch, lr=lr, seed=seed, on_step=on_step)
    fit_s = time.perf_counter() - t1
    logit_kl, tuned_kl = layer_kl(model, held), layer_kl(model, held, lens)
    from .. import __version__
    from ..model.loading import bundled_model_dir
    where = Path(getattr(model, "model_dir", "") or ".")
    lens.meta = {
        "model": {"name": where.name,
                  # the bundled model's directory differs on every install: named, not located
                  "path": "bundled" if where.resolve() == bundled_model_dir().resolve() else str(where),
                  "dtype": str(model.embed.weight.dtype).removeprefix("torch."),
                  "fingerprint": fingerprint(model)},
        "layers": "translator l reads x_l (x_0 = the first block's input, x_l = block l-1's output), l = 0..L-1; "
                  "x_L needs none",
        "objective": "KL(final layer || final_norm + LM head of W_l x_l + b_l), mean over positions, summed over layers",
        "corpus": {"source": data["source"], "note": data["note"], "train_tokens": int(train_stream.shape[1]),
                   "heldout_tokens": int(held.shape[1]), "seq_len": max(len(s) for s in data["train"])},
        "fit": {"steps": steps, "batch": min(batch, int(train_stream.shape[1])), "optimizer": "Adam",
                "lr": lr, "schedule": f"linear warm-up ({min(WARMUP, max(1, steps // 10))} steps), cosine to 0",
                "seed": seed, "first_loss": losses[0], "last_loss": losses[-1], "seconds": round(fit_s, 1)},
        "heldout_kl": {"logit_lens": logit_kl, "tuned_lens": tuned_kl},
        "sluice_version": __version__,
    }
    return lens
