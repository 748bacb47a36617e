"""Target trajectories and the lens views: rank and probability of a token at every layer and position,
through the logit lens and a tuned lens, exact against transformers' own modules; and how inspect shows them."""

import json

import pytest
import torch

import sluice
from ckpt import build, build_with_tokenizer
from sluice.cli import main
from sluice.errors import ObservatoryError
from sluice.observatory.analysis import inspect
from sluice.observatory.report import save
from sluice.observatory.trajectories import lens_views
from sluice.observatory.tuned_lens import TunedLens
from sluice.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("traj-llama")
    ref = build(d, "llama", initializer_range=0.5)  # peaked distributions: ranks spread over the vocabulary
    return d, ref


def _random_lens(L, C, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = TunedLens.identity(L, C)
    lens.weight += 0.3 * torch.randn(lens.weight.shape, generator=g)
    lens.bias += 0.5 * torch.randn(lens.bias.shape, generator=g)
    return lens


@torch.no_grad()
def _reference(ref, ids, target, lens=None):
    """rank and probability of target (B, T) at every layer, from transformers' hidden states, its final
    norm and LM head: row l < L reads hidden_states[l] (the input of decoder layer l), row L the logits."""
    out = ref(ids, output_hidden_states=True)
    L = ref.config.num_hidden_layers
    ranks, probs = [], []
    for l in range(L + 1):
        if l < L:
            h = out.hidden_states[l]
            if lens is not None:
                h = h @ lens.weight[l].T + lens.bias[l]
            z = ref.lm_head(ref.model.norm(h)).float()
        else:
            z = out.logits.float()
        own = z.gather(-1, target[..., None])
        ranks.append((z > own).sum(-1) + 1)
        probs.append(z.softmax(-1).gather(-1, target[..., None])[..., 0])
    return torch.stack(ranks), torch.stack(probs)


def test_rank_and_probability_exact_against_transformers(llama):
    d, ref = llama
    model = sluice.load(d)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 96, (2, 11), generator=g)
    target = torch.randint(0, 96, (2, 11), generator=g)
    lens = _random_lens(model.config.num_layers, model.config.hidden_size)
    views = lens_views(model, ids, target=target, tuned=lens)
    assert torch.equal(views.target, target)
    for name, tuned in (("logit", None), ("tuned", lens)):
        rank, prob = _reference(ref, ids, target, tuned)
        v = views.lenses[name]
        assert torch.equal(v.target_rank, rank), name
        assert torch.allclose(v.target_prob, prob, atol=1e-5, rtol=1e-4), name
        assert rank.min() >= 1 and rank.max() > 5  # the check covers ranks well below the top
    # x_L needs no translator: both lenses agree there, and KL to the final layer is 0
    assert torch.equal(views.lenses["tuned"].target_rank[-1], views.lenses["logit"].target_rank[-1])
    assert views.lenses["tuned"].kl[-1].abs().max() < 1e-5


def test_default_target_is_the_prediction_and_int_targets(llama):
    d, _ = llama
    model = sluice.load(d)
    ids = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(4))
    views = lens_views(model, ids)
    assert torch.equal(views.target, views.predicted)
    assert (views.lenses["logit"].target_rank[-1] == 1).all()  # the model's own top-1 is its rank 1
    assert torch.equal(views.lenses["logit"].top1_id[-1], views.predicted)
    one = lens_views(model, ids, target=17)
    assert (one.target == 17).all()
    with pytest.raises(ObservatoryError, match=r"target token ids must lie in \[0, 96\)"):
        lens_views(model, ids, target=96)
    with pytest.raises(ObservatoryError, match="translators of width"):
        lens_views(model, ids, tuned=TunedLens.identity(model.config.num_layers, 8))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("traj-tiny")
    build_with_tokenizer(d, "qwen3")
    return d


def test_inspect_keeps_the_trajectory_and_reports_it(tiny, tmp_path):
    model, tok = sluice.load(tiny), Tokenizer.from_pretrained(tiny)
    prompt = "def add(a, b):\n    return a + b"
    plain = inspect(model, tok, prompt, progress=False)
    assert "lens_views" not in plain  # no target, no tuned lens: nothing extra computed
    target = tok.encode(" return", add_special_tokens=False)[0]
    lens = _random_lens(model.config.num_layers, model.config.hidden_size)
    data = inspect(model, tok, prompt, progress=False, target=target, tuned_lens=lens)
    v = data["lens_views"]
    T = len(data["tokens"]["ids"])
    assert v["target"]["ids"] == [target] * T and v["target"]["chosen"]
    direct = lens_views(model, torch.tensor([data["tokens"]["ids"]]), target=target, tuned=lens)
    for name in ("logit", "tuned"):
        assert v["lenses"][name]["target_rank"] == direct.lenses[name].target_rank[:, 0].tolist()
        assert len(v["lenses"][name]["target_prob"]) == model.config.num_layers + 1
    # the logit view's KL is the logit lens's own
    assert torch.allclose(torch.tensor(v["lenses"]["logit"]["kl_to_final"]), torch.tensor(data["lens"]["kl_to_final"]),
                          atol=1e-5)
    paths = save(data, tmp_path)
    html = paths["html"].read_text(encoding="utf-8")
    for anchor in ("tuned", "trajectory"):
        assert f'<section id="{anchor}">' in html
    assert "Target trajectory" in html and "tuned lens KL" in html
    assert {"lens_kl", "trajectory"} <= set(paths)
    html_plain = save(plain, tmp_path / "plain")["html"].read_text(encoding="utf-8")
    assert '<section id="trajectory">' not in html_plain and '<section id="tuned">' not in html_plain


def test_cli_target_trajectory_json_and_tables(tiny, capsys):
    assert main(["inspect", "--model", str(tiny), "--json", "--target", "id:17", "def f(x):"]) == 0
    data = json.loads(capsys.readouterr().out)
    v = data["lens_views"]
    assert set(v["lenses"]) == {"logit"} and set(v["target"]["ids"]) == {17}
    assert main(["inspect", "--model", str(tiny), "--target", "id:17", "def f(x):"]) == 0
    assert "rank / p of" in capsys.readouterr().out
