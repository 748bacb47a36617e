"""`sluice demo`: what a newcomer sees first. Completions from the bundled model, then its valves."""

from __future__ import annotations

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
    from .observatory.tables import valves_table as table
    ids = torch.tensor([llm.tokenizer.encode(prompt)], device=llm.device)
    with observe(llm.model) as obs, torch.inference_mode():
        llm.model(ids)
    return table(obs.summary(), ids.shape[1], llm.model.config.vocab_size)


def run_demo(llm) -> int:
    """Stream completions from `llm` (the CLI loads it), then print its valves table."""
    from .engine import fast_step, select
    from .engine.sampling import SamplingParams

    # Look for the kernels the demo's steps use before anything is printed, so that a first run's one line
    # about building them (engine/native/extension.py, on stderr) stands alone, not inside a completion.
    fast_step.why_unavailable(), select.why_unavailable()
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
