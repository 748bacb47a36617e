"""The tuned lens: translators that must learn a planted affine map, saving and loading with its checks,
and `sluice lens train` end to end."""

import json
from pathlib import Path

import pytest
import torch

import sluice
from ckpt import build, build_with_tokenizer
from sluice.cli import main
from sluice.errors import ObservatoryError
from sluice.observatory import tuned_lens as tl
from sluice.observatory.tuned_lens_fit import fit, layer_kl

# wide enough LM-head rows that a random stream gives a peaked distribution (a flat one would make
# every lens's KL small and the test say little)
SHAPE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, initializer_range=1.0)


@pytest.fixture(autouse=True)
def one_thread():
    """Hundreds of tiny steps: with two OpenMP threads on a busy 2-core machine each step waited ~20x
    longer for its threads than it computed (13 s against 0.7 s for 50 steps)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    d = tmp_path_factory.mktemp("tuned-small")
    build(d, "qwen3", **SHAPE)
    return d


def planted(model, n: int, seed: int):
    """Streams (L+1, n, C) where x_l = s_l Q_l x_L + d_l: a known invertible affine map of the final
    stream (Q_l a random rotation, s_l a scale, d_l a shift); returns them and the maps."""
    g = torch.Generator().manual_seed(seed)
    L, C = model.config.num_layers, model.config.hidden_size
    x_L = torch.randn(n, C, generator=g)
    maps, rows = [], []
    for l in range(L):
        q, _ = torch.linalg.qr(torch.randn(C, C, generator=g))
        m = (0.5 + l) * q
        d = 0.3 * torch.randn(C, generator=g)
        maps.append((m, d))
        rows.append(x_L @ m.T + d)
    return torch.stack([*rows, x_L]), maps


def test_translators_recover_a_planted_affine_map(small):
    model = sluice.load(small)
    streams, maps = planted(model, 5120, seed=0)
    train, held = streams[:, :4096], streams[:, 4096:]  # judged on streams it was not fitted on
    lens, losses = fit(model, train, steps=800, batch=512, lr=5e-2)
    assert losses[-1] < 0.01 * losses[0]
    logit, tuned = layer_kl(model, held), layer_kl(model, held, lens)
    for l, (m, d) in enumerate(maps):
        assert logit[l] > 0.5, logit  # the planted map really hides the answer from the logit lens
        assert tuned[l] < 5e-3, tuned
        # the only exact solutions: W = c M^-1, b = -W d (the RMS norm forgives one positive scale c)
        wm = lens.weight[l] @ m
        c = float(torch.trace(wm)) / wm.shape[0]
        assert c > 0
        # relative to |I|: the identity it started from is ~1.4 away from a random rotation's inverse; what
        # is left are the directions the softmax barely feels (KL 5e-3 does not pin them further)
        eye = torch.eye(wm.shape[0])
        assert torch.linalg.matrix_norm(wm / c - eye) < 0.1 * torch.linalg.matrix_norm(eye)
        # and with the bias: the translated held-out stream is the final one, up to that scale
        back = lens.translate(l, held[l]) / c
        assert torch.linalg.matrix_norm(back - held[-1]) < 0.1 * torch.linalg.matrix_norm(held[-1])
    assert tuned[-1] == logit[-1] == pytest.approx(0.0, abs=1e-6)  # x_L: no translator, the model's own output


def test_identity_translators_are_the_logit_lens(small):
    model = sluice.load(small)
    streams, _ = planted(model, 256, seed=1)
    ident = tl.TunedLens.identity(model.config.num_layers, model.config.hidden_size)
    assert layer_kl(model, streams, ident) == pytest.approx(layer_kl(model, streams), rel=1e-5, abs=1e-6)


def _saved(model, out, seed=0):
    lens = tl.TunedLens.identity(model.config.num_layers, model.config.hidden_size)
    g = torch.Generator().manual_seed(seed)
    lens.weight += 0.1 * torch.randn(lens.weight.shape, generator=g)
    lens.bias += torch.randn(lens.bias.shape, generator=g)
    lens.meta = {"model": {"path": str(model.model_dir), "fingerprint": tl.fingerprint(model)}}
    lens.save(out)
    return lens


def test_save_load_round_trip_and_dtype(small, tmp_path):
    model = sluice.load(small)
    lens = _saved(model, tmp_path)
    back = tl.load(tmp_path, model)  # the directory, or the file itself
    assert torch.equal(back.weight, lens.weight) and torch.equal(back.bias, lens.bias)
    assert back.meta["source"] == str(tmp_path / tl.FILE)
    assert json.loads((tmp_path / tl.META).read_text())["schema"] == tl.SCHEMA
    # the same model in bf16 is still the same model
    tl.load(tmp_path / tl.FILE, sluice.load(small, dtype="bfloat16"))


def test_load_refuses_what_does_not_fit(small, tmp_path):
    model = sluice.load(small)
    _saved(model, tmp_path / "ok")
    other = tmp_path / "other"
    build(other, "qwen3", seed=7, **SHAPE)  # same shapes, other weights
    with pytest.raises(ObservatoryError, match="fitted to another model"):
        tl.load(tmp_path / "ok", sluice.load(other))
    deeper = tmp_path / "deeper"
    build(deeper, "qwen3", **{**SHAPE, "num_hidden_layers": 3})
    with pytest.raises(ObservatoryError, match=r"shape weight \(2, 32, 32\).*needs \(3, 32, 32\)"):
        tl.load(tmp_path / "ok", sluice.load(deeper))
    with pytest.raises(ObservatoryError, match="no tuned lens at"):
        tl.load(tmp_path / "nowhere", model)
    (tmp_path / "ok" / tl.META).unlink()
    with pytest.raises(ObservatoryError, match="missing or not JSON"):
        tl.load(tmp_path / "ok", model)
    (tmp_path / "junk.safetensors").write_bytes(b"not a tensor file")
    with pytest.raises(ObservatoryError, match="not a readable safetensors file"):
        tl.load(tmp_path / "junk.safetensors", model)


@pytest.fixture(scope="module")
def tiny_text(tmp_path_factory):
    d = tmp_path_factory.mktemp("tuned-cli")
    build_with_tokenizer(d / "model", "qwen3")
    text = d / "text.py"
    text.write_text("def add(a, b):\n    return a + b\n\n" * 60)
    return d / "model", text


def test_cli_train_then_inspect_shows_both_lenses(tiny_text, tmp_path, capsys):
    model_dir, text = tiny_text
    out = tmp_path / "lens"
    assert main(["lens", "train", "--model", str(model_dir), "--text", str(text), "--tokens", "400",
                 "--steps", "4", "--batch", "64", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "tuned lens" in printed.out and "wrote" in printed.err
    meta = json.loads((out / tl.META).read_text())
    assert meta["fit"]["steps"] == 4 and meta["corpus"]["train_tokens"] <= 400
    assert len(meta["heldout_kl"]["tuned_lens"]) == 4  # x_0..x_3 of a 3-block model
    assert main(["inspect", "--model", str(model_dir), "--tuned-lens", str(out), "--json", "def add(a, b):"]) == 0
    data = json.loads(capsys.readouterr().out)
    views = data["lens_views"]
    assert set(views["lenses"]) == {"logit", "tuned"}
    assert views["tuned_lens"]["source"] == str(out / tl.FILE)
    assert views["lenses"]["tuned"]["mean_kl"][-1] == pytest.approx(0.0, abs=1e-5)
    assert views["lenses"]["logit"]["mean_kl"] == pytest.approx(
        [sum(r) / len(r) for r in data["lens"]["kl_to_final"]], rel=1e-4, abs=1e-5)


def test_cli_refusals(tiny_text, small, tmp_path, capsys):
    model_dir, text = tiny_text
    with pytest.raises(SystemExit) as stop:  # argparse's own usage error
        main(["lens", "train", "--model", str(model_dir), "--tokens", "400", "--steps", "0"])
    assert stop.value.code == 2
    assert "at least 1" in capsys.readouterr().err
    _saved(sluice.load(small), tmp_path)
    assert main(["inspect", "--model", str(model_dir), "--tuned-lens", str(tmp_path), "def f():"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err and "tuned_lens.safetensors" in err
    assert main(["lens", "train", "--model", str(model_dir), "--text", str(tmp_path / "missing.txt"),
                 "--out", str(tmp_path / "o")]) == 2
    assert "missing.txt" in capsys.readouterr().err


def test_bundled_translators_load_and_the_docs_quote_them():
    model = sluice.load()
    lens = tl.load(tl.find(model), model)  # fits the bundled model, fingerprint included
    kl = lens.meta["heldout_kl"]
    assert all(t < g for t, g in zip(kl["tuned_lens"][:-1], kl["logit_lens"][:-1]))
    doc = (Path(__file__).parents[2] / "docs" / "observatory.md").read_text(encoding="utf-8")
    quoted = doc.split("<!-- tuned-kl -->", 1)[1].split("<!-- /tuned-kl -->", 1)[0]
    line = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    assert f"logit lens {line(kl['logit_lens'])}; tuned lens {line(kl['tuned_lens'])}" in quoted
    assert f"on {lens.meta['corpus']['heldout_tokens']:,} held-out tokens" in quoted


def test_cli_read_only_model_dir_names_out(tiny_text, monkeypatch, capsys):
    """As root a 0555 directory is still writable, so the refusal prepare_out_dir would give is planted."""
    import sluice.observatory.report as report
    model_dir, _ = tiny_text

    def refuse(out):
        raise ObservatoryError(f"--out {out} is not a writable directory: Read-only file system")

    monkeypatch.setattr(report, "prepare_out_dir", refuse)
    assert main(["lens", "train", "--model", str(model_dir), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert f"cannot write the tuned lens beside the model in {model_dir} (Read-only file system): pass --out DIR" in err
