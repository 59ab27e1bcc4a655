"""Tokenizers: byte-level for the toy model; the real vocabulary comes with its BPE file.

The toy vocabulary: ids 0..255 are the UTF-8 bytes, then the special ids the config names
(bos, eos, pad, media pad). Decoding skips special ids and repairs split UTF-8 sequences.
"""
from __future__ import annotations

from dataclasses import dataclass


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
                raise ValueError(f"{name}={v}: special ids must lie in [256, vocab_size={self.vocab_size})")

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    @classmethod
    def for_config(cls, cfg) -> "ByteTokenizer":
        return cls(bos_id=cfg.bos_token_id, eos_id=cfg.eos_token_id, pad_id=cfg.pad_token_id,
                   vocab_size=cfg.vocab_size)
