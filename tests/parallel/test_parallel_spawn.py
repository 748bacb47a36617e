"""Running a function on N gloo ranks from a test, and the collectives' own checks.

run_ranks starts N spawned processes, each joining a fresh gloo group through a file store, and
collects what each wrote; a worker's traceback is shown in the failing test. The parity and error
tests (test_parallel_parity.py, test_parallel_errors.py) run their workers through it.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import time
import traceback
from pathlib import Path

import torch


def _entry(target, rank: int, world: int, store: str, out: str, timeout_s: float, args) -> None:
    torch.set_num_threads(1)  # N ranks share this machine's cores
    from sluice import parallel as P
    try:
        ranks = P.init(rank, world, store, timeout_s=timeout_s)
        result = target(ranks, *args)
        Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(("ok", result)))
    except BaseException as e:  # report everything, including a ParallelError the test expects
        Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(("error", (type(e).__name__, str(e),
                                                                         traceback.format_exc()))))
    finally:
        P.shutdown()


def run_ranks(tmp: Path, world: int, target, *args, timeout_s: float = 60.0, wait_s: float = 600.0) -> list:
    """target(ranks, *args) on `world` ranks -> [("ok", result) or ("error", (type, message, traceback))
    or ("missing", exitcode)] by rank. Processes still alive after wait_s are killed. wait_s and the
    collective timeout_s stop hangs: each is 10x+ what the ranks take (or wait on each other) here."""
    tmp = Path(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    store = tmp / "store"
    store.unlink(missing_ok=True)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(target, r, world, f"file://{store}", str(tmp), timeout_s, args))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(wait_s)
    results = []
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            p.join()
        f = tmp / f"rank{r}.pkl"
        results.append(pickle.loads(f.read_bytes()) if f.exists() else ("missing", p.exitcode))
    return results


def stay_silent(flags, quiet_s: float) -> None:
    """A rank that hangs, alive but silent, until the other rank has raised (it touches flags/raised); then it
    touches flags/left and goes. So the other rank can tell that it raised on its own timeout while this one
    was still there, without a clock. It gives up after 10x quiet_s (how long the other rank takes to raise
    on a quiet machine): a hang-stopper for a test whose other rank never raises, which then fails."""
    deadline = time.monotonic() + 10 * quiet_s
    while not Path(flags, "raised").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    Path(flags, "left").touch()


def raised(flags) -> bool:
    """The raising rank's side of stay_silent: marks that it raised; True if the silent rank had already left."""
    left = Path(flags, "left").exists()
    Path(flags, "raised").touch()
    return left


def ok(results: list) -> list:
    """The results, after failing the test with the first worker error."""
    for r, (kind, value) in enumerate(results):
        assert kind == "ok", f"rank {r}: {kind}: {value if kind == 'missing' else value[2]}"
    return [v for _, v in results]


def _sums(ranks):
    from sluice.parallel import group
    t = torch.full((3,), float(ranks.rank + 1))
    gathered = group.all_gather(torch.tensor([ranks.rank]))
    return group.all_reduce(t).tolist(), gathered.flatten().tolist()


def tiny_checkpoints(tmp_path_factory, prefix: str, families: dict, sizes: dict, seed: int,
                     with_tokenizer: bool = False) -> dict[str, str]:
    """{family: directory} of tiny random checkpoints (tests/ckpt.py) with random biases: transformers
    initialises biases to zero, which would hide a bias sliced wrongly or added once per rank."""
    from ckpt import add_tensors, build, build_with_tokenizer
    from safetensors.torch import load_file
    dirs = {}
    for fam, extra in families.items():
        d = tmp_path_factory.mktemp(f"{prefix}-{fam}")
        (build_with_tokenizer if with_tokenizer else build)(d, fam, **sizes, **extra)
        g = torch.Generator().manual_seed(seed)
        biases = {k: 0.5 * torch.randn(v.shape, generator=g) for k, v in load_file(d / "model.safetensors").items()
                  if k.endswith(".bias") and not k.endswith(("attn.bias", "masked_bias"))}  # not GPT-2's mask buffers
        if biases:
            add_tensors(d, biases)
        dirs[fam] = str(d)
    return dirs


def load_recording(model_dir, ranks):
    """parallel.load_rank(model_dir, ranks) -> (the rank's model, the names of the tensors it read
    whole with get_tensor rather than as slices): only replicated (or fused q|k|v) tensors may be."""
    from sluice import parallel as P
    from sluice.model import weights
    whole = []
    real_open = weights.safe_open

    class Recording:
        def __init__(self, *a, **k):
            self.f = real_open(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, name):
            whole.append(name)
            return self.f.get_tensor(name)

        def get_slice(self, name):
            return self.f.get_slice(name)

    weights.safe_open = Recording
    try:
        return P.load_rank(model_dir, ranks), whole
    finally:
        weights.safe_open = real_open


def test_collectives_on_two_ranks(tmp_path):
    for sums, gathered in ok(run_ranks(tmp_path, 2, _sums)):
        assert sums == [3.0, 3.0, 3.0] and gathered == [0, 1]
