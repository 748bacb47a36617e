"""A LangChain tool-call transcript and structured-output examples from a real `sluice serve` on the bundled
model, recorded as they came back -> docs/results/tools-transcript.json (docs/server.md shows them).

    python bench/tools_transcript.py [--out docs/results/tools-transcript.json]

The bundled model is 3M parameters trained on Python's standard library docs: its words are nonsense, but
constrained decoding keeps every call and every structured answer on its schema; that is what this shows.
Greedy (temperature 0), so a rerun on the same commit gives the same transcript.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_servers import ROOT, _commit, sluice_server  # noqa: E402

QUESTION = "What is the weather in Paris for the next two days?"


class Forecast(BaseModel):
    """A weather forecast."""
    city: str = Field(description="the city", max_length=24)
    days: int = Field(ge=1, le=7)
    unit: Literal["celsius", "fahrenheit"]


def get_weather(city: str, days: int) -> str:
    """The weather in a city for some days."""
    return json.dumps({"city": city, "days": days, "forecast": "sunny, 21 C"})


def get_time(zone: Literal["UTC", "CET"]) -> str:
    """The time in a zone."""
    return "12:00"


def dump(message) -> dict:
    """What a LangChain message holds that a reader of the transcript wants to see."""
    out = {"type": message.type, "content": message.content}
    for key in ("tool_calls", "invalid_tool_calls"):
        if getattr(message, key, None):
            out[key] = getattr(message, key)
    if getattr(message, "tool_call_id", None):
        out["tool_call_id"] = message.tool_call_id
    finish = getattr(message, "response_metadata", {}).get("finish_reason")
    return {**out, "finish_reason": finish} if finish else out


def transcript(base: str, max_tokens: int) -> dict:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI
    from openai import OpenAI

    chat = ChatOpenAI(base_url=f"{base}/v1", api_key="none", model="sluice-stdlib", temperature=0,
                      max_tokens=max_tokens, max_retries=0, timeout=600)
    tools = {"get_weather": get_weather, "get_time": get_time}
    # An agent's loop: the model must call get_weather; the tool runs; its result goes back as a tool message.
    messages = [HumanMessage(QUESTION)]
    call = chat.bind_tools(list(tools.values()), tool_choice="get_weather").invoke(messages)
    messages.append(call)
    for c in call.tool_calls:
        messages.append(ToolMessage(tools[c["name"]](**c["args"]), tool_call_id=c["id"]))
    messages.append(chat.bind_tools(list(tools.values())).invoke(messages))  # auto: the model answers
    chunks = list(chat.bind_tools(list(tools.values()), tool_choice="any", parallel_tool_calls=False).stream(QUESTION))
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole = whole + chunk
    client = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600)
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    parsed = parse(model="sluice-stdlib", messages=[{"role": "user", "content": QUESTION}], response_format=Forecast,
                   temperature=0, max_tokens=max_tokens)
    return {
        "question": QUESTION,
        "agent_loop": [dump(m) for m in messages],
        # each chunk's (name, args piece): the name comes once, first; then the arguments' text piece by piece
        "streamed_any": {"tool_call_chunks": [[c["name"], c["args"]] for ch in chunks for c in ch.tool_call_chunks],
                         "joined": dump(whole)},
        "structured_output": {
            method: chat.with_structured_output(Forecast, method=method).invoke(QUESTION).model_dump()
            for method in ("json_schema", "function_calling")},
        "openai_parse": {"content": parsed.choices[0].message.content,
                         "parsed": parsed.choices[0].message.parsed.model_dump(),
                         "finish_reason": parsed.choices[0].finish_reason},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs/results/tools-transcript.json")
    ap.add_argument("--max-tokens", type=int, default=120)
    args = ap.parse_args(argv)
    server = sluice_server(None, "float32", 8)
    try:
        server.wait_ready(600)
        result = {"model": "sluice-stdlib (bundled)", "commit": _commit(), "temperature": 0,
                  **transcript(server.base, args.max_tokens)}
    finally:
        server.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps(result, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
