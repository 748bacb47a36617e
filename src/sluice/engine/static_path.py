"""The static one-request path of `LLM` (sluice/llm.py): speculative decoding, compile=True, the fused LM
head and batching=False run here, on the LLM's Runner (runner.py) with one fixed batch from prefill to
the last token, rather than on the continuous-batching scheduler.

One request at a time: the runner holds a single KV cache, so a second request while one runs (another
thread, a generate() inside an open stream()) is refused at once rather than waiting (LLM.static_run).
"""

from __future__ import annotations

import time
from typing import Iterator

import torch

from ..errors import NumericsError
from .fused_head import FusedHead
from .outputs import RequestOutput, Stats
from .proposers import DraftProposer, PromptLookup
from .runner import Runner
from .sampling import NONFINITE, Sampler, SamplingParams
from .speculative import Speculator
from .streaming import TextStream

# "auto" steps taken on the fused head before its fallback rate may send a batch back to the plain one.
AUTO_PROBATION = 16


def use_fused_head(model, fused_head: bool | str, params: list[SamplingParams]) -> bool:
    """Sample through the fused LM head (fused_head.py) or the plain one (logits, Sampler)?

    Hooks on the model or its LM head (the observatory) need the logits and the head module to
    run, so they always get the plain path. "auto" takes the fused path where bench/fused_head.py
    measured it faster on CPU: a batch with a sampled row that uses top-k, top-p or min-p (no
    full-vocabulary sort); greedy and plain-temperature batches keep the plain path, where the
    two are even (docs/benchmarks.md, "The softmax toll booth"). A fused "auto" batch whose
    rows keep falling back (over a quarter of them after AUTO_PROBATION steps: a model too
    flat for the candidates to prove its cuts, paying for the LM head twice) returns to the
    plain path for the rest of its steps (see decode)."""
    m = model
    if not isinstance(m.lm_head, torch.nn.Linear):  # a quantized head (model/quant.py) has no float weight
        return False
    if fused_head is False or any(mod._forward_hooks or mod._forward_pre_hooks for mod in (m, m.lm_head)):
        return False
    return fused_head is True or any(
        p.temperature > 0 and (p.top_k > 0 or p.top_p < 1 or p.min_p > 0) for p in params)


def speculator(llm, sampler: Sampler) -> Speculator:
    """The LLM's speculative decoder: its draft model or prompt lookup proposes, its runner verifies."""
    proposer = DraftProposer(llm.draft_runner) if llm.speculative == "draft" else PromptLookup()
    return Speculator(llm.runner, proposer, sampler, llm.num_speculative_tokens)


def decode(llm, outputs: list[RequestOutput], params: list[SamplingParams]) -> Iterator[tuple[int, str]]:
    """Prefill all rows together, then decode until every row has finished, on the LLM's runner (and
    its draft's, when speculating). The LLM holds itself for the generator's life (LLM.static_run).

    Yields (row, text delta) as text becomes final. One host sync per step (the sampled ids,
    needed to detokenize and check stops); the model step and the sampler have none."""
    B = len(outputs)
    model = llm.model
    sampler = Sampler(params, model.config.vocab_size, llm.device)
    for b, out in enumerate(outputs):
        sampler.add_context(b, out.prompt_token_ids)
    # Speculation verifies guesses against the target's logits, so it takes the plain head.
    spec = speculator(llm, sampler) if llm.speculative != "off" else None
    # The Sampler keeps the rows' params, streams and penalty masks, so the two paths can
    # take turns: sample() reads `fused` when called, hidden states (B, C) in, or logits (B, V).
    fused, head = spec is None and use_fused_head(model, llm.fused_head, params), FusedHead(sampler)

    def sample(x: torch.Tensor) -> torch.Tensor:
        if not fused:
            return sampler(x)
        w = model.lm_head.weight  # in engine/mixed.py's mode x is fp32 and w bf16: as the bf16 head
        return head(x.to(w.dtype), w, model.final_softcap).tokens
    streams = [TextStream(llm.tokenizer.decode, p.stop) for p in params]
    stop_ids = [set(p.stop_token_ids) | (set() if p.ignore_eos else llm.eos_token_ids) for p in params]
    stats = llm.last_stats = Stats(prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs), rows=B,
                                    speculative=llm.speculative)

    def take(b: int, tok: int) -> str:
        """Row b's next token: record it, check the stops, return the text it releases."""
        out = outputs[b]
        if tok == NONFINITE:  # the sampler found NaN or inf in this row's logits
            raise NumericsError(
                f"the model produced non-finite logits (NaN or inf) at step {len(out.token_ids)} of "
                f"prompt {b} (NaN or inf in the weights or the config?); `sluice inspect` shows "
                "the layer where it starts")
        out.token_ids.append(tok)
        stats.generated_tokens += 1
        if tok in stop_ids[b]:
            out.finish_reason = "stop"
            return streams[b].finish()
        delta = streams[b].push(tok)
        if streams[b].stopped:
            out.finish_reason = "stop"
        elif len(out.token_ids) >= params[b].max_tokens:
            out.finish_reason = "length"
            delta += streams[b].finish()
        return delta

    needed = max(len(o.prompt_token_ids) + p.max_tokens for o, p in zip(outputs, params, strict=True))
    t0 = time.perf_counter()
    active = list(range(B))
    prompts = [o.prompt_token_ids for o in outputs]
    try:
        if spec is None:
            first = llm.runner.prefill(prompts, Runner.slots_for(needed), hidden=fused)
        else:
            first = spec.prefill(prompts, Runner.slots_for(needed))
        tokens = sample(first)  # (B,): the first generated token ends the prefill
        stats.prefill_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        runs = [[t] for t in tokens.tolist()]  # per row, the tokens it gets this step (a speculative round: 1+)
        if spec is not None:
            spec.start([r[0] for r in runs])
        while True:
            for b in list(active):
                for tok in runs[b]:
                    delta = take(b, tok)
                    outputs[b].text += delta
                    done = outputs[b].finish_reason is not None
                    if done:  # a stop inside a speculative run ends the row there
                        active.remove(b)
                    if delta:
                        yield b, delta
                    if done:
                        break
            if not active:
                break
            if spec is not None:
                runs = spec.round(active)
                continue
            if fused and llm.fused_head == "auto" and head.calls >= AUTO_PROBATION and head.fallback_rate > 0.25:
                fused = False  # the candidates rarely prove this batch's cuts (a flat model): plain from here
            # A finished row may have gone non-finite; it keeps stepping (static shapes) on a real id.
            tokens = sample(llm.runner.step(tokens.clamp_min(0), hidden=fused))
            runs = [[t] for t in tokens.tolist()]
    finally:
        stats.decode_seconds = time.perf_counter() - t0
        stats.fused_head_steps, stats.fallback_rate = head.calls, head.fallback_rate
        if spec is not None:
            stats.proposed, stats.accepted = spec.proposed, spec.accepted
            stats.target_forwards, stats.row_forwards = spec.forwards, spec.row_forwards
            spec.release()
        llm.runner.release()
