"""A GenerationRequest's prompts as the LLM's checked Requests: chat messages rendered, texts tokenized,
each prompt's n choices checked at the LLM's door (context, KV pool, sampling values).

Several prompts (a completions list) are checked together before any runs, so a list with one bad
prompt runs nothing; their refusals name the prompt ("prompt 2: ..."), and their tokens together are
bounded (protocol.MAX_LIST_TOKENS, or one full context if that is more).
"""

from __future__ import annotations

import re
from dataclasses import replace

from ..errors import ContextExceeded, RequestError
from .errors import ContextOverflow
from .protocol import MAX_LIST_TOKENS

_NUMBERED = re.compile(r"prompt \d+")


def prompt_ids(llm, request) -> list[int]:
    """A request's prompt as token ids: chat messages rendered, text tokenized (ids are checked at the door)."""
    if request.messages is not None:
        return llm.chat_prompt(request.messages)  # refuses a conversation that cannot fit, unrendered
    if isinstance(request.prompt, str):
        ids = llm.tokenizer.encode(request.prompt, max_tokens=llm.max_model_len)
    else:
        ids = list(request.prompt)
    if not ids:
        raise RequestError("the prompt is empty: at least one token is needed to condition on")
    return ids


def prompt_lists(llm, request) -> list[list[int]]:
    """prompt_ids of each of a request's prompts (one, unless it has several); several are refused as soon
    as their tokens together pass the limit, before the rest are tokenized."""
    if request.prompts is None:
        return [prompt_ids(llm, request)]
    limit, total, out = max(MAX_LIST_TOKENS, llm.max_model_len), 0, []
    for i, prompt in enumerate(request.prompts):
        try:
            ids = prompt_ids(llm, replace(request, prompt=prompt, prompts=None))
        except RequestError as e:
            raise RequestError(f"prompt {i}: {e}") from None
        total += len(ids)
        if total > limit:
            raise RequestError(f"prompts 0 to {i} of {len(request.prompts)} have {total} tokens together; a request "
                               f"may send at most {limit} (split the list over several requests)")
        out.append(ids)
    return out


def checked_requests(llm, request) -> tuple[list, int]:
    """(the LLM's Requests for every choice, prompt-major; the prompts' token count, each prompt once)."""
    prompts = prompt_lists(llm, request)
    n = len(request.params) // len(prompts)  # params holds n per prompt
    out = []
    for i, ids in enumerate(prompts):
        label = "this request" if len(prompts) == 1 else f"prompt {i}"
        try:
            out += llm.requests([ids] * n, request.params[i * n:(i + 1) * n], labels=[label] * n,
                                fit_max_tokens=not request.max_tokens_given)
        except RequestError as e:
            if len(prompts) == 1:
                raise
            if isinstance(e, ContextExceeded):  # the server words it, now with the prompt's index
                raise ContextOverflow(e.prompt_tokens, e.max_tokens, e.limit, f"prompt {i}: ") from None
            # The door numbers the n copies of this one prompt 0..n-1: say which prompt of the list it is.
            # (A refused sampling value starts with its field's name instead, and stays as it is.)
            numbered = _NUMBERED.match(str(e))
            if numbered is None:
                raise
            raise RequestError(f"prompt {i}{str(e)[numbered.end():]}") from None
    return out, sum(map(len, prompts))
