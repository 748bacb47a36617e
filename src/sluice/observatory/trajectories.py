"""The logit lens and the tuned lens side by side, and a target token's trajectory through both.

    from sluice.observatory.trajectories import lens_views
    views = lens_views(model, ids, target=42, tuned=tuned_lens.load(path, model))
    views.lenses["tuned"].target_rank   # (L+1, B, T): 1 = the most likely token at that layer
    views.lenses["logit"].kl            # (L+1, B, T): KL(final || layer l), nats

One forward keeps x_0..x_L (lens.capture_stream: the same x_0 as the logit lens and observe()); each
layer's stream is then read through each lens ("logit": final norm + LM head; "tuned": the layer's
translator first, tuned_lens.py), a chunk of positions at a time, so one chunk's logits are all that
exist at once. Per layer, position and lens: KL(final || lens), entropy, top-1 token and its
probability, and the target's rank and probability.

Rank = 1 + the number of vocabulary entries with a strictly larger logit (ties share the better
rank), from the same fp32 logits the probabilities come from (after any final soft-cap). The
target: a token id for every position, a (B, T) tensor of ids, or None for the model's own top-1
prediction at each position (where its rank at layer L is 1 by definition).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ObservatoryError
from .attribution import target_ids
from .lens import capture_stream, head_logits
from .tuned_lens import TunedLens, find, load

CHUNK_LOGITS = 16 << 20  # logits per chunk of positions (64 MiB fp32), as the logit lens


@dataclass
class LensView:
    """One lens read at every layer: tensors (L+1, B, T); row l = x_l, row L = the model's output."""

    kl: torch.Tensor  # fp32, KL(final || this lens at layer l), nats
    entropy: torch.Tensor  # fp32, nats
    top1_id: torch.Tensor  # int64
    top1_prob: torch.Tensor  # fp32
    target_rank: torch.Tensor  # int64, 1 = the most likely token
    target_prob: torch.Tensor  # fp32


@dataclass
class LensViews:
    lenses: dict[str, LensView]  # "logit", and "tuned" when a tuned lens was given
    target: torch.Tensor  # (B, T) int64, the token followed at each position
    predicted: torch.Tensor  # (B, T) int64, the model's own top-1 prediction


def _read(logits: torch.Tensor, logp_final: torch.Tensor, target: torch.Tensor) -> tuple:
    """(rows, V) fp32 logits of one lens at one layer -> kl, entropy, top-1 id and prob, target rank, prob."""
    logp = logits.log_softmax(-1)
    p = logp.exp()
    kl = (logp_final.exp() * (logp_final - logp)).sum(-1)
    entropy = torch.special.entr(p).sum(-1)
    top = logp.max(-1)
    own = logits.gather(-1, target[:, None])  # (rows, 1)
    rank = (logits > own).sum(-1) + 1
    return kl, entropy, top.indices, top.values.exp(), rank, logp.gather(-1, target[:, None])[:, 0].exp()


def lens_views(model, ids: torch.Tensor, target=None, tuned: TunedLens | None = None) -> LensViews:
    """Both lenses (the tuned one when given) at every layer and position of ids (B, T); see the module doc."""
    if getattr(model, "world", 1) > 1:
        raise ObservatoryError("the lens views and target trajectories are not implemented under tensor "
                               "parallelism (--tp): run them on one process")
    if ids.ndim != 2:
        raise ObservatoryError(f"lens_views takes token ids of shape (B, T), got {tuple(ids.shape)}")
    cfg = model.config
    L, C, V = cfg.num_layers, cfg.hidden_size, cfg.vocab_size
    if tuned is not None and (tuned.num_layers != L or tuned.weight.shape[-1] != C):
        raise ObservatoryError(f"the tuned lens has {tuned.num_layers} translators of width {tuned.weight.shape[-1]}; "
                               f"this model needs {L} of width {C}")
    B, T = ids.shape
    w = model.embed.weight
    stream = torch.empty(L + 1, B, T, C, dtype=w.dtype, device=w.device)
    with torch.inference_mode():
        final = capture_stream(model, ids.to(w.device), stream)  # (B, T, V)
    predicted = final.argmax(-1).cpu()
    goal = target_ids(target, (B, T), predicted)
    if goal.min() < 0 or goal.max() >= V:
        raise ObservatoryError(f"target token ids must lie in [0, {V}), got {int(goal.min())}..{int(goal.max())}")
    names = ["logit", *(["tuned"] if tuned is not None else [])]
    out = {name: [torch.empty(L + 1, B * T, dtype=dt) for dt in (torch.float32, torch.float32, torch.int64,
                                                                   torch.float32, torch.int64, torch.float32)]
           for name in names}
    rows, n = B * T, max(1, CHUNK_LOGITS // V)
    flat = stream.view(L + 1, rows, C)
    goal_rows = goal.reshape(rows).to(w.device)
    with torch.inference_mode():
        logp_final_all = final.reshape(rows, V)
        for a in range(0, rows, n):
            logp_final = logp_final_all[a:a + n].log_softmax(-1)
            for l in range(L + 1):
                for name in names:
                    x = flat[l, a:a + n] if name == "logit" else tuned.translate(l, flat[l, a:a + n])
                    for into, value in zip(out[name], _read(head_logits(model, x), logp_final, goal_rows[a:a + n])):
                        into[l, a:a + n] = value.cpu()
    shaped = {name: LensView(*(t.view(L + 1, B, T) for t in tensors)) for name, tensors in out.items()}
    return LensViews(lenses=shaped, target=goal, predicted=predicted)


def views_data(views: LensViews, text, chosen: bool, tuned: TunedLens | None) -> dict:
    """What `sluice inspect` keeps (batch row 0): per lens and layer the mean KL to the final layer, and
    per layer and position the KL, top-1 and the target's rank and probability. text: id -> its text;
    chosen: whether the target was given (else each position's own top-1 prediction)."""
    ids = views.target[0].tolist()
    lenses = {}
    for name, v in views.lenses.items():
        top = v.top1_id[:, 0].tolist()
        lenses[name] = {"mean_kl": v.kl[:, 0].mean(-1).tolist(), "kl_to_final": v.kl[:, 0].tolist(),
                        "entropy": v.entropy[:, 0].tolist(), "top1_id": top,
                        "top1_token": [[text(i) for i in row] for row in top],
                        "top1_prob": v.top1_prob[:, 0].tolist(),
                        "target_rank": v.target_rank[:, 0].tolist(), "target_prob": v.target_prob[:, 0].tolist()}
    data = {"lenses": lenses,
            "target": {"chosen": chosen, "ids": ids, "tokens": [text(i) for i in ids],
                       "what": "given" if chosen else "the model's top-1 prediction at each position"},
            "rank_definition": "1 + the number of vocabulary entries with a larger logit at that layer (1 = top)",
            "layers": "row l reads x_l: x_0 the first block's input, x_l block l-1's output, x_L the model's output"}
    if tuned is not None:
        meta = tuned.meta
        data["tuned_lens"] = {"source": meta.get("source"), "corpus": meta.get("corpus", {}).get("source"),
                              "fit": meta.get("fit"), "heldout_kl": meta.get("heldout_kl")}
    return data


def add_views(data: dict, model, ids: torch.Tensor, text, target, tuned_lens) -> None:
    """inspect's step: data["lens_views"] when there is a tuned lens (given, or saved beside the model;
    tuned_lens=False: none) or a target to follow; nothing otherwise."""
    if tuned_lens is None and getattr(model, "world", 1) == 1:
        found = find(model)
        tuned_lens = load(found, model) if found is not None else None
    elif tuned_lens is not None and tuned_lens is not False and not isinstance(tuned_lens, TunedLens):
        tuned_lens = load(tuned_lens, model)
    tuned = tuned_lens or None
    if tuned is None and target is None:
        return
    views = lens_views(model, ids, target=target, tuned=tuned)
    data["lens_views"] = views_data(views, text, target is not None, tuned)
