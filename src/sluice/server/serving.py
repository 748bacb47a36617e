"""From an OpenAI request to engine events and back: the part of the server that knows both sides.

Streaming follows OpenAI's contract: every chunk carries the same id; each choice's first chunk
carries the role (chat); each choice gets exactly one finish_reason; with
stream_options.include_usage every chunk has "usage": null and a last chunk with no choices carries
the usage; then `data: [DONE]`. Headers go out only once the engine has accepted the prompt, so a
bad prompt is still a plain 400, not a broken stream.

Logprobs: the engine's Delta events carry the TokenLogprobs of the tokens they consumed (a Delta may
hold text "" and logprobs, when text is held back); chat reports them as {"content": [...]} per
choice or chunk, completions as the legacy parallel lists, whose text_offset runs on per choice
across chunks. With echo (server/echo.py) a completion choice's first chunk, or its whole text, starts
with the prompt, and its logprobs with the prompt's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from typing import AsyncIterator

from ..engine.logprobs import TokenLogprob
from ..engine.sampling_params import SamplingParams
from ..errors import RequestError, SluiceError
from .echo import Echo, engine_max_tokens, prompt_logprobs
from .engine import Aborted, Delta, Draining, Failed, Finished, GenerationRequest, RequestHandle, ServingEngine
from .errors import RETRY_AFTER_S, ServerError, from_sluice
from .protocol import (AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest,
                       ChatLogprobs, ChatTokenLogprob, ChunkChoice, Completion, CompletionChoice, CompletionLogprobs,
                       CompletionRequest, Delta as DeltaOut, MAX_CHOICES, TopLogprobOut, Usage)
from .tool_answers import ToolAnswers
from .tools import ToolPlan, plan as tool_plan, template_messages

_PLACEHOLDER = "sluice-text-placeholder-5b1e9c"  # _text_chunk's: a string whose JSON is itself in quotes

# OpenAI's stand-in for log 0 (a token the model rules out): JSON has no -inf.
LOGPROB_FLOOR = -9999.0


def _lp(value: float) -> float:
    return value if value > LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN fails the test too: the floor


def chat_logprobs(items: list[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(content=[
        ChatTokenLogprob(token=t.token, logprob=_lp(t.logprob), bytes=t.bytes, top_logprobs=[
            TopLogprobOut(token=a.token, logprob=_lp(a.logprob), bytes=a.bytes) for a in t.top], entropy=t.entropy)
        for t in items])


def completion_logprobs(items: list[TokenLogprob], offset: int,
                        out: CompletionLogprobs | None = None) -> tuple[CompletionLogprobs, int]:
    """The legacy shape for items whose first token starts at text offset `offset` (appended to `out`,
    if given); and the next offset.

    top_logprobs is keyed by token text, so tokens with the same text (byte-fallback pieces) share
    one entry, the more likely one's; the chosen token is always in it (OpenAI's "logprobs + 1")."""
    out = out or CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for t in items:
        top: dict[str, float] = {}
        for alt in t.top:
            top.setdefault(alt.token, _lp(alt.logprob))
        top.setdefault(t.token, _lp(t.logprob))
        out.tokens.append(t.token)
        out.token_logprobs.append(_lp(t.logprob))
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        out.entropy.append(t.entropy)
        offset += len(t.token)
    return out, offset


def echo_logprobs(echo: Echo, index: int, prompt: list | None,
                  items: list[TokenLogprob]) -> tuple[CompletionLogprobs, int]:
    """completion_logprobs of choice index's prompt, then of items. prompt: the engine's prompt logprobs
    (None first, then a TokenLogprob per token), or None when the choice ended before they came."""
    first = echo.first_token(index)
    out = CompletionLogprobs(tokens=[first], token_logprobs=[None], top_logprobs=[None], text_offset=[0],
                             entropy=[None])
    out, offset = completion_logprobs((prompt or [None])[1:], len(first), out)
    return completion_logprobs(items, offset, out)


def to_generation(req: ChatCompletionRequest | CompletionRequest) -> GenerationRequest:
    """The request's prompt and one SamplingParams per choice; a bad value is a 400 naming its field."""
    chat = isinstance(req, ChatCompletionRequest)
    field = req.unsupported()
    if field is not None:
        raise ServerError(400, f"{field} is not supported by this server yet", param=field, code="unsupported")
    if problem := req.stop_problem():
        raise ServerError(400, problem, param="stop")
    empty = next((i for i, m in enumerate(req.messages) if m.needs_content()), None) if chat else None
    if empty is not None:
        raise ServerError(400, f"messages.{empty}.content is required: a {req.messages[empty].role} message has "
                               "content (a string or a list of text parts)", param=f"messages.{empty}.content")
    max_tokens, aliases = req.max_tokens if chat else engine_max_tokens(req), {}
    if chat and req.max_completion_tokens is not None:
        max_tokens, aliases = req.max_completion_tokens, {"max_tokens": "max_completion_tokens"}
    n = req.n or 1
    if chat and req.top_logprobs is not None and not req.logprobs:
        raise ServerError(400, "top_logprobs: logprobs must be set to true to use top_logprobs", param="top_logprobs")
    # chat: logprobs true, with top_logprobs alternatives (0 if unset); completions: logprobs = alternatives
    logprobs = ((req.top_logprobs or 0) if req.logprobs else None) if chat else req.logprobs
    tools = tool_plan(req) if chat else ToolPlan()
    try:
        base = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                              min_p=req.min_p, repetition_penalty=req.repetition_penalty,
                              presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                              seed=req.seed, stop=req.stop, ignore_eos=bool(req.ignore_eos), logprobs=logprobs,
                              constraint=tools.constraint,
                              prompt_logprobs=None if chat else prompt_logprobs(req))
    except RequestError as e:
        raise from_sluice(e, "messages" if chat else "prompt", aliases) from None
    # Choice i is seeded seed + i: n > 1 gives n different samples, and each is reproducible alone.
    params = [base if base.seed is None else SamplingParams(**{**vars(base), "seed": base.seed + i})
              for i in range(n)]
    if chat:
        return GenerationRequest(params, messages=template_messages(req), max_tokens_given=max_tokens is not None,
                                 tools=tools.template_tools, tool_plan=tools)
    prompts = req.prompts()
    if len(prompts) * n > MAX_CHOICES:  # before anything runs; the prompts' tokens together: at the engine's door
        raise ServerError(400, f"prompt: {len(prompts)} prompts x n={n} make {len(prompts) * n} choices; a request "
                               f"may ask for at most {MAX_CHOICES} (split the list over several requests)",
                          param="prompt")
    if len(prompts) == 1:
        return GenerationRequest(params, prompt=prompts[0], max_tokens_given=max_tokens is not None,
                                 echo=bool(req.echo))
    return GenerationRequest([p for _ in prompts for p in params], prompts=prompts,
                             max_tokens_given=max_tokens is not None, echo=bool(req.echo))


async def _watch_disconnect(receive, engine: ServingEngine, handle: RequestHandle) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    engine.abort(handle)


class Run:
    """One submitted request, from its first event to the response it becomes."""

    def __init__(self, engine: ServingEngine, req, gen: GenerationRequest, receive):
        self.engine, self.req, self.chat = engine, req, isinstance(req, ChatCompletionRequest)
        self.n = len(gen.params)
        self.logprobs = gen.params[0].logprobs is not None  # every choice asks the same
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + secrets.token_hex(12)
        self.tools = ToolAnswers(gen.tool_plan or ToolPlan(), self.n)  # tool calls in the text
        self.created = int(time.time())
        self._templates: dict[int, list[str] | bool] = {}  # _text_chunk's, per choice
        self.echo: Echo | None = None  # set by started() when the request echoes its prompt
        self.handle = engine.submit(gen)  # NotReady / Draining / QueueFull: the app answers them
        # Read once: a busy period's path (which the fingerprint names) does not change within it.
        self.fingerprint = engine.system_fingerprint
        # Until the response starts streaming nobody else listens for the client leaving: this does.
        self._watch = asyncio.create_task(_watch_disconnect(receive, engine, self.handle))

    def _stop_watching(self) -> None:
        self._watch.cancel()

    async def started(self) -> int:
        """Wait for the engine to accept the prompt; its token count, or the refusal as a ServerError."""
        event = await self.handle.next()
        if isinstance(event, Failed):
            self._stop_watching()
            raise self._error(event.error)
        if event.echo is not None:
            self.echo = Echo(event.echo, self.req.max_tokens == 0, set(range(self.n)))
        return event.prompt_tokens

    def _error(self, err: Exception) -> ServerError:
        if isinstance(err, Aborted):  # nobody is left to read it; 499 as nginx logs a client that left
            return ServerError(499, str(err), code="aborted")
        if isinstance(err, Draining):
            return ServerError(503, str(err), code="unavailable", retry_after=RETRY_AFTER_S)
        if isinstance(err, SluiceError):
            return from_sluice(err, "messages" if self.chat else "prompt")
        return ServerError(500, f"internal error: {type(err).__name__}: {err}")

    def _usage(self, prompt_tokens: int, completion_tokens: int) -> Usage:
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)

    async def collect(self, prompt_tokens: int) -> dict:
        """The whole response (stream=false)."""
        texts, finished, logprobs = [""] * self.n, {}, [[] for _ in range(self.n)]
        prompts = [None] * self.n  # with echo: each choice's prompt logprobs
        try:
            async for event in self.handle:
                if isinstance(event, Delta):
                    prompts[event.index] = prompts[event.index] or event.prompt_logprobs
                    if self.echo is None or not self.echo.drop:
                        texts[event.index] += event.text
                        logprobs[event.index] += event.logprobs or []
                elif isinstance(event, Finished):
                    finished[event.index] = event
                elif isinstance(event, Failed):
                    raise self._error(event.error)
        finally:
            self._stop_watching()
            self.engine.abort(self.handle)  # a no-op once done; frees the engine if we were cancelled
        if len(finished) < self.n:  # only when aborted, and then nobody reads this
            raise ServerError(499, "the request was aborted", code="aborted")
        broken = [f for f in finished.values() if f.finish_reason == "error"]
        if broken:  # the model, not the request: 422, never a 500, and the server carries on
            raise ServerError(422, broken[0].error or "generation failed", code="generation_error")
        if self.echo is not None and self.echo.drop:  # max_tokens 0: the engine's one token is not the answer
            finished = {i: Finished(i, "length", 0) for i in finished}
        usage = self._usage(prompt_tokens, sum(f.completion_tokens for f in finished.values()))
        if self.chat:
            messages = [self.tools.message(texts[i], finished[i].finish_reason) for i in range(self.n)]
            choices = [ChatChoice(index=i, message=messages[i][0], finish_reason=messages[i][1],
                                  logprobs=chat_logprobs(logprobs[i]) if self.logprobs else None)
                       for i in range(self.n)]
            return ChatCompletion(id=self.id, created=self.created, model=self.engine.model_name,
                                  choices=choices, usage=usage, system_fingerprint=self.fingerprint).model_dump()
        echo = self.echo
        choices = [CompletionChoice(index=i, text=(echo.text(i) if echo else "") + texts[i],
                                    finish_reason=finished[i].finish_reason,
                                    logprobs=(echo_logprobs(echo, i, prompts[i], logprobs[i]) if echo else
                                              completion_logprobs(logprobs[i], 0))[0] if self.logprobs else None)
                   for i in range(self.n)]
        return Completion(id=self.id, created=self.created, model=self.engine.model_name, choices=choices,
                          usage=usage, system_fingerprint=self.fingerprint).model_dump()

    def _delta_chunks(self, index: int, deltas: list[DeltaOut], logprobs=None) -> list[str]:
        """One choice's deltas as chunks; logprobs ride on the first (or alone, if none)."""
        out = []
        for delta in deltas:
            out.append(self._chunk(index, delta=delta, logprobs=logprobs))
            logprobs = None
        if logprobs is not None:
            out.append(self._chunk(index, delta=DeltaOut(), logprobs=logprobs))
        return out

    def _text_chunk(self, index: int, text: str) -> str:
        """_chunk(index, text) for the usual chunk (a piece of text, nothing else), from a template.

        Building and dumping the pydantic models costs ~10 us a chunk (~1 us this way), paid on the event
        loop for every token of every stream. The template is that dump made once per choice around a
        placeholder text, whose JSON string the text's replaces: byte for byte _chunk's output
        (tests/server/test_server_chunks.py), since both escape a string the same way (non-ASCII left as is)."""
        template = self._templates.get(index)
        if template is None:
            whole = self._chunk(index, _PLACEHOLDER)
            quoted = json.dumps(_PLACEHOLDER)
            template = whole.split(quoted) if whole.count(quoted) == 1 else False
            self._templates[index] = template
        if not template:  # the placeholder also in the model's name: never mind the template
            return self._chunk(index, text)
        return json.dumps(text, ensure_ascii=False).join(template)

    def _chunk(self, index: int | None, text: str | None = None, finish: str | None = None,
               role: str | None = None, usage: Usage | None = None, error: str | None = None,
               logprobs=None, delta: DeltaOut | None = None) -> str:
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        model, why = self.engine.model_name, {} if error is None else {"error": error}
        if self.chat:
            delta = DeltaOut(role=role, content=text) if delta is None else delta
            choices = [] if index is None else [ChunkChoice(index=index, delta=delta,
                                                            finish_reason=finish, logprobs=logprobs, **why)]
            chunk = ChatCompletionChunk(id=self.id, created=self.created, model=model, choices=choices, usage=usage,
                                        system_fingerprint=self.fingerprint)
        else:
            choices = [] if index is None else [CompletionChoice(index=index, text=text or "", finish_reason=finish,
                                                                 logprobs=logprobs, **why)]
            chunk = Completion(id=self.id, created=self.created, model=model, choices=choices, usage=usage,
                               system_fingerprint=self.fingerprint)
        # usage appears (as null until the last chunk) only when the client asked for it
        return f"data: {chunk.model_dump_json(exclude=None if include_usage else {'usage'})}\n\n"

    def _echo(self, event, offsets: list[int]) -> tuple[str, object]:
        """A streamed event of an echoing request -> (the choice's first chunk, with the prompt, when this
        event is its first, else ""; the event as the usual path then takes it, or None when that chunk
        said it all). With max_tokens 0 the engine's one token is left out."""
        echo = self.echo
        if echo.drop and isinstance(event, Delta):
            event = Delta(event.index, "", None, event.prompt_logprobs)
        elif echo.drop and isinstance(event, Finished) and event.finish_reason != "error":
            event = Finished(event.index, "length", 0)
        if not isinstance(event, (Delta, Finished)) or event.index not in echo.pending:
            return "", event
        echo.pending.discard(event.index)
        delta = isinstance(event, Delta)
        logprobs = None
        if self.logprobs:
            logprobs, offsets[event.index] = echo_logprobs(echo, event.index, event.prompt_logprobs if delta else None,
                                                           (event.logprobs or []) if delta else [])
        chunk = self._chunk(event.index, echo.text(event.index) + (event.text if delta else ""), logprobs=logprobs)
        return chunk, None if delta else event

    async def stream(self, prompt_tokens: int) -> AsyncIterator[str]:
        """SSE lines (stream=true). Cancelled when the client leaves: the finally clause aborts."""
        self._stop_watching()  # from here the streaming response listens for the client leaving
        completion_tokens, open_choices, why = 0, set(range(self.n)), "internal error (see the server log)"
        offsets = [0] * self.n  # completions: where each choice's next token starts in its text
        try:
            if self.chat:
                yield "".join(self._chunk(i, "", role="assistant") for i in range(self.n))
            # The events that arrived together go out in one write: each is still its own SSE chunk.
            async for events in self.handle.batches():
                out = []
                for event in events:
                    if self.echo is not None:
                        first, event = self._echo(event, offsets)
                        out += [first] if first else []
                    if isinstance(event, Delta) and self.tools.active:
                        lp = chat_logprobs(event.logprobs) if self.logprobs and event.logprobs else None
                        out += self._delta_chunks(event.index, self.tools.feed(event.index, event.text), lp)
                    elif isinstance(event, Delta) and (event.text or (self.logprobs and event.logprobs)):
                        logprobs = None
                        if self.logprobs and self.chat:
                            logprobs = chat_logprobs(event.logprobs or [])
                        elif self.logprobs:
                            logprobs, offsets[event.index] = completion_logprobs(event.logprobs or [],
                                                                                 offsets[event.index])
                        out.append(self._chunk(event.index, event.text, logprobs=logprobs) if logprobs is not None
                                   else self._text_chunk(event.index, event.text))
                    elif isinstance(event, Finished):
                        completion_tokens += event.completion_tokens
                        open_choices.discard(event.index)
                        finish = event.finish_reason
                        if self.tools.active:
                            deltas, finish = self.tools.finish(event.index, finish)
                            out += self._delta_chunks(event.index, deltas)
                        out.append(self._chunk(event.index, finish=finish, error=event.error))
                    elif isinstance(event, Failed):
                        why = str(event.error) if isinstance(event.error, Draining) else why
                if out:
                    yield "".join(out)
            for i in sorted(open_choices):  # cut by the drain deadline or a bug: still one finish_reason each
                yield self._chunk(i, finish="error", error=why)
            if self.req.stream_options and self.req.stream_options.include_usage:
                yield self._chunk(None, usage=self._usage(prompt_tokens, completion_tokens))
            yield "data: [DONE]\n\n"
        finally:
            with contextlib.suppress(Exception):
                self.engine.abort(self.handle)
