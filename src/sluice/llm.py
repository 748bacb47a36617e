"""`sluice.LLM`: the Python API (vLLM-shaped). Loads model + tokenizer, runs batched generation.

Three layers, top down: generate() / stream() / chat() for a script; the door, requests(), which
checks prompts and params once and makes `Request`s (engine/requests.py); and add_request(), step()
and abort(), which the server, the CLI and a tensor-parallel follower drive the continuous-batching
engine with (generate() and stream() are written on them).
"""

from __future__ import annotations

import threading
import time
from dataclasses import fields
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from .engine.batching import DEFAULT_MAX_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, BatchEngine, EngineState, collect
from .engine.config import EngineConfig
from .engine.cpu_paths import decode_kernel_building, kernels_pay_off, set_compute, use_kernels
from .engine.guide import Guides
from .engine.kv_cache import default_budget
from .engine.outputs import RequestOutput, Stats
from .engine.requests import Door, PoolCapacity, Request, as_prompt_list
from .engine.sampling import SamplingParams
from .engine.sequence import Seq, Update
from .engine.speculative import check_draft, draft_dir
from .errors import ConfigError, ConstraintError, NumericsError, RequestError
from .model.hub import resolve_model_dir
from .model.loading import bundled_model_dir, load
from .text.tokenizer import Tokenizer


class LLM:
    def __init__(self, model: str | Path | None = None, dtype: str = "float32",
                 max_model_len: int | None = None, compile: bool = False, fused_head: bool | str = "auto",
                 device: str | torch.device = "cpu", quantize: str | None = None, kernels: bool | str = "auto",
                 kv_cache_memory: int | str | None = None, compute: str = "auto",
                 speculative: str | None = None, draft_model: str | Path | None = None,
                 num_speculative_tokens: int | None = None, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 max_num_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS, batching: bool = True,
                 tensor_parallel: int = 1, kv_cache_dtype: str = "auto", *, config: EngineConfig | None = None):
        """The options, all checked (engine/config.py) before anything loads; pass them as keywords or
        as one EngineConfig (config=), not both.

        kv_cache_memory: the most the KV cache plus per-row sampling buffers may take, as bytes or a
        size such as "4GiB"; None = half of the memory available then. The continuous-batching engine
        sizes its block pool by it (and, speculating with a draft model, the draft's pool) at its first
        request. A request that cannot fit is refused before any compute, with its numbers.
        kv_cache_dtype: what that pool stores, "auto" (the activations' dtype: fp32 wherever the native step
        runs), "float32" or "bfloat16": keys and values rounded to bf16 as they are written, so the pool takes
        half the memory and attention reads half the bytes per token, for that rounding (docs/kv-cache.md).
        compute: for bf16 weights, "bfloat16" runs the plain bf16 forward; "float32" keeps the linear
        weights in bf16 and computes the rest in fp32 (engine/mixed.py: faster on a CPU without bf16
        instructions); "auto" picks "float32" wherever the native step (fast_step.py) runs the model, and on
        such a CPU for a model past cpu_paths.AUTO_KERNEL_BYTES (cpu_paths.set_compute).
        speculative: "off", "draft" (a smaller model with the same tokenizer guesses, draft_model= names it:
        a directory, a cached repo id, or "bundled") or "prompt-lookup" (n-gram matches in the text so far
        guess); None = "draft" if draft_model is given, else "off". num_speculative_tokens: guesses per
        target forward (default 4), or "auto" (each sequence's own, adapted to how often its guesses are
        kept, 1..8). The output's
        distribution is the target's either way (speculative.py).
        max_num_seqs, max_num_batched_tokens: the continuous-batching engine's batch (sequences decoding
        together) and per-step token budget (a long prompt is prefilled in chunks of it); see batching.py.

        Requests run on the continuous-batching engine (batching.py, scheduler.py): generate(), stream()
        and chat() may be called from several threads, and several stream()s may be open at once, all
        sharing one batch. Speculative decoding, compile=True and the fused head are options of its step
        (plan.py); batching=False runs one sequence at a time (max_num_seqs=1).
        tensor_parallel: N > 1 splits the model over the N ranks of a torchrun launch (or of a group
        started with sluice.parallel.init): every rank runs this same script, loads only its slices,
        and returns the same outputs, provided every rank makes the same calls in the same order.
        Requests run on the continuous-batching engine's torch forward; compile=True, fused_head=True,
        speculative decoding, quantize, kernels=True, compute="float32" and batching=False are refused
        there, and the native step and CPU kernels stay off (parallel/engine.py)."""
        given = dict(model=model, dtype=dtype, max_model_len=max_model_len, compile=compile, fused_head=fused_head,
                     device=device, quantize=quantize, kernels=kernels, kv_cache_memory=kv_cache_memory,
                     compute=compute, speculative=speculative, draft_model=draft_model,
                     num_speculative_tokens=num_speculative_tokens, max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=max_num_batched_tokens, batching=batching, tensor_parallel=tensor_parallel,
                     kv_cache_dtype=kv_cache_dtype)
        if config is None:
            config = EngineConfig(**given)
        elif not isinstance(config, EngineConfig):
            raise ConfigError(f"config must be an EngineConfig, got {type(config).__name__}")
        elif any(given[f.name] != f.default for f in fields(EngineConfig)):
            raise ConfigError("pass the options either as keyword arguments or as config=EngineConfig(...), not both")
        self.engine_config = cfg = config
        self.kv_cache_memory = cfg.kv_cache_memory  # the default is read per request: what is free changes
        self.max_num_seqs, self.max_num_batched_tokens = cfg.max_num_seqs, cfg.max_num_batched_tokens
        self.compile, self.batching, self.fused_head = cfg.compile, cfg.batching, cfg.fused_head
        self.speculative, self.num_speculative_tokens = cfg.speculative, cfg.num_speculative_tokens or 0
        self.model_dir = resolve_model_dir(cfg.model) if cfg.model is not None else bundled_model_dir()
        kernels = cfg.kernels
        self.tp = None  # parallel/engine.TensorParallel: this rank's part, when the model is split
        if cfg.tensor_parallel != 1:
            from .parallel.engine import TensorParallel
            self.tp = TensorParallel.start(cfg.tensor_parallel, device=cfg.device)
            kernels = False  # the CPU kernels, the native step and fp32 compute are single-process code
            self.model = self.tp.load(self.model_dir, cfg.dtype, cfg.device)
        else:
            self.model = load(self.model_dir, cfg.dtype, device=cfg.device, quantize=cfg.quantize)
        # The whole model's config: a rank's model holds a narrower one (parallel/sharding.rank_config).
        self.config = getattr(self.model, "full_config", self.model.config)
        self.device = self.model.embed.weight.device
        # "auto" decides at the first request (cpu_paths.kernels_pay_off), so a user of a small model at
        # batch 1 (sluice demo) never pays for building or loading the kernel. True decides now, loudly.
        self._kernels_pending, self._kernels_retry, self.kernels_in_use = kernels == "auto", False, 0
        if kernels is True:
            self.kernels_in_use = use_kernels(self.model, self.device, required=True)
        if set_compute(self.model, self.device, cfg.compute, kernels, cfg.quantize):
            self._kernels_pending = False  # the bf16 linears call the kernel themselves
        self.tokenizer = Tokenizer.from_pretrained(self.model_dir)
        self.generation_config = self.tokenizer.generation_config  # read (and checked) once, there
        self.max_model_len = cfg.fit_context(self.config.max_position_embeddings)
        # The tokenizer's eos ids come from generation_config.json, else tokenizer_config.json; a
        # checkpoint without a generation_config also stops on config.json's eos_token_id.
        self.eos_token_ids = set(self.tokenizer.eos_token_ids)
        if "eos_token_id" not in self.generation_config:
            eos = self.config.eos_token_id
            self.eos_token_ids |= {eos} if isinstance(eos, int) else set(eos or [])
        self._door = Door(self.tokenizer, self.config.vocab_size, self.max_model_len, self.generation_config)
        # Under tensor parallelism the forward asks, and fast_step.unsupported says why not (by name).
        self._native = kernels is not False or self.tp is not None
        self.draft_model = self._load_draft(cfg.draft_model, kernels) if cfg.draft_model is not None else None
        self.last_stats = Stats()
        self._batch: BatchEngine | None = None  # built at the first request that uses it
        self._batch_init = threading.Lock()

    # ------------------------------------------------------------------ generate, stream, chat
    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists), decoding them as one batch."""
        requests = self.requests(as_prompt_list(prompts), params)
        outputs = [RequestOutput(prompt_token_ids=r.prompt_token_ids, prompt=r.prompt) for r in requests]
        t0 = time.perf_counter()
        self._swap_kernels(len(requests))
        seqs = [self.add_request(r) for r in requests]
        try:
            while not all(s.finished for s in seqs):
                self.step()
        finally:  # interrupted (an exception, KeyboardInterrupt): the unfinished ones end here
            self.abort([s for s in seqs if not s.finished])
            self._collect(outputs, seqs, t0)
        return outputs

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas of one completion; concatenated they equal the final text."""
        if not isinstance(prompt, str):
            prompt = as_prompt_list(prompt)
            if len(prompt) != 1:
                raise RequestError(f"stream() takes one prompt, got {len(prompt)}")
            prompt = prompt[0]
        request = self.requests([prompt], params)[0]  # a bad request fails here, at the call
        out = RequestOutput(prompt_token_ids=request.prompt_token_ids, prompt=request.prompt)
        return self._stream_batched(out, request)

    def _stream_batched(self, out: RequestOutput, request: Request) -> Iterator[str]:
        t0 = time.perf_counter()
        self._swap_kernels(1)
        seq = self.add_request(request)  # at the first next(): an unstarted stream holds nothing
        try:
            while True:
                while seq.pending:
                    update = seq.pending.popleft()
                    if update.text:
                        yield update.text
                    if update.finished:
                        return
                self.step()
        finally:  # closed early (close(), break, garbage collection): its blocks go back now
            self.abort([seq] if not seq.finished else [])
            self._collect([out], [seq], t0)
            self.last_output = out

    def chat(self, messages: list[dict], params: SamplingParams | None = None,
             **template_kwargs) -> RequestOutput:
        return self.generate([self.chat_prompt(messages, **template_kwargs)], params)[0]

    def chat_prompt(self, messages: list[dict], **template_kwargs) -> list[int]:
        # max_tokens: a conversation that cannot fit the context is refused before it is tokenized
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  max_tokens=self.max_model_len, **template_kwargs)

    # ------------------------------------------------------------------ the door and the step API
    def requests(self, prompts: list, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 labels: list[str] | None = None, fit_max_tokens: bool = False) -> list[Request]:
        """Check prompts (a list of texts or token-id lists) and params (one, or one per prompt) against
        this model and the engine that will run them, before any compute; resolve the params against
        the model's generation_config. fit_max_tokens: see requests.Door.requests."""
        capacity = PoolCapacity(self.batch_engine().scheduler.check_fits)
        return self._door.requests(prompts, params, capacity, self.eos_token_ids, labels, fit_max_tokens)

    def add_request(self, request: Request) -> Seq:
        """Queue a checked request on the continuous-batching engine; it joins the batch at the next
        step(). The Seq returned collects its tokens and text, and says when it has finished."""
        if not isinstance(request, Request):
            raise RequestError(f"add_request takes a Request (from LLM.requests), got {type(request).__name__}")
        return self.batch_engine().add(request)

    def step(self, before: Callable[[], None] | None = None) -> list[Update]:
        """Run one step of the batch: what each sequence got from it (text, tokens, finished or not).
        before(): called as the step starts, once the adds and aborts since the last one are in."""
        return self.batch_engine().step(before)

    def abort(self, seqs: list[Seq]) -> list[Update]:
        """End seqs at once if no step is running (their final updates are returned), else at the next step."""
        return self.batch_engine().abort(seqs)

    @property
    def has_work(self) -> bool:
        return self._batch is not None and self._batch.scheduler.has_work

    def snapshot(self) -> EngineState:
        """The engine's state between steps (batching.EngineState: running, waiting, KV pool, preemptions)."""
        return self.batch_engine().snapshot()

    def on_step(self, before_forward: Callable[[], None] | None = None,
                nonfinite_origin: Callable[[list[int]], str] | None = None) -> None:
        """What the server hooks on every step: before_forward() as a step's model work starts, and
        nonfinite_origin(ids), which says where a sequence's NaN or inf starts."""
        sched = self.batch_engine().scheduler
        sched.before_forward, sched.nonfinite_origin = before_forward, nonfinite_origin

    def batch_engine(self) -> BatchEngine:
        """The continuous-batching engine, built (its KV pool sized) at the first request that needs it."""
        with self._batch_init:
            if self._batch is None:
                budget = self.kv_cache_memory or default_budget(self.device)
                if self.tp is not None:
                    budget = self.tp.agree(budget)
                self._batch = BatchEngine(self.model, self.tokenizer.decode, self.max_model_len, budget,
                                          self.kv_cache_memory is not None, self.max_num_seqs if self.batching else 1,
                                          self.max_num_batched_tokens, native=self._native,
                                          head=self.tp and self.tp.head, compile=self.compile,
                                          fused_head=self.fused_head, speculative=self.speculative,
                                          draft=self.draft_model, num_speculative_tokens=self.num_speculative_tokens,
                                          plans=self.tp and self.tp.plan_channel(),
                                          guides=Guides(self.tokenizer, self.config.vocab_size, self.eos_token_ids),
                                          kv_dtype=self.engine_config.kv_cache_dtype)
            return self._batch

    def _swap_kernels(self, rows: int) -> None:
        if self._kernels_pending and (rows >= 2 or kernels_pay_off(self.model, self.device)):
            if self._kernels_retry and self.has_work:
                return  # a kernel that landed later goes in between requests, never under one in flight
            self.kernels_in_use = use_kernels(self.model, self.device, required=False)
            # Swapped (or not) once, for good; unless the kernel is still building in the background
            # (native/extension.py), when a later request tries again.
            self._kernels_pending = self._kernels_retry = (
                not self.kernels_in_use and decode_kernel_building(self.device))

    def _collect(self, outputs: list[RequestOutput], seqs: list, t0: float) -> None:
        """Fill the outputs and last_stats; a sequence whose logits went non-finite raises NumericsError, one
        whose constraint llguidance refused (a grammar past its limits) ConstraintError."""
        self.last_stats = collect(outputs, seqs, t0, self.speculative)
        bad = next((s for s in seqs if s.finish_reason == "error"), None)
        if bad is not None:  # a constrained one whose grammar failed (output_stage.py), else non-finite logits
            raise (ConstraintError if bad.guide is not None and bad.guide.matcher.is_error() else NumericsError)(bad.error)

    # ------------------------------------------------------------------ loading
    def _load_draft(self, draft, kernels):
        """The draft model for speculative decoding, on the target's dtype and device, checked to share its
        tokenizer (speculative.check_draft), in the target's compute mode, with the native step where it fits."""
        cfg, path = self.engine_config, draft_dir(draft)
        model = load(path, cfg.dtype, device=cfg.device)
        check_draft(self.model.config, self.tokenizer, self.model_dir, model.config, Tokenizer.from_pretrained(path),
                    path, self.max_model_len)
        set_compute(model, self.device, cfg.compute, kernels, None)  # as the target: the native step needs fp32 compute
        return model
