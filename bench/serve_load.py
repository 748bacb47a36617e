"""Load test of `sluice serve`: C concurrent streaming clients against a real server process, and the
same load against llama-cpp-python's OpenAI server on the same checkpoint's GGUF (docs/serve-load.md).

    flock /tmp/sluice-bench.lock .venv/bin/python bench/serve_load.py --out docs/results/serve-load.json

Per model and engine: start the server on a free 127.0.0.1 port, wait until it answers, send one
untimed warmup request, run C clients (closed loop: each sends its next request when the last one
ends) and then 1 client over the same seeded requests, read /metrics, stop the server with SIGTERM
(killed if it does not exit). Every request streams with a fixed output length (sluice: ignore_eos;
llama.cpp: min_tokens = max_tokens), so both engines generate the same number of tokens.
tests/server/test_serve_load.py runs a reduced load through the same functions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its neighbour, however this file was loaded
from serve_servers import (GAUGES, Server, _commit, cpu, ensure_q06, free_port, gguf_matches,  # noqa: E402,F401
                           llama_counter, llama_server, scrape_metrics, sluice_counter, sluice_server)
from sse_client import Stream  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LCPP_PYTHON = ROOT / ".peers/lcpp-venv/bin/python"


@dataclass
class Load:
    concurrency: int = 8
    requests: int = 4          # per client
    serial: int | None = None  # requests in the concurrency-1 run (None: all C x R)
    prompt_tokens: tuple[int, int] = (16, 256)
    max_tokens: tuple[int, int] = (16, 128)
    sampled: float = 0.5       # fraction of requests sampled (seeded) rather than greedy
    chat: float = 0.0          # fraction sent to /v1/chat/completions
    seed: int = 0
    client: str = "lean"       # the load generator: "lean" (sse_client.py) or "httpx"


@dataclass
class Spec:
    prompt_tokens: int         # the target; after fit_prompts, the engine's own count of `prompt`
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    chat: bool = False
    prompt: str = ""


@dataclass
class Result:
    ok: bool
    error: str | None
    tokens: int                # output tokens: the usage block's count where the server sends one
    chunks: int                # stream chunks that carried output (text, possibly empty)
    finish_reason: str | None
    prompt_tokens: int | None
    ttft: float | None         # seconds from sending to the first text chunk (queueing + prefill)
    tpot: float | None         # seconds per output token after the first
    start: float
    end: float
    text: str = ""


def make_specs(n: int, prompt_range, max_range, sampled: float, chat: float, seed: int) -> list[Spec]:
    rng = random.Random(seed)
    specs = []
    for _ in range(n):
        p, m = rng.randint(*prompt_range), rng.randint(*max_range)
        temp, s = (0.8, rng.randrange(2**31)) if rng.random() < sampled else (0.0, None)
        specs.append(Spec(p, m, temp, s, rng.random() < chat))
    return specs


def fit_prompts(specs: list[Spec], count, seed: int) -> list[Spec]:
    """Each spec gets a slice of a stdlib module's source that `count` (the engine's own tokenizer) says
    is at most its target length: the same text for engines that share a tokenizer."""
    source = Path(argparse.__file__).read_text()
    starts = [0] + [i + 1 for i, ch in enumerate(source) if ch == "\n"]
    rng = random.Random(seed)
    out = []
    for spec in specs:
        start = rng.choice(starts[: len(starts) // 2])
        lo, hi = 1, min(len(source) - start, 16 * spec.prompt_tokens)
        while lo < hi:  # the longest slice within the target (token counts grow with length)
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if count(source[start:start + mid]) <= spec.prompt_tokens else (lo, mid - 1)
        text = source[start:start + lo]
        out.append(replace(spec, prompt=text, prompt_tokens=count(text)))
    return out


def request_body(kind: str, spec: Spec) -> tuple[str, dict]:
    body = {"max_tokens": spec.max_tokens, "temperature": spec.temperature, "stream": True}
    if spec.seed is not None:
        # top_k bounds the work: with it off, llama.cpp's top-p over the flat 152k-token distribution of a
        # random-weight model took 4.1 s per token on one request (0.08 s with top_k 40)
        body.update(seed=spec.seed, top_k=40, top_p=0.95)
    if kind == "sluice":
        body.update(ignore_eos=True, stream_options={"include_usage": True})
    else:  # llama-cpp-python: no ignore_eos and no usage in streams; its other sampler defaults
        # (min_p 0.05, repeat_penalty 1.1) set to OpenAI's plain ones, which sluice uses
        body.update(min_tokens=spec.max_tokens, min_p=0.0, repeat_penalty=1.0)
    if spec.chat:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": spec.prompt}]}
    return "/v1/completions", {**body, "prompt": spec.prompt}


@contextlib.asynccontextmanager
async def _post(client, url: str, body: dict):
    """(status, async iterator of lines, async reader of the whole body) of a streaming POST: through
    httpx when `client` is an httpx.AsyncClient, else through sse_client.Stream."""
    if client is None:
        async with Stream(url, body) as r:
            yield r.status, r.lines(), r.read
    else:
        async with client.stream("POST", url, json=body) as r:
            yield r.status_code, r.aiter_lines(), r.aread


async def _stream(client, base: str, kind: str, spec: Spec) -> Result:
    path, body = request_body(kind, spec)
    t0 = time.perf_counter()
    first = last = finish = usage = error = None
    chunks, done, pieces = 0, False, []
    async with _post(client, base + path, body) as (status, lines, read):
        if status != 200:
            error = f"HTTP {status}: {(await read())[:300]!r}"
        else:
            async for line in lines:
                if not line.startswith("data:"):
                    continue  # blank separators, ': ping' comments
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    error = f"in-stream error: {obj['error']}"
                usage = obj.get("usage") or usage
                for c in obj.get("choices") or []:
                    delta = c.get("delta") or {}
                    text = c.get("text") if "text" in c else delta.get("content")
                    # a token's chunk, even with empty text (llama.cpp sends one per token); not a chat
                    # role header (sent before any token) nor an empty closing chunk with the finish_reason
                    if text is not None and not delta.get("role") and (text or not c.get("finish_reason")):
                        pieces.append(text)
                        last = time.perf_counter()
                        first, chunks = first or last, chunks + 1
                    finish = c.get("finish_reason") or finish
    end = time.perf_counter()
    # llama.cpp's streams carry no usage; with min_tokens = max_tokens, 'length' means max_tokens came
    tokens = usage["completion_tokens"] if usage else spec.max_tokens if finish == "length" else chunks
    if error is None and not done:
        error = "stream ended without [DONE]"
    if error is None and finish is None:
        error = "no finish_reason"
    if error is None and tokens != spec.max_tokens:
        error = f"{tokens} tokens, asked for {spec.max_tokens} (finish_reason {finish})"
    return Result(error is None, error, tokens, chunks, finish,
                  usage["prompt_tokens"] if usage else spec.prompt_tokens,
                  None if first is None else first - t0,
                  (last - first) / (tokens - 1) if first is not None and tokens > 1 else None, t0, end,
                  "".join(pieces))


async def _one(client, base: str, kind: str, spec: Spec, timeout: float) -> Result:
    t0 = time.perf_counter()
    try:
        return await asyncio.wait_for(_stream(client, base, kind, spec), timeout)
    except (httpx.HTTPError, OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, KeyError,
            TypeError) as e:  # JSONDecodeError is a ValueError; ConnectionError an OSError
        return Result(False, f"{type(e).__name__}: {e}"[:300], 0, 0, None, None, None, None, t0,
                      time.perf_counter())


async def _load(base: str, kind: str, specs: list[Spec], concurrency: int, timeout: float, client: str):
    results: list[Result | None] = [None] * len(specs)
    todo = iter(enumerate(specs))  # shared by the clients: each takes the next request when done

    async def client_loop(client):
        for i, spec in todo:
            results[i] = await _one(client, base, kind, spec, timeout)

    async with contextlib.AsyncExitStack() as stack:
        http = None
        if client == "httpx":
            limits = httpx.Limits(max_connections=concurrency + 2)
            http = await stack.enter_async_context(
                httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10), limits=limits))
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(http) for _ in range(concurrency)))
        return results, time.perf_counter() - t0


def run_load(base: str, kind: str, specs: list[Spec], concurrency: int, timeout: float, client: str = "lean"):
    """`concurrency` clients send `specs` (streaming); returns ([Result], wall seconds). client "lean":
    sse_client.Stream, a connection per request; "httpx": one httpx.AsyncClient with keep-alive."""
    return asyncio.run(_load(base, kind, specs, concurrency, timeout, client))


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    pos = (len(xs) - 1) * q / 100
    i = int(pos)
    return xs[i] + (xs[min(i + 1, len(xs) - 1)] - xs[i]) * (pos - i)


def summarize(results: list[Result], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    out_tokens = sum(r.tokens for r in ok)
    ms = lambda v: None if v is None else v * 1000  # noqa: E731
    return {"n": len(results), "errors": len(results) - len(ok),
            "error_samples": sorted({r.error for r in results if not r.ok})[:3], "out_tokens": out_tokens,
            "prompt_tokens_mean": sum(r.prompt_tokens or 0 for r in ok) / max(len(ok), 1),
            "wall_s": wall, "tok_s": out_tokens / wall if wall else 0.0,
            "ttft_p50_ms": ms(pct(ttft, 50)), "ttft_p99_ms": ms(pct(ttft, 99)),
            "tpot_p50_ms": ms(pct(tpot, 50)), "tpot_p99_ms": ms(pct(tpot, 99))}


def cpu_seconds(server: Server) -> dict:
    """CPU seconds so far of this process (the load's clients) and of the server process (all its
    threads; from /proc, so Linux only: None elsewhere)."""
    out = {"client": time.process_time(), "server": None}
    try:
        fields = Path(f"/proc/{server.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        out["server"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    except (OSError, ValueError, IndexError):
        pass
    return out


def cores_used(before: dict, after: dict, wall: float) -> dict:
    """How many cores the clients and the server kept busy on average over a run: on a machine that runs
    both, the clients' share is what the server could not have."""
    def share(k):
        return None if before[k] is None or after[k] is None or not wall else (after[k] - before[k]) / wall
    return {"client_cores": share("client"), "server_cores": share("server")}


def measure(server: Server, kind: str, load: Load, count, timeout: float, settle: float = 2.0) -> dict:
    """Warmup, then the load at concurrency C and at 1, then the end-of-run gauges."""
    specs = fit_prompts(make_specs(load.concurrency * load.requests, load.prompt_tokens, load.max_tokens,
                                   load.sampled, load.chat, load.seed), count, load.seed)
    warm = fit_prompts([Spec(prompt_tokens=16, max_tokens=4)], count, load.seed + 1)
    run_load(server.base, kind, warm, 1, timeout, load.client)
    out = {"load": {**asdict(load), "serial": load.serial or len(specs)}}
    cpu0 = cpu_seconds(server)
    res_c, wall_c = run_load(server.base, kind, specs, load.concurrency, timeout, load.client)
    cpu1 = cpu_seconds(server)
    res_1, wall_1 = run_load(server.base, kind, specs[:load.serial or len(specs)], 1, timeout, load.client)
    cpu2 = cpu_seconds(server)
    out[f"c{load.concurrency}"] = {**summarize(res_c, wall_c), **cores_used(cpu0, cpu1, wall_c)}
    out["c1"] = {**summarize(res_1, wall_1), **cores_used(cpu1, cpu2, wall_1)}
    out["ratio_c_over_1"] = (out[f"c{load.concurrency}"]["tok_s"] / out["c1"]["tok_s"]) if out["c1"]["tok_s"] else None
    out["metrics"] = scrape_metrics(server.base, settle) if kind == "sluice" else None
    # greedy and seeded requests should not depend on what else ran beside them
    out["same_text_c_vs_1"] = sum(a.text == b.text for a, b in zip(res_c, res_1, strict=False))
    out["specs"] = [{k: v for k, v in asdict(s).items() if k != "prompt"} for s in specs]
    out["requests"] = {"concurrent": [asdict(r) for r in res_c], "serial": [asdict(r) for r in res_1]}
    return out


def run_model(name: str, args, load: Load, sluice_model: str | None, dtype: str, gguf: Path | None) -> dict:
    result = {"dtype": dtype, "gguf": str(gguf) if gguf else None}
    # "sluice+draft": the same server speculating with the bundled draft (it serves the bundled model only)
    variants = [("sluice", [])] + ([("sluice+draft", ["--draft-model", "bundled"])]
                                   if "sluice+draft" in args.engines and sluice_model is None else [])
    for engine, extra in variants:
        if engine not in args.engines:
            continue
        srv = sluice_server(sluice_model, dtype, load.concurrency, [*args.sluice_arg, *extra])
        try:
            srv.wait_ready(args.load_timeout)
            result[engine] = measure(srv, "sluice", load, sluice_counter(sluice_model), args.request_timeout)
        finally:
            result.setdefault(engine, {})["exit"] = srv.stop(args.shutdown_timeout)
        print(f"{name} {engine}: {brief(result[engine], load)}", flush=True)
    if "llama.cpp" in args.engines and gguf is not None:
        srv = llama_server(gguf, args.lcpp_python, args.threads, args.n_ctx)
        try:
            srv.wait_ready(args.load_timeout)
            result["llama.cpp"] = measure(srv, "llama.cpp", load, llama_counter(srv.base), args.request_timeout)
        finally:
            result.setdefault("llama.cpp", {})["exit"] = srv.stop(args.shutdown_timeout)
        print(f"{name} llama.cpp: {brief(result['llama.cpp'], load)}", flush=True)
    s, ll = result.get("sluice", {}), result.get("llama.cpp", {})
    if s.get("c1") and ll.get("c1"):
        c = f"c{load.concurrency}"
        result["sluice_over_llama"] = {k: s[k]["tok_s"] / ll[k]["tok_s"] for k in (c, "c1") if ll[k]["tok_s"]}
    d = result.get("sluice+draft", {})
    if s.get("c1") and d.get("c1"):
        c = f"c{load.concurrency}"
        result["draft_over_plain"] = {k: d[k]["tok_s"] / s[k]["tok_s"] for k in (c, "c1") if s[k]["tok_s"]}
    return result


def brief(r: dict, load: Load) -> str:
    c = r.get(f"c{load.concurrency}")
    if not c:
        return "no result"
    return (f"C={load.concurrency} {c['tok_s']:.1f} tok/s, C=1 {r['c1']['tok_s']:.1f} tok/s, ratio "
            f"{r['ratio_c_over_1']:.2f}x, errors {c['errors']}+{r['c1']['errors']}")


def fmt(v, spec: str = ".1f") -> str:
    return "n/a" if v is None else format(v, spec) if isinstance(v, float) else str(v)


def markdown(result: dict) -> str:
    rows = ["| model | engine | clients | requests | errors | out tok/s | C / 1 | same text C / 1 | "
            "TTFT p50 / p99 ms | TPOT p50 / p99 ms | cores busy: clients / server | KV blocks used | running / waiting | exit |",
            "|" + "---|" * 14]
    ratios = []
    for model, r in result["models"].items():
        for engine in ("sluice", "sluice+draft", "llama.cpp"):
            e = r.get(engine)
            if not e or "c1" not in e:
                continue
            m = e.get("metrics") or {}
            for key in [k for k in e if k.startswith("c") and k[1:].isdigit()]:
                s, serial = e[key], key == "c1"
                ratio = "" if serial else fmt(e["ratio_c_over_1"], ".2f") + "x"
                same = "" if serial else f"{e['same_text_c_vs_1']} of {e['c1']['n']}"
                rows.append(f"| {model} ({r['dtype']}) | {engine} | {key[1:]} | {s['n']} | {s['errors']} | "
                            f"{s['tok_s']:.1f} | {ratio} | {same} | {fmt(s['ttft_p50_ms'])} / "
                            f"{fmt(s['ttft_p99_ms'])} | {fmt(s['tpot_p50_ms'])} / {fmt(s['tpot_p99_ms'])} | "
                            f"{fmt(s.get('client_cores'), '.2f')} / {fmt(s.get('server_cores'), '.2f')} | "
                            f"{fmt(m.get('kv_blocks_used'))} | {fmt(m.get('running'))} / {fmt(m.get('waiting'))} | "
                            f"{e.get('exit')} |")
        if r.get("sluice_over_llama"):
            ratios.append(f"- {model}: sluice / llama.cpp output tok/s: " +
                          ", ".join(f"{k[1:]} client(s) {v:.2f}x" for k, v in r["sluice_over_llama"].items()))
        if r.get("draft_over_plain"):
            ratios.append(f"- {model}: sluice with the bundled draft / without, output tok/s: " +
                          ", ".join(f"{k[1:]} client(s) {v:.2f}x" for k, v in r["draft_over_plain"].items()))
    return "\n".join(rows + [""] + ratios)


def parse_range(s: str) -> tuple[int, int]:
    lo, _, hi = s.partition(":")
    return int(lo), int(hi or lo)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="bundled,q06", help="comma list of bundled, q06")
    ap.add_argument("--engines", default="sluice,llama.cpp",
                    help="comma list of sluice, sluice+draft (bundled model: --draft-model bundled), llama.cpp")
    ap.add_argument("-c", "--concurrency", type=int, default=8)
    ap.add_argument("-r", "--requests", type=int, default=4, help="requests per client")
    ap.add_argument("--serial", type=int, default=None, help="requests in the 1-client run (default all)")
    ap.add_argument("--prompt-tokens", type=parse_range, default=(16, 256), metavar="LO:HI")
    ap.add_argument("--max-tokens", type=parse_range, default=(16, 128), metavar="LO:HI")
    ap.add_argument("--sampled", type=float, default=0.5)
    ap.add_argument("--chat", type=float, default=0.0, help="fraction of chat requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bundled-dtype", default="float32")
    ap.add_argument("--bundled-gguf", type=Path, default=ROOT / ".peers/bundled-f32.gguf")
    ap.add_argument("--q06", default="/tmp/sluice-speed-q06", help="random Qwen3-0.6B-shape checkpoint")
    ap.add_argument("--q06-dtype", default="bfloat16")
    ap.add_argument("--q06-gguf", type=Path, default=ROOT / ".peers/qwen3-0.6b-bf16.gguf")
    ap.add_argument("--q06-requests", type=int, default=2, help="requests per client on the 0.6B model")
    ap.add_argument("--q06-serial", type=int, default=None, help="requests in its 1-client run (default all)")
    ap.add_argument("--q06-prompt-tokens", type=parse_range, default=(16, 128), metavar="LO:HI")
    ap.add_argument("--q06-max-tokens", type=parse_range, default=(8, 32), metavar="LO:HI")
    ap.add_argument("--sluice-arg", action="append", default=[], help="extra `sluice serve` argument (repeatable)")
    ap.add_argument("--client", choices=("lean", "httpx"), default="lean",
                    help="load generator: lean (bench/sse_client.py, ~10x less CPU a chunk) or httpx")
    ap.add_argument("--lcpp-python", type=Path, default=LCPP_PYTHON)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp threads")
    ap.add_argument("--n-ctx", type=int, default=2048, help="llama.cpp context (one sequence)")
    ap.add_argument("--request-timeout", type=float, default=900.0, help="seconds per request, queueing included")
    ap.add_argument("--load-timeout", type=float, default=600.0)
    ap.add_argument("--shutdown-timeout", type=float, default=60.0)
    ap.add_argument("--out", type=Path, default=None, help="JSON results")
    args = ap.parse_args(argv)
    args.engines = args.engines.split(",")
    if "llama.cpp" in args.engines and not args.lcpp_python.exists():
        print(f"note: {args.lcpp_python} missing; llama.cpp skipped", file=sys.stderr)
        args.engines.remove("llama.cpp")
    base = Load(args.concurrency, args.requests, args.serial, args.prompt_tokens, args.max_tokens,
                args.sampled, args.chat, args.seed, args.client)
    result = {"env": {"cpu": cpu(), "python": platform.python_version(), "commit": _commit(),
                      "loadavg_start": os.getloadavg()}, "argv": sys.argv[1:], "models": {}}
    for name in args.models.split(","):
        if name == "bundled":
            result["models"][name] = run_model(name, args, base, None, args.bundled_dtype,
                                               _existing(args.bundled_gguf))
        elif name == "q06":
            load = replace(base, requests=args.q06_requests, serial=args.q06_serial,
                           prompt_tokens=args.q06_prompt_tokens, max_tokens=args.q06_max_tokens)
            ensure_q06(Path(args.q06))
            gguf = _existing(args.q06_gguf)
            if gguf is not None and not gguf_matches(Path(args.q06), gguf):
                print(f"note: {gguf} does not hold {args.q06}'s weights; llama.cpp skipped for it", file=sys.stderr)
                gguf = None
            result["models"][name] = run_model(name, args, load, args.q06, args.q06_dtype, gguf)
        else:
            ap.error(f"unknown model {name!r} (bundled, q06)")
        if args.out:  # after each model: a later failure keeps what was measured
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1))
    result["env"]["loadavg_end"] = os.getloadavg()
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(markdown(result))
    print(f"\n{result['env']}")
    return 0


def _existing(p: Path) -> Path | None:
    if not p.exists():
        print(f"note: {p} missing; llama.cpp skipped for it", file=sys.stderr)
        return None
    return p


if __name__ == "__main__":
    sys.exit(main())
