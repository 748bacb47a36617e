"""`sluice serve --tp N`: rank 0 serves HTTP and drives the other ranks' schedulers in lockstep.

Checked against a single-process `sluice serve` on the same tiny checkpoint: concurrent streaming and
non-streaming completions and chat completions, greedy and seeded sampling with filters, penalties,
n = 2 and logprobs give the same responses (chunk by chunk; logprobs within 1e-4), under torchrun
at 2 and 4 ranks; then SIGTERM to torchrun ends every rank. The lifecycle, with the ranks started
as torchrun would start them (its environment variables) so a test can signal one rank: an idle
server outlives several collective timeouts (heartbeats); SIGTERM on rank 0 drains a stream in
flight and every rank exits 0; a follower killed mid-stream fails the requests in flight with a
message and rank 0 exits 2; rank 0 killed makes the follower exit 2 with one line; --tp's mistakes
are one-line errors.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from server_harness import request, sse_events, wait_for

pytestmark = pytest.mark.slow  # torchrun servers of 2 ranks

pytest.importorskip("uvicorn")

# The collective timeout of the lifecycle tests: short, so an idle test outlives it, yet 10x+ the stall a busy
# machine can put between two heartbeats (every TIMEOUT_S / 4; a 3 s timeout left a 2.25 s stall no room).
TIMEOUT_S = 10.0
LONG = {"prompt": "hello", "temperature": 0, "max_tokens": 400, "ignore_eos": True}
# Every time limit below (thread joins, HTTP and wait_for timeouts, process waits) stops a hang and is
# 10x+ what it waits on takes here under load; none checks speed.
REQUESTS = [  # (path, body), sent all at once
    ("/v1/completions", {"prompt": "def add(a, b):", "temperature": 0, "max_tokens": 12, "ignore_eos": True,
                         "logprobs": 2}),
    ("/v1/completions", {"prompt": "import os", "temperature": 0.9, "top_k": 40, "top_p": 0.9, "min_p": 0.02,
                         "seed": 7, "max_tokens": 12, "ignore_eos": True, "logprobs": 3, "stream": True}),
    ("/v1/completions", {"prompt": [5, 80, 17, 300, 42, 9], "temperature": 1.1, "repetition_penalty": 1.3,
                         "presence_penalty": 0.5, "frequency_penalty": 0.3, "seed": 3, "max_tokens": 10,
                         "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi there"}], "temperature": 0,
                              "max_tokens": 10, "ignore_eos": True, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": "why?"}], "temperature": 0.8, "seed": 11,
                              "n": 2, "max_tokens": 10, "ignore_eos": True, "logprobs": True, "top_logprobs": 2}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 100000}),  # refused on rank 0: 400, nothing broadcast
]


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                             "LOCAL_RANK")}
    return {**env, "OMP_NUM_THREADS": "1", **{k: str(v) for k, v in extra.items()}}


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    """`sluice serve` processes on a free port: one, N under torchrun, or N started with torchrun's
    environment (so each rank is a process of ours to signal). Output goes to files in tmp."""

    def __init__(self, tmp, model, world: int = 1, torchrun: bool = False, flags=()):
        self.port, self.tmp, self.procs = _free_port(), tmp, []
        cmd = ["-m", "sluice", "serve", "--model", str(model), "--port", str(self.port), *flags]
        if world > 1:
            cmd[3:3] = ["--tp", str(world)]
        master = _free_port()
        if torchrun:
            launch = [[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
                       *cmd]]
            envs = [_env()]
        elif world == 1:
            launch, envs = [[sys.executable, *cmd]], [_env()]
        else:  # what torchrun would set, one process per rank
            launch = [[sys.executable, *cmd]] * world
            envs = [_env(RANK=r, LOCAL_RANK=r, WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", MASTER_PORT=master)
                    for r in range(world)]
        for r, (args, env) in enumerate(zip(launch, envs, strict=True)):
            out = open(tmp / f"rank{r}.log", "w")  # noqa: SIM115 -- closed with the process
            self.procs.append(subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, text=True))
        wait_for(self._up, timeout=180, what="the server to load")  # a hang-stopper: 10x+ the ~15 s here

    def log(self, rank: int = 0) -> str:
        return (self.tmp / f"rank{rank}.log").read_text()

    def _up(self) -> bool:
        for r, p in enumerate(self.procs):
            assert p.poll() is None, f"rank {r} exited with {p.returncode}:\n{self.log(r)}"
        try:
            return request(self.port, "GET", "/health")[0] == 200
        except OSError:
            return False

    def wait(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        return [p.wait(max(deadline - time.monotonic(), 0.1)) for p in self.procs]

    def workers(self) -> list[int]:
        """The pids of torchrun's workers (each in a session of its own: killing torchrun leaves them)."""
        return [pid for p in self.procs for pid in _descendants(p.pid)]

    def kill(self) -> None:
        for pid in self.workers():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _descendants(pid: int) -> list[int]:
    out = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            for child in map(int, children.read_text().split()):
                out += [child, *_descendants(child)]
    return out


def _gone(pid: int) -> bool:
    """Exited (a zombie waiting for its parent counts)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True


@pytest.fixture
def ranks(tmp_path):
    started = []

    def start(*args, **kwargs):
        started.append(Ranks(tmp_path, *args, **kwargs))
        return started[-1]
    yield start
    for r in started:
        r.kill()


def _normal(status, body: bytes, stream: bool):
    """A response without what differs between two servers (ids, times, the model path)."""
    if status != 200:
        return status, json.loads(body)
    items = sse_events(body) if stream else [json.loads(body)]
    for item in items:
        if isinstance(item, dict):
            for key in ("id", "created", "model", "system_fingerprint"):
                item.pop(key, None)
    return status, items


def _same(a, b, path="") -> None:
    """Equal, except floats (logprobs), which may differ by 1e-4 (the ranks sum in another order)."""
    if isinstance(a, float) and isinstance(b, float):
        assert abs(a - b) <= 1e-4, f"{path}: {a} != {b}"
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), f"{path}: {sorted(a)} != {sorted(b)}"
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        assert len(a) == len(b), f"{path}: {len(a)} items != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _ask_all(port: int) -> list:
    with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
        futures = [pool.submit(request, port, "POST", path, body) for path, body in REQUESTS]
        return [_normal(f.result()[0], f.result()[2], body.get("stream", False))
                for f, (_, body) in zip(futures, REQUESTS, strict=True)]


@pytest.fixture(scope="module")
def reference(tiny_dir, tmp_path_factory):
    single = Ranks(tmp_path_factory.mktemp("single"), tiny_dir)
    try:
        return _ask_all(single.port)
    finally:
        single.kill()


@pytest.mark.parametrize("world", [2, 4])
def test_torchrun_serves_what_one_process_serves(tiny_dir, reference, ranks, world):
    server = ranks(tiny_dir, world, torchrun=True)
    got = _ask_all(server.port)
    assert [s for s, _ in got] == [200, 200, 200, 200, 200, 400]
    _same(got, reference)
    _leave_mid_stream(server.port)  # its abort must reach every rank, or their batches would differ
    again = _ask_all(server.port)  # the prefix cache now holds these prompts: still the same
    _same(again, reference)
    workers = server.workers()
    assert len(workers) == world
    server.procs[0].send_signal(signal.SIGTERM)  # torchrun passes it on: rank 0 drains and stops the others
    server.wait(300)
    wait_for(lambda: all(_gone(pid) for pid in workers), timeout=30, what="the ranks to exit")


def _leave_mid_stream(port: int) -> None:
    """A streaming client that reads its first tokens and hangs up; returns once the server has aborted it."""
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({**LONG, "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    for _ in range(4):
        resp.readline()
    conn.close()

    def aborted():
        _, _, body = request(port, "GET", "/metrics")
        return 'finished_reason="aborted"} 1' in body.decode()
    wait_for(aborted, timeout=60, what="the abort")


class Stream(threading.Thread):
    """A streaming completion read to its end; `first` is set at its first token."""

    def __init__(self, port: int, body: dict):
        super().__init__(daemon=True)
        self.port, self.body = port, {**body, "stream": True}
        self.first, self.raw, self.status = threading.Event(), b"", None

    def run(self):
        import http.client
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        conn.request("POST", "/v1/completions", json.dumps(self.body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        self.status = resp.status
        while line := resp.readline():
            self.raw += line
            if line.startswith(b"data: {") and b'"text":""' not in line:
                self.first.set()
        self.first.set()


def test_idle_heartbeats_then_sigterm_drains_and_every_rank_exits_0(tiny_dir, ranks):
    server = ranks(tiny_dir, 2, flags=["--tp-timeout", str(TIMEOUT_S)])
    time.sleep(3 * TIMEOUT_S)  # idle for three collective timeouts: the heartbeats keep the followers waiting
    assert [p.poll() for p in server.procs] == [None, None], server.log(1)
    stream = Stream(server.port, {**LONG, "max_tokens": 150})
    stream.start()
    assert stream.first.wait(60)
    server.procs[0].send_signal(signal.SIGTERM)  # the drain: the stream in flight runs to its end
    stream.join(300)
    events = sse_events(stream.raw)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length", events[-3:]
    assert "".join(e["choices"][0]["text"] for e in events[:-1]).strip()
    assert server.wait(300) == [0, 0], server.log(0)


def test_a_follower_killed_fails_the_requests_and_rank_0_exits(tiny_dir, ranks):
    server = ranks(tiny_dir, 2, flags=["--tp-timeout", str(TIMEOUT_S)])
    stream = Stream(server.port, LONG)
    stream.start()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        whole = pool.submit(request, server.port, "POST", "/v1/completions", LONG)
        assert stream.first.wait(60)
        server.procs[1].kill()
        t0 = time.monotonic()
        status, _, body = whole.result(60)
    stream.join(300)
    assert status == 503, body
    assert "the tensor-parallel group failed" in json.loads(body)["error"]["message"]
    last = sse_events(stream.raw)[-2]["choices"][0]
    assert last["finish_reason"] == "error" and "the tensor-parallel group failed" in last["error"], last
    assert server.wait(10 * TIMEOUT_S + 60)[0] == 2
    print(f"rank 0 exited {time.monotonic() - t0:.1f} s after the follower was killed:\n{server.log(0)}")
    said = [line for line in server.log(0).splitlines() if line.startswith("sluice serve:")]
    assert said[-1].startswith("sluice serve: error: the tensor-parallel group failed (rank 0: "), said


def test_rank_0_killed_makes_the_follower_exit_with_one_line(tiny_dir, ranks):
    server = ranks(tiny_dir, 2, flags=["--tp-timeout", str(TIMEOUT_S)])
    server.procs[0].kill()
    t0 = time.monotonic()
    assert server.wait(10 * TIMEOUT_S + 60)[1] == 2
    print(f"the follower exited {time.monotonic() - t0:.1f} s after rank 0 was killed:\n{server.log(1)}")
    lines = server.log(1).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sluice serve: error: rank 1: broadcast of the next step failed: "
                                                   "another rank exited"), lines


@pytest.mark.parametrize("args, env, says", [
    (["--tp", "2"], {}, "--tp 2 needs torchrun's environment (WORLD_SIZE is not set): launch with "
                        "`torchrun --nproc-per-node 2 -m sluice serve --tp 2 ...`"),
    (["--tp", "2", "--compile"], dict(WORLD_SIZE=2, RANK=0),
     "--compile is not available with --tp (tensor parallelism runs the continuous-batching engine's plain torch "
     "forward); leave it out"),
    (["--tp", "2", "--prompt-lookup"], dict(WORLD_SIZE=2, RANK=0), "--prompt-lookup is not available with --tp"),
    (["--tp", "2", "--tp-timeout", "0"], dict(WORLD_SIZE=2, RANK=0),
     "--tp-timeout must be a positive number of seconds, got 0.0"),
])
def test_tp_mistakes_are_one_line_errors(args, env, says):
    r = subprocess.run([sys.executable, "-m", "sluice", "serve", "--model", "/nonexistent/not-loaded", *args],
                       capture_output=True, text=True, timeout=120, env=_env(**env))
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"sluice serve: error: {says}"), lines
