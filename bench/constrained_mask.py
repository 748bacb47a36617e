"""What constrained decoding costs per token, for the three libraries made for it: llguidance, xgrammar and
outlines-core, on the bundled model's vocabulary (8,192) and a Qwen3-sized byte-level BPE one (151,936,
random_checkpoint.write_tokenizer's), for a JSON Schema (nested objects, arrays, enums, a $ref) and a regex.

    .venv/bin/python bench/constrained_mask.py --json docs/results/constrained-mask.json

Per library and vocabulary, vocab_setup_s: seconds to read the vocabulary (once per engine); then per constraint:
- compile: seconds from the constraint's text to a matcher ready for its first mask (the grammar built
  against the vocabulary; caches off), the median of --compiles;
- per token: one decode step's work on the host, the next-token bitmask computed and the matcher
  advanced by a token, walked along a valid output (the JSON text of a sample instance, tokenized):
  microseconds, the median, mean and 90th percentile over every step of --repeats walks (llguidance
  builds its lexer's states lazily, as masks need them: the mean and p90 carry that, the compile not);
- allowed: how many tokens the masks allowed along the walk, summed: libraries that agree on the
  language agree on this number (a cross-check of correctness; where one differs, its JSON options do).
A library that is not installed is recorded as such (xgrammar is not a dependency of sluice: it needs
transformers and triton at run time; install it by hand to measure it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common import environment, save_json
from random_checkpoint import write_tokenizer
from sluice.observatory.disturbance import LoadWatch

SCHEMA = {
    "$defs": {"address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                          "required": ["street", "city", "zip"], "additionalProperties": False}},
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
        "home": {"$ref": "#/$defs/address"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "scores": {"type": "array", "items": {"type": "object", "properties": {"game": {"type": "string"},
                                                                               "points": {"type": "number"}},
                                              "required": ["game", "points"], "additionalProperties": False}},
    },
    "required": ["name", "age", "role", "home", "tags", "scores"],
    "additionalProperties": False,
}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "role": "admin",
            "home": {"street": "12 St James's Square", "city": "London", "zip": "10001"},
            "tags": ["math", "engines", "poetry"],
            "scores": [{"game": "chess", "points": 12.5}, {"game": "go", "points": 7}]}
REGEX = r"[A-Z][a-z]{2,9} [0-9]{1,3}(, [A-Z][a-z]{2,9} [0-9]{1,3}){0,4}\."
REGEX_TEXT = "Alpha 12, Bravo 7, Charlie 130."
CASES = {"json_schema": (SCHEMA, json.dumps(INSTANCE, separators=(",", ":"))), "regex": (REGEX, REGEX_TEXT)}


def token_bytes(tokenizer_json: str) -> tuple[list[bytes], list[int], object]:
    """Each id's bytes (byte-level BPE symbols mapped back to bytes), the special ids, and the tokenizer."""
    from tokenizers import Tokenizer, pre_tokenizers
    tok = Tokenizer.from_str(tokenizer_json)
    back = {c: i for i, c in enumerate(_byte_symbols(pre_tokenizers))}
    specials = sorted(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
    out = []
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        s = tok.id_to_token(i)
        out.append(b"" if i in specials else bytes(back[c] for c in s) if all(c in back for c in s) else s.encode())
    return out, specials, tok


def _byte_symbols(pre_tokenizers) -> list[str]:
    """GPT-2's bytes_to_unicode order: symbol k stands for byte k."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer_json, vocab, eos):
        import llguidance as llg
        self.llg, self.tok = llg, llg.LLTokenizer(tokenizer_json, n_vocab=len(vocab), eos_token=eos)

    def build(self, kind, spec):
        m = self.llg.LLMatcher
        return m.grammar_from_json_schema(spec, overrides={"whitespace_flexible": False}) if kind == "json_schema" \
            else m.grammar_from_regex(spec)

    def matcher(self, grammar):  # llguidance compiles against the vocabulary here, lazily as masks need it
        matcher = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def step(self, matcher, token):
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        ok = matcher.consume_token(token)
        return bits, ok


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_json, vocab, eos):
        import xgrammar as xgr
        self.xgr = xgr
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[eos])
        self.info, self.bitmask = info, xgr.allocate_token_bitmask(1, len(vocab))

    def build(self, kind, spec):
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        return compiler.compile_json_schema(spec, any_whitespace=False, separators=(",", ":")) \
            if kind == "json_schema" else compiler.compile_regex(spec)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def step(self, matcher, token):
        matcher.fill_next_token_bitmask(self.bitmask)
        return self.bitmask[0].numpy().view(np.uint8), matcher.accept_token(token)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer_json, vocab, eos):
        import outlines_core as oc
        self.oc = oc
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab):
            if b and i != eos:
                by_bytes.setdefault(b, []).append(i)
        self.vocabulary = oc.Vocabulary(eos, by_bytes)
        self.mask = np.zeros((len(vocab) + 31) // 32, dtype=np.int32)

    def build(self, kind, spec):
        from outlines_core.json_schema import build_regex_from_schema
        regex = build_regex_from_schema(json.dumps(spec), whitespace_pattern="") if kind == "json_schema" else spec
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, index):
        return self.oc.Guide(index)

    def step(self, guide, token):
        guide.write_mask_into(self.mask.ctypes.data, self.mask.size, 4)
        bits = self.mask.view(np.uint8)
        ok = bool((bits[token // 8] >> (token % 8)) & 1)
        if ok:
            guide.advance(token, return_tokens=False)
        return bits, ok


LIBRARIES = [Llguidance, Xgrammar, OutlinesCore]


def vocabularies(tmp: Path) -> dict[str, str]:
    import sluice.model.loading as loading
    big = tmp / "qwen-sized"
    big.mkdir()
    write_tokenizer(big, 151_936, 151_643)
    # keys: the vocabulary sizes (the bundled model's tokenizer; write_tokenizer's byte-level BPE)
    return {"vocab_8192": (loading.bundled_model_dir() / "tokenizer.json").read_text(),
            "vocab_151936": (big / "tokenizer.json").read_text()}


def measure(lib_cls, tokenizer_json: str, compiles: int, repeats: int) -> dict:
    vocab, specials, tok = token_bytes(tokenizer_json)
    eos = specials[0] if specials else 0
    try:
        t0 = time.perf_counter()
        lib = lib_cls(tokenizer_json, vocab, eos)
    except ImportError as e:
        return {"error": f"not installed: {e}"}
    out = {"vocab_setup_s": time.perf_counter() - t0}  # once per engine: the vocabulary as the library reads it
    for kind, (spec, text) in CASES.items():
        ids = tok.encode(text, add_special_tokens=False).ids
        times = []
        for _ in range(compiles):
            t0 = time.perf_counter()
            compiled = lib.build(kind, spec)
            lib.step(lib.matcher(compiled), ids[0])  # the first mask is part of getting ready (lazy builds)
            times.append(time.perf_counter() - t0)
        per_token, allowed, legal = [], 0, True
        for r in range(repeats):
            matcher = lib.matcher(compiled)
            for t in ids:
                t0 = time.perf_counter()
                bits, ok = lib.step(matcher, t)
                per_token.append(time.perf_counter() - t0)
                legal = legal and ok and bool((bits[t // 8] >> (t % 8)) & 1)
                if r == 0:
                    allowed += int(np.unpackbits(bits, bitorder="little")[: len(vocab)].sum())
        out[kind] = {"compile_s": statistics.median(times), "tokens": len(ids),
                     "per_token_us": 1e6 * statistics.median(per_token),
                     "per_token_p90_us": 1e6 * sorted(per_token)[int(0.9 * len(per_token))],
                     "per_token_mean_us": 1e6 * statistics.fmean(per_token),
                     "allowed_along_walk": allowed, "walk_legal": legal}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--compiles", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    import importlib.metadata as md
    env = environment()
    versions = {}
    for lib in ("llguidance", "xgrammar", "outlines-core"):
        try:
            versions[lib] = md.version(lib)
        except md.PackageNotFoundError:
            versions[lib] = None
    result = {"env": env, "libraries": versions, "compiles": args.compiles, "repeats": args.repeats, "results": {}}
    watch = LoadWatch()  # who else used the CPU, as the other benchmarks record it (observatory/disturbance.py)
    with tempfile.TemporaryDirectory() as tmp:
        for vname, tj in vocabularies(Path(tmp)).items():
            for lib in LIBRARIES:
                r = measure(lib, tj, args.compiles, args.repeats)
                result["results"].setdefault(vname, {})[lib.name] = r
                print(vname, lib.name, json.dumps(r), file=sys.stderr, flush=True)
    load = watch.result()
    result.update(loadavg_at_end=load["loadavg_at_end"], disturbed=load["disturbed"], load=load)
    save_json(args.json, result)


if __name__ == "__main__":
    main()
