"""`sluice inspect` with the attention valves and the attribution: their JSON agrees with observe(), the
report shows both sections with their figures, and --target picks the token (or says why not)."""

import json

import pytest
import torch

import sluice
from ckpt import build_with_tokenizer
from sluice.cli import main
from sluice.observatory import observe
from sluice.observatory.analysis import inspect
from sluice.observatory.report import save
from sluice.text.tokenizer import Tokenizer

PROMPT = "def add(a, b):\n    return a + b"


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    """Soft-capped, with a window of 8 that the prompt outruns."""
    d = tmp_path_factory.mktemp("gemma2")
    build_with_tokenizer(d, "gemma2", attn_logit_softcapping=5.0)
    return d


def test_json_holds_what_observe_measures(gemma2, tmp_path):
    model, tok = sluice.load(gemma2), Tokenizer.from_pretrained(gemma2)
    data = inspect(model, tok, PROMPT, progress=False)
    ids = torch.tensor([data["tokens"]["ids"]])
    with observe(model, attribution=True) as obs, torch.inference_mode():
        model(ids)
    means, per = obs.attention.head_means(), obs.attention.per_position()
    a = data["attention"]
    assert a["sliding"] == model.sliding and a["softcap"] == 5.0
    assert torch.allclose(torch.tensor(a["head_means"]["sink_mass"]), means["sink_mass"])
    assert torch.allclose(torch.tensor(a["per_position"]["max_logit"]), per["max_logit"][:, :, 0])
    assert torch.equal(torch.tensor(a["keys_visible"]), per["keys_visible"][:, 0])
    att = obs.attribution()
    lg = data["attribution"]["logit"]
    assert data["attribution"]["components"] == att.components
    assert lg["target_ids"] == att.logit["target"][0].tolist() == data["logits"]["per_position"]["top1_id"]
    assert lg["target"] == "the model's top-1 prediction at each position"
    assert torch.allclose(torch.tensor(lg["contribution"]), att.logit["contribution"][:, 0])
    assert "frozen" in data["attribution"]["note"]
    paths = save(data, tmp_path)
    html = paths["html"].read_text(encoding="utf-8")
    for anchor in ("attention", "attribution"):
        assert f'<section id="{anchor}">' in html
    assert paths["attention_heads"].stat().st_size > 1000 and paths["attribution"].stat().st_size > 1000
    assert "soft-capped at 5" in html and "sliding-window layers: 0, 2" in html


def test_target_from_the_command_line(gemma2, capsys):
    tok = Tokenizer.from_pretrained(gemma2)
    text = tok.decode(tok.encode(" return", add_special_tokens=False)[:1])  # one token of the tiny vocabulary
    one = tok.encode(text, add_special_tokens=False)
    assert len(one) == 1
    assert main(["inspect", "--model", str(gemma2), "--json", "--target", text, PROMPT]) == 0
    data = json.loads(capsys.readouterr().out)
    lg = data["attribution"]["logit"]
    assert set(lg["target_ids"]) == {one[0]} and lg["target"] == "given"
    assert main(["inspect", "--model", str(gemma2), "--json", "--target", "id:7", PROMPT]) == 0
    assert set(json.loads(capsys.readouterr().out)["attribution"]["logit"]["target_ids"]) == {7}


@pytest.mark.parametrize("target, message", [
    ("id:100000", "the vocabulary has ids 0.."),
    (" return a", "tokens ("),
    ("", "is 0 tokens"),
])
def test_bad_targets_are_refused_in_one_line(gemma2, capsys, target, message):
    assert main(["inspect", "--model", str(gemma2), "--target", target, PROMPT]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_target_with_surgery_is_refused(gemma2, capsys):
    assert main(["inspect", "--model", str(gemma2), "--target", "id:3", "--surgery", "final-norm=off", PROMPT]) == 2
    assert "--target" in capsys.readouterr().err


def test_terminal_tables_show_both_sections(gemma2):
    """The tables hold the JSON's numbers: the head with the most sink mass per block, and every
    branch's growth and logit share (the shares summing to the logit the table's caption gives)."""
    from rich.console import Console

    from sluice.observatory.tables import print_all
    model, tok = sluice.load(gemma2), Tokenizer.from_pretrained(gemma2)
    data = inspect(model, tok, PROMPT, progress=False)
    console = Console(width=200, record=True)
    print_all(data, console)
    text = console.export_text()
    assert "attention valves per block" in text and "attribution per branch" in text
    m = data["attention"]["head_means"]
    for i, sink in enumerate(m["sink_mass"]):
        h = max(range(len(sink)), key=lambda j: sink[j])
        row = next(line for line in text.splitlines()
                   if line.startswith("│") and line.split("│")[1].strip() == str(i) and "(" in line)
        assert f"{sink[h]:.3g} ({h})" in row
    a = data["attribution"]
    last = [row[-1] for row in a["logit"]["contribution"]]
    for name, share in zip(a["components"], last):
        row = next(line for line in text.splitlines() if f" {name} " in line and "│" in line)
        assert f"{share:.3g}" in row
        if name in a["growth"]["branches"]:
            assert f"{a['growth']['mean_delta'][a['growth']['branches'].index(name)]:.3g}" in row
    assert abs(sum(last) - a["logit"]["logit"][-1]) < 1e-3
