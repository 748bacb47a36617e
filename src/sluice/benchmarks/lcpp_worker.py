"""llama.cpp's side of `sluice bench --vs llama.cpp`, run as a child process by another python.

llama-cpp-python usually lives in a venv of its own (built natively for the CPU), so this file is
run as a script by that venv's python and imports nothing from sluice or torch: only the standard
library, numpy and llama_cpp. It speaks JSON lines: one request per line on stdin, one reply per
line on stdout (llama.cpp's own logging goes to stderr).

    {"cmd": "load", "model": PATH, "n_threads": 2, "n_ctx": 1024, "n_batch": 512}
        -> {"ok": true, "desc": "qwen3 0.6B BF16", "size": bytes, "n_params": n, "n_vocab": n, ...}
    {"cmd": "round", "prompt": [ids], "gen": 128}
        -> {"ok": true, "pp_s": s, "tg_s": s, "tokens": [ids], "perf": {...}}
    {"cmd": "quit"}

A round is timed here, from the caller's side of the binding, the way sluice times itself:
pp_s = eval(prompt) + greedy pick of the first token; tg_s = `gen` more single-token evals, each
followed by its greedy pick (argmax of the last logits). llama.cpp's own perf counters come back
in "perf" as a cross-check.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time


def _reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _perf(llama_cpp, ctx) -> dict:
    """llama.cpp's internal timings of the last round (ms), or {} where the binding lacks them."""
    try:
        p = llama_cpp.llama_perf_context(ctx)
        return {"t_p_eval_ms": p.t_p_eval_ms, "n_p_eval": p.n_p_eval, "t_eval_ms": p.t_eval_ms, "n_eval": p.n_eval}
    except (AttributeError, TypeError):
        return {}


class Worker:
    def __init__(self):
        import llama_cpp  # fails here, reported as {"ok": false}, when this python lacks it
        import numpy as np
        self.llama_cpp, self.np, self.llm = llama_cpp, np, None

    def load(self, req: dict) -> dict:
        lc = self.llama_cpp
        n_threads = int(req["n_threads"])
        self.llm = lc.Llama(model_path=req["model"], n_threads=n_threads, n_threads_batch=n_threads,
                            n_ctx=int(req["n_ctx"]), n_batch=int(req["n_batch"]), n_ubatch=int(req["n_batch"]),
                            logits_all=False, verbose=False)
        model = self.llm.model
        buf, desc = ctypes.create_string_buffer(256), ""
        try:
            lc.llama_model_desc(model, buf, 256)
            desc = buf.value.decode(errors="replace")
        except (AttributeError, TypeError, ctypes.ArgumentError):
            pass
        self.n_vocab = self.llm.n_vocab()
        return {"ok": True, "desc": desc, "size": int(lc.llama_model_size(model)),
                "n_params": int(lc.llama_model_n_params(model)), "n_vocab": self.n_vocab,
                "n_threads": n_threads, "version": getattr(lc, "__version__", "?"),
                "system_info": lc.llama_print_system_info().decode(errors="replace").strip()}

    def _pick(self) -> int:
        """Greedy: argmax of the last evaluated position's logits, read in place (no copy)."""
        lc, llm = self.llama_cpp, self.llm
        logits = self.np.ctypeslib.as_array(lc.llama_get_logits_ith(llm.ctx, -1), shape=(self.n_vocab,))
        return int(logits.argmax())

    def round(self, req: dict) -> dict:
        llm, prompt, gen = self.llm, [int(t) for t in req["prompt"]], int(req["gen"])
        llm.reset()  # n_tokens = 0: the next eval clears the KV cache from position 0
        try:
            self.llama_cpp.llama_perf_context_reset(llm.ctx)
        except AttributeError:
            pass
        t0 = time.perf_counter()
        llm.eval(prompt)
        tok = self._pick()
        pp_s = time.perf_counter() - t0
        tokens = [tok]
        t0 = time.perf_counter()
        for _ in range(gen):
            llm.eval([tok])
            tok = self._pick()
            tokens.append(tok)
        tg_s = time.perf_counter() - t0
        return {"ok": True, "pp_s": pp_s, "tg_s": tg_s, "tokens": tokens,
                "perf": _perf(self.llama_cpp, llm.ctx)}


def main() -> None:
    try:
        worker = Worker()
    except ImportError as e:
        _reply({"ok": False, "error": f"{sys.executable} cannot import llama_cpp ({e})"})
        return
    _reply({"ok": True, "python": sys.executable})
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("cmd") == "quit":
            break
        try:
            _reply(getattr(worker, req["cmd"])(req))
        except Exception as e:  # noqa: BLE001 -- any failure goes back to the caller as one line
            _reply({"ok": False, "error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    main()
