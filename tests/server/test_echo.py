"""`echo` on /v1/completions (server/echo.py) through the real openai client against a live server on a
tiny random model: the prompt in front of the text, the prompt's logprobs (against transformers'
log_softmax) in front of the completion's, max_tokens 0 and 1, token-id and text prompts, streaming."""

from __future__ import annotations

import pytest
import torch

from server_harness import one_torch_thread  # noqa: F401 -- a fixture
from server_harness import MODEL, assert_error_shape, request, sse_events
from test_server import client, served  # noqa: F401 -- fixtures: a live server on the tiny model, its client

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_torch_thread")
IDS = [17, 200, 5, 311, 42, 99, 7, 480, 63, 250, 12, 301, 88, 64, 3, 150, 222, 19, 401, 77]


@pytest.fixture(scope="module")
def hf_logprobs(tiny_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()

    @torch.no_grad()
    def logprobs(ids: list[int]) -> torch.Tensor:
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return logprobs


def check_prompt_part(lp, ids: list[int], n: int, hf_lp: torch.Tensor, decode_one) -> None:
    """The first len(ids) entries of a choice's legacy logprobs against transformers' log_softmax."""
    P = len(ids)
    assert lp.tokens[:P] == [decode_one(t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = hf_lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:P]), want, atol=1e-5, rtol=0)
    for p in range(1, P):
        top = lp.top_logprobs[p]
        assert lp.tokens[p] in top and len(top) <= n + 1
        best = hf_lp[p - 1].max().item()
        assert max(top.values()) == pytest.approx(best, abs=1e-5)  # the most likely token is in it
    offsets = [0]
    for t in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp.text_offset == offsets


@pytest.mark.parametrize("max_tokens", [0, 1, 3])
def test_token_ids_echo_with_logprobs_match_transformers(served, client, hf_logprobs, max_tokens):
    llm = served.llm
    out = client.completions.create(model=MODEL, prompt=[IDS], echo=True, logprobs=2, max_tokens=max_tokens,
                                    temperature=0, extra_body={"ignore_eos": True})
    [choice] = out.choices
    prompt_text = llm.tokenizer.decode(IDS, skip_special_tokens=False)
    lp = choice.logprobs
    assert len(lp.tokens) == len(IDS) + max_tokens
    check_prompt_part(lp, IDS, 2, hf_logprobs(IDS), lambda t: llm.tokenizer.decode([t]))
    assert out.usage.prompt_tokens == len(IDS) and out.usage.completion_tokens == max_tokens
    assert choice.finish_reason == "length"
    plain = client.completions.create(model=MODEL, prompt=IDS, logprobs=2, max_tokens=max(max_tokens, 1),
                                      temperature=0, extra_body={"ignore_eos": True}).choices[0]
    if max_tokens == 0:
        assert choice.text == prompt_text
    else:  # the completion's own part is what the same request without echo gives
        assert choice.text == prompt_text + plain.text
        assert lp.tokens[len(IDS):] == plain.logprobs.tokens
        assert lp.token_logprobs[len(IDS):] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)


def test_text_prompt_echoes_itself_and_n_choices_each(client, tiny_llm):
    prompt = "The quick brown fox jumps"
    out = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=4, n=2, seed=3)
    assert len(out.choices) == 2
    for c in out.choices:
        assert c.text.startswith(prompt) and c.logprobs is None
    ids = tiny_llm.tokenizer.encode(prompt)
    out = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=0, max_tokens=0, n=2)
    for c in out.choices:
        assert c.text == prompt and len(c.logprobs.tokens) == len(ids)
        assert c.logprobs.token_logprobs[1:] == pytest.approx(out.choices[0].logprobs.token_logprobs[1:])


def test_streamed_echo_sends_the_prompt_first(served, client):
    kw = dict(model=MODEL, prompt=[IDS], echo=True, logprobs=1, temperature=0, extra_body={"ignore_eos": True})
    for max_tokens in (0, 4):
        whole = client.completions.create(max_tokens=max_tokens, **kw).choices[0]
        chunks = list(client.completions.create(max_tokens=max_tokens, stream=True, **kw))
        first = chunks[0].choices[0]
        assert first.text.startswith(served.llm.tokenizer.decode(IDS, skip_special_tokens=False))
        assert len(first.logprobs.tokens) >= len(IDS) and first.logprobs.token_logprobs[0] is None
        parts = [c.choices[0] for c in chunks if c.choices]
        assert "".join(p.text for p in parts) == whole.text
        lps = [p.logprobs for p in parts if p.logprobs]
        assert sum((x.tokens for x in lps), []) == whole.logprobs.tokens
        assert sum((x.text_offset for x in lps), []) == whole.logprobs.text_offset
        assert sum((x.token_logprobs for x in lps), [])[1:] == pytest.approx(whole.logprobs.token_logprobs[1:],
                                                                             abs=1e-5)
        assert [p.finish_reason for p in parts if p.finish_reason] == ["length"]
    # echo without logprobs, streamed: the prompt comes first all the same
    chunks = list(client.completions.create(model=MODEL, prompt="Hello there", echo=True, max_tokens=2, stream=True))
    assert chunks[0].choices[0].text.startswith("Hello there")


def test_max_tokens_zero_needs_echo_and_the_rest_stays_refused(served):
    for body, param in (({"prompt": "x", "max_tokens": 0}, "max_tokens"),
                        ({"prompt": "x", "echo": True, "suffix": "y"}, "suffix"),
                        ({"prompt": "x", "echo": True, "best_of": 3}, "best_of")):
        error = assert_error_shape(*request(served.port, "POST", "/v1/completions", body)[::2], 400)
        assert error["param"] == param, error
    status, _, body = request(served.port, "POST", "/v1/completions",
                              {"prompt": "x", "echo": True, "max_tokens": 0, "stream": True})
    events = sse_events(body)
    assert status == 200 and events[-1] == "[DONE]" and events[0]["choices"][0]["text"] == "x"


def test_a_list_of_prompts_echoes_each_its_own(served, client):
    tok = served.llm.tokenizer
    prompts = [IDS, IDS[:5]]
    out = client.completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=0, n=2)
    for c in out.choices:  # prompt-major: choices 0, 1 echo the first prompt, 2, 3 the second
        ids = prompts[c.index // 2]
        assert c.text == tok.decode(ids, skip_special_tokens=False) and len(c.logprobs.tokens) == len(ids)
        assert c.logprobs.token_logprobs[0] is None and c.logprobs.entropy[0] is None
    out = client.completions.create(model=MODEL, prompt=["The quick brown fox", "Hello"], echo=True, max_tokens=2)
    assert out.choices[0].text.startswith("The quick brown fox") and out.choices[1].text.startswith("Hello")
