"""`sluice train`: pretrain a Qwen3-architecture model on sluice's own model code.

Run directory layout:
  data/      tokenizer.json, train.npy, heldout.npy, data.json   (made once, reused on --resume)
  state/     resume.safetensors (weights, AdamW moments; step, history and recipe in its metadata)
  model/     the exported Hugging Face checkpoint (sluice and transformers both load it)
  log.jsonl  one line per logged step; at evaluations also held-out loss and the valve summary

Batches are a pure function of (seed, step), and the optimizer state is saved exactly, so a run
resumed from a checkpoint follows the same loss curve as one that never stopped. Nothing here
trusts the recipe's sizes (budget.py checks them against free memory before any allocation) or
the loss (the first non-finite one stops the run before it reaches the weights or a checkpoint).
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer as HFTokenizer

from ..errors import SluiceError
from ..model.config import ModelConfig
from ..model.layers import Transformer
from . import budget
from .corpus import token_byte_lengths
from .data import load_data, prepare_data
from .export import export_hf
from .recipe import Recipe
from .state import STATE_FILE, load_state, save_state


class TrainingError(SluiceError):
    """Training cannot go on: the loss diverged, the run directory is unusable, the disk is full."""


def model_config(recipe: Recipe, vocab_size: int, sep_id: int) -> ModelConfig:
    m = recipe.model
    return ModelConfig(vocab_size=vocab_size, hidden_size=m.hidden_size,
                       intermediate_size=m.intermediate_size, num_layers=m.num_layers,
                       num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                       max_position_embeddings=m.max_position_embeddings, norm_eps=m.norm_eps,
                       qk_norm="head", tie_word_embeddings=m.tie_word_embeddings,
                       rope_theta=m.rope_theta, architecture="Qwen3ForCausalLM",
                       torch_dtype="bfloat16", bos_token_id=None, eos_token_id=sep_id)


def lr_at(step: int, t) -> float:
    """Linear warmup from lr / warmup_steps at step 0 to lr, then a cosine from lr down to
    min_lr_ratio * lr, which it reaches at step `steps`, one past the last step trained (kept so:
    the bundled model was trained with exactly this schedule)."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def batch(tokens: np.ndarray, t, step: int, micro: int):
    rng = np.random.default_rng([t.seed, step, micro])
    starts = rng.integers(0, tokens.size - t.seq_len - 1, size=t.micro_batch)
    window = torch.from_numpy(np.stack([tokens[s:s + t.seq_len + 1] for s in starts]).astype(np.int64))
    return window[:, :-1], window[:, 1:]


@torch.no_grad()
def evaluate(model, tokens: np.ndarray, byte_len: np.ndarray, seq_len: int, max_tokens: int,
             autocast: bool, batch_size: int = 8) -> dict:
    """Mean loss and bits per byte on non-overlapping windows of the held-out stream."""
    n = min(tokens.size - 1, max_tokens) // seq_len
    nats, nbytes, count = 0.0, 0, 0
    was_training = model.training
    model.eval()
    for i in range(0, n, batch_size):
        idx = np.arange(i, min(i + batch_size, n))[:, None] * seq_len + np.arange(seq_len + 1)
        window = torch.from_numpy(tokens[idx].astype(np.int64))
        x, y = window[:, :-1], window[:, 1:]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
        nats += loss.item()
        nbytes += int(byte_len[y.numpy()].sum())
        count += y.numel()
    model.train(was_training)
    if not count:  # a loss of 0.0 over nothing would read as a perfect model
        raise TrainingError(f"evaluation measured nothing: {tokens.size} held-out tokens, max_tokens "
                            f"{max_tokens}, fewer than one window of seq_len + 1 = {seq_len + 1}")
    return {"loss": nats / max(count, 1), "bpb": nats / math.log(2) / max(nbytes, 1),
            "tokens": count, "bytes": nbytes}


def run(recipe: Recipe, out_dir: str | Path, resume: bool = False, stop_at: int | None = None,
        log=None, progress: bool | None = None, valves: Callable | None = None) -> dict:
    """Train per `recipe` into `out_dir`; returns the summary also written to summary.json.

    valves: what to record as "valves" in the log at each evaluation, a function (eager model, held-out
    ids (1, T), bf16 autocast) -> dict; `sluice train` hands in observatory.training.valve_summary, so
    training itself never imports the observatory. None records nothing."""
    try:
        return _run(recipe, Path(out_dir), resume, stop_at, log, progress, valves)
    except OSError as e:  # a full disk or a vanished directory mid-run: say which file, not a traceback
        raise TrainingError(f"training into {out_dir} failed on {e.filename or 'a file'}: "
                            f"{e.strerror or e}") from None


def check_out_dir(out: Path, resume: bool) -> None:
    """--out must be (or become) a writable directory, checked before any time is spent."""
    state = out / "state"
    if out.exists() and not out.is_dir():
        raise TrainingError(f"--out {out} is a file, not a directory")
    if resume and not (state / STATE_FILE).is_file():
        raise TrainingError(f"--resume: no checkpoint in {state} to resume from")
    if not resume and state.exists():
        raise TrainingError(f"{out} already holds a run; pass --resume to continue it or pick a new --out")
    for sub in ("data", "state", "model"):
        if (out / sub).exists() and not (out / sub).is_dir():
            raise TrainingError(f"--out {out}: {out / sub} is a file where the run keeps a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out).close()
    except OSError as e:
        raise TrainingError(f"--out {out} is not a writable directory: {e.strerror or e}") from None


def bf16_autocast(setting: bool | str, flags: set[str] | None = None) -> bool:
    """The recipe's train.autocast_bf16 for this machine: "auto" means bf16 autocast where the CPU
    has bf16 matrix instructions (AVX-512 bf16 or AMX). Measured with bench/train_speed.py on the
    bundled shape: 1.9x the fp32 step on a 2-core Xeon with AMX (3,916 vs 2,097 tokens/s), and 23x
    slower than fp32 on a 2-core AVX2-only EPYC, where bf16 matmuls are emulated."""
    if setting != "auto":
        return bool(setting)
    from ..engine.native import cpu_flags
    return bool((cpu_flags() if flags is None else flags) & {"avx512_bf16", "amx_bf16"})


def _run(recipe: Recipe, out: Path, resume: bool, stop_at: int | None, log, progress, valves) -> dict:
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if stop_at is not None and (isinstance(stop_at, bool) or not isinstance(stop_at, int) or stop_at < 1):
        raise TrainingError(f"--stop-at must be a step >= 1, got {stop_at!r}")
    t = recipe.train
    # Sized with the recipe's vocab_size, the most the tokenizer can have: before any allocation.
    upper = model_config(recipe, recipe.tokenizer.vocab_size, 0)
    budget.check(budget.training_bytes(recipe, upper.num_params),
                 f"{recipe.path}: training {upper.num_params:,} parameters on train.micro_batch "
                 f"{t.micro_batch} x train.seq_len {t.seq_len} tokens",
                 "lower train.micro_batch or train.seq_len (raise train.grad_accum to keep the batch), "
                 "or the model's sizes")
    check_out_dir(out, resume)
    bf16 = bf16_autocast(t.autocast_bf16)
    if t.autocast_bf16 == "auto":
        log(f"bf16 autocast: {'on' if bf16 else 'off'} (auto: the CPU {'has' if bf16 else 'lacks'} AVX-512 bf16 / AMX)")
    state_dir = out / "state"
    meta = prepare_data(recipe, out / "data", log)
    train_ids, held_ids, tok = load_data(recipe, out / "data", meta)
    byte_len = token_byte_lengths(tok)
    # The window whose valves are recorded at each evaluation: fixed, so the series compare.
    probe = torch.from_numpy(held_ids[:t.seq_len].astype(np.int64))[None]  # (1, T)

    cfg = model_config(recipe, meta["vocab_size"], meta["sep_id"])
    torch.manual_seed(t.seed)
    model = Transformer(cfg)
    model.init_weights(t.init_std, torch.Generator().manual_seed(t.seed))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=t.lr, betas=tuple(t.betas), fused=True)
    start, history = (load_state(state_dir, model, opt, recipe) if resume else (0, []))
    if resume:
        log(f"resumed at step {start} from {state_dir}")
        _trim_log(out / "log.jsonl", start)
    step_fn = torch.compile(model) if t.compile else model
    model.train()
    log_file = (out / "log.jsonl").open("a")
    tokens_per_step = t.seq_len * t.micro_batch * t.grad_accum
    last = stop_at if stop_at is not None else t.steps
    deadline = time.time() + 60 * t.max_minutes if t.max_minutes else math.inf
    bar = _Progress(last - start, enabled=sys.stderr.isatty() if progress is None else progress)
    t_run = time.perf_counter()
    step = start
    try:
        while step < min(last, t.steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, t)
            total = 0.0
            for micro in range(t.grad_accum):
                x, y = batch(train_ids, t, step, micro)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    logits = step_fn(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)) / t.grad_accum
                loss.backward()
                total += loss.item()  # the loop syncs here anyway (for the log): checking it is free
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip).item()
            if not (math.isfinite(total) and math.isfinite(gnorm)):  # before it reaches the weights
                raise TrainingError(_diverged(step + 1, f"loss {total}, gradient norm {gnorm}", t, state_dir))
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            elapsed = time.perf_counter() - t_run
            rate = (step - start) * tokens_per_step / elapsed
            history.append(round(total, 6))
            rec = {"step": step, "loss": total, "lr": lr_at(step - 1, t), "grad_norm": gnorm,
                   "tok_s": rate, "elapsed": elapsed}
            bar.update(step, total, rate, (min(last, t.steps) - step) * tokens_per_step / max(rate, 1e-9))
            if step % t.eval_every == 0 or step == t.steps:
                ev = evaluate(model, held_ids, byte_len, t.seq_len, t.eval_tokens, bf16)
                if not math.isfinite(ev["loss"]):
                    raise TrainingError(_diverged(step, f"held-out loss {ev['loss']}", t, state_dir))
                rec.update(heldout_loss=ev["loss"], heldout_bpb=ev["bpb"])
                if valves is not None and probe.numel():  # the eager model, not step_fn (recompiles)
                    rec["valves"] = valves(model, probe, bf16)
                bar.note(f"step {step}: train loss {total:.3f}, held-out loss {ev['loss']:.3f}, "
                         f"{ev['bpb']:.3f} bits/byte", log)
            log_file.write(json.dumps(rec) + "\n")
            log_file.flush()
            if not bar.enabled and step % 10 == 0:
                log(f"step {step}/{t.steps} loss {total:.4f} {rate:,.0f} tok/s")
            if step % t.checkpoint_every == 0:
                _check_finite(model, step, t, state_dir)
                save_state(state_dir, model, opt, step, history, recipe)
            if time.time() > deadline:
                log(f"max_minutes={t.max_minutes} reached at step {step}: stopping and exporting")
                break
    finally:  # a divergence still leaves the log complete up to its last step
        bar.close()
        log_file.close()
    _check_finite(model, step, t, state_dir)
    save_state(state_dir, model, opt, step, history, recipe)
    summary = {"step": step, "steps_planned": t.steps, "autocast_bf16": bf16, "tokens_seen": step * tokens_per_step,
               "train_seconds_this_session": round(time.perf_counter() - t_run, 1),
               "tokens_per_second": round((step - start) * tokens_per_step
                                          / max(time.perf_counter() - t_run, 1e-9), 1),
               "final_train_loss": history[-1] if history else None,
               "params": cfg.num_params, "data": meta}
    if step >= t.steps or stop_at is None:
        export_hf(model, cfg, out / "model", out / "data" / "tokenizer.json", recipe)
        summary["export"] = str(out / "model")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if "export" in summary:
        write_card(out, t.seq_len)
    return summary


def _diverged(step: int, what: str, t, state_dir: Path) -> str:
    return (f"training diverged at step {step}: {what} (train.lr {t.lr}, lr at this step "
            f"{lr_at(step - 1, t):.3g}, train.grad_clip {t.grad_clip}, train.init_std {t.init_std}); "
            f"nothing was exported and {state_dir} keeps the last finite checkpoint. "
            f"Lower train.lr or train.init_std, or lengthen train.warmup_steps")


def _trim_log(path: Path, start: int) -> None:
    """Drop the log lines past the resumed step (steps done again after a crash, or a line cut off
    mid-write), so log.jsonl has each step once, as a run that never stopped."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= start:
            keep.append(line + "\n")
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(keep))
    tmp.replace(path)


def _check_finite(model, step: int, t, state_dir: Path) -> None:
    """Weights go to a checkpoint or an export only if finite: one host sync per save, not per step."""
    if not torch.stack([p.isfinite().all() for p in model.parameters()]).all():
        raise TrainingError(_diverged(step, "the weights hold NaN or infinite values", t, state_dir))


def write_card(out: Path, seq_len: int) -> dict:
    """Evaluate the *exported* checkpoint (the weights that ship) on the whole held-out split and
    write model/training.json: size, tokens, time, losses, bits per byte next to gzip and xz."""
    from ..model.loading import load
    out = Path(out)
    summary = json.loads((out / "summary.json").read_text())
    data = summary["data"]
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    tok = HFTokenizer.from_file(str(out / "data" / "tokenizer.json"))
    model = load(out / "model", "float32")
    held = np.load(out / "data" / "heldout.npy")
    ev = evaluate(model, held, token_byte_lengths(tok), seq_len, held.size, autocast=False)
    wall, prev = 0.0, 0.0
    for r in rows:  # "elapsed" restarts at 0 in each resumed session: add up the sessions
        if r["elapsed"] < prev:
            wall += prev
        prev = r["elapsed"]
    card = {"params": model.config.num_params, "steps": summary["step"],
            "tokens_seen": summary["tokens_seen"], "train_wall_seconds": round(wall + prev, 3),
            "tokenizer_and_data_seconds": data.get("tokenizer_seconds"),
            "final_train_loss": rows[-1]["loss"] if rows else None,
            "heldout": ev, "baselines": data.get("baselines", {}),
            "corpus": {k: data[k] for k in ("train_files", "heldout_files", "train_bytes",
                                            "heldout_bytes", "train_tokens", "heldout_tokens")}}
    (out / "model" / "training.json").write_text(json.dumps(card, indent=1) + "\n")
    return card


class _Progress:
    """rich progress bar on a terminal; nothing (plain log lines instead) in a pipe or file."""

    def __init__(self, total: int, enabled: bool):
        self.enabled = enabled
        if enabled:
            from rich.progress import BarColumn, Progress, TextColumn
            self.p = Progress(TextColumn("train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                              TextColumn("{task.fields[info]}"))
            self.task = self.p.add_task("train", total=total, info="")
            self.p.start()

    def update(self, step, loss, rate, eta_s):
        if self.enabled:
            self.p.update(self.task, advance=1,
                          info=f"loss {loss:.3f} | {rate:,.0f} tok/s | ETA {eta_s / 60:.1f} min")

    def note(self, msg, log):
        (self.p.console.print if self.enabled else log)(msg)

    def close(self):
        if self.enabled:
            self.p.stop()
