"""`sluice export-gguf` refusing what it must not write: a target that is not a regular file (the
temporary file is renamed over it, so a device node would become a regular file) and a checkpoint
whose weights hold NaN or inf. Both exit 2 with one line and leave the target as it was."""

import os
import stat
import subprocess
import sys

import pytest
from safetensors import safe_open

pytest.importorskip("gguf")

from ckpt import add_tensors, build_with_tokenizer  # noqa: E402
from sluice.cli import main  # noqa: E402
from sluice.model.gguf_export import ExportError, export_gguf  # noqa: E402


def test_cli_refuses_a_fifo_as_out_and_leaves_it_a_fifo(tiny_dir, tmp_path):
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    # timeout: a hang-stopper (opening a FIFO for writing would block forever), 10x+ a CLI start here
    r = subprocess.run([sys.executable, "-m", "sluice", "export-gguf", "--model", str(tiny_dir), "--out", str(fifo)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "not a regular file" in r.stderr and str(fifo) in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe.gguf"]  # no temporary file left either


def test_a_symlink_to_a_fifo_is_refused_too(tiny_dir, tmp_path):
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "link.gguf").symlink_to(tmp_path / "pipe")
    with pytest.raises(ExportError, match="not a regular file"):
        export_gguf(tiny_dir, tmp_path / "link.gguf")
    assert stat.S_ISFIFO((tmp_path / "pipe").lstat().st_mode)


def test_a_symlink_to_a_regular_file_replaces_the_file(tiny_dir, tmp_path):
    (tmp_path / "real.gguf").write_bytes(b"old")
    (tmp_path / "link.gguf").symlink_to(tmp_path / "real.gguf")
    export_gguf(tiny_dir, tmp_path / "link.gguf", "f16")
    assert (tmp_path / "link.gguf").is_symlink() and (tmp_path / "real.gguf").read_bytes()[:4] == b"GGUF"


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_nonfinite_weights_are_refused_by_tensor_name(tmp_path, capsys, poison):
    d = tmp_path / "ckpt"
    build_with_tokenizer(d, "qwen3")
    with safe_open(d / "model.safetensors", "pt") as f:
        bad = f.get_tensor("model.layers.1.mlp.down_proj.weight").clone()
    bad[3, 5] = poison
    add_tensors(d, {"model.layers.1.mlp.down_proj.weight": bad})
    out = tmp_path / "m.gguf"
    capsys.readouterr()  # the checkpoint builder's progress bars
    assert main(["export-gguf", "--model", str(d), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "model.layers.1.mlp.down_proj.weight" in err and "NaN or infinite" in err and "1 NaN" in err
    assert len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
