"""`inspect()`'s result for notebooks and pipelines: named-dimension arrays (xarray), tables (pandas) and
the report inline in Jupyter.

    r = sluice.inspect(model, tokenizer, "def f(x):")   # observatory.analysis.inspect's dict, as an InspectResult
    ds = r.to_xarray()                    # ds.residual_rms.sel(layer=3), ds.attn_sink_mass.mean("position")
    frames = r.to_pandas()                # {"stream": DataFrame indexed by (layer, position), ...}
    r                                     # in Jupyter: the HTML report, figures included

Why on the inspect result and not on `observe()`'s Observation: the result is the one object that holds
every measurement of a prompt (the lens and the target trajectories run their own forwards, which an
Observation never sees), it is plain CPU data that the next forward cannot overwrite, and it is what the
report is drawn from. It stays a dict (the JSON document), so code reading the dict reads it unchanged.
(analysis.inspect itself returns the plain dict: this module sits above the report and the plots,
which analysis must not import.)

Dimensions: layer = the residual stream x_l read (0 = the first block's input .. L = the last block's
output); block = a block's index (block b reads x_b and writes x_{b+1}); position = the token position
(coordinates token and token_id); head, kv_head = attention heads; norm, branch, component = the
named modules of the norms, residual branches and logit parts; lens = "logit" or "tuned"; k = the
logit lens's top-k rank; massive = one listed massive activation (coordinates layer, channel, position).
xarray and pandas are optional (`pip install "sluice-llm[notebook]"`): imported only when asked for.
"""

from __future__ import annotations

import numpy as np

from ..errors import ObservatoryError

# dims of a variable group -> the name of its pandas table
TABLES = {("layer", "position"): "stream", ("position",): "positions", ("norm", "position"): "norms",
          ("branch", "position"): "branches", ("layer", "position", "k"): "lens_topk",
          ("block", "head"): "heads", ("block", "head", "position"): "heads_by_position",
          ("block", "kv_head"): "kv_heads", ("block", "kv_head", "position"): "kv_heads_by_position",
          ("component", "position"): "logit_attribution", ("lens", "layer", "position"): "lens_views",
          ("lens", "layer"): "lens_views_mean", ("massive",): "massive"}


def _missing(name: str) -> ObservatoryError:
    return ObservatoryError(f"{name} is not installed: it is an optional extra of sluice, "
                            f"pip install \"sluice-llm[notebook]\" (or pip install {name})")


def _xarray():
    try:
        import xarray
    except ImportError:
        raise _missing("xarray") from None
    return xarray


def _pandas():
    try:
        import pandas
    except ImportError:
        raise _missing("pandas") from None
    return pandas


def _arr(x, dtype=np.float64) -> np.ndarray:
    # NaN and infinities may be strings in a dict read back from report.json
    if dtype is np.float64:
        return np.vectorize(lambda v: float(v) if v is not None else np.nan, otypes=[np.float64])(np.asarray(x, dtype=object))
    return np.asarray(x, dtype=dtype)


def variables(data: dict) -> tuple[dict, dict]:
    """{name: (dims, array)} and {dim: coordinate values, or (dim, values) for extra coordinates}
    of every grid in the inspect dict; the sections that were skipped are simply absent."""
    v, coords = {}, {}
    T = len(data["tokens"]["ids"])
    coords["position"] = np.arange(T)
    coords["token"] = ("position", np.asarray(data["tokens"]["text"], dtype=object))
    coords["token_id"] = ("position", np.asarray(data["tokens"]["ids"]))
    if "residual" in data:
        for key in ("rms", "var", "absmax"):
            v[f"residual_{key}"] = (("layer", "position"), _arr(data["residual"][key]))
        coords["layer"] = np.arange(len(data["residual"]["rms"]))
    if "norms" in data:
        coords["norm"] = np.asarray(data["norms"]["names"], dtype=object)
        for key in ("in_rms", "out_rms", "gain"):
            v[f"norm_{key}"] = (("norm", "position"), _arr(data["norms"][key]))
    if "branches" in data:
        coords["branch"] = np.asarray(data["branches"]["names"], dtype=object)
        for key in ("rms", "ratio"):
            v[f"branch_{key}"] = (("branch", "position"), _arr(data["branches"][key]))
    per_pos = data.get("logits", {}).get("per_position", {})
    for key, values in per_pos.items():
        if key != "top1_token":
            v[f"logit_{key}"] = (("position",), _arr(values, np.int64 if key == "top1_id" else np.float64))
    if "lens" in data:
        lens = data["lens"]
        for key, name in (("kl_to_final", "lens_kl"), ("entropy", "lens_entropy"), ("p_predicted", "lens_p_predicted")):
            v[name] = (("layer", "position"), _arr(lens[key]))
        v["lens_top_id"] = (("layer", "position", "k"), _arr(lens["top_ids"], np.int64))
        v["lens_top_prob"] = (("layer", "position", "k"), _arr(lens["top_probs"]))
        coords["k"] = np.arange(lens["topk"])
    _views(data, v, coords)
    _attention(data, v, coords)
    _attribution(data, v, coords)
    rows = data.get("massive_activations") or []
    if rows:
        coords["massive"] = np.arange(len(rows))
        for key in ("layer", "channel", "position"):
            coords[f"massive_{key}"] = ("massive", np.asarray([r[key] for r in rows]))
        v["massive_value"] = (("massive",), _arr([r["value"] for r in rows]))
        v["massive_ratio_to_rms"] = (("massive",), _arr([r["ratio_to_rms"] for r in rows]))
    return v, coords


def _views(data: dict, v: dict, coords: dict) -> None:
    views = data.get("lens_views")
    if views is None:
        return
    names = list(views["lenses"])
    coords["lens"] = np.asarray(names, dtype=object)
    coords.setdefault("layer", np.arange(len(views["lenses"][names[0]]["mean_kl"])))
    stack = lambda key, dtype=np.float64: np.stack([_arr(views["lenses"][n][key], dtype) for n in names])  # noqa: E731
    for key, dtype in (("kl_to_final", np.float64), ("entropy", np.float64), ("top1_id", np.int64),
                       ("top1_prob", np.float64), ("target_rank", np.int64), ("target_prob", np.float64)):
        v[f"view_{key}"] = (("lens", "layer", "position"), stack(key, dtype))
    v["view_mean_kl"] = (("lens", "layer"), stack("mean_kl"))
    v["target_id"] = (("position",), _arr(views["target"]["ids"], np.int64))


def _attention(data: dict, v: dict, coords: dict) -> None:
    a = data.get("attention")
    if a is None:
        return
    coords["block"] = np.arange(len(a["head_means"]["entropy"]))
    coords["head"] = np.arange(a["num_heads"])
    coords["kv_head"] = np.arange(a["num_kv_heads"])
    for key, values in a["head_means"].items():
        v[f"attn_{key}_mean"] = (("block", "kv_head" if key == "k_norm" else "head"), _arr(values))
    for key, values in a.get("per_position", {}).items():
        dims = ("block", "kv_head" if key == "k_norm" else "head", "position")
        v[f"attn_{key}"] = (dims, _arr(values, np.int64 if key == "top_position" else np.float64))


def _attribution(data: dict, v: dict, coords: dict) -> None:
    a = data.get("attribution")
    if a is None:
        return
    coords.setdefault("branch", np.asarray(a["growth"]["branches"], dtype=object))
    for key in ("delta_mean_square", "along_stream"):
        v[f"growth_{key}"] = (("branch", "position"), _arr(a["growth"][key]))
    coords["component"] = np.asarray(a["components"], dtype=object)
    lg = a["logit"]
    v["logit_contribution"] = (("component", "position"), _arr(lg["contribution"]))
    v["attributed_id"] = (("position",), _arr(lg["target_ids"], np.int64))
    for key in ("sum", "logit", "sigma"):
        v[f"attributed_{key}"] = (("position",), _arr(lg[key]))


def to_xarray(data: dict):
    """One xarray.Dataset of every grid in the inspect dict, with named dimensions (module doc)."""
    xr = _xarray()
    v, coords = variables(data)
    ds = xr.Dataset({name: (dims, values) for name, (dims, values) in v.items()}, coords=coords)
    ds.attrs.update({"model": data["model"]["name"], "architecture": data["model"]["architecture"],
                     "prompt": data["prompt"], "schema": data.get("schema", "")})
    return ds


def to_pandas(data: dict) -> dict:
    """{table: DataFrame}: the variables sharing dimensions in one table indexed by them (module doc's
    TABLES names them), plus "massive" with a row per listed massive activation."""
    pd = _pandas()
    v, coords = variables(data)
    groups: dict[tuple, dict] = {}
    for name, (dims, values) in v.items():
        groups.setdefault(dims, {})[name] = values
    frames = {}
    for dims, cols in groups.items():
        levels = [coords[d] if not isinstance(coords[d], tuple) else coords[d][1] for d in dims]
        index = pd.MultiIndex.from_product(levels, names=list(dims)) if len(dims) > 1 else \
            pd.Index(levels[0], name=dims[0])
        frame = pd.DataFrame({name: values.reshape(-1) for name, values in cols.items()}, index=index)
        if "position" in dims:  # the token beside its position, as the report shows it
            frame["token"] = np.asarray(data["tokens"]["text"], dtype=object)[frame.index.get_level_values("position")]
        if dims == ("massive",):
            for key in ("layer", "channel", "position"):
                frame[key] = coords[f"massive_{key}"][1]
        frames[TABLES.get(dims, "_".join(dims))] = frame
    return frames


class InspectResult(dict):
    """What `inspect()` returns: its dict (the JSON document), plus `to_xarray()`, `to_pandas()`,
    `save(out_dir)` and, in Jupyter, the report inline."""

    def to_xarray(self):
        return to_xarray(self)

    def to_pandas(self) -> dict:
        return to_pandas(self)

    def save(self, out_dir) -> dict:
        """report.html, report.json and the PNGs into out_dir (report.save)."""
        from .report import save
        return save(self, out_dir)

    def _repr_html_(self) -> str:
        """The whole report (report.render, figures embedded) in an iframe: its stylesheet styles its own
        page, where inline it would restyle the notebook around it."""
        import tempfile
        from html import escape
        from pathlib import Path

        from .plots import write_all
        from .report import render
        with tempfile.TemporaryDirectory(prefix="sluice-inspect-") as tmp:
            page = render(self, write_all(self, Path(tmp)))
        return (f'<iframe srcdoc="{escape(page, quote=True)}" style="width:100%;height:900px;border:1px solid #ddd" '
                'title="sluice inspect report"></iframe>')


def inspect(model, tokenizer, prompt: str, **kwargs) -> InspectResult | None:
    """analysis.inspect (same arguments) -> its dict as an InspectResult; None on tensor-parallel ranks > 0."""
    from .analysis import inspect as measure
    data = measure(model, tokenizer, prompt, **kwargs)
    return None if data is None else InspectResult(data)
