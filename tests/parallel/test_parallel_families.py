"""Tensor parallelism on the families test_parallel_parity.py does not run: 2 and 4 gloo ranks equal
the single-process sluice model (logits within 1e-5 in fp32, greedy tokens identical) and each rank
holds its share of the weights.

Mistral   sliding window (4) shorter than prompt + generation, GQA.
GPT-2     q|k|v fused in Conv1D layout (read whole per layer, transposed, split, then sliced),
          learned positions and LayerNorm biases replicated, ungated MLP with sliced up bias and
          row-parallel down bias, random biases everywhere, tied embeddings.
GPT-NeoX  q|k|v fused and interleaved per head, parallel residual (two all-reduces per layer),
          partial rotary (half of each head), biases.
Gemma 3   per-head qk-norm, sliding window (4) on every other layer with its own RoPE base, GQA.
OLMo 2    full-width q/k RMSNorm (sum of squares all-reduced), post norms, attention biases, and 2 KV
          heads: one per rank at 2 ranks, each replicated on 2 ranks at 4 (the k-norm must count
          each KV head's channels once).
"""

from __future__ import annotations

import re

import pytest
import torch

from test_parallel_parity import NEW, PROMPT, _loop
from test_parallel_spawn import load_recording, ok, run_ranks, tiny_checkpoints

pytestmark = pytest.mark.slow  # gloo ranks spawned per family

_SIZES = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
              max_position_embeddings=64)
FAMILIES = {
    "mistral": dict(num_key_value_heads=2, sliding_window=4),
    "gpt2": dict(n_inner=128),
    "neox": dict(),  # tests/ckpt.py's NeoX has partial_rotary_factor 0.5
    "gemma3": dict(num_key_value_heads=2, sliding_window=4),
    "olmo2": dict(num_key_value_heads=2, attention_bias=True),
}
# HF tensors a rank may read whole: replicated ones (norms, positions, row-parallel biases) and the
# fused q|k|v tensors (one layer at a time, weights.py's _read).
_WHOLE_OK = re.compile(r".*(norm|ln_\w+|wpe)\.(weight|bias)|.*(o_proj|down_proj|c_proj|\.dense|dense_4h_to_h)\.bias"
                       r"|.*(c_attn|query_key_value)\.(weight|bias)")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory, "tpf", FAMILIES, _SIZES, seed=2)


def _expected_rank_bytes(ref, world: int) -> int:
    """What one rank should hold, from the single-process model's parameters by kind (fp32)."""
    cfg = ref.config
    full_qk = cfg.qk_norm == "full"
    kv_share = max(1, cfg.num_kv_heads // world) / cfg.num_kv_heads  # a replicated KV head counts whole
    total = 0.0
    for n, p in ref.named_parameters():
        b = p.numel() * 4
        if ".attn.k." in n or ".attn.v." in n or (full_qk and ".attn.k_norm." in n):
            total += b * kv_share
        elif full_qk and ".attn.q_norm." in n:
            total += b / world
        elif "norm" in n or n.startswith("pos_embed") or n.endswith(("attn.o.bias", "mlp.down.bias")):
            total += b  # replicated
        else:
            total += b / world
    return round(total)


def _check(ranks, d):
    import sluice
    from sluice import parallel as P
    from sluice.parallel import group
    m, whole = load_recording(d, ranks)
    prompt = torch.tensor(PROMPT)
    full = torch.cat(list(group.all_gather(m(prompt))), -1)  # test only: the whole logits
    vr = P.vocab_range(m.full_config, ranks.rank, ranks.world)
    res = dict(bytes=P.resident_bytes(m), whole=whole, greedy=_loop(m, prompt, lambda x: P.greedy(x, vr.start), NEW))
    if ranks.rank == 0:
        ref = sluice.load(d)
        res.update(diff=(full - ref(prompt)).abs().max().item(), ref_greedy=_loop(ref, prompt, lambda x: x.argmax(-1), NEW),
                   expected_bytes=_expected_rank_bytes(ref, ranks.world), full_bytes=P.resident_bytes(ref))
    return res


def _all(ranks, dirs):
    return {fam: _check(ranks, d) for fam, d in dirs.items()}


@pytest.fixture(scope="module", params=[2, 4])
def world_run(request, ckpts, tmp_path_factory):
    world = request.param
    return world, ok(run_ranks(tmp_path_factory.mktemp(f"tpf{world}"), world, _all, ckpts))


@pytest.mark.parametrize("fam", list(FAMILIES))
def test_logits_and_greedy_equal_single_process(world_run, fam):
    world, results = world_run
    r0 = results[0][fam]
    print(f"{fam} world={world} max|logits diff|={r0['diff']:.2e}")
    assert r0["diff"] < 1e-5
    assert all(res[fam]["greedy"] == r0["ref_greedy"] for res in results)


@pytest.mark.parametrize("fam", list(FAMILIES))
def test_ranks_hold_their_share_and_read_only_replicated_or_fused_tensors_whole(world_run, fam):
    world, results = world_run
    r0 = results[0][fam]
    got = [res[fam]["bytes"] for res in results]
    print(f"{fam} world={world} full={r0['full_bytes']} per rank={got}")
    assert got == [r0["expected_bytes"]] * world
    for res in results:
        whole = res[fam]["whole"]
        assert all(_WHOLE_OK.fullmatch(n) for n in whole), whole
        assert not any(re.search(r"(q|k)_norm", n) for n in whole) or fam != "olmo2", whole  # OLMo 2's are sliced


@pytest.fixture(scope="module")
def llm_ckpts(tmp_path_factory):
    from ckpt import build_with_tokenizer
    dirs = {}
    for fam, extra in FAMILIES.items():
        d = tmp_path_factory.mktemp(f"tpf-llm-{fam}")
        sizes = {k: v for k, v in _SIZES.items() if k != "vocab_size"}  # the tokenizer's 512
        build_with_tokenizer(d, fam, **{**sizes, "max_position_embeddings": 128}, **extra)
        dirs[fam] = str(d)
    return dirs


def _llm_greedy(dirs, world=1):
    import sluice
    from sluice import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 80, 17, 300, 42], [9, 9, 70, 1, 33, 47, 95, 400, 12, 6, 200]]
    return {fam: [o.token_ids for o in sluice.LLM(d, tensor_parallel=world).generate(prompts, params)]
            for fam, d in dirs.items()}


def _llm_on_ranks(ranks, dirs):
    return _llm_greedy(dirs, ranks.world)


def test_llm_tensor_parallel_greedy_equals_single_process(llm_ckpts, tmp_path):
    """The engine path (sluice.LLM(..., tensor_parallel=2): its cache, scheduler and lockstep) on
    these families gives the single-process LLM's greedy tokens on every rank."""
    ref = _llm_greedy(llm_ckpts)
    for res in ok(run_ranks(tmp_path, 2, _llm_on_ranks, llm_ckpts, timeout_s=120)):
        assert res == ref
