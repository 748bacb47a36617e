"""The resume state of a run: one safetensors file, written atomically, checked fully when read.

state/resume.safetensors holds the weights, AdamW's moments and, in its metadata, the step, the
loss history and the recipe that made it. One file is one unit: it is written beside the old one,
fsync'd and renamed over it, so a crash mid-write leaves the previous state, never half of one.
Reading never unpickles (safetensors has no code in it) and refuses a state that is truncated,
from another recipe or shape, missing tensors, or not finite, naming what is wrong."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import CheckpointError

STATE_FILE = "resume.safetensors"
META_KEY = "sluice.resume"
# Recipe keys that may change between a run and its resume: they decide when to stop, log or save,
# never which batches are drawn or how the weights move.
MAY_CHANGE = {"train.max_minutes", "train.eval_every", "train.eval_tokens", "train.checkpoint_every",
              "train.compile"}


def recipe_keys(recipe) -> dict:
    d = dataclasses.asdict(recipe)
    return {f"{section}.{k}": list(v) if isinstance(v, tuple) else v
            for section, values in d.items() if isinstance(values, dict) for k, v in values.items()}


def save_state(state_dir: Path, model, opt, step: int, history: list, recipe) -> Path:
    state_dir.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.{k}": v.detach().contiguous() for k, v in model.state_dict().items()
               if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            for k, v in opt.state.get(p, {}).items():
                if k != "step":
                    tensors[f"opt.{names[id(p)]}.{k}"] = v.contiguous()
    adam_step = next((float(s["step"]) for s in opt.state.values()), 0.0)
    meta = {"step": step, "adam_step": adam_step, "history": history, "recipe": recipe_keys(recipe)}
    final = state_dir / STATE_FILE
    tmp = state_dir / f".{STATE_FILE}.{os.getpid()}.tmp"
    try:
        save_file(tensors, str(tmp), metadata={"format": "pt", META_KEY: json.dumps(meta)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fd = os.open(state_dir, os.O_RDONLY)  # make the rename itself durable
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"cannot write the resume state {final}: {e.strerror or e}") from None
    return final


def load_state(state_dir: Path, model, opt, recipe) -> tuple[int, list]:
    path = state_dir / STATE_FILE
    try:
        with safe_open(str(path), framework="pt") as f:
            raw_meta = (f.metadata() or {}).get(META_KEY)
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error type for a truncated or foreign file
        raise CheckpointError(f"--resume: {path} is not a readable sluice resume state ({e}); "
                              f"start a new run with another --out") from None
    meta = _check_meta(path, raw_meta, recipe)
    expected = {f"model.{k}": v for k, v in model.state_dict().items()
                if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    params = dict(model.named_parameters())
    if meta["adam_step"] > 0:
        for name, p in params.items():
            expected[f"opt.{name}.exp_avg"] = expected[f"opt.{name}.exp_avg_sq"] = p
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        raise CheckpointError(f"--resume: {path} does not match this recipe's model: missing "
                              f"{missing[:5]}{' ...' if len(missing) > 5 else ''}, unexpected "
                              f"{extra[:5]}{' ...' if len(extra) > 5 else ''}")
    for k, ref in expected.items():
        v = tensors[k]
        if v.shape != ref.shape or v.dtype != ref.dtype:
            raise CheckpointError(f"--resume: {path}: tensor {k} is {v.dtype} {tuple(v.shape)}, this "
                                  f"recipe's model needs {ref.dtype} {tuple(ref.shape)}")
        if not torch.isfinite(v).all():
            raise CheckpointError(f"--resume: {path}: tensor {k} holds NaN or infinite values")
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")}, strict=False)
    model.tie_weights()
    if meta["adam_step"] > 0:
        for name, p in params.items():
            opt.state[p] = {"step": torch.tensor(meta["adam_step"]),
                            "exp_avg": tensors[f"opt.{name}.exp_avg"],
                            "exp_avg_sq": tensors[f"opt.{name}.exp_avg_sq"]}
    return meta["step"], meta["history"]


def _check_meta(path: Path, raw, recipe) -> dict:
    def bad(why):
        raise CheckpointError(f"--resume: {path}: {why}")

    if raw is None:
        bad(f"no '{META_KEY}' metadata (not written by sluice train)")
    try:
        meta = json.loads(raw)
    except ValueError as e:
        bad(f"its '{META_KEY}' metadata is not JSON ({e})")
    if not isinstance(meta, dict):
        bad(f"its '{META_KEY}' metadata is not an object")
    step, adam, history = meta.get("step"), meta.get("adam_step"), meta.get("history")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= recipe.train.steps:
        bad(f"step must be an integer in [0, train.steps = {recipe.train.steps}], got {step!r}")
    if isinstance(adam, bool) or not isinstance(adam, (int, float)) or not math.isfinite(adam) or adam < 0:
        bad(f"adam_step must be a finite number >= 0, got {adam!r}")
    if (not isinstance(history, list) or len(history) != step
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in history)):
        bad(f"history must be a list of {step} losses, one per step")
    saved, now = meta.get("recipe"), recipe_keys(recipe)
    if not isinstance(saved, dict):
        bad("no recipe recorded with the state")
    differ = sorted(k for k in set(saved) | set(now) if k not in MAY_CHANGE and saved.get(k) != now.get(k))
    if differ:
        shown = "; ".join(f"{k}: state {saved.get(k)!r}, recipe {now.get(k)!r}" for k in differ[:6])
        bad(f"it was made by another recipe ({shown}); resume with the recipe of that run or pick a new --out")
    return meta
