"""llama.cpp's own batched decode, `llama-batched-bench`: find the binary, run it, read its table.

llama-batched-bench (tools/batched-bench in llama.cpp) loads a GGUF, and for every (PP, TG, B) asked
for, prefills B prompts of PP random tokens in one batch, then decodes TG steps of B tokens each
(one per sequence, logits computed, no sampling: the next token is random), and prints one row:

    |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
    |-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
    |   128 |    128 |    8 |   2048 |    0.751 |  1363.27 |    7.344 |   139.43 |    8.095 |   252.99 |

S_TG = B * TG / T_TG, decode tokens/s summed over the B sequences. `parse_table` reads that table
by its column names (tests/bench/fixtures holds a captured run); `run_batched_bench` runs it.
It is not part of llama-cpp-python's wheel: bench/build_batched_bench.sh builds it from the same
source distribution.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from ..errors import BenchmarkError

BINARY = "llama-batched-bench"
BUILD_HINT = ("build it from llama-cpp-python's source distribution with `bash bench/build_batched_bench.sh` "
              "in a sluice checkout (it lands in .peers/lcpp-tools/bin/), or pass --batched-bench PATH")
# Its column names -> the names its own JSONL output (--output-format jsonl) gives the same values.
COLUMNS = {"PP": "pp", "TG": "tg", "B": "pl", "N_KV": "n_kv", "T_PP s": "t_pp", "S_PP t/s": "speed_pp",
           "T_TG s": "t_tg", "S_TG t/s": "speed_tg", "T s": "t", "S t/s": "speed"}
_INTS = {"pp", "tg", "pl", "n_kv"}
_SETTING = re.compile(r"(\w+) = (-?\d+)")


def find_batched_bench(explicit: str | None) -> Path:
    """--batched-bench PATH, else llama-batched-bench on PATH, else .peers/lcpp-tools/bin/ under the
    current directory or the repository this sluice runs from."""
    if explicit:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise BenchmarkError(f"--batched-bench {explicit}: no such executable; {BUILD_HINT}")
        return path
    found = shutil.which(BINARY)
    if found:
        return Path(found)
    for root in search_roots():
        cand = root / ".peers" / "lcpp-tools" / "bin" / BINARY
        if cand.is_file() and os.access(cand, os.X_OK):
            return cand
    raise BenchmarkError(f"--vs llama.cpp: {BINARY} (llama.cpp's batched-decode benchmark) was not found; "
                         f"{BUILD_HINT}")


def search_roots() -> list[Path]:
    """Where a .peers/ folder may be: the current directory, the repository of a source checkout."""
    return [Path.cwd(), Path(__file__).resolve().parents[3]]


def parse_table(text: str) -> dict:
    """llama-batched-bench's output -> {"settings": the `n_kv_max = ..., n_threads = ...` line as a
    dict of ints, "rows": one dict per table row, keyed as its JSONL output keys them}."""
    lines = [ln.strip() for ln in text.splitlines()]
    header = next((i for i, ln in enumerate(lines) if ln.startswith("|") and "S_TG t/s" in ln), None)
    if header is None:
        raise BenchmarkError("llama-batched-bench printed no results table" + _tail(text))
    names = [c.strip() for c in lines[header].strip("|").split("|")]
    missing = [c for c in COLUMNS if c not in names]
    if missing:
        raise BenchmarkError(f"llama-batched-bench's table lacks the columns {', '.join(missing)}" + _tail(text))
    rows = []
    for ln in lines[header + 2:]:  # past the |---|---| line
        if not ln.startswith("|"):
            break
        cells = [c.strip() for c in ln.strip("|").split("|")]
        try:
            row = {COLUMNS[n]: (int(v) if COLUMNS[n] in _INTS else float(v))
                   for n, v in zip(names, cells, strict=True) if n in COLUMNS}
        except ValueError:
            raise BenchmarkError(f"llama-batched-bench: cannot read the table row {ln!r}") from None
        rows.append(row)
    settings_line = next((ln for ln in lines[:header] if "n_kv_max =" in ln), "")
    return {"settings": {k: int(v) for k, v in _SETTING.findall(settings_line)}, "rows": rows}


def _tail(text: str, n: int = 5) -> str:
    tail = [ln for ln in text.strip().splitlines() if ln.strip()][-n:]
    return (": " + " / ".join(tail)) if tail else " (no output)"


def command(binary: Path, gguf: Path, threads: int, prompt: int, gen: int, batches: list[int]) -> list[str]:
    """The command line: prompts not shared (each sequence its own, as sluice's rows have), a context
    that holds every sequence whole, prompt and decode on `threads` threads."""
    ctx = max(batches) * (prompt + gen)
    return [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-c", str(ctx),
            "-b", str(max(2048, max(batches) * prompt)), "-npp", str(prompt), "-ntg", str(gen),
            "-npl", ",".join(map(str, batches))]


def run_batched_bench(cmd: list[str], timeout_s: float, want: list[tuple[int, int, int]], tries: int = 3) -> dict:
    """Run it until its table holds every (PP, TG, B) in `want`; its parsed table, its command line,
    how many runs that took and its printed output (kept in the results).

    It prints through llama.cpp's logger, a queue that a thread of its own writes out, and the
    process exits without draining it (llama.cpp issue 22142): on a busy machine its last rows can
    be lost although it measured them. So a run whose table lacks a row is run again, up to `tries`
    times, and the number of runs is recorded."""
    got = None
    for attempt in range(1, tries + 1):
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise BenchmarkError(f"llama-batched-bench ran past {timeout_s:.0f} s: {' '.join(cmd)}") from None
        except OSError as e:
            raise BenchmarkError(f"llama-batched-bench could not start ({e}); {BUILD_HINT}") from None
        text = proc.stdout + "\n" + proc.stderr
        if proc.returncode != 0:
            raise BenchmarkError(f"llama-batched-bench failed (exit status {proc.returncode})" + _tail(text))
        try:
            got = parse_table(text)
        except BenchmarkError:
            if attempt == tries:
                raise
            continue
        found = {(r["pp"], r["tg"], r["pl"]) for r in got["rows"]}
        if all(w in found for w in want):
            return {**got, "command": cmd, "runs": attempt, "output": proc.stdout}
    missing = [w for w in want if w not in {(r["pp"], r["tg"], r["pl"]) for r in got["rows"]}]
    raise BenchmarkError(f"llama-batched-bench printed no row for (PP, TG, B) = {', '.join(map(str, missing))} "
                         f"in {tries} runs (its table: {[(r['pp'], r['tg'], r['pl']) for r in got['rows']]})")
