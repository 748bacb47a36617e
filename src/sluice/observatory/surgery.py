"""Valve surgery: apply a what-if to a live model, measure it, and put everything back.

A surgery is a string `NAME[=VALUE]` (or a `Surgery`), checked against the model before anything
changes:

    final-norm=off            the LM head reads the raw x_L (the final norm is taken out)
    norm=layer | norm=rms     every RMSNorm becomes a LayerNorm with the same effective gain (Gemma's
                              1 + w included), no bias; or every LayerNorm an RMSNorm (bias dropped)
    softcap=off | VALUE       remove, change or add the final logit soft-cap
    attn-softcap=off | VALUE  the same for the attention-score soft-cap of every layer
    residual-scale=F          multiply what each branch adds to the residual stream by F (attn-scale
    attn-scale=F, mlp-scale=F and mlp-scale do one branch; given together, the factors multiply)
    softmax=naive|safe|online and softmax-dtype=float32|bfloat16|float16
                              how the *evaluation* computes the LM-head softmax (see softmax.py)

`apply(model, surgeries)` is a context manager: the model changes on entry, and on exit (also on an
error) the original modules, attributes and hooks are put back, so logits are bit-identical to
before. Modules are swapped, never edited in place, and nothing is written to disk. Branch scaling
is a forward hook registered from outside (ARCHITECTURE.md, house rule "measurement attaches from
outside"), on the module whose output is added to the stream: the post-norm where the block has one
(Gemma, OLMo 2), else the attn / mlp branch.

`compare(model, tokenizer, surgeries, text=...)` measures the model before and after (bits per
byte, logit range, entropy, softmax overflow, a greedy continuation): see surgery_eval.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import SurgeryError
from ..model.layers import Attention, LayerNorm, RMSNorm, Transformer
from .softmax import METHODS

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
SCALES = ("residual-scale", "attn-scale", "mlp-scale")
# name -> what VALUE may be (the usage line of every message)
NAMES = {"final-norm": "off", "norm": "layer|rms", "softcap": "off|VALUE>0",
         "attn-softcap": "off|VALUE>0", **{s: "F>=0" for s in SCALES},
         "softmax": "|".join(METHODS), "softmax-dtype": "float32|bfloat16|float16"}


@dataclass(frozen=True)
class Surgery:
    """One what-if: `name` from NAMES, `value` "off", a word, or a float (already checked)."""

    name: str
    value: str | float

    def __str__(self) -> str:
        v = self.value
        return f"{self.name}={v!r}" if isinstance(v, float) else f"{self.name}={v}"

    @classmethod
    def parse(cls, spec: str | Surgery) -> Surgery:
        """'NAME[=VALUE]' -> Surgery; SurgeryError naming the problem and the valid choices."""
        if isinstance(spec, Surgery):
            spec = str(spec)  # re-checked: a hand-made Surgery gets the same validation
        if not isinstance(spec, str):
            raise SurgeryError(f"a surgery is a string NAME[=VALUE], got {type(spec).__name__} {spec!r}")
        name, eq, raw = spec.strip().partition("=")
        name, raw = name.strip().lower(), raw.strip()
        usage = ", ".join(f"{n}={v}" for n, v in NAMES.items())
        if name not in NAMES:
            raise SurgeryError(f"unknown surgery {name!r} (in {spec!r}); known: {usage}")
        if not eq and name == "final-norm":
            raw = "off"  # `final-norm` alone can only mean taking it out
        if not raw:
            raise SurgeryError(f"surgery {name!r} needs a value: {name}={NAMES[name]}")
        bad = f"bad value {raw!r} for {name}: expected {name}={NAMES[name]}"
        word = raw.lower()
        if name == "final-norm":
            if word != "off":
                raise SurgeryError(bad + " (a final norm can only be taken out)")
            return cls(name, "off")
        if name in ("norm", "softmax", "softmax-dtype"):
            choices = {"norm": ("layer", "rms"), "softmax": METHODS, "softmax-dtype": tuple(DTYPES)}[name]
            if word not in choices:
                raise SurgeryError(bad)
            return cls(name, str(DTYPES[word]).removeprefix("torch.") if name == "softmax-dtype" else word)
        if name.endswith("softcap") and word in ("off", "none"):
            return cls(name, "off")
        try:
            value = float(raw)
        except ValueError:
            raise SurgeryError(bad + " (not a number)") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and name.endswith("softcap")):
            limit = "a finite number >= 0" if name in SCALES else "a finite number > 0 (or off)"
            raise SurgeryError(f"{bad}: must be {limit}")
        return cls(name, value)


def parse(surgeries: str | Surgery | Iterable[str | Surgery]) -> list[Surgery]:
    """Strings or Surgery objects -> checked Surgery list; a name given twice is refused."""
    if isinstance(surgeries, (str, Surgery)):
        surgeries = [surgeries]
    out = [Surgery.parse(s) for s in surgeries]
    names = [s.name for s in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SurgeryError(f"surgery {twice[0]!r} given more than once: give each name once")
    return out


@dataclass
class Applied:
    """What `apply` did: the surgeries, a note per change, and the evaluation's softmax settings."""

    surgeries: list[Surgery]
    notes: list[str] = field(default_factory=list)
    softmax: str = "safe"
    softmax_dtype: torch.dtype = torch.float32


def _arch(model: Transformer) -> str:
    return f"this {model.config.architecture}"


def _swap_norms(model: Transformer, to: str, undo: list, notes: list[str]) -> None:
    """Replace every norm of the other kind by one of kind `to` with the same effective gain."""
    src = RMSNorm if to == "layer" else LayerNorm
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, src)]
    if not targets:
        have = sorted({type(m).__name__ for m in model.modules() if isinstance(m, (RMSNorm, LayerNorm))})
        raise SurgeryError(f"norm={to}: {_arch(model)} has no {src.__name__} to replace "
                           f"(its norms: {', '.join(have) or 'none'}; norm_kind={model.config.norm_kind!r})")
    biased = []
    for name, old in targets:
        w = old.weight
        new = LayerNorm(w.shape[0], old.eps, bias=False) if to == "layer" else RMSNorm(w.shape[0], old.eps)
        # RMSNorm's gain is `weight` here (offset 0), LayerNorm's is `weight`: one copy of .gain()
        new.weight = nn.Parameter(old.gain().to(device=w.device, dtype=w.dtype), requires_grad=False)
        if getattr(old, "bias", None) is not None and bool(old.bias.any()):
            biased.append(float(old.bias.detach().abs().max()))
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, new)
        undo.append(lambda p=parent, a=attr, m=old: setattr(p, a, m))
    notes.append(f"norm={to}: replaced {len(targets)} {src.__name__}s by "
                 f"{'LayerNorm (no bias)' if to == 'layer' else 'RMSNorm'} with the same gains")
    if biased:
        notes.append(f"norm=rms: dropped the bias of {len(biased)} LayerNorms (largest |bias| "
                     f"{max(biased):.3g}): RMSNorm has none")


def _set_softcap(model: Transformer, s: Surgery, undo: list, notes: list[str]) -> None:
    final = s.name == "softcap"
    owners = [model] if final else [m for m in model.modules() if isinstance(m, Attention)]
    attr = "final_softcap" if final else "softcap"
    what = "final logit soft-cap" if final else "attention soft-cap"
    old = [getattr(o, attr) for o in owners]
    have = sorted({v for v in old if v is not None})
    if s.value == "off" and not have:
        raise SurgeryError(f"{s}: {_arch(model)} has no {what} ({attr}=None); nothing to remove")
    new = None if s.value == "off" else s.value
    for o, v in zip(owners, old):
        setattr(o, attr, new)
        undo.append(lambda o=o, v=v: setattr(o, attr, v))
    was = ", ".join(f"{v:g}" for v in have)
    notes.append(f"{s}: removed the {what} ({was})" if new is None else
                 f"{s}: changed the {what} from {was} to {new:g}" if have else
                 f"{s}: added a {what} of {new:g} (the model had none)")


def _scale_branches(model: Transformer, factors: dict[str, float], undo: list, notes: list[str]) -> None:
    """Forward hooks multiplying each branch's contribution (what the block adds to x) by a factor."""
    def hook(f):
        return lambda _m, _i, out: out * f
    for block in model.layers:
        for branch, post in (("attn", block.attn_post_norm), ("mlp", block.mlp_post_norm)):
            if branch in factors:
                site = post if post is not None else getattr(block, branch)
                undo.append(site.register_forward_hook(hook(factors[branch])).remove)
    where = "post-norm" if model.layers[0].attn_post_norm is not None else "branch"
    notes.append("scaled what each block adds to the residual stream: " + ", ".join(
        f"{b} x{f:g}" for b, f in factors.items()) + f" (a hook on each {where} output)")


def _refuse_sharded(model) -> None:
    if getattr(model, "world", 1) > 1:  # its before/after measures read whole logits and sample greedily
        raise SurgeryError("surgery is not implemented under tensor parallelism (a rank model holds a "
                           "shard of the logits): run it on one process, without --tp")


@contextmanager
def apply(model: Transformer, surgeries):
    """Apply `surgeries` (strings or Surgery) to `model` for the `with` block; yields an Applied.

    Everything is checked and done in order; on exit, or on any error, the changes are undone in
    reverse order, so the model is exactly what it was (same module objects, attributes, hooks)."""
    if not isinstance(model, Transformer):
        raise SurgeryError(f"surgery works on a sluice Transformer, got {type(model).__name__}")
    _refuse_sharded(model)
    done = Applied(parse(surgeries))
    undo: list = []
    factors: dict[str, float] = {}
    try:
        for s in done.surgeries:
            if s.name == "final-norm":
                if model.final_norm is None:
                    raise SurgeryError(f"{s}: {_arch(model)} has no final norm (final_norm=None)")
                old = model.final_norm
                model.final_norm = None
                undo.append(lambda old=old: setattr(model, "final_norm", old))
                done.notes.append(f"{s}: the LM head reads the raw x_L ({type(old).__name__} bypassed)")
            elif s.name == "norm":
                _swap_norms(model, s.value, undo, done.notes)
            elif s.name.endswith("softcap"):
                _set_softcap(model, s, undo, done.notes)
            elif s.name in SCALES:
                for b in (("attn", "mlp") if s.name == "residual-scale" else (s.name.split("-")[0],)):
                    factors[b] = factors.get(b, 1.0) * s.value
            elif s.name == "softmax":
                done.softmax = s.value
            else:  # softmax-dtype
                done.softmax_dtype = DTYPES[s.value]
        if factors:  # last, so the hooks sit on the modules that will actually run (after norm=...)
            _scale_branches(model, factors, undo, done.notes)
        yield done
    finally:
        for fn in reversed(undo):
            fn()


def compare(model: Transformer, tokenizer, surgeries, text: str | None = None,
            prompt: str | None = None, max_new_tokens: int = 24) -> dict:
    """The unmodified model (safe fp32 softmax) vs the model under `surgeries`, as a JSON-able dict.

    text: what bits per byte is scored on; default the held-out text of the recipe.toml beside the
    model (the bundled model has one), else the bundled model's, with a note. prompt: what the
    greedy continuations continue; default the start of the text. See surgery_eval.py."""
    from . import surgery_eval as ev
    _refuse_sharded(model)
    plan = parse(surgeries)
    inputs = ev.prepare(model, tokenizer, text, prompt, max_new_tokens)
    with apply(model, plan) as done:  # first, so a surgery that does not apply is refused at once
        after = ev.measure(model, tokenizer, inputs, done.softmax, done.softmax_dtype)
    before = ev.measure(model, tokenizer, inputs)
    return ev.report(model, inputs, done, before, after)


__all__ = ["NAMES", "Applied", "Surgery", "apply", "compare", "parse"]
