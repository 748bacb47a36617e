"""`sluice.LLM`: the Python API (vLLM-shaped). Loads model + tokenizer, runs batched generation."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Iterator, Sequence

import torch

from .engine.batching import (
    DEFAULT_MAX_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    BatchEngine,
    collect,
)
from .engine.cpu_paths import COMPUTE_CHOICES, decode_kernel_building, kernels_pay_off, set_compute, use_kernels
from .engine.kv_cache import default_budget, parse_size
from .engine.outputs import RequestOutput, Stats
from .engine.requests import as_prompt_list, token_ids
from .engine.sampling import SamplingParams
from .engine.speculative import check_draft, draft_dir, resolve_mode
from .errors import ConfigError, NumericsError, RequestError
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
                 tensor_parallel: int = 1):
        """kv_cache_memory: the most the KV cache plus per-row sampling buffers may take, as bytes or a
        size such as "4GiB"; None = half of the memory available then. The continuous-batching engine
        sizes its block pool by it (and, speculating with a draft model, the draft's pool) at its first
        request. A request that cannot fit is refused before any compute, with its numbers.
        compute: for bf16 weights, "bfloat16" runs the plain bf16 forward; "float32" keeps the linear
        weights in bf16 and computes the rest in fp32 (engine/mixed.py: faster on a CPU without bf16
        instructions); "auto" picks "float32" wherever the native step (fast_step.py) runs the model, and on
        such a CPU for a model past cpu_paths.AUTO_KERNEL_BYTES (cpu_paths.set_compute).
        speculative: "off", "draft" (a smaller model with the same tokenizer guesses, draft_model= names it:
        a directory, a cached repo id, or "bundled") or "prompt-lookup" (n-gram matches in the text so far
        guess); None = "draft" if draft_model is given, else "off". num_speculative_tokens: guesses per
        target forward (default 4), or "auto" (each sequence's
        own, adapted to how often its guesses are kept, 1..8). The output's distribution is the target's
        either way (speculative.py).
        max_num_seqs, max_num_batched_tokens: the continuous-batching engine's batch (sequences decoding
        together) and per-step token budget (a long prompt is prefilled in chunks of it); see batching.py.

        Requests run on the continuous-batching engine (batching.py, scheduler.py): generate(), stream()
        and chat() may be called from several threads, and several stream()s may be open at once, all
        sharing one batch. Speculative decoding, compile=True and the fused head are options of its step.
        batching=False runs one sequence at a time (max_num_seqs=1), each alone.
        tensor_parallel: N > 1 splits the model over the N ranks of a torchrun launch (or of a group
        started with sluice.parallel.init): every rank runs this same script, loads only its slices,
        and returns the same outputs, provided every rank makes the same calls in the same order.
        Requests run on the continuous-batching engine's torch forward; compile=True, fused_head=True,
        speculative decoding, quantize, kernels=True, compute="float32" and batching=False are refused
        there, and the native step and CPU kernels stay off (parallel/engine.py)."""
        # The default is read per request, not here: what is free changes while the process runs.
        self.kv_cache_memory = None if kv_cache_memory is None else parse_size(kv_cache_memory)
        if fused_head not in (True, False, "auto"):
            raise ConfigError(f"fused_head must be True, False or 'auto', got {fused_head!r}")
        if kernels not in (True, False, "auto"):
            raise ConfigError(f"kernels must be True, False or 'auto', got {kernels!r}")
        for name, v in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.compile = compile
        if not isinstance(batching, bool):
            raise ConfigError(f"batching must be True or False, got {batching!r}")
        self.batching = batching
        if not isinstance(compile, bool):
            raise ConfigError(f"compile must be True or False, got {compile!r}")
        if compute not in COMPUTE_CHOICES:  # before the (slow) load
            raise ConfigError(f"compute must be one of {', '.join(COMPUTE_CHOICES)}, got {compute!r}")
        self.fused_head = fused_head  # see fused_head.use_fused_head
        self.model_dir = resolve_model_dir(model) if model is not None else bundled_model_dir()
        self.speculative, draft, self.num_speculative_tokens = resolve_mode(  # before the (slow) loads
            speculative, draft_model, num_speculative_tokens, model is None)
        self.tp = None  # parallel/engine.TensorParallel: this rank's part, when the model is split
        if tensor_parallel != 1:
            from .parallel.engine import TensorParallel
            self.tp = TensorParallel.start(tensor_parallel, compile=compile, fused_head=fused_head, quantize=quantize,
                                           kernels=kernels, compute=compute, speculative=self.speculative,
                                           batching=batching, device=device)
            kernels = False  # the CPU kernels, the native step and fp32 compute are single-process code
            self.model = self.tp.load(self.model_dir, dtype, device)
        else:
            self.model = load(self.model_dir, dtype, device=device, quantize=quantize)  # checks the device first
        # The whole model's config: a rank's model holds a narrower one (parallel/sharding.rank_config).
        self.config = getattr(self.model, "full_config", self.model.config)
        self.device = self.model.embed.weight.device
        # "auto" decides at the first request (cpu_paths.kernels_pay_off), so a user of a small model at
        # batch 1 (sluice demo) never pays for building or loading the kernel. True decides now, loudly.
        self._kernels_pending, self._kernels_retry, self.kernels_in_use = kernels == "auto", False, 0
        if kernels is True:
            self.kernels_in_use = use_kernels(self.model, self.device, required=True)
        if set_compute(self.model, self.device, compute, kernels, quantize):
            self._kernels_pending = False  # the bf16 linears call the kernel themselves
        self.tokenizer = Tokenizer.from_pretrained(self.model_dir)
        cfg = self.config
        self.generation_config = self.tokenizer.generation_config  # read (and checked) once, there
        limit = cfg.max_position_embeddings
        if max_model_len is not None and (isinstance(max_model_len, bool) or not (
                isinstance(max_model_len, int) and 0 < max_model_len <= limit)):
            raise ConfigError(f"max_model_len must be an integer in [1, {limit}] (the model's "
                              f"max_position_embeddings), got {max_model_len!r}")
        self.max_model_len = max_model_len or limit
        # The tokenizer's eos ids come from generation_config.json, else tokenizer_config.json; a
        # checkpoint without a generation_config also stops on config.json's eos_token_id.
        self.eos_token_ids = set(self.tokenizer.eos_token_ids)
        if "eos_token_id" not in self.generation_config:
            eos = cfg.eos_token_id
            self.eos_token_ids |= {eos} if isinstance(eos, int) else set(eos or [])
        self._native = kernels is not False
        self.draft_model = self._load_draft(draft, dtype, device, compute, kernels) if draft is not None else None
        self.last_stats = Stats()
        self._batch: BatchEngine | None = None  # built at the first request that uses it
        self._batch_init = threading.Lock()

    # ------------------------------------------------------------------ public API
    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists), decoding them as one batch."""
        outputs, params = self._start(as_prompt_list(prompts), params)
        engine, t0 = self.batch_engine(), time.perf_counter()
        self._swap_kernels(len(outputs))
        seqs = [engine.add(o.prompt_token_ids, p, f"prompt {i}") for i, (o, p) in enumerate(zip(outputs, params, strict=True))]
        try:
            engine.run(seqs)
        finally:
            self._collect(outputs, seqs, t0)
        return outputs

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas of one completion; concatenated they equal the final text."""
        if not isinstance(prompt, str):
            prompt = as_prompt_list(prompt)
            if len(prompt) != 1:
                raise RequestError(f"stream() takes one prompt, got {len(prompt)}")
            prompt = prompt[0]
        outputs, params = self._start([prompt], params)  # a bad request fails here, at the call
        return self._stream_batched(outputs[0], params[0])

    def _stream_batched(self, out: RequestOutput, params: SamplingParams) -> Iterator[str]:
        engine, t0 = self.batch_engine(), time.perf_counter()
        self._swap_kernels(1)
        seq = engine.add(out.prompt_token_ids, params, "prompt 0")  # at the first next(): an unstarted stream holds nothing
        try:
            for update in engine.updates(seq):
                if update.text:
                    yield update.text
        finally:
            self._collect([out], [seq], t0)
            self.last_output = out

    def batch_engine(self) -> BatchEngine:
        """The continuous-batching engine, built (its KV pool sized) at the first request that needs it."""
        with self._batch_init:
            if self._batch is None:
                budget = self.kv_cache_memory or default_budget(self.device)
                if self.tp is not None:
                    budget = self.tp.agree(budget)
                self._batch = BatchEngine(self.model, self.tokenizer.decode, self.eos_token_ids, self.max_model_len,
                                          budget, self.kv_cache_memory is not None,
                                          self.max_num_seqs if self.batching else 1, self.max_num_batched_tokens,
                                          native=self._native, head=self.tp and self.tp.head, compile=self.compile,
                                          fused_head=self.fused_head, speculative=self.speculative,
                                          draft=self.draft_model, num_speculative_tokens=self.num_speculative_tokens)
            return self._batch

    def _swap_kernels(self, rows: int) -> None:
        if self._kernels_pending and (rows >= 2 or kernels_pay_off(self.model, self.device)):
            if self._kernels_retry and self._batch is not None and self._batch.scheduler.has_work:
                return  # a kernel that landed later goes in between requests, never under one in flight
            self.kernels_in_use = use_kernels(self.model, self.device, required=False)
            # Swapped (or not) once, for good; unless the kernel is still building in the background
            # (native/extension.py), when a later request tries again.
            self._kernels_pending = self._kernels_retry = (
                not self.kernels_in_use and decode_kernel_building(self.device))

    def _collect(self, outputs: list[RequestOutput], seqs: list, t0: float) -> None:
        """Fill the outputs and last_stats; a sequence whose logits went non-finite raises NumericsError,
        as on the static path."""
        self.last_stats = collect(outputs, seqs, t0, self.speculative)
        bad = next((s for s in seqs if s.finish_reason == "error"), None)
        if bad is not None:
            raise NumericsError(bad.error)

    def chat(self, messages: list[dict], params: SamplingParams | None = None,
             **template_kwargs) -> RequestOutput:
        return self.generate([self.chat_prompt(messages, **template_kwargs)], params)[0]

    def chat_prompt(self, messages: list[dict], **template_kwargs) -> list[int]:
        # max_tokens: a conversation that cannot fit the context is refused before it is tokenized
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  max_tokens=self.max_model_len, **template_kwargs)

    def _load_draft(self, draft, dtype, device, compute, kernels):
        """The draft model for speculative decoding, on the target's dtype and device, checked to share its
        tokenizer (speculative.check_draft), in the target's compute mode, with the native step where it fits."""
        path = draft_dir(draft)
        model = load(path, dtype, device=device)
        check_draft(self.model.config, self.tokenizer, self.model_dir, model.config, Tokenizer.from_pretrained(path),
                    path, self.max_model_len)
        set_compute(model, self.device, compute, kernels, None)  # as the target: the native step needs fp32 compute
        return model

    def _start(self, prompts: list, params) -> tuple[list[RequestOutput], list[SamplingParams]]:
        """Validate the request and resolve its params, before any compute. Every check comes
        before the work it guards: the memory budget (a lower bound) before tokenizing, a text's
        byte count before tokenizing it, a token list's length before reading its elements."""
        if not prompts:
            raise RequestError("no prompts given")
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if isinstance(params, (str, bytes)) or not hasattr(params, "__len__"):
            raise RequestError(f"params must be a SamplingParams or a list of them, got {type(params).__name__}")
        if len(params) != len(prompts):
            raise RequestError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise RequestError(f"params {i} must be a SamplingParams, got {type(p).__name__}")
        cfg, limit = self.config, self.max_model_len
        vocab = cfg.vocab_size
        params = [p.with_defaults(self.generation_config) for p in params]
        for i, p in enumerate(params):
            p.validate(vocab)
            if p.max_tokens >= limit:
                raise RequestError(f"prompt {i} asks for max_tokens={p.max_tokens}, which leaves no room for a "
                                   f"prompt in the context of {limit} tokens (lower max_tokens)")
        # The pool has a fixed size; each request must fit it alone (it then never fails, see scheduler.py).
        # Every row needs at least one prompt token: refuse a hopeless batch before tokenizing it.
        engine = self.batch_engine()
        for i, p in enumerate(params):
            engine.scheduler.check_fits(1, p.max_tokens, f"prompt {i}: ")
        outputs = []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            text = prompt if isinstance(prompt, str) else None
            if text is not None:
                try:  # refused from its length alone when it cannot fit, before tokenizing
                    ids = self.tokenizer.encode(text, max_tokens=limit)
                except RequestError as e:
                    raise RequestError(f"prompt {i}: {e}") from None
            else:
                ids = token_ids(i, prompt, vocab, limit)
            if not ids:
                raise RequestError(f"prompt {i} is empty: at least one token is needed to condition on")
            if len(ids) + p.max_tokens > limit:
                raise RequestError(
                    f"prompt {i} has {len(ids)} tokens and asks for max_tokens={p.max_tokens}: "
                    f"{len(ids) + p.max_tokens} tokens do not fit the context of {limit} "
                    f"tokens (shorten the prompt or lower max_tokens)")
            outputs.append(RequestOutput(prompt_token_ids=ids, prompt=text))
        for i, (o, p) in enumerate(zip(outputs, params, strict=True)):
            engine.scheduler.check_fits(len(o.prompt_token_ids), p.max_tokens, f"prompt {i}: ")
        return outputs, params
