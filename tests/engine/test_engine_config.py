"""EngineConfig (engine/config.py): every LLM option checked in one place, before anything loads, and
named as the caller spelled it (a keyword for LLM(...), a flag for the CLI)."""

from __future__ import annotations

import pytest

import sluice
from sluice.cli import build_parser
from sluice.cli.common import engine_config, flag_naming
from sluice.engine.config import EngineConfig
from sluice.errors import ConfigError


@pytest.mark.parametrize("options, keyword, flag", [
    (dict(kv_cache_memory="lots"), "kv_cache_memory must be a size", "--kv-cache-memory must be a size"),
    (dict(max_num_seqs=0), "max_num_seqs must be an integer >= 1, got 0", "--max-num-seqs must be an integer >= 1"),
    (dict(max_num_batched_tokens=True), "max_num_batched_tokens must be an integer >= 1, got True",
     "--max-num-batched-tokens must be"),
    (dict(max_model_len=0), "max_model_len must be an integer >= 1", "--max-model-len must be an integer >= 1"),
    (dict(speculative="prompt-lookup", num_speculative_tokens=0), "num_speculative_tokens must be an integer in",
     "--speculative-tokens must be an integer in"),
    (dict(tensor_parallel=2, compile=True), "compile=True is not available with tensor parallelism",
     "--compile is not available with --tp"),
    (dict(tensor_parallel=2, speculative="prompt-lookup"), "speculative='prompt-lookup' is not available with "
     "tensor parallelism", "--prompt-lookup is not available with --tp"),
    (dict(tensor_parallel=2, quantize="int8"), "quantize='int8' is not available", "--quantize is not available"),
    (dict(tensor_parallel=2, compute="float32"), "compute='float32' is not available",
     "--compute float32 is not available with --tp"),
])
def test_a_bad_option_is_named_as_keyword_or_flag(options, keyword, flag):
    with pytest.raises(ConfigError, match="^" + keyword.replace("(", r"\(")):
        EngineConfig(**options)
    with pytest.raises(ConfigError, match="^" + flag):
        EngineConfig(**options, naming=flag_naming())


@pytest.mark.parametrize("options, says", [
    (dict(fused_head="yes"), "fused_head must be True, False or 'auto'"),
    (dict(kernels=2), "kernels must be True, False or 'auto'"),
    (dict(batching="no"), "batching must be True or False"),
    (dict(compile=1), "compile must be True or False"),
    (dict(compute="fp16"), "compute must be one of auto, float32, bfloat16"),
    (dict(tensor_parallel=0), "tensor_parallel must be an integer >= 1, got 0"),
    (dict(tensor_parallel=True), "tensor_parallel must be an integer >= 1, got True"),  # not taken as 1
    (dict(tensor_parallel=2.0), "tensor_parallel must be an integer >= 1, got 2.0"),
    (dict(tensor_parallel=2, fused_head=True), "fused_head=True is not available with tensor parallelism"),
    (dict(tensor_parallel=2, compile=True), "compile=True is not available with tensor parallelism"),
])
def test_every_option_is_checked(options, says):
    with pytest.raises(ConfigError, match="^" + says):
        EngineConfig(**options)


def test_llm_refuses_a_bool_for_tensor_parallel_before_loading(monkeypatch):
    import sluice.llm
    monkeypatch.setattr(sluice.llm, "load", lambda *a, **k: pytest.fail("loaded before the options were checked"))
    with pytest.raises(ConfigError, match=r"^tensor_parallel must be an integer >= 1, got True"):
        sluice.LLM(tensor_parallel=True)


def test_speculation_is_resolved_once():
    assert EngineConfig().speculative == "off" and EngineConfig().num_speculative_tokens is None
    bundled = EngineConfig(speculative="draft")  # the bundled model's draft, by default
    assert (bundled.draft_model, bundled.num_speculative_tokens) == ("bundled", 4)
    assert EngineConfig(model="m", draft_model="d").speculative == "draft"
    assert EngineConfig(kv_cache_memory="2KiB").kv_cache_memory == 2048


def test_the_cli_builds_the_same_config():
    args = build_parser().parse_args(["serve", "--model", "m", "--prompt-lookup", "--speculative-tokens", "3",
                                      "--max-num-seqs", "4", "--kv-cache-memory", "1MiB"])
    assert engine_config(args) == EngineConfig(model="m", speculative="prompt-lookup", num_speculative_tokens=3,
                                               max_num_seqs=4, kv_cache_memory=2**20)


def test_llm_takes_keywords_or_one_config(tiny_dir):
    llm = sluice.LLM(config=EngineConfig(model=str(tiny_dir), max_model_len=64, max_num_seqs=2))
    assert llm.max_model_len == 64 and llm.max_num_seqs == 2 and llm.engine_config.max_model_len == 64
    with pytest.raises(ConfigError, match="either as keyword arguments or as config="):
        sluice.LLM(str(tiny_dir), config=EngineConfig(model=str(tiny_dir)))
    with pytest.raises(ConfigError, match="config must be an EngineConfig, got dict"):
        sluice.LLM(config={"model": str(tiny_dir)})
    with pytest.raises(ConfigError, match=r"max_model_len must be an integer in \[1, 512\]"):
        sluice.LLM(config=EngineConfig(model=str(tiny_dir), max_model_len=513))
