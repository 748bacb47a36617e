"""The model sluice trained itself and ships in the package."""

import json
import subprocess
import sys

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


def test_bundled_model_beats_gzip_on_heldout():
    """The training summary that ships with the model records held-out bits per byte."""
    card = json.loads((bundled_model_dir() / "training.json").read_text())
    assert card["heldout"]["bpb"] < card["baselines"]["gzip-9"]


def test_demo_runs():
    r = subprocess.run([sys.executable, "-m", "sluice", "demo"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    for needle in ("four valves", "final norm", "log-sum-exp", "top-1 p", "sluice generate"):
        assert needle in r.stdout
