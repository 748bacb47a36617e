"""Training text: a deterministic file list, a hash-based held-out split, a byte-level BPE, tokens.

The split depends only on each file's relative path, so adding or removing one file never moves
another between train and held-out."""

from __future__ import annotations

import gzip
import hashlib
import lzma
import sysconfig
from dataclasses import dataclass, field
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
    # Files under corpus.train_only_parts: training tokens after `train`, nothing else.
    extra: list[Path] = field(default_factory=list)

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
        why = ("is a file, not a directory" if root.is_file() else "is not a directory" if root.exists()
               else "does not exist")
        raise CorpusError(f"corpus directory {root} {why} (corpus.source names a directory, read with corpus.glob)")
    inside = root.resolve()
    excluded, train_only = set(spec.exclude_parts), set(spec.train_only_parts)
    try:  # the recipe already refused absolute and '..' patterns; this catches malformed ones
        matches = sorted(root.glob(spec.glob))
    except (ValueError, NotImplementedError, OSError) as e:
        raise CorpusError(f"corpus.glob {spec.glob!r} cannot be matched in {root}: {e}") from None
    files = []
    for p in matches:
        if excluded & set(p.relative_to(root).parts[:-1]):
            continue
        # A symlink can point anywhere: only what resolves inside the corpus directory is corpus.
        if not p.resolve().is_relative_to(inside):
            raise CorpusError(f"corpus file {p} resolves to {p.resolve()}, outside the corpus directory "
                              f"{inside}; remove the link or narrow corpus.glob")
        if p.is_file() and p.stat().st_size > 0:
            files.append(p)
    if not files:
        raise CorpusError(f"corpus {root} has no non-empty files matching {spec.glob!r} "
                          f"(excluding path parts {sorted(excluded)})")
    train, heldout, extra = [], [], []
    for p in files:
        if train_only & set(p.relative_to(root).parts[:-1]):
            extra.append(p)
            continue
        h = int.from_bytes(hashlib.sha256(p.relative_to(root).as_posix().encode()).digest()[:8], "big")
        (heldout if h % 100 < spec.heldout_percent else train).append(p)
    if not train:
        raise CorpusError(f"corpus {root}: every file fell into the held-out split"
                          + (" or under corpus.train_only_parts" if extra else ""))
    return Corpus(root, train, heldout, extra)


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
    """All texts as one token stream, each followed by the end-of-text separator."""
    return encode_paths(tok, texts, sep_id)[0]


# Text encoded per call: an Encoding keeps ids, offsets, masks and token strings (~100 bytes a token),
# so encoding a whole corpus at once costs tens of times its size; a chunk bounds that.
CHUNK_CHARS = 4 << 20


def encode_paths(tok: HFTokenizer, items, sep_id: int) -> tuple[np.ndarray, int]:
    """Files (paths, read one at a time) or texts as one token stream, each followed by the separator,
    in chunks of about CHUNK_CHARS characters; also the UTF-8 bytes of the text encoded."""
    dtype = np.uint16 if tok.get_vocab_size() < 65536 else np.int32
    parts, chunk, size, nbytes = [], [], 0, 0

    def flush():
        for enc in tok.encode_batch(chunk, add_special_tokens=False):
            parts.append(np.asarray([*enc.ids, sep_id], dtype=dtype))
        chunk.clear()

    for item in items:
        text = item if isinstance(item, str) else Corpus.read(item)
        nbytes += len(text.encode("utf-8"))
        chunk.append(text)
        size += len(text)
        if size >= CHUNK_CHARS:
            flush()
            size = 0
    flush()
    return (np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)), nbytes


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
