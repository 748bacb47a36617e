"""Loading a checkpoint stays light: building the model on the meta device must not pull in torch._dynamo.

Arithmetic on meta tensors (nn.Embedding's normal_ init, the RoPE table) runs torch's reference
decompositions, which import torch._dynamo: 1-3 s of every `sluice` start, for values that are replaced
right after. A fresh interpreter is the only place this can be seen, so it runs in a subprocess."""

import subprocess
import sys

import torch

from sluice.model.config import ModelConfig
from sluice.model.layers import Transformer, rope_inv_freq

CHECK = """
import sys
from sluice.model import loading
model = loading.load({path!r})
print('torch._dynamo' in sys.modules, model.inv_freq.device.type)
"""


def test_loading_a_checkpoint_does_not_import_dynamo(tiny_dir):
    r = subprocess.run([sys.executable, "-c", CHECK.format(path=str(tiny_dir))], capture_output=True, text=True,
                       timeout=120)  # a hang-stopper: 20x+ the few seconds here
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "cpu"]


def test_a_meta_build_has_the_same_rope_table_and_shapes_as_a_cpu_build(tiny_dir):
    tiny_cfg = ModelConfig.from_hf(tiny_dir)
    with torch.device("meta"):
        meta = Transformer(tiny_cfg)
    cpu = Transformer(tiny_cfg)
    assert meta.embed.weight.is_meta and cpu.embed.weight.device.type == "cpu"
    assert {k: v.shape for k, v in meta.state_dict().items()} == {k: v.shape for k, v in cpu.state_dict().items()}
    assert torch.equal(meta.inv_freq, rope_inv_freq(tiny_cfg)) and torch.equal(cpu.inv_freq, meta.inv_freq)
    assert cpu.embed.weight.std() > 0.5  # a CPU build keeps torch's own N(0, 1) embedding init
