"""bench/tools_transcript.py against a real `sluice serve` subprocess on the bundled model: the transcript it
records holds valid calls and structured answers, and the tool's result went back as a tool message."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("langchain_openai")
pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "tools_transcript.py"


def test_the_transcript_records_valid_calls_and_answers(tmp_path):
    out = tmp_path / "t.json"
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], check=True, timeout=900, capture_output=True)
    r = json.loads(out.read_text())
    human, call, result, answer = r["agent_loop"]
    assert human["type"] == "human" and answer["type"] == "ai"
    [c] = call["tool_calls"]
    assert c["name"] == "get_weather" and set(c["args"]) == {"city", "days"} and call["finish_reason"] == "tool_calls"
    assert result["type"] == "tool" and result["tool_call_id"] == c["id"]
    assert json.loads(result["content"])["days"] == c["args"]["days"]
    joined = r["streamed_any"]["joined"]["tool_calls"]
    assert len(joined) == 1 and joined[0]["name"] in ("get_weather", "get_time")
    pieces = r["streamed_any"]["tool_call_chunks"]
    assert pieces[0][0] == joined[0]["name"] and all(name is None for name, _ in pieces[1:])
    assert len(pieces) > 2 and json.loads("".join(args for _, args in pieces)) == joined[0]["args"]
    for answer in [*r["structured_output"].values(), r["openai_parse"]["parsed"]]:
        assert set(answer) == {"city", "days", "unit"} and 1 <= answer["days"] <= 7
        assert answer["unit"] in ("celsius", "fahrenheit") and len(answer["city"]) <= 24
