"""A chat request's choices answering with tool calls: the whole message, or the stream's deltas, from the
text each choice generated (read by tool_calls.py as tools.py's plan says).

A choice that made calls ends with finish_reason "tool_calls" ("function_call" for the legacy functions)
where the model chose to stop; "length" stays "length" (OpenAI's calls can be cut the same way). Streamed,
a call's first delta carries its index, id, type, name and arguments "", the next ones more arguments.
"""

from __future__ import annotations

from .protocol import AssistantMessage, Delta
from .tool_calls import CallReader, Piece, read_whole
from .tool_protocol import FunctionCallOut, FunctionDelta, ToolCallDelta, ToolCallOut
from .tools import ToolPlan, call_id


class ToolAnswers:
    def __init__(self, plan: ToolPlan, n: int):
        self.plan = plan
        self.readers: list[CallReader | None] = [plan.reader() for _ in range(n)]
        self.calls: list[dict[int, int]] = [{} for _ in range(n)]  # per choice: reader's call number -> index

    @property
    def active(self) -> bool:
        """Whether the text is read for calls at all (else it is the content, as is)."""
        return self.plan.mode is not None

    def message(self, text: str, finish_reason: str) -> tuple[AssistantMessage, str]:
        """A whole choice's message and finish_reason."""
        reader = self.plan.reader()
        content, calls = read_whole(reader, text) if reader is not None else (text, [])
        if not calls:
            return AssistantMessage(content=text), finish_reason
        if self.plan.legacy:
            name, arguments = calls[0]
            message = AssistantMessage(content=content, function_call=FunctionCallOut(name=name, arguments=arguments))
        else:
            message = AssistantMessage(content=content, tool_calls=[
                ToolCallOut(id=call_id(), function=FunctionCallOut(name=name, arguments=arguments))
                for name, arguments in calls])
        return message, self._called(finish_reason)

    def feed(self, index: int, text: str) -> list[Delta]:
        """The deltas for more of choice `index`'s text."""
        return [self._delta(index, p) for p in self.readers[index].feed(text)]

    def finish(self, index: int, finish_reason: str) -> tuple[list[Delta], str]:
        """The deltas of what choice `index` held back, and its finish_reason."""
        deltas = [self._delta(index, p) for p in self.readers[index].finish()]
        return deltas, self._called(finish_reason) if self.calls[index] else finish_reason

    def _called(self, finish_reason: str) -> str:
        return ("function_call" if self.plan.legacy else "tool_calls") if finish_reason == "stop" else finish_reason

    def _delta(self, index: int, piece: Piece) -> Delta:
        if piece.content is not None:
            return Delta(content=piece.content)
        calls, first = self.calls[index], piece.name is not None
        if first:
            calls[piece.call] = len(calls)
        if self.plan.legacy:
            return Delta(function_call={"name": piece.name, "arguments": piece.arguments} if first
                         else {"arguments": piece.arguments})
        return Delta(tool_calls=[ToolCallDelta(index=calls[piece.call], id=call_id() if first else None,
                                               type="function" if first else None,
                                               function=FunctionDelta(name=piece.name, arguments=piece.arguments))])
