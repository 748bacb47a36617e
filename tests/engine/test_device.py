"""--device: checked before anything loads, and nothing in the hot path pins tensors to the CPU.

The machines tests run on have no GPU, so the GPU path itself is exercised by the device script
(docs/benchmarks.md, "Any device") when a GPU is lent; here the checks are the error paths and a
guard over the decode-path sources.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sluice
from sluice.errors import ConfigError
from sluice.model.loading import parse_device

SRC = Path(sluice.__file__).parent


def test_parse_device_accepts_cpu():
    assert parse_device("cpu") == torch.device("cpu")
    assert parse_device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.parametrize("bad", ["tpu", "gpu", "", "cuda:x", 3])
def test_parse_device_rejects_unknown(bad):
    with pytest.raises(ConfigError, match="device"):
        parse_device(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible")
def test_cuda_unavailable_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"'cuda' is not available"):
        parse_device("cuda")


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="MPS is available")
def test_mps_unavailable_is_a_clear_error(tiny_dir):
    with pytest.raises(ConfigError, match=r"'mps' is not available"):
        sluice.LLM(tiny_dir, device="mps")


def test_llm_on_cpu_by_name(tiny_dir):
    llm = sluice.LLM(tiny_dir, device="cpu")
    assert llm.device == torch.device("cpu")
    assert all(p.device.type == "cpu" for p in llm.model.parameters())
    out = llm.generate([[1, 2, 3]], sluice.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible")
def test_cli_unavailable_device_exits_2(tiny_dir):
    r = subprocess.run([sys.executable, "-m", "sluice", "generate", "--model", str(tiny_dir),
                        "--device", "cuda", "hi"], capture_output=True, text=True, timeout=120)  # hang-stopper
    assert r.returncode == 2
    assert "device 'cuda' is not available" in r.stderr and "Traceback" not in r.stderr


# The decode path: a tensor made without device= lands on the CPU and breaks (or silently slows)
# a GPU run; a .cpu()/.item()/.numpy() is a host round trip per call.
HOT = ["engine/runner.py", "engine/kv_cache.py", "engine/sampling.py", "engine/fused_head.py",
       "model/layers.py"]
FACTORIES = {"zeros", "ones", "full", "empty", "arange", "tensor", "rand", "randn", "randint", "as_tensor"}
# allowed: the prompt ids, built on the host before their one copy to the device; config-derived
# tables and parameters made at build time (moved by reset_rope / the loader); _embedding's weight,
# made at build time on the ambient default device (meta under the loader) and replaced by the load.
ALLOWED = {("engine/runner.py", "prefill", "zeros"), ("engine/runner.py", "prefill", "tensor"),
           ("model/layers.py", "rope_inv_freq", "arange"), ("model/layers.py", "__init__", "full"),
           ("model/layers.py", "__init__", "ones"), ("model/layers.py", "__init__", "zeros"),
           ("model/layers.py", "_embedding", "empty")}


def _offenders(rel: str) -> list[str]:
    tree = ast.parse((SRC / rel).read_text())
    bad = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            attr, owner = node.func.attr, node.func.value
            if attr in {"cpu", "numpy", "item"} and not node.args:
                bad.append(f"{rel}:{node.lineno} .{attr}() in {fn.name}")
            elif (attr in FACTORIES and isinstance(owner, ast.Name) and owner.id == "torch"
                  and not any(k.arg == "device" for k in node.keywords) and (rel, fn.name, attr) not in ALLOWED):
                bad.append(f"{rel}:{node.lineno} torch.{attr}() without device= in {fn.name}")
    return bad


@pytest.mark.parametrize("rel", HOT)
def test_hot_path_has_no_cpu_round_trips_or_cpu_factories(rel):
    bad = _offenders(rel)
    assert not bad, "device-pinned code in the decode path:\n" + "\n".join(bad)
