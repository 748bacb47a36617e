"""The bundled model's draft (speculative decoding): shipped next to it, same tokenizer, 10x smaller."""

import json

import torch

import sluice
from sluice.model.loading import bundled_draft_dir, bundled_model_dir
from sluice.training.recipe import Recipe
from sluice.training.train import model_config

PROMPT = "def parse_args(argv):\n    parser = argparse."


def test_draft_shares_the_main_models_tokenizer_byte_for_byte():
    draft, main = bundled_draft_dir(), bundled_model_dir()
    assert draft.parent == main.parent
    assert (draft / "tokenizer.json").read_bytes() == (main / "tokenizer.json").read_bytes()
    a, b = sluice.Tokenizer.from_pretrained(draft), sluice.Tokenizer.from_pretrained(main)
    assert a.encode(PROMPT) == b.encode(PROMPT)
    assert sluice.load(draft).config.vocab_size == sluice.load(main).config.vocab_size


def test_draft_is_a_fifth_or_less_of_the_main_model():
    draft, main = sluice.load(bundled_draft_dir()), sluice.load(bundled_model_dir())
    assert draft.config.architecture == main.config.architecture == "Qwen3ForCausalLM"
    assert draft.config.num_params * 5 < main.config.num_params
    assert draft.config.max_position_embeddings == main.config.max_position_embeddings
    assert draft.config.eos_token_id == main.config.eos_token_id


def test_draft_matches_transformers():
    d = bundled_draft_dir()
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    model = sluice.load(d)
    ids = torch.tensor([sluice.Tokenizer.from_pretrained(d).encode(PROMPT)])
    with torch.no_grad():
        assert (model(ids) - ref(ids).logits).abs().max().item() <= 1e-4


def test_draft_is_what_its_recipe_makes():
    """recipe.toml next to the weights is the recipe that made them: same shape, bundled tokenizer."""
    d = bundled_draft_dir()
    recipe = Recipe.load(d / "recipe.toml")
    assert recipe.tokenizer.source == "bundled"
    cfg = sluice.load(d).config
    assert model_config(recipe, cfg.vocab_size, cfg.eos_token_id).num_params == cfg.num_params
    card = json.loads((d / "training.json").read_text())
    assert card["params"] == cfg.num_params and card["steps"] <= recipe.train.steps
    assert 0 < card["heldout"]["bpb"] < card["baselines"]["gzip-9"] * 1.5


def test_draft_agrees_with_the_main_models_greedy_choices():
    """Teacher-forced on the main model's own greedy continuation of a code prompt, the draft's argmax
    is often the main model's (bench/draft_agreement.py measures it on 24 held-out prompts)."""
    main, draft = sluice.load(bundled_model_dir()), sluice.load(bundled_draft_dir())
    ids = torch.tensor([sluice.Tokenizer.from_pretrained(bundled_model_dir()).encode(
        "import os\n\n\ndef main():\n    parser = argparse.ArgumentParser()")])
    with torch.no_grad():
        for _ in range(48):
            ids = torch.cat([ids, main(ids)[:, -1:].argmax(-1)], 1)
        agree = (main(ids)[:, -49:-1].argmax(-1) == draft(ids)[:, -49:-1].argmax(-1)).float().mean().item()
    assert agree >= 0.4, agree


def test_all_bundled_assets_fit_in_30_mb():
    assets = bundled_model_dir().parent
    total = sum(p.stat().st_size for p in assets.rglob("*") if p.is_file())
    assert total <= 30 * 2**20, f"{total:,} bytes"
