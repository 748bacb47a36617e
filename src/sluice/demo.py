"""`sluice demo`: what a newcomer sees first. Completions from the bundled model, then its valves."""

from __future__ import annotations

import math
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

# No trailing newline: the tokenizer learned "\n" + indentation as one token, so a prompt that ends
# in a bare "\n" token is one the model never saw in training and continues badly.
PROMPTS = [
    "def fibonacci(n):",
    "import os\n\n\ndef list_python_files(root):",
    "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):",
]
VALVE_PROMPT = "def read_config(path):\n    with open(path) as f:\n"


def valves_table(llm, prompt: str) -> Table:
    """The four valves of the source article, measured by the observatory on one forward of `prompt`."""
    from .observatory import observe
    ids = torch.tensor([llm.tokenizer.encode(prompt)])
    with observe(llm.model) as obs, torch.inference_mode():
        llm.model(ids)
    s = obs.summary()
    rms = s["residual_rms"]
    vocab = llm.model.config.vocab_size
    t = Table(title=f"the four valves, {ids.shape[1]} tokens of {prompt.splitlines()[0]!r} "
                    "(RMS over the hidden size, mean over tokens)", title_justify="left")
    for name in ("", "1. attn norm in -> out", "1. mlp norm in -> out", "2. residual stream"):
        t.add_column(name, justify="right" if name else "left")
    t.add_row("embeddings", "", "", f"x_0 {rms[0]:.3f}")
    for i in range(len(s["attn_norm_in"])):
        t.add_row(f"block {i}", f"{s['attn_norm_in'][i]:.2f} -> {s['attn_norm_out'][i]:.2f}",
                  f"{s['mlp_norm_in'][i]:.2f} -> {s['mlp_norm_out'][i]:.2f}", f"x_{i + 1} {rms[i + 1]:.2f}")
    t.add_row("3. final norm", f"{s['final_norm_in']:.2f} -> {s['final_norm_out']:.2f}", "",
              f"grew {rms[-1] / max(rms[0], 1e-12):.0f}x")
    t.caption = (f"4. LM head: logits in [{s['logit_min']:.2f}, {s['logit_max']:.2f}], log-sum-exp "
                 f"{s['logsumexp']:.2f}; softmax over {vocab:,} tokens: entropy {s['entropy']:.2f} nats "
                 f"(uniform {math.log(vocab):.2f}), top-1 p {s['top1_prob']:.3f}")
    t.caption_justify = "left"
    return t


def run_demo(llm) -> int:
    """Stream completions from `llm` (the CLI loads it), then print its valves table."""
    from .engine.sampling import SamplingParams

    console = Console(highlight=False)
    t0 = time.perf_counter()
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
                  "  sluice inspect \"def read_config(path):\" --out report/   # every valve, plots, HTML\n"
                  "  sluice train --out runs/my-model      # retrain the bundled model from its recipe")
    return 0
