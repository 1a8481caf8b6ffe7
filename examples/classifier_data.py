"""A text-classification task that ships with Python.

The task: which standard-library package (asyncio, email, importlib, xml) a piece of prose comes
from, a docstring paragraph or a block of comments. The text is read from this Python's own
library sources with ``ast`` and ``tokenize`` (nothing is imported or downloaded) and split
into words (a 2048-word vocabulary). Much of it names its topic ("the event loop", "the
message header"), much does not ("Return True if the object is ..."), so a good model gets
about four in five of the held-out paragraphs: 80.9% with the recipe of ``classifier_training.py``,
averaged over seeds 0-4 (80.0-81.9%) on Python 3.11.

Label ``i`` is ``PACKAGES[i]``; :func:`load_task` returns the stratified train and held-out
splits as ``zerojax.models.classifier`` batches (``{"tokens", "length", "label"}``) and the
vocabulary; :func:`pretraining_tokens` is the text the backbone is pretrained on (the prose of
the library's top-level modules: ``argparse.py``, ``typing.py``, ..., none of the task's
packages, so no held-out text is seen). The recipe is in ``classifier_training.py``.

Everything is deterministic for a given Python version (the library's text differs a little
between versions).
"""
from __future__ import annotations

import ast
import collections
import functools
import glob
import hashlib
import io
import os
import re
import tokenize
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from zerojax.models.classifier import SEQ_LEN, VOCAB, Data

PACKAGES = ("asyncio", "email", "importlib", "xml")
MIN_CHARS = 40
_SKIP_DIRS = ("test", "tests", "idle_test", "__pycache__")


def _library_root() -> str:
    return os.path.dirname(os.__file__)


def _paragraphs(path: str) -> List[str]:
    """The prose of one source file, whitespace collapsed: its docstring paragraphs (module,
    class, function), then its comment blocks (consecutive ``#`` lines), each of MIN_CHARS or more."""
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        tree = ast.parse(source)
        comments = [t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT]
    except (SyntaxError, UnicodeDecodeError, ValueError, tokenize.TokenError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            out += re.split(r"\n\s*\n", ast.get_docstring(node) or "")
    block, last_line = [], -2
    for tok in comments:
        if tok.start[0] != last_line + 1 and block:
            out.append(" ".join(block))
            block = []
        block.append(tok.string.lstrip("#"))
        last_line = tok.start[0]
    out.append(" ".join(block))
    return [p for p in (" ".join(p.split()) for p in out) if len(p) >= MIN_CHARS]


def _package_paragraphs(package: str) -> List[str]:
    top = os.path.join(_library_root(), package)
    if not os.path.isdir(top):
        raise FileNotFoundError(f"the standard library package {package!r} is not under {_library_root()}; "
                                f"choose packages among those present (default {PACKAGES})")
    out = []
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                out += _paragraphs(os.path.join(dirpath, name))
    return out


_WORD = re.compile(r"[a-z]+|[0-9]+|[^\sa-z0-9]")
PAD, UNK, END = 0, 1, 2  # reserved ids: padding, a word outside the vocabulary, end of a paragraph


def words(text: str) -> List[str]:
    """Lower-cased words, numbers and single punctuation marks."""
    return _WORD.findall(text.lower())


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@functools.lru_cache(maxsize=None)
def _pretraining_paragraphs() -> Tuple[str, ...]:
    paras = []
    for path in sorted(glob.glob(os.path.join(_library_root(), "*.py"))):
        paras += _paragraphs(path)
    return tuple(paras)


@functools.lru_cache(maxsize=None)
def vocabulary(size: int = VOCAB) -> Tuple[str, ...]:
    """The ``size`` tokens: ``<pad>``, ``<unk>``, ``<end>``, then the most frequent words of the
    pretraining text (ties in alphabetical order); the id of a word is its index."""
    counts = collections.Counter(w for p in _pretraining_paragraphs() for w in words(p))
    ranked = sorted(counts, key=lambda w: (-counts[w], w))
    return ("<pad>", "<unk>", "<end>") + tuple(ranked[:size - 3])


def encode(text: str, vocab: Sequence[str]) -> List[int]:
    """Token ids of ``text`` (``UNK`` for words outside ``vocab``)."""
    return _encoder(vocab)(text)


def _encoder(vocab: Sequence[str]) -> Callable[[str], List[int]]:
    index = {w: i for i, w in enumerate(vocab)}
    return lambda text: [index.get(w, UNK) for w in words(text)]


def _rows(seqs: Sequence[Tuple[int, ...]], labels: Sequence[int], seq_len: int) -> Data:
    tokens = np.zeros((len(seqs), seq_len), np.int32)
    lengths = np.zeros((len(seqs),), np.int32)
    for i, ids in enumerate(seqs):
        tokens[i, :len(ids)] = ids
        lengths[i] = len(ids)
    return {"tokens": tokens, "length": lengths, "label": np.asarray(labels, np.int32)}


def load_task(seq_len: int = SEQ_LEN, packages: Sequence[str] = PACKAGES, heldout_fraction: float = 0.25,
              per_class: Optional[int] = None, vocab_size: int = VOCAB
              ) -> Tuple[Data, Data, int, Tuple[str, ...]]:
    """``(train, heldout, num_classes, vocab)``: docstring paragraphs labelled by package.

    Each paragraph is its first ``seq_len`` tokens of :func:`vocabulary` (``vocab``, a tuple of
    words whose index is the id); a token sequence found in two packages is dropped, one found
    twice in a package kept once. Classes are balanced to ``per_class`` examples (default: the
    smallest class) and split per class by a hash of the text, so both splits are stratified,
    deterministic and disjoint. Label ``i`` is ``packages[i]``.
    """
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"heldout_fraction={heldout_fraction!r} must be in (0, 1)")
    vocab = vocabulary(vocab_size)
    to_ids = _encoder(vocab)
    owners: Dict[Tuple[int, ...], set] = {}
    text_of: Dict[Tuple[int, ...], str] = {}
    for label, package in enumerate(packages):
        for para in _package_paragraphs(package):
            ids = tuple(to_ids(para)[:seq_len])
            owners.setdefault(ids, set()).add(label)
            text_of.setdefault(ids, para)
    by_class: List[List[Tuple[int, ...]]] = [[] for _ in packages]
    for ids, labels in owners.items():
        if len(labels) == 1:
            by_class[labels.pop()].append(ids)
    for seqs in by_class:
        seqs.sort(key=lambda ids: digest(text_of[ids]))
    n = min(len(t) for t in by_class) if per_class is None else per_class
    if n < 10 or any(len(t) < n for t in by_class):
        raise ValueError(f"too few paragraphs for {n} per class: {[len(t) for t in by_class]} in {list(packages)}")
    n_held = max(1, round(n * heldout_fraction))
    train, held = [], []
    for label, seqs in enumerate(by_class):
        for i, ids in enumerate(seqs[:n]):
            (held if i < n_held else train).append((ids, label))
    train.sort(key=lambda pair: digest(text_of[pair[0]]))  # interleave the classes
    return (_rows(*zip(*train), seq_len), _rows(*zip(*held), seq_len), len(packages), vocab)


def pretraining_tokens(vocab_size: int = VOCAB) -> np.ndarray:
    """The docstrings of the library's top-level modules (``*.py`` directly under it, none of the
    task's packages), in file order, as one stream of ids, each paragraph followed by ``END``."""
    to_ids = _encoder(vocabulary(vocab_size))
    ids = []
    for para in _pretraining_paragraphs():
        ids += to_ids(para) + [END]
    return np.asarray(ids, np.int32)


__all__ = ["END", "MIN_CHARS", "PACKAGES", "PAD", "UNK", "digest", "encode", "load_task", "pretraining_tokens",
           "vocabulary", "words"]
