"""`sluice serve --stream-interval N`: the engine thread hands a stream's text to the event loop every N steps
(server/engine.HeldEvents), and a request's start, first text and end at once; what the clients get is the same."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf

import pytest

from server_harness import MODEL, LiveServer, one_torch_thread  # noqa: F401

import sluice  # noqa: E402
from sluice.engine.sampling_params import SamplingParams  # noqa: E402
from sluice.server import BatchServingEngine  # noqa: E402
from sluice.server.engine import Delta, Done, Finished, GenerationRequest, HeldEvents, RequestHandle, Started  # noqa: E402


def _delivered(loop, handle) -> list:
    loop.run_until_complete(asyncio.sleep(0))  # runs the call_soon_threadsafe callbacks
    out = []
    while not handle._events.empty():
        out.append(handle._events.get_nowait())
    return out


def test_text_waits_for_the_interval_and_a_start_first_text_or_end_goes_at_once():
    loop = asyncio.new_event_loop()
    try:
        handle = RequestHandle(GenerationRequest([SamplingParams()], prompt="x"), loop)
        held = HeldEvents(interval=3)
        with held.holding():
            handle.emit(Started(4))
            held.step()  # the prefill's step: the start goes now
            assert _delivered(loop, handle) == [Started(4)]
            handle.emit(Delta(0, "a"))
            held.step()  # a first text goes now (time to first token)
            assert _delivered(loop, handle) == [Delta(0, "a")]
            for text in "bcd":
                handle.emit(Delta(0, text))
                held.step()
                got = _delivered(loop, handle)
                assert got == ([] if text != "d" else [Delta(0, "b"), Delta(0, "c"), Delta(0, "d")])
            handle.emit(Delta(0, "e"))
            handle.emit(Finished(0, "length", 5))
            handle.emit(Done())
            held.step()  # an end goes at once, with what it follows, in order
            assert _delivered(loop, handle) == [Delta(0, "e"), Finished(0, "length", 5), Done()]
    finally:
        loop.close()


def test_interval_one_delivers_at_every_step():
    loop = asyncio.new_event_loop()
    try:
        handle = RequestHandle(GenerationRequest([SamplingParams()], prompt="x"), loop)
        handle.streaming = True
        held = HeldEvents()
        with held.holding():
            for text in "ab":
                handle.emit(Delta(0, text))
                held.step()
                assert _delivered(loop, handle) == [Delta(0, text)]
    finally:
        loop.close()


def _request(i: int) -> dict:
    sampling = dict(temperature=0) if i % 2 == 0 else dict(temperature=0.9, seed=7 + i, top_p=0.9)
    return dict(model=MODEL, prompt="def f(x):" * (1 + i), max_tokens=5 + 6 * i, **sampling,
                extra_body={"ignore_eos": True})


def _chunks(server: LiveServer) -> list[list]:
    """Eight concurrent streams: each one's chunks (text, finish_reason)."""
    client = server.client()

    def stream(i):
        return [(ch.text, ch.finish_reason) for c in client.completions.create(stream=True, **_request(i))
                for ch in c.choices]
    with cf.ThreadPoolExecutor(8) as pool:
        return list(pool.map(stream, range(8)))


@pytest.mark.parametrize("interval", [1, 3])
def test_concurrent_streams_get_the_same_chunks_at_any_interval(tiny_dir, one_torch_thread, interval):  # noqa: F811
    results = {}
    for n in sorted({1, interval}):
        engine = BatchServingEngine(lambda: sluice.LLM(str(tiny_dir), max_num_seqs=8), MODEL, stream_interval=n)
        assert engine.wait_ready(120), engine.load_error
        server = LiveServer(engine)
        try:
            results[n] = _chunks(server)
        finally:
            server.stop()
            engine.close(10)
    assert results[interval] == results[1]
    for i, chunks in enumerate(results[interval]):  # one chunk a token, then the one with the finish_reason
        assert len(chunks) <= 5 + 6 * i + 1 and chunks[-1][1] == "length"


def test_serve_refuses_a_stream_interval_below_one():
    from sluice.cli import build_parser
    from sluice.cli.serve import _check
    from sluice.errors import ConfigError
    assert build_parser().parse_args(["serve"]).stream_interval == 1
    with pytest.raises(ConfigError, match="--stream-interval must be at least 1, got 0"):
        _check(build_parser().parse_args(["serve", "--stream-interval", "0"]))
