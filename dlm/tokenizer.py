"""Tokenizers (HF `tokenizers`), with the special tokens every paradigm needs.

Two kinds are trained by dlm, both saved as a plain tokenizer.json so checkpoints stay uniform:
  byte-level BPE   (`Tokenizer.train`) for code and text: the default
  characters       (`Tokenizer.train_chars`, `dlm train --tokenizer char`) for tasks with a small
                   alphabet (sudoku: one token per cell): one token per character seen in the corpus,
                   `<unk>` for any other; a BPE model without merges, so decode(encode(s)) == s

dlm's own tokenizers reserve, at ids 0..15:
  <pad> <bos> <eos> <mask>            padding, document start/end, the absorbing-diffusion mask
  <fim_prefix> <fim_suffix> <fim_middle> <fill>   infilling / template fill markers
  <reserved_0> .. <reserved_7>        kept free for later paradigms (chat roles, separators)

Any HF `tokenizer.json` can be used instead; its specials are found by their usual names.
A model may end text with several tokens (Gemma 4: <eos> and <end_of_turn>): `eos_ids` holds them all, the first
being `eos_id`, the one written after documents and used as padding. tokenizer.json cannot say which they are; a
checkpoint records them in its config.json (`tokenizer.eos_ids`, set by `use_eos_ids`), an imported model takes
them from its generation_config.json or config.json (`eos_token_id`, an id or a list).
Special-token strings inside ordinary text are encoded as text (never as control tokens).

A prompt is encoded as transformers' `tokenizer(prompt)["input_ids"]` encodes it: with the tokens the tokenizer's
post-processor puts around a text (the <bos> a Llama, Mistral or Gemma tokenizer.json adds; dlm's own tokenizers add
none). A piece of text that continues other ids (a suffix, a scored continuation, a training document) is encoded
alone (`specials=False`). Output text is decoded as transformers' `decode(ids, skip_special_tokens=True)`: without
the special tokens (`text`).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from dlm.errors import DlmError

SPECIALS = [
    "<pad>", "<bos>", "<eos>", "<mask>",
    "<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<fill>",
    *[f"<reserved_{i}>" for i in range(8)],
]

CHAR_UNK = "<unk>"  # the character tokenizer's token for a character it has not seen

# names used by other tokenizers for the same roles, in order of preference
_ALIASES = {
    "eos": ["<eos>", "<|endoftext|>", "</s>", "<|end_of_text|>", "<|im_end|>", "<|eot_id|>", "[SEP]"],
    "bos": ["<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>", "[CLS]"],
    "pad": ["<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>"],
    "mask": ["<mask>", "<|mask|>", "[MASK]", "<|MASK|>"],
    "fim_prefix": ["<fim_prefix>", "<|fim_prefix|>"],
    "fim_suffix": ["<fim_suffix>", "<|fim_suffix|>"],
    "fim_middle": ["<fim_middle>", "<|fim_middle|>"],
    "fill": ["<fill>", "<|fill|>"],
}


class Tokenizer:
    """A thin wrapper: encode/decode plus the ids of the special tokens."""

    def __init__(self, tk: HFTokenizer, source: str = "<memory>"):
        self.tk = tk
        self.tk.encode_special_tokens = True  # "<eos>" typed in a text is text, not an end of document
        self.tk.no_padding()
        self.tk.no_truncation()
        self.source = source
        self._lead: list[int] | None = None
        ids = {role: self._find(names) for role, names in _ALIASES.items()}
        if ids["eos"] is None:
            raise DlmError(f"tokenizer {source}: no end-of-text token (looked for {_ALIASES['eos']})")
        self.eos_id: int = ids["eos"]
        self.eos_ids: tuple[int, ...] = (self.eos_id,)  # every id that ends text (use_eos_ids); the first is eos_id
        self.eos_set: frozenset[int] = frozenset(self.eos_ids)  # the same as a set: what the samplers stop at
        self._found_eos = self.eos_id
        self.bos_id: int = ids["bos"] if ids["bos"] is not None else self.eos_id
        self.pad_id: int = ids["pad"] if ids["pad"] is not None else self.eos_id
        self.mask_id: int | None = ids["mask"]
        self.fim_prefix_id = ids["fim_prefix"]
        self.fim_suffix_id = ids["fim_suffix"]
        self.fim_middle_id = ids["fim_middle"]
        self.fill_id = ids["fill"]

    def _find(self, names: list[str]) -> int | None:
        for n in names:
            i = self.tk.token_to_id(n)
            if i is not None:
                return i
        return None

    def use_eos_ids(self, ids) -> Tokenizer:
        """End text at any of `ids` (an id or a list, as transformers' eos_token_id); the first becomes eos_id."""
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.vocab_size
                              for i in ids):
            raise DlmError(f"EOS ids must be token ids of the tokenizer, in [0, {self.vocab_size}), got {ids!r}"[:240])
        self.eos_ids = tuple(ids)  # in the order given (an export writes them back as they were)
        self.eos_set = frozenset(self.eos_ids)
        self.eos_id = self.eos_ids[0]
        return self

    @property
    def eos_record(self) -> list[int] | None:
        """The EOS ids a checkpoint records beside tokenizer.json: None when they are the one tokenizer.json names."""
        return None if self.eos_ids == (self._found_eos,) else list(self.eos_ids)

    @property
    def hf_eos_token_id(self) -> int | list[int]:
        """eos_token_id as transformers' config.json and generation_config.json hold it: an id, or the list."""
        return self.eos_id if len(self.eos_ids) == 1 else list(self.eos_ids)

    # construction ---------------------------------------------------------------------------
    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 4096) -> Tokenizer:
        if vocab_size < 256 + len(SPECIALS) + 1:
            raise DlmError(f"--vocab-size must be >= {256 + len(SPECIALS) + 1} (bytes + specials), got {vocab_size}")
        tk = HFTokenizer(models.BPE())
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tk.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        )
        tk.train_from_iterator(texts, trainer=trainer)
        return cls(tk, source=f"trained(vocab={vocab_size})")

    @classmethod
    def train_chars(cls, texts: Iterable[str]) -> Tokenizer:
        """One token per character of the corpus (specials first, then `<unk>`, then the characters in order)."""
        chars: set[str] = set()
        for t in texts:
            chars.update(t)
        if not chars:
            raise DlmError("--tokenizer char: the corpus has no characters to build a vocabulary from")
        specials = [*SPECIALS, CHAR_UNK]
        vocab = {tok: i for i, tok in enumerate(specials)}
        for ch in sorted(chars):
            vocab.setdefault(ch, len(vocab))
        tk = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token=CHAR_UNK))
        tk.decoder = decoders.Fuse()  # characters join without spaces
        tk.add_special_tokens(specials)
        return cls(tk, source=f"chars(vocab={len(vocab)})")

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Tokenizer:
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise DlmError(f"tokenizer file not found: {p}")
        try:  # read here, not by the library: a path need not be UTF-8 (the library takes str paths only)
            tk = HFTokenizer.from_str(p.read_bytes().decode("utf-8"))
        except Exception as e:  # the tokenizers library raises a plain Exception on bad JSON
            raise DlmError(f"{p}: not a valid tokenizer.json ({str(e).splitlines()[0][:200]})") from None
        return cls(tk, source=str(p))

    def save(self, path: str | os.PathLike) -> None:
        """Write tokenizer.json atomically."""
        p = Path(path)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")  # the temporary names every dlm write uses
        tmp.write_text(self.tk.to_str(pretty=True), encoding="utf-8")  # (the library's save takes UTF-8 paths only)
        os.replace(tmp, p)

    def to_json(self) -> str:
        return self.tk.to_str()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    # use ------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, specials: bool = True) -> list[int]:
        """A prompt's ids, as transformers' `tokenizer(text)["input_ids"]`: the text's tokens with what the
        post-processor puts around them (a <bos>); specials=False: the text's own tokens alone (a piece)."""
        return self.tk.encode(text, add_special_tokens=specials).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Pieces (documents, continuations): each text's own tokens, nothing around them."""
        return [e.ids for e in self.tk.encode_batch(texts, add_special_tokens=False)]

    def encode_tail(self, text: str, n: int) -> list[int]:
        """A prompt cut to its last n ids (n >= 1), the post-processor's lead (a <bos>) kept in front."""
        lead = self.lead_ids[:max(n - 1, 0)]
        ids = self.encode(text, specials=False)
        return lead + ids[len(ids) - (n - len(lead)):] if len(lead) + len(ids) > n else self.encode(text)

    @property
    def lead_ids(self) -> list[int]:
        """The ids the post-processor puts before every text (a Llama or Gemma tokenizer's [<bos>]; [] for most)."""
        if self._lead is None:
            e = self.tk.encode("a", add_special_tokens=True)
            first = next((i for i, s in enumerate(e.sequence_ids) if s is not None), len(e.ids))
            self._lead = e.ids[:first]
        return list(self._lead)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special)

    def text(self, ids: Iterable[int]) -> str:
        """Output text, as transformers' `decode(ids, skip_special_tokens=True)`: the special tokens left out."""
        return self.tk.decode(list(ids), skip_special_tokens=True)

    @property
    def special_ids(self) -> set[int]:
        return {i for i in (self.pad_id, self.bos_id, *self.eos_ids, self.mask_id, self.fim_prefix_id,
                            self.fim_suffix_id, self.fim_middle_id, self.fill_id) if i is not None}

    def hf_config(self) -> dict:
        """tokenizer_config.json for transformers' AutoTokenizer. No add_bos_token / add_eos_token: tokenizer.json's
        post-processor says what goes around a text (transformers 5 rebuilds it from those keys when both are given)."""
        def tok(i: int | None) -> str | None:
            return None if i is None else self.tk.id_to_token(i)
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": tok(self.bos_id), "eos_token": tok(self.eos_id), "pad_token": tok(self.pad_id),
            "mask_token": tok(self.mask_id), "unk_token": None,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1 << 30, "split_special_tokens": True,
        }

