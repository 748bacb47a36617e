"""observatory/disturbance.py: which processes competed with a benchmark run, and when a run counts
as disturbed. Snapshots are made up here (no timing, no dependence on what else the machine runs),
but for one check that /proc is read at all."""

import os

import pytest

from sluice.observatory import disturbance
from sluice.observatory.disturbance import LoadWatch, parse_stat

ME = os.getpid()


def test_parse_stat_takes_the_name_up_to_the_last_parenthesis():
    raw = "4242 (my (odd) name) S 17 4242 4242 0 -1 4194304 10 0 0 0 250 50 0 0 20 0 3 0 100 0 0"
    assert parse_stat(raw) == (17, "my (odd) name", 300, 100)


def test_this_process_is_in_a_real_snapshot():
    snap = disturbance._snapshot()
    if snap is None:
        pytest.skip("no /proc here")
    ppid, name, cpu, start = snap[ME]
    assert ppid == os.getppid() and cpu >= 0


def test_busy_counts_only_processes_outside_this_run():
    # pid 900 a busy stranger, 901 a child of this process (the llama.cpp worker), 902 its grandchild,
    # 903 a stranger that started between the snapshots, 904 one that stayed idle, 905 a kernel
    # worker that renamed itself (its old CPU time is not new), 906 a pid reused by a new process.
    before = {ME: (1, "python", 10.0, 7), 900: (1, "cc1plus", 5.0, 7), 901: (ME, "python", 0.0, 7),
              902: (901, "llama", 0.0, 7), 904: (1, "sshd", 1.0, 7), 905: (2, "kworker/1:0-events", 500.0, 7),
              906: (1, "old", 300.0, 7)}
    after = {ME: (1, "python", 30.0, 7), 900: (1, "cc1plus", 15.0, 7), 901: (ME, "python", 8.0, 7),
             902: (901, "llama", 9.0, 7), 903: (1, "make", 2.0, 7), 904: (1, "sshd", 1.0, 7),
             905: (2, "kworker/1:0-mm_percpu_wq", 500.2, 7), 906: (1, "new", 1.0, 99)}
    busy = disturbance._busy(before, after, seconds=20.0)
    assert busy == [{"pid": 900, "name": "cc1plus", "cores": 0.5}, {"pid": 903, "name": "make", "cores": 0.1},
                    {"pid": 906, "name": "new", "cores": 0.05}]


def _watch(monkeypatch, snaps, loadavg, cores=2):
    """A LoadWatch over made-up snapshots: the first two at the start, the third at the end."""
    it = iter(snaps)
    monkeypatch.setattr(disturbance, "_snapshot", lambda: next(it))
    monkeypatch.setattr(disturbance.os, "getloadavg", lambda: loadavg)
    monkeypatch.setattr(disturbance.os, "cpu_count", lambda: cores)
    monkeypatch.setattr(disturbance.time, "sleep", lambda s: None)
    monkeypatch.setattr(disturbance, "cpu_times", lambda: None)  # no steal unless a test makes it up
    clock = iter([99.5, 100.0, 110.0])  # a 0.5 s look at the start, then a 10 s run
    monkeypatch.setattr(disturbance.time, "monotonic", lambda: next(clock))
    return LoadWatch(start_sample_s=0.5).result()


def test_a_quiet_run_after_a_busy_minute_is_not_disturbed(monkeypatch):
    """A high load average alone (a run that just ended, processes just paused) is no disturbance."""
    idle = {ME: (1, "python", 1.0, 7), 900: (1, "cc1plus", 5.0, 7)}
    r = _watch(monkeypatch, [idle, idle, idle], (3.5, 2.0, 1.0))
    assert r["disturbed"] is False and r["disturbed_reasons"] == []
    assert r["loadavg_at_start"] == [3.5, 2.0, 1.0] and r["cores"] == 2 and r["busy_during_run"] == []


def test_load_above_the_cores_with_busy_processes_at_the_start_is_disturbed(monkeypatch):
    a = {ME: (1, "python", 1.0, 7), 900: (1, "cc1plus", 5.0, 7)}
    b = {ME: (1, "python", 1.0, 7), 900: (1, "cc1plus", 5.4, 7)}  # 0.8 of a core over the 0.5 s look
    r = _watch(monkeypatch, [a, b, b], (2.5, 2.0, 1.0))
    assert r["disturbed"] and len(r["disturbed_reasons"]) == 1
    assert "load average 2.50 at the start, above the 2 cores" in r["disturbed_reasons"][0]
    assert r["busy_at_start"] == [{"pid": 900, "name": "cc1plus", "cores": 0.8}]


def test_other_processes_busy_during_the_run_disturb_it(monkeypatch):
    start = {ME: (1, "python", 1.0, 7), 900: (1, "cc1plus", 5.0, 7)}
    end = {ME: (1, "python", 20.0, 7), 900: (1, "cc1plus", 8.0, 7)}  # 3 s of CPU in the 10 s run
    r = _watch(monkeypatch, [start, start, end], (0.5, 0.5, 0.5))
    assert r["disturbed"] and r["busy_during_run"] == [{"pid": 900, "name": "cc1plus", "cores": 0.3}]
    assert r["disturbed_reasons"] == ["other processes used 0.30 cores during the run: cc1plus (0.30)"]
    # a little background noise stays under the bar
    end[900] = (1, "cc1plus", 6.0, 7)
    it_start = dict(start)
    assert _watch(monkeypatch, [it_start, it_start, end], (0.5, 0.5, 0.5))["disturbed"] is False


def test_without_proc_nothing_is_claimed(monkeypatch):
    r = _watch(monkeypatch, [None, None, None], (0.1, 0.1, 0.1))
    assert r["processes_read"] is False and r["disturbed"] is False and r["busy_at_start"] == []


def test_steal_time_disturbs_a_run(monkeypatch):
    quiet = {ME: (1, "python", 1.0, 7)}
    ticks = iter([(100.0, 10_000.0), (180.0, 11_000.0), (100.0, 10_000.0), (110.0, 11_000.0)])
    monkeypatch.setattr(disturbance, "_snapshot", lambda: dict(quiet))
    monkeypatch.setattr(disturbance, "cpu_times", lambda: next(ticks))
    monkeypatch.setattr(disturbance.os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    monkeypatch.setattr(disturbance.time, "sleep", lambda s: None)
    r = LoadWatch().result()  # 80 of 1,000 ticks stolen: 8%
    assert r["disturbed"] and r["steal_share"] == 0.08
    assert r["disturbed_reasons"] == ["the hypervisor gave 8% of the CPU time to other guests during the run (steal)"]
    r = LoadWatch().result()  # 1%: background noise
    assert r["disturbed"] is False and r["steal_share"] == 0.01


def test_cpu_times_reads_proc_stat():
    got = disturbance.cpu_times()
    if got is None:
        pytest.skip("no /proc/stat here")
    assert 0 <= got[0] <= got[1]


class FakeWatch:
    """A LoadWatch whose verdicts are given in advance, one per round."""
    verdicts: list = []

    def __init__(self, start_sample_s=None):
        self.disturbed = FakeWatch.verdicts.pop(0)

    def result(self):
        return {"disturbed": self.disturbed, "disturbed_reasons": ["made up"] if self.disturbed else []}


def test_watched_repeats_a_disturbed_round_once_then_keeps_it_marked(monkeypatch):
    monkeypatch.setattr(disturbance, "LoadWatch", FakeWatch)
    calls = []
    FakeWatch.verdicts = [True, False]
    out, load = disturbance.watched(lambda: calls.append(1) or len(calls))
    assert out == 2 and load["attempts"] == 2 and load["disturbed_attempts"] == 1 and not load["disturbed"]
    FakeWatch.verdicts = [True, True]
    out, load = disturbance.watched(lambda: calls.append(1) or len(calls))
    assert out == 4 and load["attempts"] == 2 and load["disturbed"] and load["disturbed_reasons"] == ["made up"]
    FakeWatch.verdicts = [False]
    assert disturbance.watched(lambda: 7)[1]["attempts"] == 1
