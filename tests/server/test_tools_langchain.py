"""The issue's acceptance, against a live server on the bundled model with real constrained decoding:
LangChain's bind_tools (a forced call, "any", and auto) and with_structured_output (json_schema and
function_calling), whole and streamed, and the openai client's chat.completions.parse with a pydantic model.
Every returned object validates against the schema it was asked for (pydantic, and jsonschema for the
arguments): the output may be nonsense text from a 3M-parameter model, but never off the schema."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, Field

import sluice
from server_harness import one_torch_thread  # noqa: F401 -- a fixture
from server_harness import LiveServer, make_engine

langchain_openai = pytest.importorskip("langchain_openai")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

BUNDLED = Path(sluice.__file__).parent / "assets" / "sluice-stdlib"
QUESTION = "What is the weather in Paris for the next two days?"
# Enough for each call's JSON: no whitespace outside strings, and the bundled model closes its strings soon.
MAX_TOKENS = 120


class Forecast(BaseModel):
    """A weather forecast."""
    city: str = Field(description="the city", max_length=24)
    days: int = Field(ge=1, le=7)
    unit: Literal["celsius", "fahrenheit"]


def get_weather(city: str, days: int) -> str:
    """The weather in a city for some days."""
    return "sunny"


def get_time(zone: Literal["UTC", "CET"]) -> str:
    """The time in a zone."""
    return "noon"


@pytest.fixture(scope="module")
def served():
    engine, _ = make_engine(BUNDLED)
    live = LiveServer(engine)
    yield live
    live.stop()
    engine.close()


@pytest.fixture(scope="module")
def chat(served):
    return langchain_openai.ChatOpenAI(base_url=f"{served.url}/v1", api_key="none", model="tiny", max_retries=0,
                                       temperature=0, max_tokens=MAX_TOKENS, timeout=300)


def schema_of(function) -> dict:
    from langchain_core.utils.function_calling import convert_to_openai_tool
    return convert_to_openai_tool(function)["function"]["parameters"]


def assert_valid_calls(message, functions) -> None:
    by_name = {f.__name__: f for f in functions}
    assert message.tool_calls and not message.invalid_tool_calls, message
    for call in message.tool_calls:
        assert call["id"].startswith("call_") and call["name"] in by_name
        jsonschema.validate(call["args"], schema_of(by_name[call["name"]]))


def test_bind_tools_with_a_forced_call(chat):
    message = chat.bind_tools([get_weather, get_time], tool_choice="get_weather").invoke(QUESTION)
    assert_valid_calls(message, [get_weather])
    assert message.response_metadata["finish_reason"] == "tool_calls"


def test_bind_tools_any_makes_one_call_of_an_offered_tool(chat):
    message = chat.bind_tools([get_weather, get_time], tool_choice="any", parallel_tool_calls=False).invoke(QUESTION)
    assert_valid_calls(message, [get_weather, get_time])
    assert len(message.tool_calls) == 1


def test_bind_tools_auto_answers_and_any_call_is_valid(chat):
    # The bundled model was never taught to call tools: auto lets it answer in text (no call is forced).
    message = chat.bind_tools([get_weather]).invoke(QUESTION)
    assert isinstance(message.content, str)
    if message.tool_calls:
        assert_valid_calls(message, [get_weather])


def test_streamed_tool_call_chunks_join_into_valid_arguments(chat):
    chunks = list(chat.bind_tools([get_weather], tool_choice="get_weather").stream(QUESTION))
    assert sum(len(c.tool_call_chunks) for c in chunks) > 2  # the arguments came in pieces
    whole = chunks[0]
    for c in chunks[1:]:
        whole = whole + c
    assert_valid_calls(whole, [get_weather])


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_returns_a_valid_model(chat, method):
    answer = chat.with_structured_output(Forecast, method=method).invoke(QUESTION)
    assert isinstance(answer, Forecast)
    Forecast.model_validate(answer.model_dump())


def test_with_structured_output_default_method(chat):
    assert isinstance(chat.with_structured_output(Forecast).invoke(QUESTION), Forecast)


def test_openai_parse_with_a_pydantic_model(served):
    client = served.client()
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    out = parse(model="tiny", messages=[{"role": "user", "content": QUESTION}], response_format=Forecast,
                temperature=0, max_tokens=MAX_TOKENS)
    assert isinstance(out.choices[0].message.parsed, Forecast) and out.choices[0].finish_reason == "stop"
