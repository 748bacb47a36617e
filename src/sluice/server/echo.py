"""`echo` on /v1/completions: the prompt in front of each choice's text and, with `logprobs`, the prompt's
logprobs in front of the completion's, as OpenAI's legacy completions and vLLM report them. This is how
lm-evaluation-harness's `local-completions` model scores a loglikelihood: `echo: true, logprobs: 1,
max_tokens: 1` on a token-id prompt, then the sum of token_logprobs over the continuation's positions.

The engine computes the prompt's logprobs (SamplingParams.prompt_logprobs, engine/prompt_logprobs.py) and
hands them over with a choice's first update; each choice's prompt text (the request's own, or its token
ids decoded) and first token's text come with Started (a list of prompts gives each choice its own). The first prompt token has nothing before it:
its token_logprobs and top_logprobs entries are null. text_offset runs over the token texts, prompt
then completion, from 0.

`max_tokens: 0` (the prompt's logprobs alone; valid only with echo, as in vLLM) runs one token, which
costs nothing past the prefill (the prompt's last logits draw it), and leaves it out: the choice's text is
the prompt, its completion_tokens 0 and its finish_reason "length".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ServerError
from .protocol import CompletionRequest


def engine_max_tokens(req: CompletionRequest) -> int | None:
    """The max_tokens the engine runs: 0 becomes 1 (left out of the answer); 0 without echo is a 400."""
    if req.max_tokens != 0:
        return req.max_tokens
    if not req.echo:
        raise ServerError(400, "max_tokens: 0 is valid only with echo: true (the prompt's logprobs alone); "
                               "ask for at least 1 token", param="max_tokens")
    return 1


def prompt_logprobs(req: CompletionRequest) -> int | None:
    """The engine's SamplingParams.prompt_logprobs for the request: its logprobs, when it echoes."""
    return req.logprobs if req.echo else None


def choice_prompts(tokenizer, request, requests) -> list[tuple[str, str]]:
    """Per choice (the engine's requests, prompt-major): its prompt's text, as sent or its token ids decoded
    (special tokens included), and its first token's text, as logprobs name tokens."""
    sent = request.prompts or [request.prompt]
    n = len(requests) // len(sent)
    return [(p if isinstance(p, str) else tokenizer.decode(r.prompt_token_ids, skip_special_tokens=False),
             tokenizer.decode(r.prompt_token_ids[:1])) for r, p in zip(requests, (p for p in sent for _ in range(n)),
                                                                       strict=True)]


@dataclass
class Echo:
    """An echoing request's prompts, per choice, and which choices still have theirs to send (the first chunk of each)."""
    prompts: list[tuple[str, str]]  # choice_prompts
    drop: bool  # max_tokens 0: the one token the engine ran is left out
    pending: set[int] = field(default_factory=set)

    def text(self, index: int) -> str:
        return self.prompts[index][0]

    def first_token(self, index: int) -> str:
        """Its entry has null logprobs: nothing before it predicts it."""
        return self.prompts[index][1]
