"""Was a benchmark run disturbed? What else used the CPU while it ran, read from /proc.

It lives in the observatory (not benchmarks/) because `sluice profile` needs it too, and
benchmarks/ may import the observatory but not the other way round.

A run's numbers are only worth keeping when nothing else competed for its cores. Two signals:
  * the 1-minute load average at the start above the core count, while other processes were busy
    right then (a load average alone also holds the decaying tail of a run that just ended, or of
    processes just paused, which take nothing from this one);
  * processes outside this run's own tree (this process and its children, e.g. the llama.cpp
    worker) that used, together, a quarter of a core or more over the run, from their CPU time
    at the start and at the end;
  * on a virtual machine, steal time: the share of the machine's CPU time that the hypervisor gave
    to other guests during the run (/proc/stat), from STEAL_SHARE up.
`LoadWatch()` takes the first snapshot; `.result()` the second, and returns what a results file
records: the load averages, the busy processes (name, pid, cores used) and `disturbed` with its
reasons. Where /proc cannot be read (not Linux), the process part is empty and says so.
`watched(fn)` runs fn under a LoadWatch and repeats a disturbed run, for measurements made in rounds
(`sluice profile`'s contexts, `sluice bench norms`'s cells).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

BUSY_CORES = 0.25  # other processes' CPU, summed, above which a run counts as disturbed
LIST_CORES = 0.02  # a process is listed from this share of a core up
START_SAMPLE_S = 0.5
STEAL_SHARE = 0.05  # steal above this share of all CPU time over the run counts as a disturbance
REPEATS = 1  # a disturbed round is measured again this many times before it is kept, marked


def _tick() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (ValueError, OSError, AttributeError):
        return 100


def _snapshot() -> dict[int, tuple[int, str, float, int]] | None:
    """pid -> (parent pid, name, CPU seconds so far, start time) of every process; None without /proc."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").is_file():
        return None
    tick, out = _tick(), {}
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid, name, ticks, start = parse_stat((d / "stat").read_text())
        except (OSError, ValueError, IndexError):  # it ended between the listing and the read
            continue
        out[int(d.name)] = (ppid, name, ticks / tick, start)
    return out


def cpu_times() -> tuple[float, float] | None:
    """(steal, total) CPU ticks of the whole machine so far, from /proc/stat's "cpu" line; None
    where it cannot be read. Fields: user nice system idle iowait irq softirq steal (guest time
    is already inside user)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        ticks = [int(v) for v in fields[1:9]]
    except (OSError, ValueError, IndexError):
        return None
    return float(ticks[7]), float(sum(ticks))


def parse_stat(raw: str) -> tuple[int, str, int, int]:
    """/proc/PID/stat -> (parent pid, name, user + system CPU time in clock ticks, start time). The
    line is "pid (name) state ppid ...": the name may hold spaces and parentheses, so it ends at the
    last ")"."""
    name = raw[raw.index("(") + 1:raw.rindex(")")]
    rest = raw[raw.rindex(")") + 2:].split()
    return int(rest[1]), name, int(rest[11]) + int(rest[12]), int(rest[19])  # fields 4, 14, 15, 22 of proc(5)


def _own_tree(snap: dict[int, tuple[int, str, float]]) -> set[int]:
    """This process and its descendants (children the run started), from the parent links."""
    own, me = set(), os.getpid()
    for pid in snap:
        p, seen = pid, 0
        while p > 1 and seen < 64:
            if p == me:
                own.add(pid)
                break
            p, seen = snap[p][0] if p in snap else 0, seen + 1
    return own


def _busy(before: dict, after: dict, seconds: float) -> list[dict]:
    """Processes outside this run's tree by cores used between the snapshots, the busiest first."""
    own, rows = _own_tree(after), []
    for pid, (_, name, cpu, start) in after.items():
        if pid in own:
            continue
        # The same process is the same pid and start time (a name changes: exec, a kernel worker's
        # current queue); one that started after the first snapshot used all its CPU time since.
        used = cpu - before[pid][2] if pid in before and before[pid][3] == start else cpu
        cores = used / seconds if seconds > 0 else 0.0
        if cores >= LIST_CORES:
            rows.append({"pid": pid, "name": name, "cores": round(cores, 3)})
    return sorted(rows, key=lambda r: -r["cores"])


class LoadWatch:
    """Snapshots at the start (now) and at the end (result()) of a benchmark run."""

    def __init__(self, start_sample_s: float = START_SAMPLE_S):
        self.cores = os.cpu_count() or 1
        self.loadavg_at_start = list(os.getloadavg())
        # A short look at who is busy right now, to tell a current load from a decaying one. The
        # window is timed around both snapshots (reading /proc takes a while on a busy machine), so
        # it errs long: cores used are never overstated.
        t = time.monotonic()
        first = _snapshot()
        time.sleep(start_sample_s if first is not None else 0)
        self._start = _snapshot()
        self._t0 = time.monotonic()
        self.busy_at_start = _busy(first, self._start, self._t0 - t) if first is not None else []
        self._cpu = cpu_times()

    def result(self) -> dict:
        end = _snapshot()
        seconds = time.monotonic() - self._t0
        busy = _busy(self._start, end, seconds) if self._start is not None and end is not None else []
        reasons = []
        start_cores = sum(b["cores"] for b in self.busy_at_start)
        if self.loadavg_at_start[0] > self.cores and start_cores >= BUSY_CORES:
            reasons.append(f"load average {self.loadavg_at_start[0]:.2f} at the start, above the {self.cores} "
                           f"cores, with other processes using {start_cores:.2f} cores then")
        steal = None
        if self._cpu is not None and (end_cpu := cpu_times()) is not None and end_cpu[1] > self._cpu[1]:
            steal = (end_cpu[0] - self._cpu[0]) / (end_cpu[1] - self._cpu[1])
            if steal >= STEAL_SHARE:
                reasons.append(f"the hypervisor gave {100 * steal:.0f}% of the CPU time to other guests "
                               f"during the run (steal)")
        run_cores = sum(b["cores"] for b in busy)
        if run_cores >= BUSY_CORES:
            names = ", ".join(f"{b['name']} ({b['cores']:.2f})" for b in busy[:5])
            reasons.append(f"other processes used {run_cores:.2f} cores during the run: {names}")
        return {"loadavg_at_start": self.loadavg_at_start, "loadavg_at_end": list(os.getloadavg()),
                "cores": self.cores, "busy_at_start": self.busy_at_start, "busy_during_run": busy,
                "run_seconds": round(seconds, 2), "processes_read": end is not None,
                "steal_share": None if steal is None else round(steal, 4),
                "disturbed": bool(reasons), "disturbed_reasons": reasons}


def watched(fn, repeats: int = REPEATS, start_sample_s: float = START_SAMPLE_S):
    """(fn(), load): fn run under a LoadWatch, run again (up to `repeats` more times) while the
    watch calls it disturbed. The last run is kept; load is its LoadWatch result plus "attempts"
    and "disturbed_attempts", so a result that stayed disturbed says so and one that was redone
    says that too."""
    disturbed = 0
    for attempt in range(1, repeats + 2):
        watch = LoadWatch(start_sample_s=start_sample_s)
        out = fn()
        load = watch.result()
        if not load["disturbed"]:
            break
        disturbed += 1
    return out, {**load, "attempts": attempt, "disturbed_attempts": disturbed}
