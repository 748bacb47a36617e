"""`sluice profile` under load: a round that other work disturbed is measured again, and one that stays
disturbed is marked in the JSON, the table and the report. The disturbance is made up (a LoadWatch
whose verdicts are given), so the test does not depend on what else this machine runs."""

import json

import pytest

from ckpt import build_with_tokenizer
from sluice.cli import main
from sluice.observatory import disturbance, machine

FAKE_MACHINE = {"stream_copy": {"GB_s": 10.0, "GB_s_median": 10.0, "bytes": 1, "reps": 1},
                "matmul": {"GFLOP_s": 50.0, "shapes": []}, "threads": 1}


class Watch:
    """Stands in for LoadWatch: disturbed or quiet as the test says, counting its rounds."""
    disturbed = False
    rounds = 0

    def __init__(self, start_sample_s=None):
        Watch.rounds += 1

    def result(self):
        d = Watch.disturbed
        return {"disturbed": d, "disturbed_reasons": ["other processes used 1.50 cores during the run: cc1plus (1.50)"] if d else [],
                "loadavg_at_start": [3.0, 2.0, 1.0]}


@pytest.fixture
def ckpt(tmp_path_factory, monkeypatch):
    monkeypatch.setattr(machine, "measure", lambda dtype, *a, **k: FAKE_MACHINE)
    monkeypatch.setattr(disturbance, "LoadWatch", Watch)
    Watch.rounds = 0
    d = tmp_path_factory.mktemp("profile-load")
    build_with_tokenizer(d, "qwen3", max_position_embeddings=64)
    return d


@pytest.mark.parametrize("disturbed", [True, False])
def test_profile_marks_disturbed_rounds(ckpt, capsys, tmp_path, disturbed):
    Watch.disturbed = disturbed
    out = tmp_path / "report"
    assert main(["profile", "--model", str(ckpt), "--contexts", "16,32", "--reps", "1", "--path", "torch",
                 "--json", "--out", str(out)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["disturbed"] is disturbed
    for r in data["rows"]:
        assert r["disturbed"] is disturbed
        assert r["load"]["attempts"] == (2 if disturbed else 1)  # repeated once, then kept marked
    assert Watch.rounds == 2 * (2 if disturbed else 1) + (2 if disturbed else 1)  # contexts + the peak measurement
    notes = [n for n in data["notes"] if n.startswith("DISTURBED")]
    if disturbed:
        assert any("context 16, 32 measured while other work used the CPU, still after 2 tries" in n
                   and "cc1plus" in n for n in notes), notes
        assert any("peak bandwidth" in n for n in notes)
        assert "DISTURBED" in (out / "profile.html").read_text()
    else:
        assert notes == [] and "DISTURBED" not in (out / "profile.html").read_text()
    # and in the table a terminal reader sees
    assert main(["profile", "--model", str(ckpt), "--contexts", "16", "--reps", "1", "--path", "torch"]) == 0
    table = capsys.readouterr().out
    assert "shared?" in table  # the column's header (rich may wrap it)
    assert ("│ DISTURBED │" in table) is disturbed and ("note: DISTURBED" in table) is disturbed
