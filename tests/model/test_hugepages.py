"""model/hugepages.py: load() moves the large CPU weights into 2 MiB-page memory; only the layout changes."""

import torch

import sluice
from sluice.engine.sampling import SamplingParams
from sluice.model import hugepages
from sluice.model.loading import load

from ckpt import build_with_tokenizer


def _tied_dir(tmp_path):
    d = tmp_path / "tied"
    build_with_tokenizer(d, "qwen3", tie_word_embeddings=True, save_dtype=torch.bfloat16)
    return d


def test_the_moved_model_is_the_same_model(tmp_path, monkeypatch):
    """With the size floor lowered so a tiny model's tensors move: every tensor keeps its dtype, shape and
    values, ties stay one tensor, parameters stay frozen Parameters, each moved one starts on a 2 MiB
    boundary, and the logits are the same bits as the file-backed model's."""
    d = _tied_dir(tmp_path)
    monkeypatch.setenv("SLUICE_HUGE_PAGES", "off")
    base = load(d, "bfloat16")
    assert base.huge_pages == {"moved_bytes": 0, "tensors": 0, "reason": "SLUICE_HUGE_PAGES=off"}
    monkeypatch.delenv("SLUICE_HUGE_PAGES")
    monkeypatch.setattr(hugepages, "MIN_BYTES", 1024)
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "madvise")
    moved = load(d, "bfloat16")
    big = {n: t for n, t in moved.state_dict().items() if t.nbytes >= 1024}
    assert moved.huge_pages["reason"] is None and moved.huge_pages["tensors"] == len({t.data_ptr() for t in big.values()})
    assert moved.huge_pages["moved_bytes"] == sum({t.data_ptr(): t.nbytes for t in big.values()}.values())
    assert moved.embed.weight.data_ptr() == moved.lm_head.weight.data_ptr()  # tied: still one tensor
    assert moved.lm_head.weight is moved.embed.weight  # one Parameter, as loaded (parameters() lists it once)
    assert [n for n, _ in moved.named_parameters()] == [n for n, _ in base.named_parameters()]
    ref = base.state_dict()
    for n, t in moved.state_dict().items():
        assert t.dtype == ref[n].dtype and t.shape == ref[n].shape and torch.equal(t, ref[n]), n
        if n in big:
            assert t.data_ptr() % hugepages.HUGE == 0 and t.data_ptr() != ref[n].data_ptr(), n
    for p in moved.parameters():
        assert isinstance(p, torch.nn.Parameter) and not p.requires_grad
    ids = torch.tensor([[1, 5, 9, 33, 60]])
    assert torch.equal(moved(ids), base(ids))


def test_the_native_step_reads_the_moved_weights(tmp_path, monkeypatch):
    """The engine builds its step over the moved tensors: the same greedy tokens and logprobs as over the
    file's pages (a step holding the old pointers would read freed memory or the file's stale copy)."""
    d = _tied_dir(tmp_path)
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)
    prompt = [[3, 14, 15, 9, 26]]
    monkeypatch.setenv("SLUICE_HUGE_PAGES", "off")
    a = sluice.LLM(str(d), dtype="bfloat16").generate(prompt, params)[0]
    monkeypatch.delenv("SLUICE_HUGE_PAGES")
    monkeypatch.setattr(hugepages, "MIN_BYTES", 1024)
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "madvise")
    llm = sluice.LLM(str(d), dtype="bfloat16")
    assert llm.model.huge_pages["tensors"] > 0
    b = llm.generate(prompt, params)[0]
    forward = llm.batch_engine().scheduler.forward
    assert forward.native_reason is None and forward.use_fast
    assert b.token_ids == a.token_ids and b.logprobs == a.logprobs


def test_what_keeps_the_weights_in_place(tmp_path, monkeypatch):
    """The kernel's THP off, or weights too big for the memory available: nothing moves, and the reason says
    which; the tensors are the file's own."""
    d = _tied_dir(tmp_path)
    monkeypatch.setattr(hugepages, "MIN_BYTES", 1024)
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "never")
    m = load(d, "bfloat16")
    assert m.huge_pages["tensors"] == 0 and "huge pages are never" in m.huge_pages["reason"]
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "always")
    monkeypatch.setattr(hugepages, "mem_available", lambda: 1 << 16)
    m = load(d, "bfloat16")
    assert m.huge_pages["tensors"] == 0 and "of the memory available" in m.huge_pages["reason"]
    assert all(t.data_ptr() % hugepages.HUGE for t in m.state_dict().values() if t.nbytes >= 1024)


def test_what_other_processes_move_counts_against_the_memory(tmp_path, monkeypatch):
    """why_not(also_moving): weights that fit alone stay where they are when, with what others move at the same
    time (tensor-parallel ranks on one machine), they would not."""
    monkeypatch.setattr(hugepages, "MIN_BYTES", 1024)
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "madvise")
    m = load(_tied_dir(tmp_path), "bfloat16")
    need = hugepages.movable_bytes(m)
    assert need == m.huge_pages["moved_bytes"] > 0
    monkeypatch.setattr(hugepages, "mem_available", lambda: int(2 * need / hugepages.FIT_FRACTION))
    assert hugepages.why_not(m) is None and hugepages.why_not(m, need) is None
    reason = hugepages.why_not(m, 2 * need)
    assert "other ranks here move" in reason and "of the memory available" in reason


def test_a_model_off_the_cpu_moves_nothing_and_says_where_it_is():
    """One check for every loader (load(), parallel.load_rank): weights on another device stay where they are."""
    lin = torch.nn.Linear(1024, 1024, device="meta")
    assert hugepages.move_to_huge_pages(lin) == {"moved_bytes": 0, "tensors": 0, "reason": "device meta"}


def test_thp_mode_reads_the_bracketed_choice(tmp_path, monkeypatch):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    monkeypatch.setattr(hugepages, "THP_MODE", f)
    assert hugepages.thp_mode() == "madvise"
    f.write_text("[always] madvise never\n")
    assert hugepages.thp_mode() == "always"
    monkeypatch.setattr(hugepages, "THP_MODE", tmp_path / "missing")
    assert hugepages.thp_mode() == "absent"


def test_advised_memory_faults_in_huge_pages():
    """Where the kernel offers THP on request, the advised mapping's first writes fault in 2 MiB pages: the
    process's AnonHugePages grows by the tensor's size (the point of the move). Skipped where THP is off."""
    import pytest
    if hugepages.thp_mode() not in ("always", "madvise") or hugepages.huge_page_bytes() is None:
        pytest.skip(f"transparent huge pages: {hugepages.thp_mode()}")
    before = hugepages.huge_page_bytes()
    t = hugepages._huge_empty(8 * hugepages.HUGE, torch.float32, torch.Size([8 * hugepages.HUGE // 4]))
    t.fill_(1.0)
    assert hugepages.huge_page_bytes() - before >= 4 * hugepages.HUGE
    assert float(t.sum()) == t.numel()
