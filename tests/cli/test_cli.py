"""The command line, run as a user would: a subprocess with arguments and stdin."""

import json
import subprocess
import sys

import pytest


def sluice(*args, stdin=None, timeout=120):  # a hang-stopper: 10x+ the ~12 s a `python -m sluice` run on a tiny model takes here under load
    return subprocess.run([sys.executable, "-m", "sluice", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_generate_json(tiny_dir):
    r = sluice("generate", "--model", str(tiny_dir), "--max-tokens", "6", "--temperature", "0",
               "--ignore-eos", "--json", "Hello world")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) == 6 and out["finish_reason"] == "length"
    assert out["stats"]["prompt_tokens"] > 0 and out["stats"]["generated_tokens"] == 6


@pytest.mark.slow
def test_generate_streams_text_and_stats(tiny_dir, tiny_llm):
    import sluice as api
    expected = tiny_llm.generate("Hello world", api.SamplingParams(max_tokens=6, temperature=0,
                                                                    ignore_eos=True))[0].text
    r = sluice("generate", "--model", str(tiny_dir), "--max-tokens", "6", "--temperature", "0",
               "--ignore-eos", "Hello world")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "Hello world" + expected + "\n"
    assert "prompt tokens" in r.stderr and "decode" in r.stderr and "tok/s" in r.stderr


@pytest.mark.parametrize("flag,value,name", [("--temperature", "3", "temperature"),
                                             ("--top-p", "0", "top_p"),
                                             ("--max-tokens", "0", "max_tokens")])
def test_generate_bad_sampling_value(tiny_dir, flag, value, name):
    r = sluice("generate", "--model", str(tiny_dir), flag, value, "hi")
    assert r.returncode == 2
    assert name in r.stderr and value in r.stderr and "Traceback" not in r.stderr


def test_generate_missing_model(tmp_path):
    r = sluice("generate", "--model", str(tmp_path / "nope"), "hi")
    assert r.returncode == 2 and "nope" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_chat_two_turns_over_stdin(tiny_dir):
    r = sluice("chat", "--model", str(tiny_dir), "--max-tokens", "4", "--temperature", "0",
               "--ignore-eos", stdin="Hello there\n/reset\nWhat is 2+2?\n")
    assert r.returncode == 0, r.stderr
    replies = [line for line in r.stdout.split("> ") if line.strip()]
    assert len(replies) == 2  # one reply per user turn; /reset prints to stderr only
    assert "conversation cleared" in r.stderr


@pytest.mark.slow
def test_chat_exit_command(tiny_dir):
    r = sluice("chat", "--model", str(tiny_dir), "--max-tokens", "2", stdin="/exit\nnever read\n")
    assert r.returncode == 0 and r.stdout.count("> ") == 1


@pytest.mark.slow
def test_chat_ctrl_c_stops_the_reply_not_the_session(tmp_path):
    """Through a pseudo-terminal, as a person would: Ctrl-C mid-reply, then keep chatting."""
    import os
    import pty
    import select
    import time

    from ckpt import build_with_tokenizer
    build_with_tokenizer(tmp_path, "qwen3", max_position_embeddings=8192)
    pid, fd = pty.fork()
    if pid == 0:  # child: the real CLI on the pty, with the signal state a shell would give it
        import signal  # (a fork inherits pytest's blocked / ignored signals across exec)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.execv(sys.executable, [sys.executable, "-m", "sluice", "chat", "--model", str(tmp_path),
                                  "--max-tokens", "8000", "--temperature", "1", "--seed", "0",
                                  "--ignore-eos"])
    seen = b""

    # The reads' time limits stop hangs: 10x+ what each wait takes here (start-up ~12 s, the rest < 3 s).
    def read_until(needle: bytes, timeout: float = 120) -> bytes:
        nonlocal seen
        end = time.time() + timeout
        while needle not in seen and time.time() < end:
            if select.select([fd], [], [], 0.5)[0]:
                try:
                    seen += os.read(fd, 4096)
                except OSError:
                    break
        assert needle in seen, seen[-500:]
        return seen

    def read_more(n: int, timeout: float = 60) -> None:
        nonlocal seen
        target, end = len(seen) + n, time.time() + timeout
        while len(seen) < target and time.time() < end:
            if select.select([fd], [], [], 0.5)[0]:
                seen += os.read(fd, 4096)
        assert len(seen) >= target, seen[-500:]

    read_until(b"> ")
    os.write(fd, b"hello\r")
    read_until(b"hello")
    read_more(40)  # the reply is streaming (8000 tokens: far from done)
    os.write(fd, b"\x03")
    read_until(b"[stopped]")
    read_until(b"> ", timeout=30)  # the session goes on
    os.write(fd, b"/exit\r")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
