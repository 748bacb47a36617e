"""inspect()'s result in notebooks and pipelines: xarray and pandas with named dimensions holding the same
numbers as the dict (and so as observe()), a clear error without the extra, and the report inline."""

import html
import json
import sys

import pytest
import torch

import sluice
from ckpt import build_with_tokenizer
from sluice.errors import ObservatoryError
from sluice.observatory.analysis import to_json
from sluice.observatory.export import InspectResult, inspect, to_pandas, to_xarray
from sluice.observatory.report import SECTIONS
from sluice.observatory.tuned_lens import TunedLens
from sluice.text.tokenizer import Tokenizer

PROMPT = "def add(a, b):\n    return a + b"


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    d = tmp_path_factory.mktemp("export-qwen3")
    build_with_tokenizer(d, "qwen3")
    model, tok = sluice.load(d), Tokenizer.from_pretrained(d)
    target = tok.encode(" return", add_special_tokens=False)[0]
    lens = TunedLens.identity(model.config.num_layers, model.config.hidden_size)
    lens.bias += 0.1
    return inspect(model, tok, PROMPT, progress=False, target=target, tuned_lens=lens), model


def test_xarray_named_dimensions_hold_the_dicts_numbers(result):
    r, model = result
    assert isinstance(r, InspectResult) and isinstance(r, dict)
    assert sluice.inspect is inspect  # the public name
    ds = r.to_xarray()
    L, T = model.config.num_layers, len(r["tokens"]["ids"])
    H = model.config.num_heads
    assert ds.residual_rms.dims == ("layer", "position") and ds.residual_rms.shape == (L + 1, T)
    assert ds.attn_sink_mass.dims == ("block", "head", "position") and ds.attn_sink_mass.shape == (L, H, T)
    assert ds.attn_sink_mass_mean.dims == ("block", "head")
    assert ds.view_target_rank.dims == ("lens", "layer", "position")
    assert list(ds.lens.values) == ["logit", "tuned"]
    assert ds.logit_contribution.dims == ("component", "position")
    assert ds.lens_top_id.dims == ("layer", "position", "k")
    assert list(ds.token.values) == r["tokens"]["text"]
    # selecting by name gives the dict's numbers
    assert float(ds.residual_rms.sel(layer=2, position=3)) == r["residual"]["rms"][2][3]
    assert float(ds.attn_entropy.sel(block=1, head=2, position=4)) == r["attention"]["per_position"]["entropy"][1][2][4]
    assert int(ds.view_target_rank.sel(lens="tuned", layer=0, position=T - 1)) == \
        r["lens_views"]["lenses"]["tuned"]["target_rank"][0][-1]
    comps = r["attribution"]["components"]
    assert float(ds.logit_contribution.sel(component=comps[1], position=T - 1)) == \
        r["attribution"]["logit"]["contribution"][1][-1]
    assert float(ds.lens_kl.sel(layer=0).mean()) == pytest.approx(r["lens_views"]["lenses"]["logit"]["mean_kl"][0], rel=1e-5)


def test_pandas_tables_indexed_by_their_dimensions(result):
    r, model = result
    frames = r.to_pandas()
    stream = frames["stream"]
    assert stream.index.names == ["layer", "position"]
    assert stream.loc[(2, 3), "residual_rms"] == r["residual"]["rms"][2][3]
    assert stream.loc[(0, 1), "token"] == r["tokens"]["text"][1]
    heads = frames["heads_by_position"]
    assert heads.index.names == ["block", "head", "position"]
    assert heads.loc[(1, 2, 4), "attn_sink_mass"] == r["attention"]["per_position"]["sink_mass"][1][2][4]
    views = frames["lens_views"]
    assert views.loc[("tuned", 1, 0), "view_target_prob"] == r["lens_views"]["lenses"]["tuned"]["target_prob"][1][0]
    assert set(frames) >= {"positions", "norms", "branches", "lens_topk", "heads", "kv_heads", "logit_attribution",
                           "lens_views_mean"}
    # the same from a report.json read back, where NaN would be strings
    back = json.loads(to_json(r))
    assert to_pandas(back)["stream"].equals(stream)


def test_missing_extra_is_named(result, monkeypatch):
    r, _ = result
    monkeypatch.setitem(sys.modules, "xarray", None)  # what `import xarray` meets when it is not installed
    with pytest.raises(ObservatoryError, match=r"xarray is not installed.*sluice-llm\[notebook\]"):
        to_xarray(r)
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ObservatoryError, match=r"pandas is not installed"):
        r.to_pandas()


def test_repr_html_shows_the_report(result):
    r, _ = result
    shown = r._repr_html_()
    assert shown.startswith("<iframe srcdoc=") and "sluice inspect" in shown
    page = html.unescape(shown.split('srcdoc="', 1)[1].split('" style=', 1)[0])
    for anchor, _title in SECTIONS:
        if anchor != "training":
            assert f'<section id="{anchor}">' in page, anchor
    assert page.count("data:image/png;base64,") >= 10  # the figures come along
    assert "<script" not in page
