"""Prompts of different lengths in one forward: right padding and the mask that says which tokens are real.

Right padding needs nothing from the model: with positions 0..T-1 and a causal mask, a real token
at position t attends only to positions <= t, which are all real, so its every activation is the
one a forward of that prompt alone computes (up to the float reassociation a different batch size
may bring). Left padding would shift positions and need a padding mask inside attention, so it is
refused rather than silently measured wrong.

The observatory then leaves the pad positions out of every statistic: per-position tensors hold NaN
there (-1 for ids and channel indices), and every mean, maximum or search runs over real tokens only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import ObservatoryError


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists -> (ids (B, T) int64 right-padded with pad_id, mask (B, T) bool, True = real)."""
    rows = [list(p) for p in prompts]
    if not rows or any(len(r) == 0 for r in rows):
        raise ObservatoryError(f"pad_prompts needs one or more non-empty prompts, got lengths "
                               f"{[len(r) for r in rows]}")
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[b, :len(r)] = True
    return ids, mask


def check_mask(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The attention mask as a (B, T) bool tensor on the CPU, after checking it fits ids and is a
    right padding (each row some real tokens, then only pads)."""
    if ids.ndim != 2:
        raise ObservatoryError(f"a padded batch takes token ids of shape (B, T), got {tuple(ids.shape)}")
    mask = torch.as_tensor(mask).cpu()
    if mask.shape != ids.shape:
        raise ObservatoryError(f"attention_mask has shape {tuple(mask.shape)}, the ids {tuple(ids.shape)}")
    if mask.dtype != torch.bool:
        if ((mask != 0) & (mask != 1)).any():
            raise ObservatoryError("attention_mask must hold only 0/1 (or False/True)")
        mask = mask.bool()
    lengths = mask.sum(1)
    if (lengths == 0).any():
        raise ObservatoryError(f"attention_mask rows {(lengths == 0).nonzero()[:, 0].tolist()} have no real token")
    prefix = torch.arange(mask.shape[1]) < lengths[:, None]  # what a right padding of these lengths is
    if not torch.equal(mask, prefix):
        bad = (mask != prefix).any(1).nonzero()[:, 0].tolist()
        raise ObservatoryError(f"attention_mask rows {bad} are not right-padded (real tokens first, then "
                               "pads): left padding would shift positions; pad on the right (pad_prompts)")
    return mask


def blank_padding(stats: dict[str, torch.Tensor], mask: torch.Tensor, logits_len: int) -> None:
    """In place: NaN (floats) or -1 (ids, channels) at the pad positions of every per-position
    statistic; the logits rows too when they cover every position."""
    pad = ~mask  # (B, T)
    for name, t in stats.items():
        if name in ("logits", "top1_id"):
            if logits_len != mask.shape[1]:
                continue  # only the last position's logits: nothing there is a pad
        if name == "nonfinite":
            t[..., pad] = 0
        elif name.startswith("resid_top"):  # (L+1, B, T, k)
            t[:, pad] = -1 if name.endswith("channels") else float("nan")
        else:
            t[..., pad] = -1 if not t.is_floating_point() else float("nan")


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean over the last two dims (B, T) of x, real tokens only."""
    return x.mean((-2, -1)) if mask is None else x[..., mask].mean(-1)
