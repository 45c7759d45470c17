"""Tokenize once into a memory-mapped cache; pack into fixed-length sequences; held-out prompts.

The cache lives in $DLM_CACHE (default ~/.cache/dlm), one folder per (corpus, tokenizer) pair,
one .npy per split: every document's tokens followed by <eos>. With a FIM rate (AR training,
`fim_document`), that fraction of the documents is stored in fill-in-the-middle order instead, in
a file of its own per (rate, seed). A prompted corpus (`Corpus.prompted`: a `dlm distill` .jsonl)
stores its prompts and responses tokenized apart, and beside the tokens a .resp.npy of flags: 1 where a
token is response (its <eos> included), 0 where it is prompt. Files are written under a temporary name
and renamed, so a killed run never leaves a half-written cache behind.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dlm.data.corpus import Corpus
from dlm.errors import DlmError
from dlm.tokenizer import Tokenizer


def cache_dir() -> Path:
    return Path(os.environ.get("DLM_CACHE", Path.home() / ".cache" / "dlm"))


def token_file(corpus: Corpus, tok: Tokenizer, split: str, fim_rate: float = 0.0, seed: int = 0) -> Path:
    key = hashlib.sha256(f"{corpus.key}:{tok.sha256}".encode()).hexdigest()[:20]
    name = f"{split}.fim{fim_rate:g}-{seed}" if fim_rate > 0 else split
    if corpus.prompted:  # prompt and response tokenized apart: not the tokens of a plain corpus
        name += ".pr"
    return cache_dir() / key / f"{name}.npy"


def flag_file(tokens: Path) -> Path:
    return tokens.with_name(f"{tokens.stem}.resp.npy")


def fim_markers(tok: Tokenizer) -> tuple[int, int, int]:
    ids = (tok.fim_prefix_id, tok.fim_suffix_id, tok.fim_middle_id)
    if any(i is None for i in ids):
        raise DlmError(f"tokenizer {tok.source} has no fill-in-the-middle markers (<fim_prefix> <fim_suffix> "
                       "<fim_middle>): use --fim-rate 0")
    return ids  # type: ignore[return-value]


def fim_prompt_ids(tok: Tokenizer, prefix: list[int], suffix: list[int]) -> list[int]:
    """What an AR model trained with FIM continues with the middle: <fim_prefix> P <fim_suffix> S <fim_middle>."""
    pre, suf, mid = fim_markers(tok)
    return [pre, *prefix, suf, *suffix, mid]


def fim_document(tok: Tokenizer, text: str, rng: np.random.Generator) -> list[int]:
    """One document in FIM order (PSM, Bavarian et al. 2022): cut at two uniformly random characters into
    prefix, middle, suffix; <fim_prefix> prefix <fim_suffix> suffix <fim_middle> middle. The <eos> that
    follows every document then ends the middle, so a model learns where a middle stops."""
    a, b = sorted(int(x) for x in rng.integers(0, len(text) + 1, size=2))
    return fim_prompt_ids(tok, tok.encode(text[:a], specials=False), tok.encode(text[b:], specials=False)) + \
        tok.encode(text[a:b], specials=False)


def load_tokens(corpus: Corpus, tok: Tokenizer, split: str, fim_rate: float = 0.0, seed: int = 0) -> np.ndarray:
    """All tokens of a split, documents separated by <eos>, memory-mapped.

    fim_rate > 0: each document, with that probability (seeded by (seed, its name)), in FIM order."""
    path = token_file(corpus, tok, split, fim_rate, seed)
    if path.exists() and not (_readable(path) and (not corpus.prompted or _readable_flags(path))):
        path.unlink()  # damaged (cut short by a full disk, say): rebuilt from the corpus
    if not path.exists():
        docs = corpus.docs(split)
        dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
        if fim_rate > 0:
            fim_markers(tok)
        chunks, flags = [], []
        for i in range(0, len(docs), 256):
            part = docs[i:i + 256]
            texts = [d.text for d in part]  # (a stdlib document is read from disk at each .text)
            prompts = tok.encode_batch([t[:d.prompt_chars] for d, t in zip(part, texts)]) if corpus.prompted \
                else [[] for _ in part]
            for d, text, pre, ids in zip(part, texts, prompts,
                                         tok.encode_batch([t[d.prompt_chars:] for d, t in zip(part, texts)])):
                n_prompt = len(pre)
                ids = pre + ids
                if fim_rate > 0:
                    rng = np.random.default_rng([seed, int.from_bytes(hashlib.sha1(d.name.encode()).digest()[:8], "big")])
                    if rng.random() < fim_rate:
                        ids, n_prompt = fim_document(tok, text, rng), 0  # no prompt left to tell apart
                chunks.append(np.asarray(ids + [tok.eos_id], dtype=dtype))
                flags.append(np.arange(len(ids) + 1) >= n_prompt)
        arr = np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)
        path.parent.mkdir(parents=True, exist_ok=True)
        if corpus.prompted:  # the flags first: tokens on disk imply their flags are there
            tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.resp.npy")
            np.save(tmp, np.concatenate(flags).astype(np.uint8) if flags else np.zeros(0, dtype=np.uint8))
            os.replace(tmp, flag_file(path))
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npy")
        np.save(tmp, arr)
        os.replace(tmp, path)
        meta = {"corpus": corpus.spec, "corpus_key": corpus.key, "tokenizer": tok.sha256, "split": split,
                "documents": len(docs), "tokens": int(arr.size), "fim_rate": fim_rate, "seed": seed}
        tmp = path.with_name(f".{path.stem}.json.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, path.with_name(f"{path.stem}.json"))
    return np.load(path, mmap_mode="r", allow_pickle=False)


def load_flags(corpus: Corpus, tok: Tokenizer, split: str, fim_rate: float = 0.0, seed: int = 0) -> np.ndarray | None:
    """The response flags of a prompted corpus' split (uint8, aligned with load_tokens'), or None."""
    if not corpus.prompted:
        return None
    load_tokens(corpus, tok, split, fim_rate, seed)
    return np.load(flag_file(token_file(corpus, tok, split, fim_rate, seed)), mmap_mode="r", allow_pickle=False)


def _readable_flags(path: Path) -> bool:
    try:
        flags = np.load(flag_file(path), mmap_mode="r", allow_pickle=False)
        return flags.ndim == 1 and flags.dtype == np.uint8 and flags.size == np.load(path, mmap_mode="r").size
    except (OSError, ValueError, EOFError):
        return False


def _readable(path: Path) -> bool:
    """Whether a cached split reads back as the 1-D token array its .json describes."""
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
        meta = json.loads(path.with_name(path.stem + ".json").read_text())
        return arr.ndim == 1 and arr.dtype in (np.uint16, np.uint32) and int(meta["tokens"]) == arr.size
    except (OSError, ValueError, EOFError, KeyError, TypeError):  # ValueError: a cut header or body, or bad JSON
        return False


@dataclass
class Batches:
    """Fixed-length windows of seq_len + 1 tokens, in a seeded order that depends only on the step.

    Batch s holds windows s*B .. s*B + B - 1 of an endless stream of epochs, each epoch a fresh
    permutation; so resuming at step s needs no saved loader state.
    """

    tokens: np.ndarray
    seq_len: int
    batch_size: int
    seed: int = 0
    flags: np.ndarray | None = None  # a prompted corpus' response flags (load_flags), aligned with tokens
    where: str = "the corpus split"  # what the tokens are, in an error: "--data FILE, its val split"

    def __post_init__(self) -> None:
        self.n = (len(self.tokens) - 1) // self.seq_len
        if self.n < 1:
            raise DlmError(f"{self.where} has {len(self.tokens)} tokens: too few for one sequence of --seq-len "
                           f"{self.seq_len}")
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.n)}
        return self._perms[epoch]

    def window(self, i: int, of: np.ndarray | None = None) -> np.ndarray:
        s = i * self.seq_len
        return np.asarray((self.tokens if of is None else of)[s:s + self.seq_len + 1], dtype=np.int64)

    def _indices(self, step: int) -> list[int]:
        return [int(self._perm(g // self.n)[g % self.n]) for g in range(step * self.batch_size, (step + 1) * self.batch_size)]

    def _rows(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = torch.from_numpy(np.stack([self.window(i) for i in idx]))  # (B, seq_len + 1)
        if self.flags is None:
            return x, None
        return x, torch.from_numpy(np.stack([self.window(i, self.flags) for i in idx])).bool()

    def batch(self, step: int) -> torch.Tensor:
        return self._rows(self._indices(step))[0]

    def batch_sup(self, step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Batch `step` and its response flags (bool, same shape; None for a corpus without prompts)."""
        return self._rows(self._indices(step))

    def sequential(self, max_batches: int | None = None, sup: bool = False):
        """Every window once, in order (evaluation); with sup, (windows, response flags or None) pairs."""
        for k, i in enumerate(range(0, self.n, self.batch_size)):
            if max_batches is not None and k >= max_batches:
                return
            rows = self._rows(list(range(i, min(i + self.batch_size, self.n))))
            yield rows if sup else rows[0]


class PairedBatches:
    """Two streams read side by side (joint --dlm-data): batch s is (B, 2, seq_len + 1), row b pairing window b
    of `first`'s batch s with window b of `second`'s; the flags likewise (True where a stream has none), or None
    when neither stream has flags. Pairing along dim 1 keeps the rows that data parallelism slices whole."""

    def __init__(self, first: Batches, second: Batches):
        self.first, self.second = first, second

    @staticmethod
    def _pair(a: tuple[torch.Tensor, torch.Tensor | None],
              b: tuple[torch.Tensor, torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = min(a[0].shape[0], b[0].shape[0])  # the last validation batches of two splits may differ in rows
        x = torch.stack([a[0][:n], b[0][:n]], dim=1)
        if a[1] is None and b[1] is None:
            return x, None
        flags = [torch.ones_like(r[0][:n], dtype=torch.bool) if r[1] is None else r[1][:n] for r in (a, b)]
        return x, torch.stack(flags, dim=1)

    def batch(self, step: int) -> torch.Tensor:
        return self.batch_sup(step)[0]

    def batch_sup(self, step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._pair(self.first.batch_sup(step), self.second.batch_sup(step))

    def sequential(self, max_batches: int | None = None, sup: bool = False):
        for a, b in zip(self.first.sequential(max_batches, sup=True), self.second.sequential(max_batches, sup=True)):
            rows = self._pair(a, b)
            yield rows if sup else rows[0]


@dataclass
class Prompt:
    name: str  # document and line it was cut from
    text: str
    reference: str  # what followed in the document


def heldout_prompts(corpus: Corpus, split: str = "test", n: int = 8, prompt_chars: int = 240,
                    reference_chars: int = 400, seed: int = 0) -> list[Prompt]:
    """Snippets of held-out documents, each cut at a line start, with the text that followed.

    Deterministic for (corpus, split, n, seed); prefers code over blank or comment-only stretches.
    """
    rng = np.random.default_rng(seed)
    docs = sorted(corpus.split(split), key=lambda d: hashlib.sha1(d.name.encode()).digest())
    out: list[Prompt] = []
    for d in docs:
        lines = d.text.splitlines(keepends=True)
        starts = [i for i in range(len(lines)) if lines[i].strip() and not lines[i].lstrip().startswith("#")]
        if len(lines) < 8 or not starts:
            continue
        for _ in range(4):  # a few tries for a window with enough text after it
            i = int(starts[rng.integers(len(starts))])
            text = ""
            j = i
            while j < len(lines) and len(text) + len(lines[j]) <= prompt_chars:
                text += lines[j]
                j += 1
            ref = "".join(lines[j:])[:reference_chars]
            if len(text) >= prompt_chars // 3 and len(ref) >= reference_chars // 4:
                out.append(Prompt(f"{d.name}:{i + 1}", text, ref))
                break
        if len(out) == n:
            break
    if not out:
        raise DlmError(f"--data {corpus.spec}: no usable prompts in the {split} split")
    return out
