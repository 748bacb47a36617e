"""The model sluice trained itself and ships in the package."""

import json
import subprocess
import sys

import pytest
import torch

import sluice
from sluice.model.loading import bundled_model_dir


def test_bundled_model_matches_transformers():
    d = bundled_model_dir()
    assert sum(f.stat().st_size for f in d.iterdir()) <= 30 * 2**20
    model = sluice.load()  # no argument: the bundled model
    assert model.config.architecture == "Qwen3ForCausalLM"
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    tok = sluice.Tokenizer.from_pretrained(d)
    ids = torch.tensor([tok.encode("def parse_args(argv):\n    parser = argparse.")])
    with torch.no_grad():
        assert (model(ids) - ref(ids).logits).abs().max().item() <= 1e-4


def test_bundled_greedy_completion_is_deterministic_and_real_python():
    llm = sluice.LLM()
    p = sluice.SamplingParams(max_tokens=24, temperature=0)
    a = llm.generate("import os\n\n\ndef main():", p)[0]
    b = llm.generate("import os\n\n\ndef main():", p)[0]
    assert a.text == b.text and a.text.strip()
    # It learned Python: the greedy continuation of a function header is an indented body.
    assert a.text.startswith("\n    ") and a.text.strip()


@pytest.mark.slow
def test_bundled_model_beats_gzip_on_heldout():
    """Bits per byte of the shipped weights, measured now on a sample of the held-out stdlib files by
    the code that wrote the card (write_card: encode, token_byte_lengths, evaluate on the fp32 load),
    against gzip -9 on the same text and against the card's number for the whole held-out split."""
    import time

    from tokenizers import Tokenizer as HFTokenizer

    from sluice.training.corpus import compression_baselines, encode_paths, load_corpus, token_byte_lengths
    from sluice.training.recipe import Recipe
    from sluice.training.train import evaluate

    d = bundled_model_dir()
    card = json.loads((d / "training.json").read_text())
    recipe = Recipe.load(d / "recipe.toml")
    held = load_corpus(recipe.corpus).heldout
    # Mid-sized files (five on CPython 3.11, 35 KB): a few seconds of evaluation, and no outliers
    # such as the codec tables (encodings/cp875.py, 0.4 bits/byte) or one file of 140 KB.
    sample = [p for p in held if 5_000 <= p.stat().st_size <= 8_500]
    texts = [p.read_bytes().decode("utf-8", errors="replace") for p in sample]
    tok = HFTokenizer.from_file(str(d / "tokenizer.json"))
    ids, nbytes = encode_paths(tok, texts, tok.token_to_id("<|endoftext|>"))
    assert ids.size >= 8 * recipe.train.seq_len, f"held-out sample too small: {[p.name for p in sample]}"
    t0 = time.perf_counter()
    ev = evaluate(sluice.load(d, "float32"), ids, token_byte_lengths(tok), recipe.train.seq_len, ids.size,
                  autocast=False)
    gzip9 = compression_baselines(texts)["gzip-9"]
    print(f"{len(sample)} files, {nbytes} bytes: {ev['bpb']:.3f} bits/byte (gzip -9 {gzip9:.3f}, card "
          f"{card['heldout']['bpb']:.3f}) in {time.perf_counter() - t0:.1f} s")
    assert ev["bytes"] > 0.9 * nbytes  # the windows cover the sample, up to the last partial window
    assert ev["bpb"] < 0.8 * gzip9
    assert abs(ev["bpb"] - card["heldout"]["bpb"]) < 0.25
    assert card["heldout"]["bpb"] < card["baselines"]["gzip-9"]


@pytest.mark.slow
def test_demo_runs():
    r = subprocess.run([sys.executable, "-m", "sluice", "demo"], capture_output=True, text=True,
                       timeout=1200)  # a hang-stopper: 10x+ the demo's ~20 s, or its first-run kernel builds (~2 min)
    assert r.returncode == 0, r.stderr
    for needle in ("four valves", "final norm", "log-sum-exp", "top-1 p", "sluice generate"):
        assert needle in r.stdout
