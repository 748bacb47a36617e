"""Tensor parallelism on 2 and 4 gloo ranks equals the single-process sluice model.

One spawn per world size runs every check on every family (starting ranks is the slow part) and the
tests assert on what rank 0 measured. Families: Llama (KV heads split, biases on q/k/v/o and the
MLP: the row-parallel o and down add theirs once, after the all-reduce), Qwen2 (q/k/v biases, KV
heads replicated at 4 ranks), Qwen3 (per-head qk-norm, tied embeddings, one KV head replicated on
every rank), Gemma 2 (sandwich norms, attention and final soft-caps small enough to bite (2 and 3),
embedding scale). The other five families: test_parallel_families.py.
"""

from __future__ import annotations

import pytest
import torch

from test_parallel_spawn import load_recording, ok, run_ranks, tiny_checkpoints

pytestmark = pytest.mark.slow  # gloo ranks spawned, 2 and 4

_SIZES = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8)
FAMILIES = {"llama": dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True), "qwen2": dict(num_key_value_heads=2),
            "qwen3": dict(num_key_value_heads=1, tie_word_embeddings=True),
            "gemma2": dict(num_key_value_heads=2, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)}
PROMPT = [[3, 17, 42, 5, 88, 60, 11], [9, 9, 70, 1, 33, 47, 95], [50, 2, 64, 31, 7, 80, 22]]
NEW = 8


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory, "tp", FAMILIES, _SIZES, seed=1)


def _loop(model, prompt, pick, n):
    """n tokens decoded with a KV cache; pick(last logits (B, V or V/N)) -> (B,) ids."""
    from sluice.engine.kv_cache import KVCache
    B, T = prompt.shape
    cache = KVCache(model.config, B, T + n)
    logits = model(prompt, positions=torch.arange(T).expand(B, T), cache=cache)[:, -1]
    out = []
    for step in range(n):
        tok = pick(logits)
        out.append(tok.tolist())
        logits = model(tok[:, None], positions=torch.full((B, 1), T + step), cache=cache)[:, -1]
    return out


_SAMPLED = [dict(temperature=1.0, seed=7), dict(temperature=0.7, top_k=5, seed=3), dict(temperature=0.0)]


def _check_family(ranks, d):
    import sluice
    from sluice import parallel as P
    from sluice.engine.sampling import SamplingParams, Sampler
    from sluice.parallel import group
    m, whole = load_recording(d, ranks)
    prompt = torch.tensor(PROMPT)
    local = m(prompt)  # (B, T, V/N)
    full = torch.cat(list(group.all_gather(local)), -1)  # test only: the whole logits, to compare
    vr = P.vocab_range(m.full_config, ranks.rank, ranks.world)
    tp_log_z = P.log_z(local.reshape(-1, local.shape[-1]))
    greedy = _loop(m, prompt, lambda x: P.greedy(x, vr.start), NEW)
    params = [SamplingParams(**p) for p in _SAMPLED]
    sampled = _loop(m, prompt, P.ParallelSampler(params, m.full_config.vocab_size, vr.start, vr.stop), NEW)
    res = dict(bytes=P.resident_bytes(m), whole=whole, greedy=greedy, sampled=sampled)
    if ranks.rank == 0:
        ref = sluice.load(d)
        want = ref(prompt)
        res.update(diff=(full - want).abs().max().item(),
                   log_z=((tp_log_z - want.reshape(-1, want.shape[-1]).logsumexp(-1)).abs()
                          / want.reshape(-1, want.shape[-1]).logsumexp(-1).abs()).max().item(),
                   ref_greedy=_loop(ref, prompt, lambda x: x.argmax(-1), NEW),
                   ref_sampled=_loop(ref, prompt, Sampler(params, ref.config.vocab_size), NEW),
                   ref_bytes=P.resident_bytes(ref), cfg=ref.config,
                   repl_bytes=sum(p.numel() * 4 for n, p in ref.named_parameters()  # replicated on every rank
                                  if "norm" in n or n.endswith(("attn.o.bias", "mlp.down.bias"))),
                   kv_bytes=sum(p.numel() * 4 for n, p in ref.named_parameters() if ".attn.k." in n or ".attn.v." in n))
    return res


def _sampler_on_random_logits(ranks):
    """The ParallelSampler against the Sampler on the same logits (shared seed), row by row."""
    from sluice import parallel as P
    from sluice.engine.sampling import SamplingParams, Sampler
    V = 96 * 5
    lo, hi = ranks.rank * V // ranks.world, (ranks.rank + 1) * V // ranks.world
    params = [SamplingParams(**p) for p in _SAMPLED] + [SamplingParams(temperature=1.3, top_k=70, seed=11)]
    tp, single = P.ParallelSampler(params, V, lo, hi), Sampler(params, V)
    g = torch.Generator().manual_seed(5)
    same, draws = 0, []
    for _ in range(40):
        x = 3 * torch.randn(len(params), V, generator=g)
        a, b = tp(x[:, lo:hi]), single(x)
        same += int(torch.equal(a, b))
        draws.append(a.tolist())
    tied = torch.zeros(2, V)
    tied[0, [V - 1, V // 2 + 1, 7]] = 5.0  # ties across shards: torch.argmax takes the lowest id
    tied[1, V - 1] = float("nan")
    got = P.ParallelSampler([SamplingParams(temperature=0)] * 2, V, lo, hi)(tied[:, lo:hi]).tolist()
    wide = 40 * torch.randn(4, V, generator=g)
    rel = ((P.log_z(wide[:, lo:hi]) - wide.logsumexp(-1)).abs() / wide.logsumexp(-1).abs()).max().item()
    return dict(same=same, draws=draws, tied=got, log_z=rel)


def _all_checks(ranks, dirs):
    return {"families": {fam: _check_family(ranks, d) for fam, d in dirs.items()},
            "sampler": _sampler_on_random_logits(ranks)}


@pytest.fixture(scope="module", params=[2, 4])
def world_run(request, ckpts, tmp_path_factory):
    world = request.param
    return world, ok(run_ranks(tmp_path_factory.mktemp(f"tp{world}"), world, _all_checks, ckpts))


@pytest.mark.parametrize("fam", list(FAMILIES))
def test_logits_equal_single_process(world_run, fam):
    world, results = world_run
    r = results[0]["families"][fam]
    print(f"{fam} world={world} max|logits diff|={r['diff']:.2e} log Z rel={r['log_z']:.1e}")
    assert r["diff"] < 1e-5
    assert r["log_z"] < 1e-6


@pytest.mark.parametrize("fam", list(FAMILIES))
def test_greedy_and_seeded_generation_equal_single_process(world_run, fam):
    world, results = world_run
    rows = [res["families"][fam] for res in results]
    assert all(r["greedy"] == rows[0]["ref_greedy"] for r in rows)  # every rank, the same tokens
    assert all(r["sampled"] == rows[0]["ref_sampled"] for r in rows)


@pytest.mark.parametrize("fam", list(FAMILIES))
def test_each_rank_holds_about_one_nth_of_the_weights(world_run, fam):
    world, results = world_run
    r0 = results[0]["families"][fam]
    cfg, full, repl, kv = r0["cfg"], r0["ref_bytes"], r0["repl_bytes"], r0["kv_bytes"]
    kv_rank = kv * max(1, cfg.num_kv_heads // world) // cfg.num_kv_heads  # replicated KV heads count whole
    expected = (full - repl - kv) // world + repl + kv_rank
    got = [res["families"][fam]["bytes"] for res in results]
    print(f"{fam} world={world} full={full} per rank={got} expected={expected}")
    assert got == [expected] * world
    for res in results:  # sharded tensors were read as slices; only replicated ones whole
        whole = res["families"][fam]["whole"]
        assert all("norm" in n or n.endswith(("o_proj.bias", "down_proj.bias")) for n in whole), whole


def test_sampler_equals_single_process_sampler(world_run):
    world, results = world_run
    V = 96 * 5
    for res in results:
        s = res["sampler"]
        assert s["same"] == 40 and s["draws"] == results[0]["sampler"]["draws"]
        assert s["tied"] == [7, -1]
        assert s["log_z"] < 1e-6
    assert len({tuple(row) for step in results[0]["sampler"]["draws"] for row in [step[:2]]}) > 1  # it varies
    assert V % world == 0
