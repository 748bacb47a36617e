"""The tuned lens (Belrose et al. 2023): a learned affine translator per layer in front of the logit lens.

The logit lens (lens.py) reads x_l through the final norm and the LM head as if x_l were already
in the last layer's basis. It is not: early layers keep features in directions the head reads
differently, so the logit lens of an early layer says little, and its KL to the final layer mostly
measures that change of basis. The tuned lens first maps x_l into the final layer's basis with a
translator x -> W_l x + b_l, fitted (tuned_lens_fit.py) to minimise KL(final || lens) on a corpus;
what is left of the KL is what layer l really does not know yet.

Layer convention as in lens.py: translator l reads x_l, where x_0 is the first block's input and
x_l the output of block l-1. There are L translators, for x_0..x_{L-1}; x_L needs none (its lens is
the model's own output). A translator starts as the identity (W = I, b = 0): the logit lens.

On disk, beside the model (or wherever `sluice lens train --out` put it): tuned_lens.safetensors
holds "weight" (L, C, C) and "bias" (L, C) in fp32, and tuned_lens.json the provenance: the model
it was fitted to (with a fingerprint of its final norm and LM head), the corpus, the settings and
the held-out KL per layer. `load()` refuses a file whose shapes or model do not match.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import ObservatoryError

FILE, META = "tuned_lens.safetensors", "tuned_lens.json"
SCHEMA = "sluice.tuned_lens/1"
# A fingerprint: this many LM-head rows (evenly spaced over the vocabulary), their first this many
# channels, and the final norm's first gains. Compared by relative distance, so the same model
# loaded in another dtype (or int8) still matches while another model (distance ~1.4) does not.
SAMPLE_ROWS, SAMPLE_COLS, MATCH_TOLERANCE = 16, 8, 0.1


@dataclass
class TunedLens:
    """L translators: translator l maps x_l (..., C) to x_l @ weight[l].T + bias[l]."""

    weight: torch.Tensor  # (L, C, C) fp32
    bias: torch.Tensor  # (L, C) fp32
    meta: dict = field(default_factory=dict)  # provenance (tuned_lens.json), "source": where it was read

    @classmethod
    def identity(cls, num_layers: int, hidden_size: int) -> TunedLens:
        eye = torch.eye(hidden_size).expand(num_layers, hidden_size, hidden_size).clone()
        return cls(eye, torch.zeros(num_layers, hidden_size))

    @property
    def num_layers(self) -> int:
        return self.weight.shape[0]

    def translate(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """x_l (..., C) -> the translated stream, fp32; x_L (layer == L) comes back unchanged."""
        if layer == self.num_layers:
            return x.float()
        w, b = self.weight[layer].to(x.device), self.bias[layer].to(x.device)
        return torch.addmm(b, x.float().reshape(-1, w.shape[0]), w.T).reshape(*x.shape[:-1], w.shape[0])

    def save(self, out_dir) -> tuple[Path, Path]:
        """Write tuned_lens.safetensors and tuned_lens.json into out_dir; return both paths."""
        out = Path(out_dir)
        try:
            out.mkdir(parents=True, exist_ok=True)
            tensors, meta = out / FILE, out / META
            save_file({"weight": self.weight.detach().float().contiguous(),
                       "bias": self.bias.detach().float().contiguous()}, tensors,
                      metadata={"schema": SCHEMA})
            keep = {k: v for k, v in self.meta.items() if k != "source"}
            meta.write_text(json.dumps({"schema": SCHEMA, **keep}, indent=1) + "\n", encoding="utf-8")
        except OSError as e:
            raise ObservatoryError(f"cannot write the tuned lens into {out}: {e.strerror or e} "
                                   "(pass --out DIR to write it elsewhere)") from e
        return tensors, meta


def fingerprint(model) -> dict:
    """What identifies the model a tuned lens belongs to: its shape and a sample of the weights the
    lens reads through (final norm and LM head)."""
    cfg = model.config
    head = model.lm_head
    weight = head.weight if isinstance(head, torch.nn.Linear) else head.dequantize()
    rows = torch.linspace(0, weight.shape[0] - 1, SAMPLE_ROWS).round().long()
    sample = weight.detach()[rows.to(weight.device), :SAMPLE_COLS].float().cpu().flatten()
    norm = model.final_norm
    gains = norm.gain().detach().float().cpu()[:SAMPLE_ROWS] if norm is not None else torch.ones(0)
    return {"architecture": cfg.architecture, "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size, "weights": [*sample.tolist(), *gains.tolist()]}


def _distance(a: list[float], b: list[float]) -> float:
    ta, tb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    if ta.shape != tb.shape:
        return math.inf
    return float((ta - tb).norm() / tb.norm().clamp_min(1e-30))


def resolve(path) -> Path:
    """A directory holding tuned_lens.safetensors, or the file itself -> the file."""
    p = Path(path)
    p = p / FILE if p.is_dir() else p
    if not p.is_file():
        raise ObservatoryError(f"no tuned lens at {path}: expected {FILE} (written by `sluice lens train`) "
                               "or a directory holding it")
    return p


def find(model) -> Path | None:
    """The tuned lens saved beside the model's weights, if there is one."""
    model_dir = getattr(model, "model_dir", None)
    p = Path(model_dir) / FILE if model_dir else None
    return p if p is not None and p.is_file() else None


def load(path, model) -> TunedLens:
    """Read a tuned lens and check it against `model`: the shapes, then the fingerprint of the final
    norm and LM head recorded when it was fitted. Anything else is refused with the reason."""
    file = resolve(path)
    try:
        tensors = load_file(file)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types for a corrupt file
        raise ObservatoryError(f"{file} is not a readable safetensors file: {e}") from None
    weight, bias = tensors.get("weight"), tensors.get("bias")
    cfg = model.config
    L, C = cfg.num_layers, cfg.hidden_size
    if weight is None or bias is None:
        raise ObservatoryError(f"{file} holds {sorted(tensors)}, not the tensors 'weight' and 'bias' of a tuned lens")
    if tuple(weight.shape) != (L, C, C) or tuple(bias.shape) != (L, C):
        raise ObservatoryError(f"{file} has translators of shape weight {tuple(weight.shape)}, bias "
                               f"{tuple(bias.shape)}; this model ({L} layers, hidden {C}) needs ({L}, {C}, {C}) "
                               f"and ({L}, {C}): it was fitted to another model")
    meta_path = file.with_name(META)
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ObservatoryError(f"{meta_path} (the provenance of {file.name}) is missing or not JSON: {e}") from None
    recorded = meta.get("model", {}).get("fingerprint")
    if not isinstance(recorded, dict):
        raise ObservatoryError(f"{meta_path} records no model fingerprint: refit with `sluice lens train`")
    mine = fingerprint(model)
    for key in ("architecture", "num_layers", "hidden_size", "vocab_size"):
        if recorded.get(key) != mine[key]:
            raise ObservatoryError(f"{file} was fitted to a model with {key} = {recorded.get(key)!r}; this one "
                                   f"has {mine[key]!r}")
    far = _distance(mine["weights"], recorded.get("weights", []))
    if not far <= MATCH_TOLERANCE:
        raise ObservatoryError(
            f"{file} was fitted to another model: the final norm and LM head differ from the ones it "
            f"recorded (relative distance {far:.2g} > {MATCH_TOLERANCE}; fitted to "
            f"{meta.get('model', {}).get('path', '?')}): refit it with `sluice lens train`")
    return TunedLens(weight.float(), bias.float(), {**meta, "source": str(file)})
