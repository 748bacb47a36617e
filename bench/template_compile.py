"""How far real chat templates are from the compile bound (text/template_limits.MAX_TEMPLATE_TOKENS), and what
a template right at the bound costs to compile.

    python bench/template_compile.py --templates DIR --out docs/results/template-compile.json

DIR holds real templates as *.jinja files: llama.cpp's models/templates has ~70 (Gemma, Llama 3.x, Qwen3,
Mistral, DeepSeek, Kimi, gpt-oss, Command R, ...), e.g. from the llama-cpp-python sdist that
../shared/peers/build-llama-cpp.sh unpacks (.peers/sdist/llama_cpp_python-*/vendor/llama.cpp/models/templates).
For each: characters, lexer tokens (as the bound counts them) and whether sluice compiles it. Then, for a few
shapes of hostile template cut to exactly the bound, the seconds and the resident memory that compiling took, each
in a fresh child process (its peak RSS minus what it held before compiling).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from common import save_json

from sluice.benchmarks.common import code_version
from sluice.text import template_limits as lim
from sluice.text.chat_template import compile_template

# Units repeated up to the bound; `~` costs the most per token (the sandbox rewrites each into a measured concat).
SHAPES = {"print": "{{x}}", "concat": "{{x~y}}", "for": "{% for i in x %}{{ i }}{% endfor %}",
          "if": "{% if a %}b{% endif %}", "filter": "{{x|e}}"}

CHILD = """
import json, sys, time
import jinja2
from sluice.text import template_limits as lim
from sluice.text.chat_template import compile_template
unit = sys.argv[1]
env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
per = sum(1 for _ in env.lex(unit))
source = unit * (lim.MAX_TEMPLATE_TOKENS // per)
def status(key):
    return int(next(line for line in open("/proc/self/status") if line.startswith(key)).split()[1])
before, t0 = status("VmRSS"), time.perf_counter()
compile_template(source)
print(json.dumps({"tokens": per * (lim.MAX_TEMPLATE_TOKENS // per), "chars": len(source),
                  "seconds": round(time.perf_counter() - t0, 2), "rss_mib": round((status("VmHWM") - before) / 1024)}))
"""


def tokens(source: str) -> int:
    import jinja2
    return sum(1 for _ in jinja2.Environment(trim_blocks=True, lstrip_blocks=True).lex(source))


def real_templates(folder: Path) -> list[dict]:
    rows = []
    for path in sorted(folder.glob("*.jinja")):
        source = path.read_text(encoding="utf-8")
        try:
            compile_template(source)
            compiled = "ok"
        except Exception as err:  # noqa: BLE001 -- reported, not fatal: a template sluice cannot compile is a finding
            compiled = f"{type(err).__name__}: {err}"
        rows.append({"name": path.stem, "chars": len(source), "tokens": tokens(source), "compiled": compiled})
    return sorted(rows, key=lambda r: r["tokens"])


def at_the_bound() -> dict:
    out = {}
    for name, unit in SHAPES.items():
        p = subprocess.run([sys.executable, "-c", CHILD, unit], capture_output=True, text=True, check=True)
        out[name] = {"unit": unit, **json.loads(p.stdout)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--templates", type=Path, required=True, help="a folder of real *.jinja chat templates")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    real = real_templates(args.templates)
    largest = max(real, key=lambda r: r["tokens"])
    result = {"code": code_version(), "max_template_tokens": lim.MAX_TEMPLATE_TOKENS, "templates": len(real),
              "largest": largest, "headroom": round(lim.MAX_TEMPLATE_TOKENS / largest["tokens"], 1),
              "not_compiled": [r for r in real if r["compiled"] != "ok"], "real": real, "at_the_bound": at_the_bound()}
    for r in real[-5:]:
        print(f"{r['name']:48s} {r['chars']:7,} chars {r['tokens']:6,} tokens  {r['compiled'][:40]}")
    print(f"{len(real)} real templates; the largest has {largest['tokens']:,} tokens, the bound "
          f"{lim.MAX_TEMPLATE_TOKENS:,} ({result['headroom']}x)")
    for name, r in result["at_the_bound"].items():
        print(f"at the bound, {name:7s} {r['tokens']:6,} tokens {r['chars']:7,} chars: {r['seconds']:.2f} s, "
              f"+{r['rss_mib']} MiB")
    save_json(args.out, result)


if __name__ == "__main__":
    main()
