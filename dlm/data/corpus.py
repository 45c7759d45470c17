"""Corpora and their deterministic train/val/test split by file.

A corpus is a list of named documents:
  stdlib          the running interpreter's standard library (.py files; tests and site-packages left out)
  FILE.jsonl      one document per line, from its "text" field; a "prompt" field that starts the text
                  marks the rest as the response (`dlm distill` writes both): training then reads the
                  response tokens only (TrainConfig.prompt_loss)
  FILE.csv        sudoku puzzles in the public layout (`quizzes,solutions`): one document per puzzle,
                  QUIZ=SOLUTION (dlm.data.csvtask)
  FILE (other)    a text file, cut into documents of CHUNK_LINES lines
  DIR             every UTF-8 text file below it (hidden entries skipped)

A document's split is a function of its name alone (a hash), so a held-out file stays held out
whatever else is added to the corpus.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterator

from dlm.errors import DlmError

SPLITS = ("train", "val", "test")
VAL_FRACTION = 0.03
TEST_FRACTION = 0.03
CHUNK_LINES = 120
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass(frozen=True)
class Document:
    name: str
    path: Path | None = None  # read lazily from here ...
    text_: str | None = None  # ... or held in memory
    line: int = 0  # first line of a chunk of a text file
    prompt_chars: int = 0  # a prompted document (.jsonl "prompt"): text[:prompt_chars] is the prompt

    @property
    def text(self) -> str:
        if self.text_ is not None:
            return self.text_
        assert self.path is not None
        return self.path.read_bytes().decode("utf-8", errors="replace")


def split_of(name: str) -> str:
    h = int.from_bytes(hashlib.sha1(name.encode()).digest()[:8], "big") / 2**64
    if h < TEST_FRACTION:
        return "test"
    if h < TEST_FRACTION + VAL_FRACTION:
        return "val"
    return "train"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


class Corpus:
    """Documents of one source, with a key that changes when the source does."""

    def __init__(self, spec: str):
        self.spec = spec
        if spec == "stdlib":
            self.kind = "stdlib"
            self.root = stdlib_root()
        else:
            p = Path(spec).expanduser()
            if not p.exists():
                raise DlmError(f"--data: no such file or directory: {spec} (use 'stdlib', a text file, a folder or a .jsonl)")
            if not (p.is_dir() or p.is_file()):  # a device or a pipe: /dev/zero would never end
                raise DlmError(f"--data {spec}: not a regular file or a folder")
            self.root = p.resolve()
            self.kind = "dir" if p.is_dir() else {".jsonl": "jsonl", ".csv": "csv"}.get(p.suffix.lower(), "text")
        if not self.documents:
            raise DlmError(f"--data {spec}: the corpus is empty (no documents with text found)")

    @cached_property
    def documents(self) -> list[Document]:
        if self.kind == "stdlib":
            return [Document(str(f.relative_to(self.root)), path=f) for f in self._walk(self.root, "*.py")]
        if self.kind == "dir":
            docs = []
            for f in self._walk(self.root, "*"):
                try:
                    with open(f, "rb") as fh:
                        head = fh.read(8192)
                except OSError:  # unreadable (permissions, a file that went away): not a document
                    continue
                if b"\0" in head:
                    continue
                try:
                    head.decode("utf-8")
                except UnicodeDecodeError as e:
                    if e.start < len(head) - 4:  # a multibyte char cut at the end of the probe is fine
                        continue
                docs.append(Document(str(f.relative_to(self.root)), path=f))
            return [d for d in docs if d.text.strip()]
        if self.kind == "jsonl":
            return self._jsonl()
        if self.kind == "csv":
            from dlm.data.csvtask import pair_text, read_pairs

            return [Document(f"{self.root.name}:{i}", text_=pair_text(q, s), line=i)
                    for i, (q, s) in enumerate(read_pairs(self.root, "--data"), start=2)]
        return self._text_chunks()

    def _walk(self, root: Path, pattern: str) -> list[Path]:
        out = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
            for fn in sorted(filenames):
                if fn.startswith(".") or not Path(fn).match(pattern):
                    continue
                f = Path(dirpath) / fn
                try:
                    if f.is_file() and f.stat().st_size > 0:
                        out.append(f)
                except OSError:  # (a link /proc or the permissions will not let us follow)
                    continue
        return out

    def _jsonl(self) -> list[Document]:
        docs = []
        with open(self.root, "rb") as fh:
            for i, raw in enumerate(fh, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DlmError(f"--data {self.spec}: line {i} is not UTF-8 text (byte {raw[e.start]:#04x} at "
                                   f"column {e.start + 1})") from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DlmError(f"--data {self.spec}: line {i} is not valid JSON ({e.msg})") from None
                if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                    raise DlmError(f"--data {self.spec}: line {i} has no string field 'text'")
                prompt = row.get("prompt", "")
                if not isinstance(prompt, str) or not row["text"].startswith(prompt):
                    raise DlmError(f"--data {self.spec}: line {i}: its 'prompt' must be a string that starts "
                                   "its 'text' (the rest is the response)")
                if row["text"].strip():
                    docs.append(Document(f"{self.root.name}:{i}", text_=row["text"], line=i,
                                         prompt_chars=len(prompt)))
        return docs

    def _text_chunks(self) -> list[Document]:
        lines = self.root.read_bytes().decode("utf-8", errors="replace").splitlines(keepends=True)
        docs = []
        for start in range(0, len(lines), CHUNK_LINES):
            text = "".join(lines[start:start + CHUNK_LINES])
            if text.strip():
                docs.append(Document(f"{self.root.name}:{start + 1}", text_=text, line=start + 1))
        return docs

    @cached_property
    def key(self) -> str:
        """Identity of the corpus contents, for the token cache."""
        h = hashlib.sha256(f"{self.kind}:{self.root}:{sys.version_info[:2] if self.kind == 'stdlib' else ''}".encode())
        if self.kind in ("stdlib", "dir"):
            for d in self.documents:
                st = d.path.stat()
                h.update(f"{d.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        else:
            st = self.root.stat()
            h.update(f"{st.st_size}\0{st.st_mtime_ns}".encode())
        return h.hexdigest()[:16]

    @cached_property
    def prompted(self) -> bool:
        """Whether documents mark a prompt (.jsonl rows with a non-empty "prompt"): losses may read responses only."""
        return self.kind == "jsonl" and any(d.prompt_chars for d in self.documents)

    def split(self, split: str) -> list[Document]:
        if split not in SPLITS:
            raise DlmError(f"--split must be one of {list(SPLITS)}, got {split!r}")
        docs = [d for d in self.documents if split_of(d.name) == split]
        if not docs and split != "train":
            # a corpus too small for the hash buckets: hold out its last document(s) by hash order
            ranked = sorted(self.documents, key=lambda d: hashlib.sha1(d.name.encode()).digest())
            if len(ranked) >= 3:
                docs = [ranked[0] if split == "test" else ranked[1]]
        if not docs:
            raise DlmError(f"--data {self.spec}: the {split} split is empty ({len(self.documents)} documents in all)")
        return docs

    def train_docs(self) -> list[Document]:
        held = {d.name for s in ("val", "test") for d in self.split(s)}
        return [d for d in self.documents if d.name not in held]

    def docs(self, split: str) -> list[Document]:
        return self.train_docs() if split == "train" else self.split(split)

    def texts(self, split: str) -> Iterator[str]:
        for d in self.docs(split):
            yield d.text
