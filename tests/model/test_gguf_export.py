"""`sluice export-gguf`: tiny random checkpoints written as GGUF and read back with the gguf package.

Every tensor must come back with llama.cpp's name and shape and sluice's values (q/k rows undone
from llama.cpp's interleaved RoPE layout for the llama architecture), the hyperparameters and the
tokenizer as the checkpoint has them; reduced precisions within their rounding.
"""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

import sluice  # noqa: E402
from ckpt import build, build_with_tokenizer  # noqa: E402
from sluice.model import gguf_export  # noqa: E402
from sluice.model.gguf_export import ExportError, export_gguf, rope_deinterleave, rope_interleave  # noqa: E402
from sluice.engine.gemv import cpu_flags  # noqa: E402
from sluice.model.layers import apply_rope, rope_tables  # noqa: E402

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
# Non-default values everywhere, so a key copied from the wrong field (or a default) shows up.
CASES = {
    # Untied head, biases on q/k/v/o (the q/k biases are reordered like the rows), Llama 3 RoPE scaling.
    "llama": dict(arch="llama", kind="llama", tie_word_embeddings=False, attention_bias=True,
                  rope_theta=50000.0, max_position_embeddings=384, rope_scaling=LLAMA3_ROPE),
    # Tied head (no output tensor), per-head q/k norms, head_dim independent of the width.
    "qwen3": dict(arch="qwen3", kind="qwen", tie_word_embeddings=True, rope_theta=1e6,
                  max_position_embeddings=320),
}
EPS = {"llama": 1e-5, "qwen3": 3e-6}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    name = request.param
    d = tmp_path_factory.mktemp(f"gguf-{name}")
    build_with_tokenizer(d, **CASES[name])
    # rms_norm_eps is set in config.json afterwards: passing it to build() keeps the norm gains at 1.
    cfg = json.loads((d / "config.json").read_text())
    cfg["rms_norm_eps"] = EPS[name]
    (d / "config.json").write_text(json.dumps(cfg))
    return name, d, sluice.load(d, "float32")


def _export(case, tmp_path, outtype):
    name, d, model = case
    summary = export_gguf(d, tmp_path / f"{name}-{outtype}.gguf", outtype)
    return summary, gguf.GGUFReader(summary["path"])


def _field(reader, key):
    return reader.fields[key].contents()


def _sluice_tensors(model):
    """sluice name -> (llama.cpp name, tensor in HF layout), what the file must hold."""
    cfg, out = model.config, {}
    blocks = {"attn_norm": "attn_norm", "attn.q": "attn_q", "attn.k": "attn_k", "attn.v": "attn_v",
              "attn.o": "attn_output", "attn.q_norm": "attn_q_norm", "attn.k_norm": "attn_k_norm",
              "mlp_norm": "ffn_norm", "mlp.gate": "ffn_gate", "mlp.up": "ffn_up", "mlp.down": "ffn_down"}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        parts = name.split(".")
        if parts[0] == "layers":
            theirs = f"blk.{parts[1]}.{blocks['.'.join(parts[2:-1])]}.{parts[-1]}"
        else:
            theirs = {"embed": "token_embd", "final_norm": "output_norm", "lm_head": "output"}[parts[0]] + "." + parts[-1]
        out[name] = (theirs, t)
    return out


def _read(reader):
    """llama.cpp name -> (float32 array in numpy (rows, cols) order, GGML type)."""
    return {t.name: (gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist()))),
                     t.tensor_type) for t in reader.tensors}


def _hf_layout(name, arr, cfg, arch):
    t = torch.from_numpy(np.array(arr))
    if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
        t = rope_deinterleave(t, cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads)
    return t


def test_f32_round_trip_tensors(case, tmp_path):
    name, d, model = case
    cfg = model.config
    summary, reader = _export(case, tmp_path, "f32")
    arch = {"llama": "llama", "qwen3": "qwen3"}[name]
    assert summary["arch"] == arch and summary["outtype"] == "f32"
    got = _read(reader)
    want = _sluice_tensors(model)
    extra = {"rope_freqs.weight"} if name == "llama" else set()
    assert set(got) == {g for g, _ in want.values()} | extra
    assert summary["tensors"] == len(got) and summary["bytes"] == Path(summary["path"]).stat().st_size
    assert ("output.weight" in got) == (not cfg.tie_word_embeddings)
    for theirs, t in want.values():
        arr, qtype = got[theirs]
        assert qtype == gguf.GGMLQuantizationType.F32, theirs
        assert tuple(arr.shape) == tuple(t.shape), theirs
        assert torch.equal(_hf_layout(theirs, arr, cfg, arch), t), theirs
    if name == "llama":
        # llama.cpp divides each pair's frequency by rope_freqs: Llama 3's rule, written out here.
        base = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
        wavelen = 2 * math.pi / base
        lo, hi = 64 / LLAMA3_ROPE["low_freq_factor"], 64 / LLAMA3_ROPE["high_freq_factor"]
        smooth = (64 / wavelen - 1.0) / (4.0 - 1.0)
        expect = torch.where(wavelen < hi, 1.0, torch.where(wavelen > lo, 4.0, 1 / ((1 - smooth) / 4.0 + smooth)))
        torch.testing.assert_close(torch.from_numpy(np.array(got["rope_freqs.weight"][0])), expect)


def test_f32_round_trip_metadata_and_tokenizer(case, tmp_path):
    name, d, model = case
    cfg = model.config
    _, reader = _export(case, tmp_path, "f32")
    arch = _field(reader, "general.architecture")
    raw = json.loads((d / "config.json").read_text())
    expect = {"block_count": raw["num_hidden_layers"], "context_length": raw["max_position_embeddings"],
              "embedding_length": raw["hidden_size"], "feed_forward_length": raw["intermediate_size"],
              "attention.head_count": raw["num_attention_heads"],
              "attention.head_count_kv": raw["num_key_value_heads"], "vocab_size": raw["vocab_size"],
              "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim}
    for key, value in expect.items():
        assert _field(reader, f"{arch}.{key}") == value, key
    assert _field(reader, f"{arch}.rope.freq_base") == pytest.approx(CASES[name]["rope_theta"])
    assert _field(reader, f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(EPS[name], rel=1e-6)
    assert _field(reader, "general.file_type") == gguf.LlamaFileType.ALL_F32
    if name == "llama":
        assert _field(reader, "llama.rope.dimension_count") == cfg.head_dim

    tok = json.loads((d / "tokenizer.json").read_text())
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    by_id = {i: t for t, i in tok["model"]["vocab"].items()} | {a["id"]: a["content"] for a in tok["added_tokens"]}
    assert len(tokens) == raw["vocab_size"] and tokens == [by_id[i] for i in range(len(tokens))]
    for a in tok["added_tokens"]:
        assert types[a["id"]] == (gguf.TokenType.CONTROL if a["special"] else gguf.TokenType.USER_DEFINED)
    assert types[tok["model"]["vocab"][tokens[300]]] == gguf.TokenType.NORMAL
    merges = [" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]]
    assert _field(reader, "tokenizer.ggml.merges") == merges
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    assert _field(reader, "tokenizer.ggml.pre") == {"llama": "llama-bpe", "qwen3": "qwen2"}[name]
    tc = json.loads((d / "tokenizer_config.json").read_text())
    assert _field(reader, "tokenizer.chat_template") == tc["chat_template"]
    # As llama.cpp's converter: tokenizer_config.json's named tokens first, config.json's ids after.
    assert _field(reader, "tokenizer.ggml.eos_token_id") == tokens.index(tc["eos_token"])
    if name == "llama":
        assert _field(reader, "tokenizer.ggml.bos_token_id") == tokens.index("<|begin_of_text|>")
        assert _field(reader, "tokenizer.ggml.add_bos_token") is True
    else:
        assert _field(reader, "tokenizer.ggml.add_bos_token") is False
        assert _field(reader, "tokenizer.ggml.padding_token_id") == tokens.index("<|endoftext|>")


@pytest.mark.parametrize("outtype", ["f16", "bf16", "q8_0", "q4_0"])
def test_reduced_precision_within_rounding(case, tmp_path, outtype):
    name, d, model = case
    cfg = model.config
    summary, reader = _export(case, tmp_path, outtype)
    got = _read(reader)
    q = gguf.GGMLQuantizationType
    matrix = {"f16": q.F16, "bf16": q.BF16, "q8_0": q.Q8_0, "q4_0": q.Q4_0}[outtype]
    assert _field(reader, "general.file_type") == {"f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2}[outtype]
    for theirs, t in _sluice_tensors(model).values():
        arr, qtype = got[theirs]
        back = _hf_layout(theirs, arr, cfg, summary["arch"])
        if t.dim() == 1:  # norm gains and biases stay f32, exactly
            assert qtype == q.F32 and torch.equal(back, t), theirs
        elif outtype in ("q8_0", "q4_0") and t.shape[1] % 32:  # ffn_down of width 112: not whole blocks
            assert qtype == q.F16 and torch.equal(back, t.half().float()), theirs
        elif outtype == "q4_0":
            assert qtype == q.Q4_0, theirs
            _assert_q4_0_error(t, back, theirs)
        elif outtype == "q8_0":
            assert qtype == q.Q8_0, theirs
            # Each block of 32 stores round(x / d), d = max|x| / 127, with d kept in fp16 (relative
            # error 2^-11): |error| <= d / 2 + 127 * d * 2^-11.
            blocks = t.reshape(-1, 32)
            step = blocks.abs().amax(dim=1, keepdim=True) / 127
            err = (back.reshape(-1, 32) - blocks).abs()
            assert bool((err <= step * (0.5 + 127 * 2**-11) + 1e-7).all()), theirs
            assert err.max() > 0  # really quantized
        else:
            assert qtype == matrix, theirs
            rounded = t.to(torch.float16 if outtype == "f16" else torch.bfloat16).float()
            assert torch.equal(back, rounded), theirs  # round to nearest even, as torch does
    smaller = export_gguf(d, tmp_path / "f32.gguf", "f32")["bytes"]
    assert summary["bytes"] < smaller


def _assert_q4_0_error(t, back, name):
    """Q4_0 stores, per block of 32, d = m / -8 (m the value of largest magnitude, d kept in fp16)
    and codes min(15, trunc(x / d + 8.5)), read back as (code - 8) * d: within half a step |d| / 2
    of x, but within a whole step for the values near -m, whose code 16 is clipped to 15; plus up to
    8 codes times d's fp16 rounding (relative 2^-11)."""
    blocks = t.reshape(-1, 32)
    m = blocks.gather(1, blocks.abs().argmax(1, keepdim=True))  # (blocks, 1)
    step = (m.abs() / 8).expand_as(blocks)
    err = (back.reshape(-1, 32) - blocks).abs()
    assert bool((err <= step * (1 + 8 * 2**-11) + 1e-7).all()), name
    clipped = err > step * (0.5 + 8 * 2**-11) + 1e-7
    assert bool(((blocks + m).abs()[clipped] <= step[clipped] / 2 + 1e-7).all()), name
    assert err.max() > 0  # really quantized


def test_interleaved_rows_are_what_llama_cpp_rope_expects():
    """HF's rotate-half RoPE on q, then rows reordered, equals llama.cpp's adjacent-pair RoPE on
    the reordered rows: so attention scores (q . k) are the same in both engines."""
    torch.manual_seed(0)
    heads, D, T = 3, 8, 5
    q = torch.randn(1, T, heads, D)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    cos, sin = rope_tables(inv_freq, torch.arange(T)[None], torch.float32)
    hf = apply_rope(q, cos, sin)  # (1, T, H, D)

    def interleaved_rope(x):  # llama.cpp's normal rope: rotate (x[2i], x[2i+1]) by angle_i
        angle = torch.arange(T)[:, None].float() * inv_freq  # (T, D/2)
        c, s = angle.cos()[None, :, None], angle.sin()[None, :, None]
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)

    def rows(x):  # the per-head row order of a (H*D,) projection applied to activations
        return rope_interleave(x.reshape(-1, heads * D).T, heads).T.reshape(x.shape)
    torch.testing.assert_close(interleaved_rope(rows(q)), rows(hf))
    w = torch.randn(heads * D, 4)
    assert torch.equal(rope_deinterleave(rope_interleave(w, heads), heads), w)


def test_interrupted_export_leaves_nothing(tiny_dir, tmp_path, monkeypatch):
    target = tmp_path / "model.gguf"
    target.write_bytes(b"old")
    calls = []

    def failing(t, qtype):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(t, qtype)
    real = gguf_export._encode
    monkeypatch.setattr(gguf_export, "_encode", failing)
    with pytest.raises(KeyboardInterrupt):
        export_gguf(tiny_dir, target, "f16")
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_not_enough_disk_space_is_refused(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_export.shutil, "disk_usage", lambda p: type("U", (), {"free": 1000})())
    with pytest.raises(ExportError, match="not enough free disk space"):
        export_gguf(tiny_dir, tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []


def sluice_cli(*args):  # timeout: a hang-stopper, 10x+ the ~12 s a CLI run on a tiny model takes here
    return subprocess.run([sys.executable, "-m", "sluice", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_cli_writes_the_file(tiny_dir, tmp_path):
    out = tmp_path / "tiny.gguf"
    r = sluice_cli("export-gguf", "--model", str(tiny_dir), "--out", str(out), "--outtype", "q8_0", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert out.is_file() and summary["bytes"] == out.stat().st_size and summary["outtype"] == "q8_0"
    assert gguf.GGUFReader(out).fields["general.architecture"].contents() == "qwen3"


def test_cli_refuses_an_unsupported_family(tmp_path):
    build(tmp_path / "gpt2", "gpt2")
    r = sluice_cli("export-gguf", "--model", str(tmp_path / "gpt2"), "--out", str(tmp_path / "x.gguf"))
    assert r.returncode == 2
    assert "GPT2LMHeadModel" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "x.gguf").exists()


def test_cli_refuses_a_bad_outtype(tmp_path):
    r = sluice_cli("export-gguf", "--out", str(tmp_path / "x.gguf"), "--outtype", "q4_k")
    assert r.returncode == 2 and "q4_k" in r.stderr and "Traceback" not in r.stderr
    assert re.search(r"choose from .*q8_0.*q4_0", r.stderr)  # the choices, listed (quoted or not, by Python version)
    assert not (tmp_path / "x.gguf").exists()


def test_bad_outtype_from_python_names_the_choices(tiny_dir, tmp_path):
    with pytest.raises(sluice.errors.ConfigError, match="one of f32, f16, bf16, q8_0, q4_0, got 'q4_k'"):
        export_gguf(tiny_dir, tmp_path / "x.gguf", "q4_k")


ROOT = Path(__file__).resolve().parents[2]
CONVERTER = ROOT.parent / "shared" / "peers" / "convert-to-gguf.py"
SDIST = ROOT / ".peers" / "sdist" / "llama_cpp_python-0.3.36"


@pytest.mark.slow
@pytest.mark.skipif(not (CONVERTER.is_file() and (SDIST / "vendor" / "llama.cpp").is_dir()),
                    reason="llama.cpp's converter is not unpacked (see ../shared/peers/README.md)")
def test_same_file_as_llama_cpp_converter(case, tmp_path):
    """llama.cpp's own convert_hf_to_gguf.py on the same checkpoint: every tensor byte-identical
    (names, types, shapes, q/k row order, Q8_0 blocks) and every shared key equal."""
    pytest.importorskip("transformers")
    name, d, _ = case
    ref = tmp_path / "ref.gguf"
    r = subprocess.run([sys.executable, str(CONVERTER), str(SDIST), str(d), "--outtype", "q8_0",
                        "--outfile", str(ref)], capture_output=True, text=True, timeout=300)  # hang-stopper, 10x+
    assert r.returncode == 0, r.stderr[-2000:]
    ours = gguf.GGUFReader(export_gguf(d, tmp_path / "ours.gguf", "q8_0")["path"])
    theirs = gguf.GGUFReader(ref)
    a, b = {t.name: t for t in ours.tensors}, {t.name: t for t in theirs.tensors}
    assert set(a) == set(b)
    for n in b:
        assert a[n].tensor_type == b[n].tensor_type and list(a[n].shape) == list(b[n].shape), n
        if n == "rope_freqs.weight":  # sluice's own scaled frequencies, divided: equal to an ulp
            np.testing.assert_allclose(a[n].data, b[n].data, rtol=1e-6)
        else:
            assert np.array_equal(np.asarray(a[n].data), np.asarray(b[n].data)), n
    # The converter cannot name a locally trained tokenizer's split (the wrapper says qwen2) and
    # titles the model name; everything else both write must agree.
    skip = {"general.name", "tokenizer.ggml.pre"}
    kb = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.") and k not in skip}
    ka = {k: f.contents() for k, f in ours.fields.items() if k in kb}
    assert set(ka) == set(kb)
    for k, v in kb.items():
        assert ka[k] == (pytest.approx(v) if isinstance(v, float) else v), k


# On a CPU with AMX, the llama.cpp that llama-cpp-python 0.3.36 vendors dies on its first AMX Q4_0/Q8_0 matmul
# (bench/llama_cpp_no_amx_flags.sh says why): there the peer is its build without AMX, where one was made
# (bench/build_llama_cpp_no_amx.sh), as `sluice bench` uses it.
_NO_AMX_PYTHON = ROOT / ".peers" / "lcpp-noamx-venv" / "bin" / "python"
LCPP_PYTHON = (_NO_AMX_PYTHON if "amx_tile" in cpu_flags() and _NO_AMX_PYTHON.is_file()
               else ROOT / ".peers" / "lcpp-venv" / "bin" / "python")
# Runs in llama-cpp-python's own venv: token ids in, llama.cpp's logits at every position out.
_LCPP_LOGITS = """
import json, sys
import numpy as np
from llama_cpp import Llama
path, ids, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
llm = Llama(model_path=path, n_ctx=256, n_threads=2, logits_all=True, verbose=False)
llm.eval(ids)
np.save(out, np.array(llm.scores[:len(ids)], dtype=np.float32))
"""


@pytest.mark.slow
@pytest.mark.skipif(not LCPP_PYTHON.is_file(), reason="llama-cpp-python is not built (../shared/peers/README.md)")
def test_llama_cpp_computes_the_same_logits(case, tmp_path):
    """llama.cpp itself runs the f32 export: its logits at every position equal sluice's to the
    rounding of its f16 KV cache, so names, q/k row order, RoPE (and its Llama 3 scaling), norms and biases all agree."""
    name, d, model = case
    _assert_llama_cpp_logits(export_gguf(d, tmp_path / "m.gguf", "f32")["path"], model, tmp_path)


def _assert_llama_cpp_logits(path, model, tmp_path):
    ids = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    theirs = _llama_cpp_logits(path, ids, tmp_path)
    with torch.inference_mode():
        ours = model(torch.tensor([ids]))[0]
    # llama.cpp keeps its KV cache in f16 by default: differences of ~1e-3 of the logit range.
    assert (theirs - ours).abs().max() < 5e-3 * ours.abs().max()
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1))


# Runs in llama-cpp-python's venv: llama.cpp's own quantizer (llama-quantize --pure), GGUF in, GGUF out.
_LCPP_QUANTIZE = """
import ctypes, sys
import llama_cpp as lc
p = lc.llama_model_quantize_default_params()
p.ftype, p.pure, p.nthread = getattr(lc, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3]), True, 2
sys.exit(lc.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))
"""


@pytest.mark.slow
@pytest.mark.skipif(not LCPP_PYTHON.is_file(), reason="llama-cpp-python is not built (../shared/peers/README.md)")
def test_q4_0_blocks_are_llama_quantize_s(case, tmp_path):
    """llama.cpp's converter writes no Q4_0; its quantizer does. `llama-quantize --pure` of the f32
    export to Q4_0 gives byte for byte the tensors of sluice's q4_0 export (and the same F16 fallback
    for rows that are not whole blocks of 32)."""
    name, d, _ = case
    f32 = export_gguf(d, tmp_path / "f32.gguf", "f32")["path"]
    r = subprocess.run([str(LCPP_PYTHON), "-c", _LCPP_QUANTIZE, f32, str(tmp_path / "ref.gguf"), "Q4_0"],
                       capture_output=True, text=True, timeout=300)  # a hang-stopper, 10x+ the seconds it takes
    assert r.returncode == 0, r.stderr[-2000:]
    ours = gguf.GGUFReader(export_gguf(d, tmp_path / "ours.gguf", "q4_0")["path"])
    theirs = gguf.GGUFReader(tmp_path / "ref.gguf")
    a, b = {t.name: t for t in ours.tensors}, {t.name: t for t in theirs.tensors}
    assert set(a) == set(b)
    assert any(t.tensor_type == gguf.GGMLQuantizationType.Q4_0 for t in b.values())
    for n in b:
        assert a[n].tensor_type == b[n].tensor_type and list(a[n].shape) == list(b[n].shape), n
        assert np.array_equal(np.asarray(a[n].data), np.asarray(b[n].data)), n
    assert _field(ours, "general.file_type") == _field(theirs, "general.file_type") == gguf.LlamaFileType.MOSTLY_Q4_0


@pytest.mark.slow
@pytest.mark.skipif(not LCPP_PYTHON.is_file(), reason="llama-cpp-python is not built (../shared/peers/README.md)")
def test_llama_cpp_runs_the_q4_0_export(case, tmp_path):
    """llama.cpp runs the q4_0 file as the function sluice computes with the file's own (dequantized)
    weights: logits within 6e-2 of the logit range at worst and 1e-2 on average, and the same
    greedy pick at all but a few of the 40 positions (random weights give near ties). The bound is
    llama.cpp's, not the file's: it rounds each activation row to Q8_0 blocks before a quantized
    matmul and keeps its KV cache in f16 (measured here: q4_0 3.2% / 2.1% at worst, 0.4% / 0.3% on
    average, for qwen3 / llama; its own q8_0 runs 4.1% / 1.8% at worst). Against sluice's fp32
    weights the greedy picks part at about half the positions: 4 bits on random weights."""
    name, d, model = case
    path = export_gguf(d, tmp_path / "m.gguf", "q4_0")["path"]
    cfg, got = model.config, _read(gguf.GGUFReader(path))
    deq = sluice.load(d, "float32")  # a fresh copy: the fixture's model is shared
    with torch.no_grad():
        for sname, (theirs, t) in _sluice_tensors(model).items():
            deq.get_parameter(sname).copy_(_hf_layout(theirs, got[theirs][0], cfg, "llama" if name == "llama" else "qwen3"))
    if cfg.tie_word_embeddings:
        assert deq.lm_head.weight.data_ptr() == deq.embed.weight.data_ptr()  # the head reads the copied table
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    theirs_logits = _llama_cpp_logits(path, ids, tmp_path)
    with torch.inference_mode():
        ours = deq(torch.tensor([ids]))[0]
    diff, scale = (theirs_logits - ours).abs(), ours.abs().max()
    assert diff.max() < 6e-2 * scale and diff.mean() < 1e-2 * scale
    assert (theirs_logits.argmax(-1) == ours.argmax(-1)).sum() >= 36


def _llama_cpp_logits(path, ids, tmp_path):
    r = subprocess.run([str(LCPP_PYTHON), "-c", _LCPP_LOGITS, path, json.dumps(ids), str(tmp_path / "l.npy")],
                       capture_output=True, text=True, timeout=300)  # a hang-stopper, 10x+ the ~15 s here
    assert r.returncode == 0, r.stderr[-2000:]
    return torch.from_numpy(np.load(tmp_path / "l.npy"))


@pytest.mark.slow
@pytest.mark.parametrize("tokenizer", ["none", "word-level"])
def test_without_a_bpe_tokenizer_the_file_has_no_vocabulary(tmp_path, tokenizer):
    """Random checkpoints for benchmarks carry no tokenizer or a word-level one: the weights are
    still written, with tokenizer model "none" (llama.cpp then runs on token ids)."""
    from tokenizers import Tokenizer, models
    d = tmp_path / "ckpt"
    build(d, "qwen3")
    if tokenizer == "word-level":
        Tokenizer(models.WordLevel({f"t{i}": i for i in range(96)}, unk_token="t0")).save(str(d / "tokenizer.json"))
    summary = export_gguf(d, tmp_path / "m.gguf", "f32")
    reader = gguf.GGUFReader(summary["path"])
    assert _field(reader, "tokenizer.ggml.model") == "none" and "tokenizer.ggml.tokens" not in reader.fields
    assert _field(reader, "qwen3.vocab_size") == 96 and summary["tokens"] == 0
    assert any("no tokenizer written" in n for n in summary["notes"])
    if LCPP_PYTHON.is_file():
        _assert_llama_cpp_logits(summary["path"], sluice.load(d), tmp_path)


def test_qwen3_with_attention_bias_is_refused(tmp_path):
    build(tmp_path / "q", "qwen3", attention_bias=True)  # an o_proj bias llama.cpp's qwen3 never reads
    with pytest.raises(sluice.errors.ConfigError, match="attention_bias"):
        export_gguf(tmp_path / "q", tmp_path / "q.gguf")
    assert not (tmp_path / "q.gguf").exists()
