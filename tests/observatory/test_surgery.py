"""Valve surgery: every what-if changes the live model as documented, is undone bit-exactly, never
touches the checkpoint files, and is refused with a clear SurgeryError when it does not apply;
bits per byte agree with transformers' cross-entropy; the CLI prints the comparison or one line."""

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from ckpt import build, build_with_tokenizer
from tokenizers import Tokenizer as HFTokenizer

import sluice
from sluice.cli import main
from sluice.errors import ObservatoryError, SluiceError, SurgeryError
from sluice.model.layers import LayerNorm, RMSNorm
from sluice.observatory import surgery

TEXT = ("def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5\n"
        "The quick brown fox jumps over the lazy dog. What is the capital of France?\n")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Tiny checkpoints built once per module: {name: directory}."""
    out = {}

    def make(name, fn, *args, **kw):
        out[name] = d = tmp_path_factory.mktemp(name)
        fn(d, *args, **kw)
    make("qwen3", build_with_tokenizer, "qwen3")
    make("llama-bos", build_with_tokenizer, "llama", kind="llama")
    make("qwen3-short", build_with_tokenizer, "qwen3", max_position_embeddings=16)
    make("qwen3-big", build_with_tokenizer, "qwen3", initializer_range=1.0)  # logits far past 11.1
    make("gemma2", build, "gemma2", final_logit_softcapping=3.0, attn_logit_softcapping=2.0,
         initializer_range=0.3)
    make("olmo2", build, "olmo2")
    make("gpt2", build, "gpt2")
    return out


@pytest.fixture(scope="module")
def models(dirs):
    return {name: sluice.load(d) for name, d in dirs.items()}


def ids_for(model, T=12):
    return torch.arange(T)[None] * 7 % model.config.vocab_size  # (1, T)


def logits(model, ids):
    with torch.inference_mode():
        return model(ids)


def no_hooks(model):
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_final_norm_off_changes_logits_and_undo_is_bit_identical(models):
    m = models["qwen3"]
    ids = ids_for(m)
    before, norm = logits(m, ids), m.final_norm
    with surgery.apply(m, ["final-norm=off"]) as done:
        assert m.final_norm is None
        inside = logits(m, ids)
        # the LM head reads the raw x_L: recompute it from the block outputs
        x = m.embed(ids)
        positions = torch.arange(ids.shape[1])[None]
        from sluice.model.layers import rope_tables
        cos, sin = rope_tables(m.inv_freq, positions, x.dtype)
        for block in m.layers:
            x = block(x, cos, sin, None)
        torch.testing.assert_close(inside, m.logits(x))
    assert "RMSNorm bypassed" in done.notes[0]
    assert not torch.allclose(inside, before)
    assert m.final_norm is norm
    assert torch.equal(logits(m, ids), before)


KINDS = [("qwen3", ["final-norm=off"]), ("qwen3", ["norm=layer"]), ("gpt2", ["norm=rms"]),
         ("gemma2", ["norm=layer"]), ("gemma2", ["softcap=off"]), ("gemma2", ["softcap=1.5"]),
         ("gemma2", ["attn-softcap=off"]), ("qwen3", ["attn-softcap=0.5"]), ("qwen3", ["softcap=0.5"]),
         ("qwen3", ["residual-scale=0.5"]), ("olmo2", ["attn-scale=2"]), ("gpt2", ["mlp-scale=0"]),
         ("olmo2", ["norm=layer", "final-norm=off", "residual-scale=3", "attn-scale=0.5"]),
         ("qwen3", ["softmax=naive", "softmax-dtype=float16"])]


@pytest.mark.parametrize("arch,specs", KINDS, ids=[f"{a}:{'+'.join(s)}" for a, s in KINDS])
def test_every_surgery_is_undone_bit_identically(models, arch, specs):
    m = models[arch]
    ids = ids_for(m)
    before = logits(m, ids)
    modules = dict(m.named_modules())
    params = {k: v.clone() for k, v in m.state_dict().items()}
    with surgery.apply(m, specs):
        inside = logits(m, ids)
    eval_only = all(s.startswith("softmax") for s in specs)
    assert torch.equal(inside, before) == eval_only  # a model surgery changes the logits
    assert torch.equal(logits(m, ids), before)
    assert dict(m.named_modules()) == modules and no_hooks(m)  # the very same module objects
    assert all(torch.equal(v, params[k]) for k, v in m.state_dict().items())


def test_undone_on_exception_and_on_a_refusal_half_way(models):
    m = models["qwen3"]
    ids = ids_for(m)
    before = logits(m, ids)
    with pytest.raises(RuntimeError, match="boom"), surgery.apply(m, ["norm=layer", "residual-scale=2"]):
        raise RuntimeError("boom")
    assert torch.equal(logits(m, ids), before) and no_hooks(m)
    # norm=layer is done before softcap=off is refused: it must be undone too
    with pytest.raises(SurgeryError, match="no final logit soft-cap"), \
            surgery.apply(m, ["norm=layer", "softcap=off"]):
        pass
    assert isinstance(m.layers[0].attn_norm, RMSNorm)
    assert torch.equal(logits(m, ids), before)


def sha256s(d: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


def test_checkpoint_files_are_never_touched(dirs, models):
    d, m = dirs["qwen3"], models["qwen3"]
    hashes = sha256s(d)
    tok = sluice.Tokenizer.from_pretrained(d)
    for specs in (["final-norm=off"], ["norm=layer", "residual-scale=0"], ["softcap=2"]):
        surgery.compare(m, tok, specs, text=TEXT, max_new_tokens=2)
    assert sha256s(d) == hashes


@pytest.mark.parametrize("arch", ["qwen3", "gemma2"])
def test_norm_layer_computes_layer_norm_with_the_same_gain(models, arch):
    m = models[arch]
    old_block, old_q = m.layers[0].attn_norm, m.layers[0].attn.q_norm
    seen = {}
    with surgery.apply(m, ["norm=layer"]) as done:
        new_block, new_q = m.layers[0].attn_norm, m.layers[0].attn.q_norm
        assert isinstance(new_block, LayerNorm) and new_block.bias is None
        for name, mod in (("block", new_block), ("q", new_q)):
            if mod is not None:
                mod.register_forward_hook(lambda _m, i, o, name=name: seen.update({name: (i[0], o)}))
        logits(m, ids_for(m))
    assert "RMSNorm" in done.notes[0]
    for name, old in (("block", old_block), ("q", old_q)):
        if old is None:
            continue
        x, y = seen[name]
        expect = F.layer_norm(x, x.shape[-1:], old.gain(), None, old.eps)  # Gemma: gain = 1 + w
        torch.testing.assert_close(y, expect, rtol=0, atol=1e-6)
        assert not torch.allclose(y, old(x), atol=1e-3)  # and it is not the RMSNorm any more
    assert arch != "gemma2" or old_block.offset == 1.0


def test_norm_rms_on_gpt2_drops_the_bias_and_says_so(models):
    m = models["gpt2"]
    ln = m.layers[0].attn_norm
    with torch.no_grad():
        ln.bias.fill_(0.25)
    try:
        seen = {}
        with surgery.apply(m, "norm=rms") as done:
            new = m.layers[0].attn_norm
            assert isinstance(new, RMSNorm)
            new.register_forward_hook(lambda _m, i, o: seen.update(x=i[0], y=o))
            logits(m, ids_for(m))
        x = seen["x"]
        torch.testing.assert_close(seen["y"], x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + ln.eps)
                                   * ln.weight, rtol=0, atol=1e-6)
        assert any("dropped the bias" in n and "0.25" in n for n in done.notes)
    finally:
        with torch.no_grad():
            ln.bias.zero_()


@pytest.mark.parametrize("arch", ["qwen3", "olmo2"])
def test_residual_scale_one_is_identity_and_zero_leaves_embeddings_and_head(models, arch):
    m = models[arch]
    ids = ids_for(m)
    before = logits(m, ids)
    with surgery.apply(m, ["residual-scale=1"]):
        assert torch.equal(logits(m, ids), before)
    for specs in (["residual-scale=0"], ["attn-scale=0", "mlp-scale=0"]):
        with surgery.apply(m, specs):
            zero = logits(m, ids)
        with torch.inference_mode():
            torch.testing.assert_close(zero, m.logits(m.final_norm(m.embed(ids))), rtol=0, atol=0)
    with surgery.apply(m, ["residual-scale=2"]):
        assert not torch.allclose(logits(m, ids), before)


@pytest.mark.parametrize("arch", ["qwen3", "olmo2", "gemma2"])
def test_branch_scale_multiplies_exactly_what_the_block_adds(models, arch):
    """With attn-scale=0 the first block adds F * (its MLP branch, post-norm included) to x: the hook
    must sit on the module whose output is added (a post-norm would undo a scale applied before it)."""
    m = models[arch]
    blk, seen = m.layers[0], {}
    h = blk.register_forward_hook(lambda _m, i, o: seen.update(x=i[0], out=o))
    try:
        with surgery.apply(m, ["attn-scale=0", "mlp-scale=3"]) as done:
            logits(m, ids_for(m))
    finally:
        h.remove()
    x = seen["x"]
    norm = (lambda t: t) if blk.mlp_norm is None else blk.mlp_norm
    post = (lambda t: t) if blk.mlp_post_norm is None else blk.mlp_post_norm
    with torch.inference_mode():
        torch.testing.assert_close(seen["out"], x + 3 * post(blk.mlp(norm(x))), rtol=1e-5, atol=1e-5)
    assert ("post-norm" if blk.mlp_post_norm is not None else "branch") in done.notes[-1]


def test_gemma2_softcaps_removed_changed_added(models):
    m = models["gemma2"]
    ids = ids_for(m, 16)
    before = logits(m, ids)
    assert before.abs().max() < 3.0
    with surgery.apply(m, ["softcap=off"]) as done:
        uncapped = logits(m, ids)
    assert "removed the final logit soft-cap (3)" in done.notes[0]
    assert uncapped.max() > 3.0 and not torch.allclose(uncapped, before)
    with surgery.apply(m, ["attn-softcap=off"]):
        assert m.layers[1].attn.softcap is None
        assert not torch.allclose(logits(m, ids), before)
    with surgery.apply(m, ["softcap=1"]) as done:
        assert logits(m, ids).abs().max() <= 1.0  # tanh saturates to exactly 1 in fp32
    assert "changed the final logit soft-cap from 3 to 1" in done.notes[0]
    with surgery.apply(models["qwen3"], ["softcap=0.5"]) as done:
        assert logits(models["qwen3"], ids_for(models["qwen3"])).abs().max() <= 0.5
    assert "added a final logit soft-cap of 0.5" in done.notes[0]
    assert m.final_softcap == 3.0 and all(layer.attn.softcap == 2.0 for layer in m.layers)


@pytest.mark.parametrize("spec,words", [
    ("softcap=off", ["Qwen3ForCausalLM has no final logit soft-cap", "final_softcap=None"]),
    ("attn-softcap=off", ["Qwen3ForCausalLM has no attention soft-cap", "softcap=None"]),
    ("bogus=1", ["unknown surgery 'bogus'", "final-norm=off"]),
    ("residual-scale=abc", ["bad value 'abc' for residual-scale", "not a number"]),
    ("residual-scale=-1", ["bad value '-1'", ">= 0"]),
    ("mlp-scale=nan", ["bad value 'nan'", "finite"]),
    ("softcap=0", ["bad value '0' for softcap", "> 0"]),
    ("softmax-dtype=int8", ["bad value 'int8' for softmax-dtype", "float16"]),
    ("softmax=fast", ["bad value 'fast' for softmax", "naive|safe|online"]),
    ("norm=batch", ["bad value 'batch' for norm", "layer|rms"]),
    ("final-norm=on", ["can only be taken out"]),
    ("residual-scale", ["needs a value"]),
])
def test_refusals_name_the_problem(models, spec, words):
    with pytest.raises(SurgeryError) as err, surgery.apply(models["qwen3"], [spec]):
        pass
    assert all(w in str(err.value) for w in words), str(err.value)
    assert isinstance(err.value, SluiceError)


def test_more_refusals(models):
    with pytest.raises(SurgeryError, match="no RMSNorm to replace.*LayerNorm"), \
            surgery.apply(models["gpt2"], ["norm=layer"]):
        pass
    with pytest.raises(SurgeryError, match="given more than once"):
        surgery.parse(["softcap=1", "softcap=2"])
    with pytest.raises(SurgeryError, match="a string NAME"):
        surgery.parse([3.0])
    assert [str(s) for s in surgery.parse(["Final-Norm", " softmax-dtype = fp16 ", "softcap=30"])] == \
        ["final-norm=off", "softmax-dtype=float16", "softcap=30.0"]


def test_naive_fp16_softmax_overflows_on_logits_past_11(dirs, models):
    m, tok = models["qwen3-big"], sluice.Tokenizer.from_pretrained(dirs["qwen3-big"])
    data = surgery.compare(m, tok, ["softmax=naive", "softmax-dtype=float16"], text=TEXT, max_new_tokens=3)
    b, a = data["before"], data["after"]
    assert a["logit_max"] > 11.1 and a["overflow_threshold"] == pytest.approx(11.09, abs=0.01)
    assert a["logits_over_threshold"] > 0 and a["exp_overflow"] > 0 and a["nonfinite_probs"] > 0
    assert a["rows_broken"] > 0 and not math.isfinite(a["bits_per_byte"])
    assert math.isfinite(b["bits_per_byte"]) and b["exp_overflow"] == b["nonfinite_probs"] == 0
    assert a["continuation_ids"] == b["continuation_ids"]  # the model itself is unchanged
    safe = surgery.compare(m, tok, ["softmax=safe", "softmax-dtype=float16"], text=TEXT, max_new_tokens=0)
    assert safe["after"]["exp_overflow"] == 0 and math.isfinite(safe["after"]["bits_per_byte"])
    json.dumps(data)  # JSON-able (inf stays a float; the CLI writes it as "inf")


def reference_bpb(hf_model, tok_file: Path, text: str, window: int) -> float:
    """transformers' logits + torch cross-entropy over the same windows, bytes from the offsets."""
    enc = HFTokenizer.from_file(str(tok_file)).encode(text)
    ids = enc.ids
    nats = 0.0
    for s in range(0, len(ids) - 1, window):
        y = torch.tensor(ids[s + 1:s + window + 1])
        with torch.no_grad():
            out = hf_model(torch.tensor([ids[s:s + len(y)]])).logits[0]
        nats += float(F.cross_entropy(out.double(), y, reduction="sum"))
    first_scored = enc.offsets[1][0] if enc.special_tokens_mask[0] == 0 else 0
    return nats / math.log(2) / len(text[first_scored:].encode("utf-8"))


@pytest.mark.parametrize("name,arch,kw", [("qwen3", "qwen3", {}), ("llama-bos", "llama", {"kind": "llama"}),
                                          ("qwen3-short", "qwen3", {"max_position_embeddings": 16})])
def test_bits_per_byte_matches_transformers_cross_entropy(tmp_path, dirs, models, name, arch, kw):
    hf = build_with_tokenizer(tmp_path, arch, **kw)  # same seed: the same weights as dirs[name]
    tok = sluice.Tokenizer.from_pretrained(dirs[name])
    data = surgery.compare(models[name], tok, ["residual-scale=1"], text=TEXT, max_new_tokens=1)
    window = models[name].config.max_position_embeddings
    assert data["text"]["window"] == window and data["text"]["tokens"] > (window if window < 20 else 2)
    expect = reference_bpb(hf, dirs[name] / "tokenizer.json", TEXT, window)
    assert data["before"]["bits_per_byte"] == pytest.approx(expect, rel=1e-5)
    assert data["after"]["bits_per_byte"] == pytest.approx(expect, rel=1e-5)


def test_compare_bounds_and_default_text(dirs, models):
    m, tok = models["qwen3"], sluice.Tokenizer.from_pretrained(dirs["qwen3"])
    with pytest.raises(ObservatoryError, match="max_new_tokens"):
        surgery.compare(m, tok, ["final-norm=off"], text=TEXT, max_new_tokens=10**9)
    with pytest.raises(ObservatoryError, match="over the limit"):
        surgery.compare(m, tok, ["final-norm=off"], text="x" * (1 << 20))
    with pytest.raises(ObservatoryError, match="over the model's context"):
        surgery.compare(m, tok, ["final-norm=off"], text=TEXT, prompt="a b " * 400, max_new_tokens=4)


def test_sluice_surgery_is_exported():
    assert sluice.surgery is surgery and callable(sluice.surgery.apply)


@pytest.mark.slow
def test_cli_json_table_and_bad_input(dirs, capsys, tmp_path):
    d = str(dirs["qwen3"])
    assert main(["inspect", "--model", d, "--surgery", "final-norm=off", "--json", "some text"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["surgeries"] == ["final-norm=off"] and data["before"]["bits_per_byte"] > 0
    # no recipe.toml beside this model: the bundled model's held-out text, with a note saying so
    assert "no recipe.toml" in data["text"]["note"] and "held-out split" in data["text"]["source"]
    assert 4000 < data["text"]["bytes"] <= 8192
    assert data["after"]["logit_max"] != data["before"]["logit_max"]
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    assert main(["inspect", "--model", d, "--surgery", "norm=layer", "--surgery", "softmax-dtype=bf16",
                 "--text", str(f), "def add("]) == 0
    out = capsys.readouterr().out
    assert "bits per byte" in out and "greedy continuation" in out and "safe bf16" in out
    for argv, words in ((["--surgery", "residual-scale=abc"], "not a number"),
                        (["--surgery", "softcap=off"], "Qwen3ForCausalLM has no final logit soft-cap"),
                        (["--text", str(f)], "only applies with --surgery"),
                        (["--surgery", "final-norm=off", "--out", str(tmp_path / "o")], "does not combine"),
                        (["--surgery", "final-norm=off", "--text", str(tmp_path / "nope")], "no such file")):
        assert main(["inspect", "--model", d, *argv, "x"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err and "Traceback" not in err, err
    # checked before the (slow) load: a bad surgery is named even when the model does not exist
    assert main(["inspect", "--model", str(tmp_path / "no-model"), "--surgery", "bogus", "x"]) == 2
    assert "unknown surgery 'bogus'" in capsys.readouterr().err
