"""Tokenizers: byte-level for the toy model; the real vocabulary comes with its BPE file.

The toy vocabulary: ids 0..255 are the UTF-8 bytes, then the special ids the config names
(bos, eos, pad, media pad). Decoding skips special ids and repairs split UTF-8 sequences.
"""
from __future__ import annotations

from dataclasses import dataclass

from k3jax.config import ConfigError


@dataclass(frozen=True)
class ByteTokenizer:
    bos_id: int = 256
    eos_id: int = 257
    pad_id: int = 511
    vocab_size: int = 512

    def __post_init__(self):
        for name in ("bos_id", "eos_id", "pad_id"):
            v = getattr(self, name)
            if not 256 <= v < self.vocab_size:
                raise ConfigError(f"{name}={v}: special ids must lie in [256, vocab_size={self.vocab_size})")

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    @classmethod
    def for_config(cls, cfg) -> "ByteTokenizer":
        return cls(bos_id=cfg.bos_token_id, eos_id=cfg.eos_token_id, pad_id=cfg.pad_token_id,
                   vocab_size=cfg.vocab_size)


class TiktokenTokenizer:
    """The real vocabulary: a tiktoken BPE file (`tiktoken.model`: one `base64(token) rank`
    per line) plus special tokens in the ids above the BPE ranks.

    `tiktoken` is imported here, not at module import, so the toy path never needs it.
    Specials without a given name are `<|reserved_token_{id}|>` so every id decodes. The
    pre-tokeniser regex is a parameter: pass the one shipped with the checkpoint's
    tokenizer for exact parity; the default splits Han runs, letter words with their
    contractions, digit groups of up to three, punctuation runs and whitespace.
    """
    DEFAULT_PATTERN = "|".join([
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ])

    def __init__(self, bpe_file: str, *, vocab_size: int, bos_id: int, eos_id: int, pad_id: int | None = None,
                 special_names: dict[int, str] | None = None, pattern: str | None = None):
        from k3jax.errors import require
        tiktoken = require("tiktoken", "tokenizer", "the real vocabulary's tokenizer (tokenizer: tiktoken)")
        from tiktoken.load import load_tiktoken_bpe
        ranks = load_tiktoken_bpe(bpe_file)
        n_base = len(ranks)
        if n_base > vocab_size:
            raise ConfigError(f"{bpe_file}: {n_base} BPE ranks exceed vocab_size={vocab_size}")
        names = dict(special_names or {})
        specials = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(n_base, vocab_size)}
        for name, i in (("bos_id", bos_id), ("eos_id", eos_id), ("pad_id", pad_id)):
            if i is not None and not n_base <= i < vocab_size:
                raise ConfigError(f"{name}={i}: special ids must lie in [{n_base}, {vocab_size})")
        self._enc = tiktoken.Encoding(name="k3jax_bpe", pat_str=pattern or self.DEFAULT_PATTERN,
                                      mergeable_ranks=ranks, special_tokens=specials)
        self.n_base, self.vocab_size = n_base, vocab_size
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        # Special-token strings inside user text stay ordinary text: no injected control ids.
        ids = self._enc.encode_ordinary(text)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids if 0 <= int(i) < self.n_base])


def tokenizer_for(cfg, kind: str = "byte", bpe_file: str | None = None, pattern: str | None = None):
    """The tokenizer a train config names: 'byte' (toy) or 'tiktoken' (needs bpe_file)."""
    if kind == "byte":
        return ByteTokenizer.for_config(cfg)
    if kind == "tiktoken":
        if not bpe_file:
            raise ConfigError("tokenizer 'tiktoken' needs data.bpe_file (the checkpoint's tiktoken.model)")
        return TiktokenTokenizer(bpe_file, vocab_size=cfg.vocab_size, bos_id=cfg.bos_token_id,
                                 eos_id=cfg.eos_token_id, pad_id=cfg.pad_token_id, pattern=pattern)
    raise ConfigError(f"unknown tokenizer {kind!r} (expected 'byte' or 'tiktoken')")
