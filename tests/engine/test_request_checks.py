"""Requests checked at the door: prompts, token ids, SamplingParams, max_tokens and LLM arguments of the
wrong kind or size are refused by name (RequestError) before any work, a huge id list by its length
alone, a conversation longer than the context before it is tokenized."""

import numpy as np
import pytest
import torch

import sluice
from sluice import RequestError, SamplingParams

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.mark.parametrize("prompts, shown", [
    (b"hello", "prompts is bytes; decode it to a str first"),
    ((p for p in ["a", "b"]), "got generator \\(pass a list\\)"),
    ({"a", "b"}, "got set"),
    (None, "got NoneType"),
    (3, "got int"),
    ([None], "prompt 0 must be a str or a list of token ids, got NoneType"),
    (["ok", 1.5], "prompt 1 must be a str or a list of token ids, got float"),
    ([[1.5, 2]], "prompt 0 has a token id that is not an integer: 1.5"),
    ([[3, 1.5]], "prompt 0 has a token id that is not an integer: 1.5"),
    ([[3, True]], "prompt 0 has a token id that is not an integer: True"),
    ([[3, "4"]], "not an integer: '4'"),
    (["a", b"b"], "prompt 1 is bytes"),
    ([[1, -1]], r"outside the vocabulary \[0, 512\): -1"),
    ([[]], "prompt 0 is empty"),
    ([], "no prompts given"),
    (torch.ones(2, 2, 2, dtype=torch.long), "must be 1-D .* or 2-D"),
    ([torch.tensor([1.0, 2.0])], "dtype torch.float32; token ids must be a 1-D integer tensor"),
    (np.array([1.0, 2.0]), "numpy array of dtype float64"),
])
def test_bad_prompt_arguments_are_refused_by_name(tiny_llm, prompts, shown):
    with pytest.raises(RequestError, match=shown):
        tiny_llm.generate(prompts, SamplingParams(max_tokens=2))


def test_id_prompts_in_other_containers(tiny_llm):
    p = SamplingParams(max_tokens=3, **GREEDY)
    ref = tiny_llm.generate([[5, 6, 7]], p)[0].token_ids
    for form in ([5, 6, 7], (5, 6, 7), torch.tensor([5, 6, 7]), np.array([5, 6, 7]), [np.int64(5), 6, 7],
                 [torch.tensor([5, 6, 7])], torch.tensor([[5, 6, 7]])):
        assert tiny_llm.generate(form, p)[0].token_ids == ref, form
    assert "".join(tiny_llm.stream(np.array([5, 6, 7]), p)) == tiny_llm.last_output.text


class _UnwalkedList(list):
    """A list that fails the test if anything walks its elements: refusal must go by len() alone."""

    def __iter__(self):
        raise AssertionError("the id list was iterated before its length was checked")

    def __getitem__(self, i):
        raise AssertionError("the id list was indexed before its length was checked")


def test_huge_id_list_is_refused_by_its_length(tiny_llm):
    ids = [5] * 10**7
    with pytest.raises(RequestError, match="prompt 0 has 10000000 token ids, more than the context of 512"):
        tiny_llm.generate([ids], SamplingParams(max_tokens=2))
    # no per-element pass over ten million ids: checked by construction, not by a timing bound
    with pytest.raises(RequestError, match="prompt 0 has 10000000 token ids, more than the context of 512"):
        tiny_llm.generate([_UnwalkedList(ids)], SamplingParams(max_tokens=2))


def test_max_tokens_and_params_checked_before_any_work(tiny_llm):
    with pytest.raises(RequestError, match="max_tokens=512, which leaves no room for a prompt in the context of 512"):
        tiny_llm.generate("hi", SamplingParams(max_tokens=512))
    with pytest.raises(RequestError, match="max_tokens=10000000000"):
        tiny_llm.generate("hi", SamplingParams(max_tokens=10**10))
    with pytest.raises(RequestError, match="params 1 must be a SamplingParams, got dict"):
        tiny_llm.generate(["a", "b"], [SamplingParams(), {"max_tokens": 3}])
    with pytest.raises(RequestError, match="params must be a SamplingParams or a list of them, got int"):
        tiny_llm.generate(["a"], 5)


def test_generation_config_of_wrong_types_names_the_file(tiny_dir, tmp_path):
    import json
    import shutil
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "max_new_tokens": "16"}))
    # refused at load (the tokenizer reads the file) or, at the latest, by the first request
    with pytest.raises(sluice.SluiceError, match=r"generation_config.json: max_new_tokens must be an integer >= 1, "
                                                 r"got '16'"):
        sluice.LLM(str(d)).generate("hi")


def test_conversation_longer_than_the_context_is_refused_before_tokenizing(tiny_llm, monkeypatch):
    monkeypatch.setattr(tiny_llm.tokenizer._backend, "encode", lambda *a, **k: pytest.fail("tokenized it"),
                        raising=False)
    with pytest.raises(RequestError, match="512"):
        tiny_llm.chat([{"role": "user", "content": "hello " * 10**6}], SamplingParams(max_tokens=2))


@pytest.mark.parametrize("kwargs,words", [(dict(max_model_len=True), "max_model_len"),
                                          (dict(compile="yes"), "compile must be True or False")])
def test_llm_arguments_of_the_wrong_type_are_refused(tiny_dir, kwargs, words):
    with pytest.raises(sluice.SluiceError, match=words):
        sluice.LLM(tiny_dir, **kwargs)


def test_chat_messages_that_are_a_string_are_refused(tiny_llm):
    with pytest.raises(sluice.RequestError, match="messages must be a list of dicts.*got str"):
        tiny_llm.chat("hi")
