"""The engines `sluice bench` times: sluice itself, transformers (same process), llama.cpp (child).

Each engine loads once and then answers `round(prompt, gen)` with one timed prefill and `gen`
timed decode steps, all greedy at batch 1, as {"pp_s", "tg_s", "tokens"}:
  pp_s    the prompt's forward pass plus the greedy pick of the first new token;
  tg_s    `gen` more steps, each a one-token forward plus its greedy pick;
  tokens  the first token and the `gen` after it (to check that the engines see the same model).
`weight_bytes` (what one decode step reads of the weights) and `kv_itemsize` let the caller turn
tokens/s into bytes/s.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..engine import kv_cache
from ..engine.gemv import cpu_flags
from ..engine.mixed import activation_dtype
from ..errors import BenchmarkError

GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int8": "q8_0", "int4": "q4_0"}
LLAMA_INSTALL = ("install llama-cpp-python where a python can import it (`pip install llama-cpp-python`, "
                 "or in this repository `bash ../shared/peers/build-llama-cpp.sh .peers` for a native "
                 "build in .peers/lcpp-venv) and pass that python with --llama-python PATH")


def _weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: everything stored (tied tensors once, quantized ones
    as stored, scales included) but the embedding table, of which a step reads one row, unless
    the LM head reads that same storage (tied, unquantized)."""
    seen, total = set(), 0
    for t in model.state_dict().values():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.nbytes
    emb = model.embed.weight
    head = getattr(model.lm_head, "weight", None)
    if head is None or head.data_ptr() != emb.data_ptr():
        total -= emb.nbytes - emb[0].nbytes
    return total


def _gguf_weight_bytes(path: Path) -> int | None:
    """The same for a GGUF file, from its tensor table (None without the gguf package): all
    tensors, token_embd only one row when a separate output (LM head) tensor exists."""
    try:
        from gguf import GGUFReader
    except ImportError:
        return None
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    total = sum(int(t.n_bytes) for t in tensors.values())
    emb = tensors.get("token_embd.weight")
    if "output.weight" in tensors and emb is not None:
        rows = int(emb.shape[-1])  # GGUF lists dimensions innermost first: (hidden, vocab)
        total -= int(emb.n_bytes) - int(emb.n_bytes) // rows
    return total


class SluiceEngine:
    name = "sluice"

    def __init__(self, model_dir: Path, dtype: str, quantize: str | None, compile: bool,
                 speculation: dict | None = None, kv_cache_dtype: str = "auto"):
        from .. import llm as engine_llm  # the module, so a test can watch what LLM is given
        from ..engine.sampling import SamplingParams
        LLM = engine_llm.LLM
        kwargs = {"dtype": dtype, "compile": compile, **(speculation or {})}
        if kv_cache_dtype != "auto":
            kwargs["kv_cache_dtype"] = kv_cache_dtype
        if quantize:
            if "quantize" not in inspect.signature(LLM).parameters:
                raise BenchmarkError(f"--quantize {quantize}: this sluice has no weight quantization yet")
            kwargs["quantize"] = quantize
        self.llm, self._params = LLM(model_dir, **kwargs), SamplingParams
        self.precision = quantize or {"float32": "f32", "bfloat16": "bf16"}.get(dtype, dtype)
        self.weight_bytes = _weight_bytes(self.llm.model)
        self.huge_pages = getattr(self.llm.model, "huge_pages", None)
        # what the pool holds: the activations' dtype (fp32 under bf16 weights on the native step) or the option's
        self.kv_itemsize = kv_cache.kv_cache_dtype(kv_cache_dtype, activation_dtype(self.llm.model)).itemsize
        self.vocab_limit = min(self.llm.model.config.vocab_size, self.llm.tokenizer.vocab_size)

    def round(self, prompt: list[int], gen: int) -> dict:
        # One generate call gives both: prefill_seconds ends with the first token sampled, then
        # `gen` decode steps (max_tokens counts the first token too).
        params = self._params(max_tokens=gen + 1, temperature=0, ignore_eos=True)
        # Each round's prompt is new (no prefix to find), so the earlier rounds' cached prefixes are dropped first:
        # their blocks, already written, are taken again (paged_cache.BlockPool.take), as llama.cpp reuses the KV
        # buffer it cleared at load, instead of each round writing into pool memory never touched before.
        self.llm.batch_engine().pool.drop_cached()
        out = self.llm.generate([prompt], params)[0]
        s = self.llm.last_stats
        spec = None if s.speculative == "off" else {
            "proposed": s.proposed, "accepted": s.accepted, "target_forwards": s.row_forwards,
            "decode_tokens": max(s.generated_tokens - s.rows, 0)}
        return {"pp_s": s.prefill_seconds, "tg_s": s.decode_seconds, "tokens": out.token_ids, "speculation": spec}

    def close(self) -> None:
        self.llm = None


class TransformersEngine:
    """transformers' model in this process, driven by a plain greedy loop over its DynamicCache
    (what `generate` uses by default), without generate's logits-processor machinery."""
    name = "transformers"

    def __init__(self, model_dir: Path, dtype: str, params_read: int):
        try:
            from transformers import AutoModelForCausalLM, DynamicCache
        except ImportError as e:
            raise BenchmarkError(f"--vs transformers needs the transformers package, which sluice itself does "
                                 f"not require ({e}): pip install 'sluice-llm[peers]'") from None
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        self._cache = DynamicCache
        # transformers 5.x renamed the argument past_key_values -> cache (the old name warns)
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.precision = {"float32": "f32", "bfloat16": "bf16"}.get(dtype, dtype)
        self.kv_itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        self.weight_bytes = params_read * self.kv_itemsize

    @torch.inference_mode()
    def round(self, prompt: list[int], gen: int) -> dict:
        m = self.model
        cache = {self._cache_arg: self._cache(config=m.config)}  # filled in place by every forward
        t0 = time.perf_counter()
        out = m(torch.tensor([prompt]), use_cache=True, logits_to_keep=1, **cache)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)  # (1, 1)
        pp_s = time.perf_counter() - t0
        tokens = [tok]
        t0 = time.perf_counter()
        for _ in range(gen):
            out = m(tok, use_cache=True, **cache)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(tok)
        tg_s = time.perf_counter() - t0
        return {"pp_s": pp_s, "tg_s": tg_s, "tokens": [int(t) for t in tokens]}

    def close(self) -> None:
        self.model = None


def find_llama_python(explicit: str | None) -> str:
    """--llama-python, else this interpreter if it can import llama_cpp, else .peers/lcpp-venv."""
    if explicit:
        if not Path(explicit).is_file():
            raise BenchmarkError(f"--llama-python {explicit}: no such file")
        return explicit
    if importlib.util.find_spec("llama_cpp") is not None:
        return sys.executable
    roots = [Path.cwd(), Path(__file__).resolve().parents[3]]  # the repository, for a source checkout
    for root in roots:
        cand = root / ".peers" / "lcpp-venv" / "bin" / "python"
        if cand.is_file():
            return str(cand)
    raise BenchmarkError(f"--vs llama.cpp: llama-cpp-python is not installed; {LLAMA_INSTALL}")


def gguf_for(model_dir: Path, precision: str, explicit: str | None) -> Path:
    """--gguf FILE, else `sluice export-gguf`'s output for this checkpoint and precision, written
    once into a cache folder keyed by the checkpoint's path, sizes and modification times."""
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise BenchmarkError(f"--gguf {explicit}: no such file")
        return path
    outtype = GGUF_TYPES.get(precision)
    try:
        from ..model.gguf_export import export_gguf
    except ImportError:
        raise BenchmarkError("--vs llama.cpp needs a GGUF file: pass --gguf FILE (this sluice cannot "
                             "export one yet)") from None
    if outtype is None:
        raise BenchmarkError(f"--vs llama.cpp: no GGUF type matches {precision}; pass --gguf FILE")
    key = hashlib.sha256(str(model_dir.resolve()).encode())
    for f in sorted(model_dir.iterdir()):
        if f.is_file():
            st = f.stat()
            key.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    out = Path(tempfile.gettempdir()) / "sluice-bench-gguf" / f"{model_dir.name}-{key.hexdigest()[:12]}-{outtype}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".part")
        print(f"sluice bench: exporting {model_dir} to {out} ({outtype}) for llama.cpp", file=sys.stderr)
        export_gguf(model_dir, tmp, outtype)
        tmp.replace(out)
    return out


class LlamaCppEngine:
    """llama.cpp through llama-cpp-python in a child process (lcpp_worker.py), JSON lines both ways."""
    name = "llama.cpp"

    def __init__(self, python: str, gguf: Path, threads: int, n_ctx: int, n_batch: int, params_read: int):
        worker = Path(__file__).with_name("lcpp_worker.py")
        self._err = tempfile.TemporaryFile()  # llama.cpp's logging, shown only when something fails
        self.proc = subprocess.Popen([python, str(worker)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, text=True, bufsize=1)
        hello = self._read()
        if not hello.get("ok"):
            self.close()
            raise BenchmarkError(f"--vs llama.cpp: {hello.get('error')}; {LLAMA_INSTALL}")
        info = self._ask({"cmd": "load", "model": str(gguf), "n_threads": threads, "n_ctx": n_ctx,
                          "n_batch": n_batch})
        self.info, self.gguf = info, gguf
        self.precision = self._precision(info["desc"], gguf)
        # From the file's tensor table; else the mean bytes per parameter times those read.
        self.weight_bytes = _gguf_weight_bytes(gguf) or round(params_read * info["size"] / info["n_params"])
        self.kv_itemsize = 2  # llama.cpp's default KV cache type is f16
        self.vocab_limit = info["n_vocab"]

    @staticmethod
    def _precision(desc: str, gguf: Path) -> str:
        for word in reversed(desc.split()):  # "qwen3 0.6B BF16" -> bf16; "... Q8_0" -> q8_0
            if word.upper() in {"F32", "F16", "BF16"} or word.upper().startswith(("Q", "IQ")):
                return word.lower()
        return gguf.stem

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self._err.seek(0)
            tail = self._err.read().decode(errors="replace").strip().splitlines()[-3:]
            raise BenchmarkError("--vs llama.cpp: the llama.cpp process ended unexpectedly" + self._death()
                                 + (f": {' / '.join(tail)}" if tail else ""))
        return json.loads(line)

    def _death(self) -> str:
        """How the worker ended, when a signal killed it: its name, and on a CPU with AMX the likely cause (the
        llama.cpp that llama-cpp-python 0.3.36 vendors crashes on its first AMX matmul, docs/benchmarks.md)."""
        try:
            rc = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return ""
        if rc >= 0:
            return f" (exit status {rc})"
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        hint = ""
        if name in ("SIGSEGV", "SIGILL", "SIGBUS") and "amx_tile" in cpu_flags():
            hint = ("; this CPU has AMX, whose llama.cpp kernels (Q8_0, Q4_0, ...) crash in some builds: a llama.cpp "
                    "built without them (GGML_NATIVE=OFF, GGML_AMX_*=OFF) runs here")
        return f" (killed by {name}{hint})"

    def _ask(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        if not reply.get("ok"):
            raise BenchmarkError(f"--vs llama.cpp: {req['cmd']} failed: {reply.get('error')}")
        return reply

    def round(self, prompt: list[int], gen: int) -> dict:
        r = self._ask({"cmd": "round", "prompt": prompt, "gen": gen})
        return {"pp_s": r["pp_s"], "tg_s": r["tg_s"], "tokens": r["tokens"], "perf": r.get("perf", {})}

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self._err.close()
