"""A reduced load test of `sluice serve` (a real server process on the bundled model), run through
bench/serve_load.py's own functions: 4 streaming clients x 3 requests (completions and chat, greedy
and seeded), then 1 client. Behaviour only, no timing asserts: every request gets exactly the tokens
it asked for and a finish_reason, nothing errs, and the engine holds nothing afterwards."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

BENCH = Path(__file__).resolve().parents[2] / "bench" / "serve_load.py"


# Every time limit below (the server's start, the load's and each request's timeouts) stops a hang and is
# 10x+ what it waits on takes here under load; none checks speed.


@pytest.fixture(scope="module")
def sl():
    spec = importlib.util.spec_from_file_location("serve_load", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["serve_load"] = mod  # dataclasses look their module up while the file executes
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def run(sl):
    load = sl.Load(concurrency=4, requests=3, serial=6, prompt_tokens=(8, 48), max_tokens=(3, 8), sampled=0.5,
                   chat=0.5, seed=1)
    srv = sl.sluice_server(None, "float32", load.concurrency)
    try:
        srv.wait_ready(300)
        result = sl.measure(srv, "sluice", load, sl.sluice_counter(None), timeout=600)
        # refused by the server (max_tokens < 0 is a 400): an error with the server's message
        result["refused"] = [sl.run_load(srv.base, "sluice", [sl.Spec(4, -1, prompt="x")], 1, 30, client)[0][0]
                             for client in ("lean", "httpx")]
        result["httpx"], _ = sl.run_load(srv.base, "sluice", [sl.Spec(12, 5, prompt="def main():")] * 3, 2, 60,
                                         "httpx")  # the other load generator, same checks
    finally:
        result_exit = srv.stop(60)
    return result, result_exit, srv


@pytest.mark.slow
def test_no_errors_and_clean_exit(run):
    r, code, srv = run
    assert code == 0, f"SIGTERM should drain and exit 0:\n{srv.log_tail()}"
    for key, n in (("c4", 12), ("c1", 6)):
        assert r[key]["n"] == n
        assert r[key]["errors"] == 0, r[key]["error_samples"]


@pytest.mark.slow
def test_every_request_got_its_tokens(run):
    r, _, _ = run
    specs = r["specs"]
    assert {s["chat"] for s in specs} == {True, False}  # both routes under load
    assert {s["seed"] is None for s in specs} == {True, False}  # greedy and seeded
    for results, n in ((r["requests"]["concurrent"], 12), (r["requests"]["serial"], 6)):
        assert len(results) == n
        for res, spec in zip(results, specs, strict=False):
            assert res["ok"], res["error"]
            assert res["tokens"] == spec["max_tokens"]  # from the usage block (ignore_eos: no early stop)
            assert res["finish_reason"] == "length"
            assert res["chunks"] >= 1 and res["text"]
            assert res["ttft"] is not None and res["tpot"] is not None
            if not spec["chat"]:  # the prompt fitted with the local tokenizer is what the server counted
                assert res["prompt_tokens"] == spec["prompt_tokens"]


@pytest.mark.slow
def test_summary_counts_what_came(run):
    r, _, _ = run
    for key, kind in (("c4", "concurrent"), ("c1", "serial")):
        assert r[key]["out_tokens"] == sum(x["tokens"] for x in r["requests"][kind])
        assert r[key]["tok_s"] > 0
        # the cores each side kept busy: CPU seconds over the run's wall time, both sides measured
        assert 0 < r[key]["client_cores"] and 0 < r[key]["server_cores"] <= os.cpu_count() + 0.5


@pytest.mark.slow
def test_engine_holds_nothing_afterwards(run):
    m = run[0]["metrics"]
    assert m["running"] == 0 and m["waiting"] == 0
    if m["kv_blocks_used"] is not None:  # the paged engine's gauge; the one-at-a-time engine has none
        assert m["kv_blocks_used"] == 0


@pytest.mark.slow
def test_failures_are_errors(sl, run):
    """A refusal (HTTP 400) or a server that is gone counts as an error with its reason, never as a
    request that merely produced nothing."""
    r, _, srv = run
    for refused in r["refused"]:  # through the lean client and through httpx
        assert not refused.ok and refused.error.startswith("HTTP 400") and "max_tokens" in refused.error
    gone = [sl.run_load(srv.base, "sluice", [sl.Spec(4, 2, prompt="x")], 1, 10, client)[0][0]
            for client in ("lean", "httpx")]  # stopped: connect fails
    assert not gone[0].ok and "ConnectionRefusedError" in gone[0].error
    assert not gone[1].ok and "ConnectError" in gone[1].error
    assert sl.summarize(r["refused"] + gone, 1.0)["errors"] == 4
    assert [x.ok and x.tokens == 5 and x.finish_reason == "length" for x in r["httpx"]] == [True] * 3


def test_the_lean_client_dechunks_any_split_of_the_wire(sl):
    """bench/sse_client.py parses the chunked framing out of whatever each read brought: the same bytes
    for any way the wire is cut, and a body cut short is an error, never a silent success or a hang."""
    import asyncio
    import random

    from sse_client import Stream

    async def body(wire: bytes, cuts: list[int]) -> bytes:
        reader, stream = asyncio.StreamReader(), Stream("http://127.0.0.1:1/", {})
        stream.headers, stream._reader = {"transfer-encoding": "chunked"}, reader

        async def feed():
            for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True):
                reader.feed_data(wire[a:b])
                await asyncio.sleep(0)
            reader.feed_eof()

        feeding = asyncio.create_task(feed())
        try:
            return await stream.read()
        finally:
            await feeding

    rng = random.Random(1)
    for trial in range(200):
        payloads = [rng.randbytes(rng.randint(1, 300)) for _ in range(rng.randint(0, 12))]
        wire = b"".join(b"%x\r\n" % len(p) + p + b"\r\n" for p in payloads) + b"0\r\n\r\n"
        cuts = sorted(rng.sample(range(1, len(wire)), min(len(wire) - 1, rng.randint(0, 30))))
        assert asyncio.run(body(wire, cuts)) == b"".join(payloads), trial
        with pytest.raises(asyncio.IncompleteReadError):
            asyncio.run(body(wire[:-6], cuts[: len(cuts) // 2]))
