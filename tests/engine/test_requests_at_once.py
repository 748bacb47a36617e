"""One LLM serves many requests at once, in every configuration (speculative decoding too, which once
ran one request at a time): a second stream, or another thread's request, runs alongside an open
stream and gives what it would alone; a stream closed early lets its sequence go."""

import gc
import threading

import pytest

import sluice
from sluice import SamplingParams

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["plain", "draft", "prompt-lookup"])
def any_llm(tiny_dir, request):
    kwargs = {"plain": {}, "draft": dict(draft_model=str(tiny_dir)), "prompt-lookup": dict(speculative="prompt-lookup")}
    return sluice.LLM(str(tiny_dir), **kwargs[request.param])


def test_second_request_while_a_stream_is_open_runs_alongside(any_llm):
    p = SamplingParams(max_tokens=8, **GREEDY)
    alone = [any_llm.generate(t, p)[0].text for t in ("abc", "xyz")]
    s1, s2 = any_llm.stream("abc", p), any_llm.stream("xyz", p)
    first = next(s1)
    assert "".join(s2) == alone[1]  # ran to its end while s1 stayed open
    assert any_llm.generate("xyz", p)[0].text == alone[1]
    assert first + "".join(s1) == alone[0]  # the open stream was not disturbed


@pytest.mark.parametrize("how", ["close", "break", "gc"])
def test_a_stream_closed_early_frees_the_llm(tiny_llm, how):
    p = SamplingParams(max_tokens=8, **GREEDY)
    if how == "break":
        for _ in tiny_llm.stream("abc", p):
            break  # the loop held the only reference: the stream is collected and closed here
    else:
        s = tiny_llm.stream("abc", p)
        next(s)
        if how == "close":
            s.close()
        else:
            holder = [s]
            holder.append(holder)  # a reference cycle: only the cycle collector frees it
            del s, holder
            gc.collect()
    assert tiny_llm.generate("abc", SamplingParams(max_tokens=2, **GREEDY))[0].token_ids


def test_another_thread_runs_while_a_stream_is_open(any_llm):
    p = SamplingParams(max_tokens=4, **GREEDY)
    alone = any_llm.generate("xyz", p)[0].text
    s = any_llm.stream("abc", p)
    next(s)
    results = []
    t = threading.Thread(target=lambda: results.append(_catch(lambda: any_llm.generate("xyz", p)[0].text)))
    t.start()
    t.join()
    assert results == [alone]
    s.close()


def _catch(f):
    try:
        return f()
    except Exception as e:  # noqa: BLE001 - handed to the main thread to assert on
        return e
