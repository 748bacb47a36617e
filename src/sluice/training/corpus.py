"""Training text: a deterministic file list, a hash-based held-out split, a byte-level BPE, tokens.

The split depends only on each file's relative path, so adding or removing one file never moves
another between train and held-out."""

from __future__ import annotations

import gzip
import hashlib
import lzma
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from ..errors import SluiceError
from .recipe import CorpusSpec, TokenizerSpec


class CorpusError(SluiceError, ValueError):
    """The corpus directory is missing or yields no usable text."""


@dataclass
class Corpus:
    root: Path
    train: list[Path]
    heldout: list[Path]

    @staticmethod
    def read(path: Path) -> str:
        return path.read_bytes().decode("utf-8", errors="replace")

    def texts(self, split: str) -> list[str]:
        return [self.read(p) for p in (self.train if split == "train" else self.heldout)]


def corpus_root(spec: CorpusSpec) -> Path:
    return Path(sysconfig.get_paths()["stdlib"]) if spec.source == "stdlib" else Path(spec.source).expanduser()


def load_corpus(spec: CorpusSpec) -> Corpus:
    root = corpus_root(spec)
    if not root.is_dir():
        raise CorpusError(f"corpus directory {root} does not exist")
    excluded = set(spec.exclude_parts)
    files = sorted(p for p in root.glob(spec.glob)
                   if p.is_file() and not excluded & set(p.relative_to(root).parts[:-1])
                   and p.stat().st_size > 0)
    if not files:
        raise CorpusError(f"corpus {root} has no non-empty files matching {spec.glob!r} "
                          f"(excluding path parts {sorted(excluded)})")
    train, heldout = [], []
    for p in files:
        h = int.from_bytes(hashlib.sha256(p.relative_to(root).as_posix().encode()).digest()[:8], "big")
        (heldout if h % 100 < spec.heldout_percent else train).append(p)
    if not train:
        raise CorpusError(f"corpus {root}: every file fell into the held-out split")
    return Corpus(root, train, heldout)


def train_tokenizer(corpus: Corpus, spec: TokenizerSpec) -> HFTokenizer:
    """Byte-level BPE (GPT-2/Qwen style): any byte sequence is encodable, no unknown token."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, special_tokens=list(spec.special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator((Corpus.read(p) for p in corpus.train), trainer=trainer)
    return tok


def encode_files(tok: HFTokenizer, texts: list[str], sep_id: int) -> np.ndarray:
    """All texts as one uint16 stream, each followed by the end-of-text separator."""
    out: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        out.extend(enc.ids)
        out.append(sep_id)
    return np.asarray(out, dtype=np.uint16 if tok.get_vocab_size() < 65536 else np.int32)


def token_byte_lengths(tok: HFTokenizer) -> np.ndarray:
    """UTF-8 bytes each token stands for (0 for special tokens): the denominator of bits per byte.

    A byte-level BPE piece is spelled in the ByteLevel alphabet, one character per byte."""
    special = {t.content for t in tok.get_added_tokens_decoder().values()}
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    lengths = np.zeros(tok.get_vocab_size(), dtype=np.int64)
    for piece, i in tok.get_vocab().items():
        if piece in special:
            continue
        if not alphabet.issuperset(piece):
            raise CorpusError(f"token {piece!r} is not byte-level: bits per byte need a byte-level BPE")
        lengths[i] = len(piece)
    return lengths


def compression_baselines(texts: list[str]) -> dict[str, float]:
    """Bits per byte of gzip -9 and xz -9e on the texts joined as one stream (their best case)."""
    data = "\n".join(texts).encode("utf-8")
    n = max(len(data), 1)
    return {"bytes": len(data),
            "gzip-9": 8 * len(gzip.compress(data, compresslevel=9, mtime=0)) / n,
            "xz-9e": 8 * len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)) / n}
