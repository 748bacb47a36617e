"""Tiny random Hugging Face checkpoints, built with transformers itself (the reference)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as T

_SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              initializer_range=0.1, bos_token_id=1, eos_token_id=2)

ARCHS = {
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, {}),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, {"sliding_window": 4096}),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, {}),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, {"head_dim": 24}),
    # GPT-2 spells its sizes n_embd / n_inner / n_positions and has no grouped-query attention.
    "gpt2": (T.GPT2Config, T.GPT2LMHeadModel, {"n_inner": 112, "num_key_value_heads": None}),
    "neox": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM, {"num_key_value_heads": None,
                                                       "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                                           "partial_rotary_factor": 0.5}}),
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, {"head_dim": 24, "query_pre_attn_scalar": 20,
                                                     "sliding_window": 8}),
    "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, {"head_dim": 24, "query_pre_attn_scalar": 20,
                                                         "sliding_window": 8, "sliding_window_pattern": 2}),
    "olmo2": (T.Olmo2Config, T.Olmo2ForCausalLM, {}),
}


def build(out: Path, arch: str = "qwen3", *, seed: int = 0, save_dtype=torch.float32,
          max_shard_size=None, random_norms: bool | None = None, **overrides):
    """Save a random `arch` checkpoint to `out`; return the transformers model (fp32, eval).

    random_norms: norm gains drawn around 1 instead of ones, so a norm applied wrongly shows in the
    logits. None (the default) means yes unless rms_norm_eps is overridden (what older tests expect);
    parity tests of a non-default eps pass True, so the eps is tested with live norms."""
    cfg_cls, model_cls, extra = ARCHS[arch]
    kwargs = {**_SMALL, **extra, **overrides}
    kwargs = {k: v for k, v in kwargs.items() if v is not None or k not in _SMALL}
    cfg = cfg_cls(**kwargs)
    cfg.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    if random_norms if random_norms is not None else "rms_norm_eps" not in overrides:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1 + 0.3 * torch.randn_like(p))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    saved = model.to(save_dtype)
    if max_shard_size is not None:
        saved.save_pretrained(out, max_shard_size=max_shard_size)
    else:
        saved.save_pretrained(out)
    return model.float()


def build_with_tokenizer(out: Path, arch: str = "qwen3", generation_config: dict | None = None,
                         kind: str = "qwen", **overrides):
    """A tiny random checkpoint plus a real (tiny) tokenizer and generation_config: what the engine
    and the CLI need. Returns the transformers model."""
    import json

    from tok_fixtures import VOCAB_SIZE, build_tokenizer

    model = build(out, arch, vocab_size=VOCAB_SIZE, **overrides)
    build_tokenizer(out, kind)
    gen = {"eos_token_id": 2, "do_sample": False, "max_new_tokens": 16}
    gen.update(generation_config or {})
    (Path(out) / "generation_config.json").write_text(json.dumps(gen))
    return model


@torch.no_grad()
def hf_greedy(ref, prompt: torch.Tensor, n: int) -> list[int]:
    """transformers' own greedy continuation of `prompt` (1, T): exactly n new token ids."""
    out = ref.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                       pad_token_id=0)
    return out[0, prompt.shape[1]:].tolist()


def add_tensors(d: Path, extra: dict[str, torch.Tensor]) -> None:
    """Add tensors to a single-file checkpoint in `d` (legacy buffers, unexpected weights)."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(Path(d) / "model.safetensors")
    tensors.update(extra)
    save_file(tensors, Path(d) / "model.safetensors", metadata={"format": "pt"})
