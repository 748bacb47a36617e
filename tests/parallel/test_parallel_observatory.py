"""The observatory on 2 and 4 tensor-parallel gloo ranks reports what one process reports.

`inspect()` on every rank of a rank model (parallel.load_rank) gives rank 0 the single-process
report dict: every number within 1e-5 relative (fp32), every token, id and count identical. Families:
Gemma 2 (sandwich norms, attention and final soft-caps, 2 KV heads: replicated at 4 ranks) and Qwen3
(per-head q/k norms, one KV head replicated on every rank). Also: observe() on a batch of two rows,
a model whose NaN starts in a column-parallel shard the last rank holds, and the refusals.
"""

from __future__ import annotations

import math

import pytest
import torch

from test_parallel_spawn import ok, run_ranks

pytestmark = pytest.mark.slow  # gloo ranks spawned, 2 and 4

PROMPT = "def add(a, b):\n    return a + b  # sum"
FAMILIES = {"gemma2": dict(num_key_value_heads=2), "qwen3": dict(num_key_value_heads=1)}
REL, ABS = 1e-5, 1e-6  # ABS: for values that are 0 up to rounding (KL of the last layer to itself)
DOT_ABS = 1e-5  # the logits, the per-head attention statistics and the attribution: see compare()
# The softmax-safety errors measure rounding noise (an fp32 softmax against fp64: ~1e-8): logits that
# differ by 1e-6 between the two runs change that noise itself, so only its size is compared.
NOISE = ("max_abs_err", "max_abs_err_ok", "max_logz_err")
BATCH = [[5, 70, 300, 12, 9, 401], [33, 2, 2, 250, 511, 64]]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    from ckpt import build_with_tokenizer
    out = {}
    for fam, extra in FAMILIES.items():
        d = tmp_path_factory.mktemp(f"tpobs-{fam}")
        build_with_tokenizer(d, fam, **extra)
        out[fam] = str(d)
    # NaN in the last intermediate channel of layer 1's up projection: only the last rank holds it
    d = tmp_path_factory.mktemp("tpobs-nan")
    build_with_tokenizer(d, "qwen3", num_key_value_heads=1)
    (weights,) = d.glob("*.safetensors")
    tensors = load_file(weights)
    tensors["model.layers.1.mlp.up_proj.weight"][-1, 7] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    out["nan"] = str(d)
    return out


def _observe_batch(model):
    import sluice
    with sluice.observe(model, capacity=(2, 8)) as obs, torch.inference_mode():
        model(torch.tensor(BATCH))
        return {**obs.stats, "summary": obs.summary(), "massive": obs.massive_activations()}


def _worker(ranks, dirs):
    from sluice.errors import SurgeryError
    from sluice.observatory import surgery
    from sluice.observatory.analysis import inspect
    from sluice.parallel import load_rank
    from sluice.text.tokenizer import Tokenizer
    out = {}
    for fam, d in dirs.items():
        model = load_rank(d, ranks)
        out[fam] = inspect(model, Tokenizer.from_pretrained(d), PROMPT, progress=False)
        if fam == "qwen3":
            out["batch"] = _observe_batch(model)
            try:
                with surgery.apply(model, "final-norm=off"):
                    pass
            except SurgeryError as e:
                out["surgery"] = str(e)
    return out


@pytest.fixture(scope="module", params=[2, 4])
def tp(request, dirs, tmp_path_factory):
    world = request.param
    return world, ok(run_ranks(tmp_path_factory.mktemp(f"tpobs{world}"), world, _worker, dirs))


@pytest.fixture(scope="module")
def single(dirs):
    import sluice
    from sluice.observatory.analysis import inspect
    from sluice.text.tokenizer import Tokenizer
    out = {}
    for fam, d in dirs.items():
        model = sluice.load(d)
        out[fam] = inspect(model, Tokenizer.from_pretrained(d), PROMPT, progress=False)
        if fam == "qwen3":
            out["batch"] = _observe_batch(model)
    return out


def compare(a, b, path="", worst=None):
    """Assert a (tensor-parallel) equals b (single process): floats within REL (ABS near 0), the rest
    exactly. Returns the largest relative difference seen, by key path."""
    worst = {} if worst is None else worst
    if isinstance(b, dict):
        assert isinstance(a, dict) and a.keys() == b.keys(), f"{path}: keys {sorted(a)} != {sorted(b)}"
        for k in b:
            compare(a[k], b[k], f"{path}.{k}", worst)
    elif isinstance(b, (list, tuple)):
        assert isinstance(a, (list, tuple)) and len(a) == len(b), f"{path}: length differs"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            compare(x, y, f"{path}[{i}]" if not isinstance(y, (int, float)) else path, worst)
    elif isinstance(b, torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype, path
        if b.is_floating_point():
            compare(a.double().flatten().tolist(), b.double().flatten().tolist(), path, worst)
        else:
            assert torch.equal(a, b), f"{path}: {a} != {b}"
    elif isinstance(b, float) and not isinstance(b, bool):
        if math.isnan(b) or math.isinf(b):
            assert a == b or (math.isnan(a) and math.isnan(b)), f"{path}: {a} != {b}"
            return worst
        diff = abs(a - b)
        if path.rsplit(".", 1)[-1] in NOISE:  # the same size of rounding noise, see NOISE
            assert diff <= 0.5 * max(abs(a), abs(b)) + 1e-7, f"{path}: {a} vs {b}"
            return worst
        # attention scores, logits, logit parts and mean-square changes are dot products of O(1) terms that
        # can cancel to near 0 (a histogram edge between min and max logit, too): the stream's 1e-5 relative
        # agreement carries through as an absolute one. (Seen: a gemma2 edge of -0.1297 off by 3.3e-6 on an
        # AVX-512 EPYC, whose kernels round the shards' partial sums differently from the Xeon's.)
        floor = DOT_ABS if path.startswith((".attention.", ".attribution.", ".logits.")) else ABS
        assert diff <= REL * max(abs(a), abs(b)) + floor, f"{path}: {a} vs {b} (diff {diff:.2e})"
        key = path.split("[")[0]
        worst[key] = max(worst.get(key, 0.0), diff / max(abs(b), 1e-30) if diff > ABS else 0.0)
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
    return worst


@pytest.mark.parametrize("fam", list(FAMILIES))
def test_report_equals_single_process(tp, single, fam):
    world, results = tp
    got = results[0][fam]
    assert all(r[fam] is None for r in results[1:])  # only rank 0 gets the report
    worst = compare(got, single[fam])
    top = sorted(worst.items(), key=lambda kv: -kv[1])[:4]
    print(f"{fam} world={world} largest relative diffs: " + ", ".join(f"{k} {v:.1e}" for k, v in top))
    assert not got["findings"] and not got["skipped"]
    assert got["model"]["vocab_size"] == 512 and got["model"]["num_params"] == single[fam]["model"]["num_params"]
    assert got["lens"]["top_ids"] == single[fam]["lens"]["top_ids"]  # identical top tokens per layer


def test_observe_on_a_batch_equals_single_process(tp, single):
    world, results = tp
    for r in results:  # every rank holds the reduced statistics, not only rank 0
        compare(r["batch"], single["batch"])


def test_nan_from_one_rank_shard_is_found_as_in_one_process(tp, single):
    """The NaN starts in layers.1.mlp.up's last channel, on the last rank only: rank 0's report names
    it (the flags are reduced), the logits' per-position NaN statistics match, and the lens, whose
    cross-shard merge needs finite values, is refused with the reason instead of reported."""
    world, results = tp
    got, want = results[0]["nan"], single["nan"]
    assert want["nonfinite"]["first"]["module"] == "layers.1.mlp.up"
    compare(got["nonfinite"], want["nonfinite"])
    compare(got["findings"], want["findings"])
    compare(got["logits"]["per_position"], want["logits"]["per_position"])
    compare(got["residual"], want["residual"])
    assert "tensor parallelism" in got["skipped"]["lens"] and "lens" not in got


def test_surgery_is_refused_on_every_rank(tp):
    world, results = tp
    for r in results:
        assert "not implemented under tensor parallelism" in r["surgery"]


def _cli_worker(ranks, d, out, cases):
    """cmd_inspect on every rank as `torchrun ... -m sluice inspect --tp N` runs it (the group is
    already up, so parallel.init() joins it): (exit status or error, stdout) per case."""
    import contextlib
    import io

    from sluice.cli import build_parser
    from sluice.cli.inspect import cmd_inspect
    results = []
    for tp, extra in cases:
        args = build_parser().parse_args(["inspect", "--model", d, "--json", "--tp", str(tp), *extra, PROMPT])
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                results.append((cmd_inspect(args), buf.getvalue()))
        except Exception as e:  # noqa: BLE001 - the refusals are the point
            results.append((f"{type(e).__name__}: {e}", buf.getvalue()))
        from sluice.parallel import init
        init(ranks.rank, ranks.world, f"file://{out}/store{len(results)}", timeout_s=60)  # cmd_inspect shut it down
    return results


def test_cli_inspect_under_tp(dirs, single, tmp_path):
    """Rank 0 alone prints the JSON (equal to the single-process report) and writes --out; bad input
    stops every rank (a --tp that is not the group's size; an --out rank 0 cannot write)."""
    import json

    from sluice.observatory.analysis import jsonable
    d = dirs["qwen3"]
    (tmp_path / "a-file").write_text("")
    cases = [(2, ["--out", str(tmp_path / "report")]), (4, []), (2, ["--out", str(tmp_path / "a-file")]),
             (2, ["--surgery", "final-norm=off"])]
    r0, r1 = ok(run_ranks(tmp_path / "ranks", 2, _cli_worker, d, str(tmp_path / "ranks"), cases))
    (status, stdout), (status1, stdout1) = r0[0], r1[0]
    assert status == 0 and status1 == 0 and stdout1 == ""
    compare(json.loads(stdout), jsonable(single["qwen3"]))
    assert (tmp_path / "report" / "report.html").exists() and (tmp_path / "report" / "report.json").exists()
    for r in (r0, r1):
        assert "ConfigError" in r[1][0] and "--tp 4 but torchrun started 2 processes" in r[1][0]
        assert "not implemented under tensor parallelism" in r[3][0]
    assert "is an existing file, not a directory" in r0[2][0] and r1[2] == (2, "")


def test_torchrun_inspect_tp(dirs, single, tmp_path):
    """The real launch: `torchrun --nproc-per-node 2 -m sluice inspect --tp 2 --json`."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    from sluice.observatory.analysis import jsonable
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    r = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "sluice", "inspect", "--tp", "2",
                        "--model", dirs["qwen3"], "--json", PROMPT], capture_output=True, text=True, timeout=300,  # 10x+
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    compare(json.loads(r.stdout), jsonable(single["qwen3"]))  # one JSON document: rank 0's alone
