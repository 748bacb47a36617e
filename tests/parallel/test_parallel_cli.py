"""`torchrun --nproc-per-node 2 -m sluice generate --tp 2` prints what the single process prints, and
--tp's mistakes are one-line errors, before any model loads (under torchrun, torchrun itself then adds
its own report of the failed processes)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # torchrun and CLI subprocesses on 2 ranks

ARGS = ["--max-tokens", "12", "--ignore-eos"]
SAMPLED = ["--temperature", "0.9", "--top-k", "50", "--top-p", "0.9", "--min-p", "0.02",
           "--repetition-penalty", "1.2", "--seed", "5"]


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                             "LOCAL_RANK")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


# The runs' timeouts stop hangs: 10x+ the ~25 s a two-rank run on a tiny model takes here under load.
def sluice(*args, env=None):
    return subprocess.run([sys.executable, "-m", "sluice", *args], capture_output=True, text=True, timeout=300,
                          env=env or _env())


def torchrun(n: int, *args):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                           "-m", "sluice", *args], capture_output=True, text=True, timeout=300, env=_env())


@pytest.mark.parametrize("sampling", [["--temperature", "0"], SAMPLED], ids=["greedy", "sampled"])
def test_torchrun_generate_prints_what_one_process_prints(tiny_dir, sampling):
    cmd = ["generate", "--model", str(tiny_dir), *ARGS, *sampling, "Hello world"]
    single = sluice(*cmd)
    assert single.returncode == 0, single.stderr
    tp = torchrun(2, *cmd[:1], "--tp", "2", *cmd[1:])
    assert tp.returncode == 0, tp.stderr
    print(f"single: {single.stdout!r}\ntp 2:   {tp.stdout!r}")
    assert tp.stdout == single.stdout  # rank 0 alone prints: one copy of the text
    assert tp.stderr.count("prompt tokens") == 1  # and one stats line
    one = sluice(cmd[0], "--tp", "1", *cmd[1:])
    assert one.returncode == 0 and one.stdout == single.stdout


@pytest.mark.parametrize("args, env, says", [
    (["--tp", "2"], {}, "--tp 2 needs torchrun's environment (WORLD_SIZE is not set): launch with "
                        "`torchrun --nproc-per-node 2 -m sluice generate --tp 2 ...`"),
    (["--tp", "2"], dict(WORLD_SIZE="4", RANK="0"), "--tp 2 but torchrun started 4 processes (WORLD_SIZE=4); they must match"),
    ([], dict(WORLD_SIZE="2", RANK="0"), "torchrun started 2 processes (WORLD_SIZE=2) but --tp is 1: pass --tp 2 to split the model over them"),
    (["--tp", "0"], {}, "--tp must be an integer >= 1, got 0"),
])
def test_tp_mistakes_are_one_line_errors(args, env, says):
    r = sluice("generate", "--model", "/nonexistent/not-loaded", *args, "hi", env=_env(**env))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [f"sluice generate: error: {says}"]


def test_a_model_that_does_not_split_names_its_numbers(tiny_dir):
    r = torchrun(3, "generate", "--model", str(tiny_dir), "--tp", "3", "hi")
    assert r.returncode != 0
    ours = [line for line in r.stderr.splitlines() if line.startswith("sluice generate:")]
    assert ours == ["sluice generate: error: tensor parallelism over 3 ranks needs num_attention_heads (4) to be a "
                    "multiple of 3"], r.stderr  # rank 0's line alone; ranks 1 and 2 stay silent
    # torchrun reports a failed child with a traceback of its own (ChildFailedError); none from sluice's code
    assert "ChildFailedError" in r.stderr and "src/sluice/" not in r.stderr and "sluice/cli" not in r.stderr
