"""The machinery around bench/serve_load.py's load: servers as subprocesses on free loopback ports,
the token counters each engine's prompts are cut with, /metrics gauges, the random 0.6B checkpoint and
its GGUF check, and what the JSON records about the machine and the commit."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


GAUGES = {"kv_blocks_used": "sluice_kv_blocks_used", "kv_blocks_total": "sluice_kv_blocks_total",
          "running": "sluice_num_requests_running", "waiting": "sluice_num_requests_waiting"}


def scrape_metrics(base: str, settle: float = 2.0) -> dict:
    """The end-of-run gauges (None where the server has no such metric). A finished stream may reach
    the client a moment before the engine's bookkeeping: poll up to `settle` seconds for all zeros."""
    deadline = time.monotonic() + settle
    while True:
        values: dict[str, float | None] = dict.fromkeys(GAUGES)
        for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.split("{")[0].split()[0], line.rsplit(None, 1)[-1]
                for key, metric in GAUGES.items():
                    if name == metric:
                        values[key] = (values[key] or 0) + float(value)
        busy = any(values[k] for k in ("kv_blocks_used", "running", "waiting"))
        if not busy or time.monotonic() > deadline:
            return values
        time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess: its output goes to a log file (a full pipe would stall it)."""

    def __init__(self, cmd: list[str], port: int, ready_path: str, name: str):
        self.cmd, self.port, self.name, self.ready_path = cmd, port, name, ready_path
        self.base = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"serve-load-{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     cwd=ROOT)

    def log_tail(self, n: int = 3000) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-n:]

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.base + self.ready_path, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop(5)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 60) -> int | str:
        """SIGTERM (sluice drains and exits 0); the whole process group is killed past `timeout`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
                return "killed"
        return self.proc.returncode


def sluice_server(model: str | None, dtype: str, max_num_seqs: int, extra: list[str] = ()) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "sluice", "serve", "--port", str(port), "--dtype", dtype,
           "--max-num-seqs", str(max_num_seqs), *(["--model", model] if model else []), *extra]
    return Server(cmd, port, "/health", "sluice")


def llama_server(gguf: Path, python: Path, threads: int, n_ctx: int) -> Server:
    """llama-cpp-python's server: one Llama (one sequence) behind a global lock, so concurrent requests
    queue. interrupt_requests defaults to True there, which cuts a running stream short whenever
    another request arrives; a load test needs it off."""
    port = free_port()
    cmd = [str(python), "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "--n_ctx", str(n_ctx), "--n_threads", str(threads), "--n_threads_batch", str(threads),
           "--interrupt_requests", "False", "--verbose", "False"]
    return Server(cmd, port, "/v1/models", "llama.cpp")


def sluice_counter(model: str | None):
    from sluice import Tokenizer
    from sluice.model.loading import bundled_model_dir
    tok = Tokenizer.from_pretrained(model or bundled_model_dir())
    return lambda text: len(tok.encode(text))


def llama_counter(base: str):
    def count(text: str) -> int:
        r = httpx.post(base + "/extras/tokenize/count", json={"input": text}, timeout=30)
        r.raise_for_status()
        return r.json()["count"]
    return count


def ensure_q06(path: Path) -> None:
    """The random Qwen3-0.6B-shape checkpoint of docs/benchmarks.md, made if missing: random_checkpoint.py
    (seeded, so its weights equal .peers/qwen3-0.6b-*.gguf's) plus a word-level tokenizer 't0'..'tN'."""
    if (path / "config.json").exists():
        return
    subprocess.run([sys.executable, str(ROOT / "bench/random_checkpoint.py"), "qwen3-0.6b", "--dtype", "float32",
                    "--out", str(path)], check=True, timeout=1800)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    (path / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {f"t{i}": i for i in range(vocab)}, "unk_token": "t0"}}))


def gguf_matches(ckpt: Path, gguf: Path, name: str = "blk.0.attn_q.weight",
                 hf: str = "model.layers.0.self_attn.q_proj.weight") -> bool:
    """Whether the GGUF holds the checkpoint's weights (one matrix compared, at the GGUF's precision)."""
    import numpy as np
    import torch
    from gguf import GGUFReader
    from safetensors import safe_open
    shard = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"][hf]
    with safe_open(str(ckpt / shard), "pt") as f:
        want = f.get_tensor(hf).float()
    t = next(t for t in GGUFReader(str(gguf)).tensors if t.name == name)
    data = np.asarray(t.data).reshape(-1)
    if t.tensor_type.name == "BF16":
        got, want = torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16), want.bfloat16().float()
    else:
        got = torch.from_numpy(data.astype(np.float32))
    return got.numel() == want.numel() and bool((got.float().reshape(want.shape) == want).all())


def cpu() -> dict:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    lines = text.splitlines()
    name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), []))
    wanted = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16")
    return {"model": name, "cores": os.cpu_count(), "flags": [f for f in wanted if f in flags]}


def _commit() -> str:
    """HEAD, plus the source files changed since (what runs is the working tree)."""
    try:
        git = ["git", "-C", str(ROOT)]
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run([*git, "status", "--porcelain", "--", "src"], capture_output=True, text=True,
                               timeout=10).stdout.split("\n")
        changed = [ln[3:] for ln in dirty if ln.strip()]
        return head.stdout.strip() + (f" + uncommitted {', '.join(changed)}" if changed else "")
    except (OSError, subprocess.SubprocessError):
        return "?"
