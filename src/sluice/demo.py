"""`sluice demo`: what a newcomer sees first. Completions from the bundled model, then its valves."""

from __future__ import annotations

import math
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\n\ndef list_python_files(root):\n",
    "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n",
]
VALVE_PROMPT = "def read_config(path):\n    with open(path) as f:\n"


def valves_table(llm, prompt: str) -> Table:
    from .observatory import ValveProbe
    ids = torch.tensor([llm.tokenizer.encode(prompt)])
    with ValveProbe(llm.model) as probe, torch.inference_mode():
        llm.model(ids)
    s = probe.summary()
    t = Table(title=f"the four valves on {ids.shape[1]} tokens of {prompt.splitlines()[0]!r}",
              title_justify="left")
    t.add_column("where")
    t.add_column("RMS in", justify="right")
    t.add_column("RMS out", justify="right")
    t.add_column("what it shows")
    t.add_row("x_0 embeddings", "", f"{s['residual_rms'][0]:.3f}", "the residual stream starts here")
    for i in range(len(s["attn_norm_in"])):
        t.add_row(f"block {i}: attn norm / mlp norm",
                  f"{s['attn_norm_in'][i]:.2f} / {s['mlp_norm_in'][i]:.2f}",
                  f"{s['attn_norm_out'][i]:.2f} / {s['mlp_norm_out'][i]:.2f}",
                  f"1. input RMSNorm; stream after block: x_{i + 1} RMS {s['residual_rms'][i + 1]:.2f}")
    t.add_row("final norm", f"{s['final_norm_in']:.2f}", f"{s['final_norm_out']:.2f}",
              "3. flattens the stream's growth "
              f"(x_L / x_0 = {s['residual_rms'][-1] / max(s['residual_rms'][0], 1e-12):.1f}x)")
    vocab = llm.model.config.vocab_size
    t.add_row("LM head logits", f"min {s['logit_min']:.2f}", f"max {s['logit_max']:.2f}",
              f"4. softmax over {vocab:,} tokens: log-sum-exp {s['logsumexp']:.2f}")
    t.add_row("next-token softmax", f"H {s['entropy']:.2f} nats", f"top-1 p {s['top1_prob']:.3f}",
              f"entropy of a uniform guess: {math.log(vocab):.2f} nats")
    return t


def run_demo(args) -> int:
    from .cli import _load_llm
    from .sampling import SamplingParams

    console = Console(highlight=False)
    t0 = time.perf_counter()
    llm = _load_llm(args)
    cfg = llm.model.config
    console.print(f"[bold]sluice demo[/bold]: {llm.model_dir.name}, a {cfg.architecture} with "
                  f"{cfg.num_params / 1e6:.1f}M parameters ({cfg.num_layers} layers, hidden "
                  f"{cfg.hidden_size}, vocab {cfg.vocab_size:,}) that sluice trained on the Python "
                  "standard library.\n")
    params = SamplingParams(max_tokens=60, temperature=0.7, top_p=0.95, seed=0,
                            repetition_penalty=1.1)
    for prompt in PROMPTS:
        console.print("[dim]" + "-" * 60 + "[/dim]")
        sys.stdout.write(prompt)
        for delta in llm.stream(prompt, params):
            sys.stdout.write(delta)
            sys.stdout.flush()
        s = llm.last_stats
        console.print(f"\n[dim][{s.generated_tokens} tokens, decode {s.decode_tok_s:.0f} tok/s][/dim]")
    console.print()
    console.print(valves_table(llm, VALVE_PROMPT))
    console.print(f"\n[dim]demo took {time.perf_counter() - t0:.1f} s[/dim]\nnext, try:\n"
                  "  sluice generate --temperature 0 \"def merge_sort(items):\"\n"
                  "  sluice generate --json --max-tokens 32 \"import json\"\n"
                  "  sluice chat\n"
                  "  sluice train --out runs/my-model      # retrain the bundled model from its recipe")
    return 0
