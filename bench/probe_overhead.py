"""Probe overhead: the cost of `sluice.observe(model)` on the decode step and on prefill (CPU).

    python bench/probe_overhead.py --ablate --json runs/bench/probe_overhead.json   # full run
    python bench/probe_overhead.py --quick --no-compile --workdir /tmp/x            # smoke test

Same random checkpoint as decode_speed.py (Qwen3-0.6B's shapes). One model per dtype, with
observe(model) attached once, before any Runner exists (so before torch.compile traces a step);
"plain" runs take the probe's hooks out of the model's hook dicts and "probed" runs put the very
same hook functions back. One model and not two, so both read the very same weight pages (with
two copies, any speed difference between the copies would be counted as the probe's). Dynamo is
told to guard on hooks (torch._dynamo.config.skip_nnmodule_hook_guards=False); by default it does
not, and the compiled step would keep whichever hooks it was first traced with. With the guards it
traces once with and once without the hooks and afterwards picks the matching graph.

Which path: while a probe is attached the engine leaves the native step for the torch forward
(docs/engine.md, note 5), so that forward is what a probe costs on. It is timed here through
sluice.engine.Runner, the fixed-shape harness of the same torch modules over a static cache (the
scheduler runs them over its paged pool, and compiles them with dynamic shapes).

Each repetition prefills a fixed 128-token prompt with sluice.engine.Runner and times `--steps`
greedy runner.step calls, for every variant in turn (A, B, A, B, ...); per run the median step,
over runs the median. The script checks that the probe leaves prefill and decode logits
bit-identical (torch.equal), that with hooks the (compiled) step really runs them (the statistics
change at every decode step), and that a plain run leaves the probe's buffers untouched.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from pathlib import Path

import torch
from common import environment, save_json
from decode_speed import FULL, QUICK, build_checkpoint

import sluice

ROWS = {"fp32 eager": ("float32", False), "fp32 compile": ("float32", True),
        "bf16 eager": ("bfloat16", False)}

# --ablate adds two variants per eager row: "timed hooks", the probe with a clock around every hook
# (summed per kind of module below), and "no-op hooks", an empty function in place of every hook:
# the price of ~400 hook calls per forward (nn.Module's slow call path) before any arithmetic.
GROUPS = ("residual", "norms", "branches", "logits", "linears", "attention", "begin")


def group_of(obs, name: str, pre: bool, fn=None) -> str:
    if (getattr(fn, "__module__", None) or "").endswith("observatory.attention"):
        return "attention"  # the per-head valves: a hook on each attn.attend and their own pre-hook
    if name == "" and pre:
        return "begin"     # the model's pre-hook: zeroes the statistics of the forward to come
    if name in obs.norm_names:
        return "norms"     # RMS in and out, per norm (incl. per-head q/k norms)
    if name in obs.branch_names:
        return "branches"  # output RMS of attention and MLP
    if name == "":
        return "logits"    # the model's output: max, min, std, log Z, entropy, top-1 over the vocabulary
    if name == "embed" or re.fullmatch(r"layers\.\d+", name):
        return "residual"  # RMS, variance, top-k channels of x_0..x_L
    return "linears"       # the other Linears: only the NaN/inf check (every hook also does it)


class Switch:
    """Takes observe()'s hooks out of the model and puts the same functions back (or stand-ins)."""

    def __init__(self, model, obs):
        ids = {h.id for h in obs._handles}  # found by id, however observe() registered them
        self.entries = [(hooks, hid, hooks[hid], group_of(obs, name, hooks is module._forward_pre_hooks, hooks[hid]))
                        for name, module in model.named_modules()
                        for hooks in (module._forward_pre_hooks, module._forward_hooks)
                        for hid in list(hooks) if hid in ids]

    def set(self, variant: str, timers: dict | None = None) -> None:
        for hooks, hid, fn, group in self.entries:
            hooks.pop(hid, None)
            if variant == "probed":
                hooks[hid] = fn
            elif variant == "timed hooks":
                hooks[hid] = _timed(fn, group, timers)
            elif variant == "no-op hooks":
                hooks[hid] = fn if group == "begin" else _noop

    def counts(self) -> dict[str, int]:
        return {g: sum(1 for *_, group in self.entries if group == g) for g in GROUPS}


def _noop(*_):
    return None


def _timed(fn, group: str, timers: dict):
    def hook(*args):
        t0 = time.perf_counter()
        out = fn(*args)
        timers[group] = timers.get(group, 0.0) + time.perf_counter() - t0
        return out
    return hook


def run_once(runner, obs, prompt: list[int], steps: int, slots: int, timers: dict | None = None):
    """Prefill + `steps` greedy decode steps. Returns (prefill s, median s per step, all logits,
    with `obs`: whether the residual RMS it recorded changed at every decode step, and with
    `timers`: ms per decode step spent inside the hooks, per group)."""
    t0 = time.perf_counter()
    logits = runner.prefill([prompt], slots)  # (1, V)
    t_prefill = time.perf_counter() - t0
    out, times = [logits.clone()], []
    changed, prev = True, None
    if timers is not None:
        timers.clear()  # decode only
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = runner.step(logits.argmax(-1))
        times.append(time.perf_counter() - t0)
        if obs is not None:  # untimed: read what the step wrote
            now = obs.stats["resid_rms"][:, 0, 0].clone()
            changed &= prev is None or not torch.equal(now, prev)
            prev = now
        out.append(logits)
    runner.release()
    inside = {g: 1e3 * t / steps for g, t in timers.items()} if timers is not None else None
    # Median over steps: a step that another process delayed does not move it.
    return t_prefill, statistics.median(times), torch.cat(out), changed if obs is not None else None, inside


def code_version() -> dict:
    """Which probes were measured (they change; a number is only meaningful with its code)."""
    import hashlib
    import subprocess
    probes = Path(sluice.__file__).parent / "observatory" / "probes.py"
    git = lambda *a: subprocess.run(["git", "-C", str(probes.parent), *a], capture_output=True,
                                    text=True, check=False)
    last, dirty = git("log", "-1", "--format=%h %cs %s", "--", probes.name), git("status", "--porcelain", probes.name)
    return {"sluice_path": str(probes.parents[1]),
            "probes_sha256": hashlib.sha256(probes.read_bytes()).hexdigest()[:12],
            "probes_last_commit": last.stdout.strip() or None,
            "probes_uncommitted_changes": bool(dirty.stdout.strip()) if last.returncode == 0 else None}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/sluice-bench"), help="checkpoint cache")
    ap.add_argument("--json", type=Path, default=None, help="write results here as JSON")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per run")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of: {', '.join(ROWS)}")
    ap.add_argument("--no-compile", action="store_true", help="skip the compile=True row")
    ap.add_argument("--ablate", action="store_true",
                    help="also time the eager rows with timed hooks and with no-op hooks (where the time goes)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny shape, 16-token prompt, 4 steps, 1 rep: a smoke test, not a benchmark")
    args = ap.parse_args(argv)
    shape, name = FULL, "qwen3-0.6b-random"
    if args.quick:
        shape, name = QUICK, "quick-random"
        args.reps, args.prompt_tokens, args.steps = 1, 16, 4
    rows = [r for r in args.rows.split(",") if not (args.no_compile and ROWS[r][1])]

    from sluice.engine.runner import Runner

    # Without this a compiled step runs whatever hooks it was traced with (see the docstring); the
    # checks "hooks ran every step" and "buffers untouched" below would catch that.
    torch._dynamo.config.skip_nnmodule_hook_guards = False

    load_before = os.getloadavg()[0]  # above ~0.5 something else is running, and numbers suffer
    code = code_version()  # now: the file may be edited while this runs, the imported module is not
    t0 = time.perf_counter()
    model_dir = build_checkpoint(args.workdir, shape, name)
    print(f"checkpoint {model_dir} ready in {time.perf_counter() - t0:.1f} s", flush=True)
    prompt = torch.randint(1, shape["vocab_size"], (args.prompt_tokens,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    slots = Runner.slots_for(args.prompt_tokens + args.steps + 1)

    probes, variants = {}, {}  # dtype -> (obs, Switch); (row, variant) -> runner
    for row in rows:
        dtype, compile = ROWS[row]
        if dtype not in probes:
            model = sluice.load(model_dir, dtype)
            obs = sluice.observe(model)  # attached before any Runner exists
            probes[dtype] = (obs, Switch(model, obs))
        runner = Runner(probes[dtype][0].model, compile=compile)
        names = ["plain", "probed"] + (["timed hooks", "no-op hooks"] if args.ablate and not compile else [])
        variants.update({(row, v): runner for v in names})

    def run(key, prompt, steps):
        obs, switch = probes[ROWS[key[0]][0]]
        timers = {} if key[1] == "timed hooks" else None
        switch.set(key[1], timers)
        try:
            return run_once(variants[key], obs if key[1] == "probed" else None, prompt, steps, slots, timers)
        finally:
            switch.set("probed")  # the state observe() left, whatever ran

    # Warmup (untimed): a short prompt into the same number of cache slots, so a compiled step is
    # traced (with and without hooks) for exactly the shapes that are timed.
    errors, warmup_s = {}, {}
    for key in list(variants):
        t0 = time.perf_counter()
        try:
            run(key, prompt[:8], 2)
        except Exception as e:  # noqa: BLE001 - a compile failure is a result to report, not a crash
            errors[" ".join(key)] = f"{type(e).__name__}: {e}"[:500]
            del variants[key]
        warmup_s[key] = time.perf_counter() - t0
        print(f"warmup {' '.join(key)}: {warmup_s[key]:.1f} s", flush=True)

    samples = {key: {"prefill": [], "step": [], "inside": []} for key in variants}
    logits, hooks_ran, untouched = {}, {}, {}
    for rep in range(args.reps):
        for key in variants:  # interleaved: every variant once per repetition
            buf = probes[ROWS[key[0]][0]][0]._buf["resid_rms"]
            before = buf.clone() if key[1] == "plain" else None
            pre, step, lg, changed, inside = run(key, prompt, args.steps)
            if before is not None:  # a plain run that ran the hooked graph would have written here
                untouched[key] = untouched.get(key, True) and torch.equal(before, buf)
            samples[key]["prefill"].append(pre)
            samples[key]["step"].append(step)
            if inside is not None:
                samples[key]["inside"].append(inside)
            if rep == 0:
                logits[key] = lg
            if changed is not None:
                hooks_ran[key] = hooks_ran.get(key, True) and changed
        print(f"rep {rep + 1}/{args.reps} done", flush=True)

    out_rows = []
    for (row, variant), smp in samples.items():
        if (row, "plain") not in samples:
            continue
        base = samples[(row, "plain")]
        pre, step = statistics.median(smp["prefill"]), statistics.median(smp["step"])
        r = {"row": row, "variant": variant, "dtype": ROWS[row][0], "compile": ROWS[row][1],
             "prefill_s": pre, "step_ms": 1e3 * step,
             "prefill_ratio": pre / statistics.median(base["prefill"]),
             "step_ratio": step / statistics.median(base["step"]),
             # per repetition this run / the plain one of the same repetition
             "step_ratio_paired_median": statistics.median(a / b for a, b in zip(smp["step"], base["step"])),
             "prefill_samples_s": smp["prefill"], "step_samples_ms": [1e3 * x for x in smp["step"]],
             "warmup_s": warmup_s[(row, variant)]}
        if variant == "plain":
            r["probe_buffers_untouched"] = untouched[(row, variant)]
        else:
            r["logits_identical"] = torch.equal(logits[(row, variant)], logits[(row, "plain")])
            r["hooks_ran_every_step"] = hooks_ran.get((row, variant))  # None: ablation rows
        if smp["inside"]:
            r["inside_hooks_ms"] = {g: statistics.median(x.get(g, 0.0) for x in smp["inside"]) for g in GROUPS}
        out_rows.append(r)

    result = {"benchmark": "probe_overhead", "quick": args.quick, "checkpoint": str(model_dir),
              "shape": shape, "batch_size": 1, "prompt_tokens": args.prompt_tokens,
              "steps": args.steps, "reps": args.reps, "cache_slots": slots,
              "hooks": next(iter(probes.values()))[1].counts(),
              "load_avg_1m": {"start": load_before, "end": os.getloadavg()[0]},
              **environment(), "code": code, "errors": errors, "rows": out_rows}
    print_table(result)
    save_json(args.json, result)
    return result


def print_table(r: dict) -> None:
    cpu, code = r["cpu"], r["code"]
    print(f"\n### Probe overhead: batch 1, {r['prompt_tokens']}-token prompt, {r['steps']} decode steps "
          f"(median step per run), median of {r['reps']} runs{' (QUICK: smoke test only)' if r['quick'] else ''}\n")
    print(f"CPU: {cpu.get('model', '?')}, {cpu.get('torch_threads')} torch threads, AVX2: {cpu.get('avx2')}, "
          f"AVX-512 bf16: {cpu.get('avx512_bf16')}, AMX bf16: {cpu.get('amx_bf16')}; 1-min load average "
          f"{r['load_avg_1m']['start']:.2f} at start, {r['load_avg_1m']['end']:.2f} at end. probes.py from "
          f"{code['sluice_path']}: {code['probes_last_commit']}"
          f"{' + uncommitted changes' if code['probes_uncommitted_changes'] else ''} (sha256 "
          f"{code['probes_sha256']}); {sum(r['hooks'].values())} hooks "
          f"({', '.join(f'{g} {n}' for g, n in r['hooks'].items())})\n")
    print("| row | variant | decode ms/step | decode overhead | prefill s | prefill overhead "
          "| logits identical | hooks ran every step |")
    print("|---|---|---:|---:|---:|---:|---|---|")
    flag = lambda x: "-" if x is None else ("yes" if x else "NO")
    for row in r["rows"]:
        print(f"| {row['row']} | {row['variant']} | {row['step_ms']:.1f} | {row['step_ratio']:.3f}x "
              f"| {row['prefill_s']:.2f} | {row['prefill_ratio']:.3f}x | {flag(row.get('logits_identical'))} "
              f"| {flag(row.get('hooks_ran_every_step'))} |")
    leaked = [row["row"] for row in r["rows"] if row.get("probe_buffers_untouched") is False]
    print("\nPlain runs left the probe's buffers untouched: "
          + (f"NO ({', '.join(leaked)} ran the hooked graph)" if leaked else "yes"))
    timed = [row for row in r["rows"] if "inside_hooks_ms" in row]
    if timed:
        print("\nms per decode step spent inside the probe's hooks (timed hooks variant), by kind of module:\n")
        print("| row | " + " | ".join(GROUPS) + " | total |")
        print("|---|" + "---:|" * (len(GROUPS) + 1))
        for row in timed:
            ms = row["inside_hooks_ms"]
            print(f"| {row['row']} | " + " | ".join(f"{ms.get(g, 0.0):.1f}" for g in GROUPS) + f" | {sum(ms.values()):.1f} |")
    for key, err in r["errors"].items():
        print(f"FAILED {key}: {err}")


if __name__ == "__main__":
    main()
