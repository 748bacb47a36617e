"""One LLM runs one request at a time: a second request (another stream, another thread) is refused
by name while one runs, and a stream closed early lets the LLM go."""

import gc
import threading

import pytest

from sluice import RequestError, SamplingParams

GREEDY = dict(temperature=0, ignore_eos=True)


def test_second_request_while_a_stream_is_open_is_refused(static_llm):
    p = SamplingParams(max_tokens=8, **GREEDY)
    alone = static_llm.generate("abc", p)[0].text
    s1, s2 = static_llm.stream("abc", p), static_llm.stream("xyz", p)
    first = next(s1)
    with pytest.raises(RequestError, match="already running a request.*stream\\(\\).*one LLM per thread"):
        next(s2)
    with pytest.raises(RequestError, match="already running"):
        static_llm.generate("xyz", p)
    assert first + "".join(s1) == alone  # the open stream was not disturbed
    assert static_llm.generate("abc", p)[0].text == alone  # and it let go when done


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


def test_another_thread_is_refused_while_one_runs(static_llm):
    p = SamplingParams(max_tokens=4, **GREEDY)
    s = static_llm.stream("abc", p)
    next(s)
    errors = []
    t = threading.Thread(target=lambda: errors.append(_catch(lambda: static_llm.generate("xyz", p))))
    t.start()
    t.join()
    assert isinstance(errors[0], RequestError) and "already running" in str(errors[0])
    s.close()


def _catch(f):
    try:
        f()
    except Exception as e:  # noqa: BLE001 - handed to the main thread to assert on
        return e
    return None
