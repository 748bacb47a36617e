"""engine/fast_step.py (step.cpp) on a paged KV pool read through a block table, the layout of the
continuous-batching scheduler: slot s of row b is in block table[b, s // bs] at offset s % bs.

Both layouts run one code path in step.cpp, so a paged run must give bit for bit the logits of a
static-cache run and leave in each block exactly the keys and values of the static cache's slots.
The pool's blocks are handed out in a scrambled order, rows' blocks interleaved, and everything not
written (spare blocks, the tails of last blocks) holds NaN: a read of any slot the step must not
see would poison the logits. A paged run is also checked against the plain torch forward on a
static cache, which catches what both native layouts might get wrong together."""

import pytest
import torch

from ckpt import build
from sluice.engine import fast_step
from sluice.engine.fast_step import FastStep
from sluice.engine.kv_cache import KVCache
from test_fast_step import load, random_model

pytestmark = pytest.mark.skipif(fast_step.kernel() is None, reason="needs sluice's whole-step CPU kernel")

B, PROMPT, MORE, DECODE = 3, 20, 12, 6
REWIND = 3  # row b's second chunk starts REWIND * b slots early (a rollback), so rows end at different positions
LAST = [PROMPT - REWIND * b + MORE - 1 + DECODE for b in range(B)]  # each row's highest position
SLOTS = max(LAST) + 1


@pytest.fixture(scope="module")
def ckpt_dirs(tmp_path_factory):
    out = {}
    for name, arch, over in (("qwen3", "qwen3", {}), ("mistral-window", "mistral", {"sliding_window": 6})):
        out[name] = tmp_path_factory.mktemp(name)
        build(out[name], arch, **over)  # qwen3: qk-norm, GQA 4 heads over 2; mistral: a window of 6
    return out


def scrambled_pool(model, bs: int, seed: int = 0):
    """NaN-filled k, v pools (L, NB, K, bs, D) with 3 spare blocks, and a (B, nb) int64 table giving
    each row the blocks its positions reach, in a random order over all rows; entries past a row's
    last block are -1 (never read)."""
    cfg = model.config
    need = [last // bs + 1 for last in LAST]
    nb, NB = max(need), sum(need) + 3
    shape = (cfg.num_layers, NB, cfg.num_kv_heads, bs, cfg.head_dim)
    ids = torch.randperm(NB, generator=torch.Generator().manual_seed(seed)).tolist()
    table = torch.full((B, nb), -1, dtype=torch.long)
    for j in range(nb):  # block j of every row in turn, so rows' blocks interleave in the pool
        for b in range(B):
            if j < need[b]:
                table[b, j] = ids.pop()
    return torch.full(shape, float("nan")), torch.full(shape, float("nan")), table


def static_cache(model):
    cfg = model.config
    shape = (cfg.num_layers, B, cfg.num_kv_heads, SLOTS, cfg.head_dim)
    return torch.zeros(shape), torch.zeros(shape)


def run(forward, vocab: int, tokens_from=None) -> list[torch.Tensor]:
    """A prompt chunk, a second chunk from rewound positions, then DECODE greedy steps; forward(tokens,
    positions) -> logits (B, T, V). tokens_from: another run's logits, whose greedy tokens to feed."""
    g = torch.Generator().manual_seed(1)
    outs = [forward(torch.randint(0, vocab, (B, PROMPT), generator=g), torch.arange(PROMPT).expand(B, PROMPT))]
    start = torch.tensor([PROMPT - REWIND * b for b in range(B)])[:, None]
    outs.append(forward(torch.randint(0, vocab, (B, MORE), generator=g), start + torch.arange(MORE)))
    pos = start[:, -1:] + MORE
    for i in range(DECODE):
        tokens = (tokens_from or outs)[len(outs) - 1][:, -1].argmax(-1)[:, None]
        outs.append(forward(tokens, pos + i))
    assert (pos + DECODE - 1).flatten().tolist() == LAST
    return outs


def check_paged_equals_static(model, bs: int):
    step, vocab = FastStep(model), model.config.vocab_size
    k, v = static_cache(model)
    kp, vp, table = scrambled_pool(model, bs)
    with torch.inference_mode():
        want = run(lambda t, p: step(t, p, k, v), vocab)
        got = run(lambda t, p: step(t, p, kp, vp, block_table=table), vocab)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"call {i}: paged logits differ from static by {(g - w).abs().max()}"
    for b in range(B):
        for s in range(LAST[b] + 1):
            blk, off = table[b, s // bs], s % bs
            assert torch.equal(kp[:, blk, :, off], k[:, b, :, s]) and torch.equal(vp[:, blk, :, off], v[:, b, :, s]), \
                f"row {b} slot {s}: block {blk} offset {off} does not hold the static cache's keys/values"
    return kp, table


@pytest.mark.parametrize("bs", [1, 5, 16])
def test_paged_equals_static_qwen3(ckpt_dirs, bs):
    kp, table = check_paged_equals_static(load(ckpt_dirs["qwen3"]), bs)
    used = set(table[table >= 0].tolist())
    spare = [i for i in range(kp.shape[1]) if i not in used]
    assert spare and kp[:, spare].isnan().all()  # nothing was written outside the table's blocks


@pytest.mark.parametrize("bs", [5, 16])
def test_paged_equals_static_sliding_window(ckpt_dirs, bs):
    check_paged_equals_static(load(ckpt_dirs["mistral-window"]), bs)  # bs 5: windows start mid-block


@pytest.mark.parametrize("bs", [5, 16])
def test_paged_equals_static_bf16_weights(ckpt_dirs, bs):
    model = load(ckpt_dirs["qwen3"], "bfloat16")
    assert model.layers[0].mlp.up.weight.dtype == torch.bfloat16
    check_paged_equals_static(model, bs)


def test_paged_equals_static_mixed_window_layers():
    check_paged_equals_static(random_model(sliding_window=3, layer_types=("sliding", "full")), 5)


@pytest.mark.parametrize("name, bs", [("qwen3", 5), ("mistral-window", 16)])
def test_paged_matches_the_torch_forward(ckpt_dirs, name, bs):
    """Against the plain torch path on a static cache (test_parity checks that path against transformers)."""
    check_paged_matches_torch(load(ckpt_dirs[name]), bs)


def check_paged_matches_torch(model, bs: int) -> None:
    """The native step over a scrambled paged pool against the torch forward over a static cache, for a
    run of chunks and decode steps: logits within 1e-4 of their scale."""
    step, vocab = FastStep(model), model.config.vocab_size
    cache = KVCache.wrap(*static_cache(model))
    kp, vp, table = scrambled_pool(model, bs)
    with torch.inference_mode():
        want = run(lambda t, p: model(t, p, cache), vocab)
        got = run(lambda t, p: step(t, p, kp, vp, block_table=table), vocab, tokens_from=want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        scale = w.abs().max()
        assert (g - w).abs().max() <= 1e-4 * scale, f"call {i}: {(g - w).abs().max() / scale:.2e} of the scale"


def test_int32_table_and_the_static_cache_as_a_pool(ckpt_dirs):
    """An int32 table reads the same blocks; a static cache is the pool whose row b is block b of S slots."""
    model = load(ckpt_dirs["qwen3"])
    step, vocab = FastStep(model), model.config.vocab_size
    k, v = static_cache(model)
    kp, vp, table = scrambled_pool(model, 5)
    k2, v2 = static_cache(model)
    with torch.inference_mode():
        want = run(lambda t, p: step(t, p, k, v), vocab)
        got32 = run(lambda t, p: step(t, p, kp, vp, block_table=table.to(torch.int32)), vocab)
        as_pool = run(lambda t, p: step(t, p, k2, v2, block_table=torch.arange(B)[:, None]), vocab)
    assert all(torch.equal(a, w) and torch.equal(b, w) for a, b, w in zip(got32, as_pool, want, strict=True))
    assert torch.equal(k2, k) and torch.equal(v2, v)


def test_bad_tables_are_refused_before_any_work(ckpt_dirs):
    model = load(ckpt_dirs["qwen3"])
    step = FastStep(model)
    kp, vp, table = scrambled_pool(model, 5)
    NB, nb = kp.shape[1], table.shape[1]
    tokens, pos = torch.ones(B, 2, dtype=torch.long), torch.tensor([[0, 1], [3, 4], [6, 7]])
    k0 = kp.clone()
    bad_id, neg_id, one_row = table.clone(), table.clone(), table[:1]
    bad_id[1, 0], neg_id[2, 1] = NB, -1  # both in blocks that the rows' positions reach
    cases = [((tokens, pos, kp, vp), {"block_table": bad_id}, rf"block_table\[1\]\[0\] = {NB} is not a block"),
             ((tokens, pos, kp, vp), {"block_table": neg_id}, r"block_table\[2\]\[1\] = -1 is not a block"),
             ((tokens, pos + 5 * nb - 7, kp, vp), {"block_table": table}, f"beyond its block table's {nb} blocks of 5"),
             ((tokens, pos, kp, vp), {"block_table": one_row}, "block_table must be a CPU tensor"),
             ((tokens, pos, kp, vp), {"block_table": table.float()}, "int64 or int32"),
             ((tokens, pos, kp, vp[:, :1]), {"block_table": table}, "cache pool"),
             ((tokens, pos, kp.double(), vp.double()), {"block_table": table}, "fp32")]
    for args, kw, words in cases:
        with pytest.raises(RuntimeError, match=words):
            step(*args, **kw)
    assert torch.equal(kp.isnan(), k0.isnan())  # nothing was written by any refused call
    step(tokens, pos, kp, vp, block_table=table)  # the good table is fine, and writes
    assert not torch.equal(kp.isnan(), k0.isnan())
