"""A run's data/ directory: tokenizer.json, train.npy, heldout.npy, data.json.

Built once per run (data.json, written last and atomically, marks it complete) and reused on
--resume, where every file is checked before training trusts it: a token id past the vocabulary
would index out of the embedding, a short held-out stream would make the evaluation measure nothing."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from . import budget
from .corpus import (CHUNK_CHARS, CorpusError, compression_baselines, encode_paths, load_corpus,
                     train_tokenizer)
from .recipe import reused_tokenizer, tokenizer_file


def prepare_data(recipe, data_dir: Path, log) -> dict:
    """Tokenizer + token streams, built once per run directory."""
    meta_path = data_dir / "data.json"
    if meta_path.is_file():
        return _read_meta(meta_path)
    data_dir.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus(recipe.corpus)
    sizes = [p.stat().st_size for p in corpus.train + corpus.extra + corpus.heldout]
    budget.check(budget.data_bytes(sum(sizes), max(sizes), CHUNK_CHARS), f"the corpus {corpus.root}",
                 "train on a subset (corpus.glob, corpus.exclude_parts) or split the largest files")
    log(f"corpus {corpus.root}: {len(corpus.train)} train files"
        + (f" + {len(corpus.extra)} train-only files" if corpus.extra else "")
        + f", {len(corpus.heldout)} held-out files")
    t0 = time.perf_counter()
    if recipe.tokenizer.source == "train":
        tok = train_tokenizer(corpus, recipe.tokenizer)
        tok.save(str(data_dir / "tokenizer.json"))
    else:  # copied, not re-saved: the run's tokenizer.json is byte-identical to the one it reuses
        tok = reused_tokenizer(recipe.tokenizer, recipe.path)
        shutil.copyfile(tokenizer_file(recipe.tokenizer), data_dir / "tokenizer.json")
        log(f"tokenizer: {tokenizer_file(recipe.tokenizer)} ({tok.get_vocab_size()} tokens), reused")
    sep = tok.token_to_id(recipe.tokenizer.special_tokens[0])
    train_ids, train_bytes = encode_paths(tok, corpus.train + corpus.extra, sep)
    held_texts = corpus.texts("heldout")
    held_ids, held_bytes = encode_paths(tok, held_texts, sep)
    np.save(data_dir / "train.npy", train_ids)
    np.save(data_dir / "heldout.npy", held_ids)
    meta = {"root": str(corpus.root), "train_files": len(corpus.train) + len(corpus.extra),
            "train_only_files": len(corpus.extra),
            "heldout_files": len(corpus.heldout), "train_bytes": train_bytes, "heldout_bytes": held_bytes,
            "train_tokens": int(train_ids.size), "heldout_tokens": int(held_ids.size),
            "vocab_size": tok.get_vocab_size(), "sep_id": sep,
            "baselines": compression_baselines(held_texts) if held_texts else {},
            "tokenizer_seconds": round(time.perf_counter() - t0, 1)}
    tmp = meta_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, meta_path)
    log(f"tokenizer + encoding: {meta['train_tokens']:,} train tokens "
        f"({meta['train_bytes'] / max(meta['train_tokens'], 1):.2f} bytes/token), "
        f"{meta['heldout_tokens']:,} held-out tokens")
    return meta


def _read_meta(path: Path) -> dict:
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CorpusError(f"{path} is unreadable ({e}); delete the run's data/ directory to rebuild it") from None
    ints = ("train_files", "heldout_files", "train_bytes", "heldout_bytes", "train_tokens",
            "heldout_tokens", "vocab_size", "sep_id")
    bad = [k for k in ints if not isinstance(meta.get(k) if isinstance(meta, dict) else None, int)
           or isinstance(meta[k], bool) or meta[k] < 0]
    if bad:
        raise CorpusError(f"{path}: {bad} must be integers >= 0; delete the run's data/ directory to rebuild it")
    return meta


def load_data(recipe, data_dir: Path, meta: dict) -> tuple[np.ndarray, np.ndarray, HFTokenizer]:
    """The token streams and tokenizer of data/, each checked against data.json and the recipe."""
    try:
        tok = HFTokenizer.from_file(str(data_dir / "tokenizer.json"))
    except Exception as e:  # tokenizers raises a bare Exception for a malformed file
        raise CorpusError(f"{data_dir / 'tokenizer.json'} is not a readable tokenizer ({e})") from None
    source = recipe.tokenizer.source
    if source != "train":  # on --resume: the tokenizer reused must still be the one the run began with
        reused = tokenizer_file(recipe.tokenizer)
        if (data_dir / "tokenizer.json").read_bytes() != reused.read_bytes():
            raise CorpusError(f"{data_dir / 'tokenizer.json'} differs from tokenizer.source {source!r} "
                              f"({reused}), which changed since this run began; start a new --out")
    vocab = meta["vocab_size"]
    if vocab != tok.get_vocab_size() or vocab > recipe.tokenizer.vocab_size or meta["sep_id"] >= vocab:
        raise CorpusError(f"{data_dir / 'data.json'}: vocab_size {vocab} / sep_id {meta['sep_id']} disagree "
                          f"with tokenizer.json ({tok.get_vocab_size()} tokens) or the recipe's "
                          f"tokenizer.vocab_size ({recipe.tokenizer.vocab_size})")
    streams = []
    for name, key in (("train.npy", "train_tokens"), ("heldout.npy", "heldout_tokens")):
        path = data_dir / name
        try:
            ids = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise CorpusError(f"{path} is not a readable token array ({e})") from None
        if ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.size != meta[key]:
            raise CorpusError(f"{path}: expected {meta[key]} integer token ids, found {ids.dtype} "
                              f"{tuple(ids.shape)}")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise CorpusError(f"{path}: token ids must be in [0, {vocab}), found "
                              f"[{int(ids.min())}, {int(ids.max())}]")
        streams.append(np.ascontiguousarray(ids))
    train_ids, held_ids = streams
    t = recipe.train
    if train_ids.size <= t.seq_len + 1:
        raise CorpusError(f"corpus too small: {train_ids.size} training tokens for train.seq_len {t.seq_len}")
    if held_ids.size < t.seq_len + 1:  # evaluate() needs one whole window, or it measures nothing
        raise CorpusError(f"the held-out split has {held_ids.size} tokens, fewer than one evaluation "
                          f"window (train.seq_len + 1 = {t.seq_len + 1}); raise corpus.heldout_percent "
                          f"or add files")
    return train_ids, held_ids, tok
