"""Reading tool calls out of generated text as it streams; a whole response is the same reading in one go,
so a streamed answer and a non-streamed one give the same calls, byte for byte.

One shape per tool_choice (tools.py picks it and the constraint that makes the model keep to it):
- "named": the whole output is the named function's arguments, a JSON object;
- "required": a JSON array of {"name": ..., "arguments": {...}} objects;
- "auto": free text in which a model trained for it writes Hermes / Qwen3 blocks,
  <tool_call>{"name": ..., "arguments": {...}}</tool_call>; the text around them is the content.

The constrained shapes stream as they come: a call's name once its string closes, then the raw text of its
arguments (valid JSON by the constraint, unless max_tokens cuts it, as OpenAI's can be). An auto block is
not constrained, so it is held until it closes and becomes a call only if it parses; else it stays text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ARGUMENT_KEYS = ("arguments", "parameters")  # Llama-style models write "parameters"
OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class Piece:
    """A piece of one choice's message: text of its content, or a call's name (its first piece) or more of
    its arguments' JSON text. call: which call of the choice (0, 1, ...)."""
    content: str | None = None
    call: int | None = None
    name: str | None = None
    arguments: str = ""


def merged(pieces: list[Piece]) -> list[Piece]:
    """Neighbouring pieces of the same kind as one (the scanner reads a character at a time)."""
    out: list[Piece] = []
    for p in pieces:
        last = out[-1] if out else None
        if last and p.content is not None and last.content is not None:
            last.content += p.content
        elif (last and p.name is None and p.content is None and last.content is None and last.name is None
              and last.call == p.call):
            last.arguments += p.arguments
        else:
            out.append(Piece(p.content, p.call, p.name, p.arguments))
    return out


class CallScanner:
    """Follows JSON text whose call objects {"name": "...", "arguments": {...}} sit at depth `base` (0: one
    object alone, 1: objects in an array) and reports each call's name, then its arguments' raw text (held
    until the name is known, whichever key comes first)."""

    def __init__(self, base: int):
        self.base, self.depth = base, 0
        self.in_string = self.escaped = False
        self.call = -1
        self.key: str | None = None  # at call level: the key being read, or whose value is being read
        self.key_text = ""
        self.reading = False  # inside the value of `key`
        self.value_text = ""  # the value's text so far (the name's JSON text; the arguments': has it begun)
        self.name: str | None = None
        self.held: list[Piece] = []  # arguments text before the name

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        for ch in text:
            self._step(ch, out)
        return merged(out)

    def _step(self, ch: str, out: list[Piece]) -> None:
        level = self.depth - self.base  # 1: directly inside a call object
        if self.reading and not self.in_string and level == 1 and ch in ",}":
            self._end_value(out)
        if self.reading:
            self._value_char(ch, out)
        elif level == 1 and (self.in_string or ch == '"'):
            self.key_text += ch
        if self.in_string:  # the JSON lexer, just enough of it to know depth and strings
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                if level == 1 and not self.reading:
                    self.key, self.key_text = _loads_str(self.key_text), ""
        elif ch == '"':
            self.in_string = True
        elif ch == ":" and level == 1 and not self.reading:
            self.reading, self.value_text = True, ""
        elif ch in "{[":
            if ch == "{" and level == 0:
                self.call, self.name, self.held, self.key = self.call + 1, None, [], None
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1

    def _value_char(self, ch: str, out: list[Piece]) -> None:
        if self.key in ARGUMENT_KEYS and (self.value_text or not ch.isspace()):
            (out if self.name is not None else self.held).append(Piece(call=self.call, arguments=ch))
        if self.key == "name" or self.key in ARGUMENT_KEYS:
            self.value_text += ch

    def _end_value(self, out: list[Piece]) -> None:
        if self.key == "name" and self.name is None:
            self.name = _loads_str(self.value_text.strip())
            if self.name is not None:
                out.append(Piece(call=self.call, name=self.name))
                out.extend(self.held)
                self.held = []
        self.reading, self.key = False, None


def _loads_str(text: str) -> str | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class HermesReader:
    """Free text with <tool_call>{...}</tool_call> blocks: content outside them, a call for each block that
    parses. Text that may be the start of <tool_call> is held back until the next piece tells."""

    def __init__(self):
        self.buffer, self.inside, self.calls = "", False, 0

    def feed(self, text: str) -> list[Piece]:
        self.buffer += text
        out: list[Piece] = []
        while True:
            mark = CLOSE if self.inside else OPEN
            at = self.buffer.find(mark)
            if at < 0:
                if not self.inside:
                    keep = next((k for k in range(min(len(OPEN) - 1, len(self.buffer)), 0, -1)
                                 if OPEN.startswith(self.buffer[-k:])), 0)
                    out.append(Piece(content=self.buffer[:len(self.buffer) - keep]))
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            before, self.buffer = self.buffer[:at], self.buffer[at + len(mark):]
            out.extend(self._block(before) if self.inside else [Piece(content=before)])
            self.inside = not self.inside
        return merged([p for p in out if p.content != ""])

    def finish(self) -> list[Piece]:
        rest, self.buffer = self.buffer, ""
        if self.inside:  # a block left open at the end (a stop string, max_tokens): a call if it parses
            return self._block(rest, closed=False)
        return [Piece(content=rest)] if rest else []

    def _block(self, body: str, closed: bool = True) -> list[Piece]:
        try:
            call = json.loads(body)
            name = call["name"]
            arguments = next(call[k] for k in ARGUMENT_KEYS if k in call)
            if isinstance(arguments, str):  # some models write the arguments as a JSON string
                arguments = json.loads(arguments)
            ok = isinstance(name, str) and isinstance(arguments, dict)
        except (ValueError, KeyError, TypeError, StopIteration):
            ok = False
        if not ok:
            return [Piece(content=OPEN + body + (CLOSE if closed else ""))]
        self.calls += 1
        return [Piece(call=self.calls - 1, name=name),
                Piece(call=self.calls - 1, arguments=json.dumps(arguments, ensure_ascii=False))]


class CallReader:
    """One choice's output as Pieces, for a tool_choice mode ("auto", "required" or "named" with `name`),
    keeping at most `limit` calls (parallel_tool_calls false: 1). Constrained output in which no call's name
    ever completed (max_tokens cut it) is returned whole as content at the end."""

    def __init__(self, mode: str, name: str | None = None, limit: int | None = None):
        self.mode, self.limit = mode, limit
        self.reader = HermesReader() if mode == "auto" else CallScanner(1 if mode == "required" else 0)
        self.named = name
        self.raw, self.started, self.any_call = "", False, False

    def feed(self, text: str) -> list[Piece]:
        self.raw += text
        if self.named is None:
            return self._keep(self.reader.feed(text))
        if not self.started:  # the arguments object itself: its name is known from the start
            text = text.lstrip()
            if not text:
                return []
            self.started = True
            return self._keep([Piece(call=0, name=self.named), Piece(call=0, arguments=text)])
        return self._keep([Piece(call=0, arguments=text)])

    def finish(self) -> list[Piece]:
        out = self._keep(self.reader.finish()) if self.mode == "auto" else []
        if self.mode != "auto" and not self.any_call and self.raw:
            out.append(Piece(content=self.raw))
        return out

    def _keep(self, pieces: list[Piece]) -> list[Piece]:
        kept = [p for p in pieces if p.call is None or self.limit is None or p.call < self.limit]
        self.any_call = self.any_call or any(p.name is not None for p in kept)
        return kept


def read_whole(reader: CallReader, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """A whole output's content (None when there are calls and nothing but blank text around them) and its
    calls as (name, arguments JSON text)."""
    content, calls = "", {}
    for p in reader.feed(text) + reader.finish():
        if p.content is not None:
            content += p.content
        elif p.name is not None:
            calls[p.call] = [p.name, p.arguments]
        else:
            calls[p.call][1] += p.arguments
    found = [(name, arguments) for name, arguments in calls.values()]
    return (None if found and not content.strip() else content), found
