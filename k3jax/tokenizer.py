"""Tokenizers: byte-level for the toy model; the real vocabulary comes with its BPE file.

Both share one interface: `encode(text, bos, eos)` for plain documents, `encode_segment(text,
special)` for chat segments (k3jax.chat: markup segments may hold special-token names, text
segments never do), `decode(ids, specials=False)`, and `specials` (name -> id).

The toy vocabulary: ids 0..255 are the UTF-8 bytes, then the special ids the config names
(bos, eos, pad), then K3's chat tokens in `CHAT_TOKENS` order on the lowest free ids (the toy
preset: 258 `<|media_pad|>`, 259 `<|end_of_msg|>`, 260..262 `<|open|>` `<|close|>` `<|sep|>`,
263..265 the media brackets), so XTML markup is one id per marker as in K3.

The real vocabulary: `tiktoken.model` (163,584 BPE ranks) plus K3's 256 reserved ids named by
`k3_special_tokens.json` (CHAT_FORMAT.md §1), split by K3's pre-tokenizer regex.
"""
from __future__ import annotations

import functools
import itertools
import json
import os
import re
from dataclasses import dataclass, field

# K3's XTML markers and image tokens (CHAT_FORMAT.md §1, §3).
END_OF_MSG, OPEN, CLOSE, SEP = "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>"
MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD = ("<|media_begin|>", "<|media_content|>", "<|media_end|>",
                                                    "<|media_pad|>")
# The byte tokenizer's chat ids follow this order; <|media_pad|> first so the toy preset's
# media_placeholder_token_id (258) is the first free id.
CHAT_TOKENS = (MEDIA_PAD, END_OF_MSG, OPEN, CLOSE, SEP, MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END)

# TikTokenTokenizer.pat_str of the K3 release (tiktoken syntax: `&&` intersects classes).
K3_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
# The release encodes at most this many characters per tiktoken call, and cuts any run of
# whitespace or of non-whitespace longer than MAX_RUN (tiktoken's BPE is quadratic in it).
MAX_CHUNK, MAX_RUN = 400_000, 25_000
# Chat segments are mostly short and repeat (markers, tag names, attribute pieces): their ids
# are remembered, which makes rendered conversations several times faster to encode.
_CACHE_CHARS, _CACHE_SIZE = 48, 1 << 16


class _SegmentCache:
    def __init__(self, encode):
        self.encode, self.ids = encode, {}

    def __call__(self, text: str, special: bool) -> list[int]:
        if len(text) > _CACHE_CHARS:
            return self.encode(text, special)
        key = (text, special)
        ids = self.ids.get(key)
        if ids is None:
            if len(self.ids) >= _CACHE_SIZE:
                self.ids.clear()
            ids = self.ids[key] = tuple(self.encode(text, special))
        return list(ids)


@functools.lru_cache(maxsize=1)
def k3_special_tokens() -> list[dict]:
    """The 256 reserved ids of K3's vocabulary: [{'id', 'name', 'special'}], ids 163584..163839."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "k3_special_tokens.json")
    with open(path, encoding="utf-8") as f:
        table = json.load(f)["tokens"]
    if len(table) != 256:
        raise ValueError(f"{path}: expected 256 reserved tokens, found {len(table)}")
    return table


def _specials_pattern(names) -> re.Pattern:
    # longest first, so a name that is a prefix of another never wins
    return re.compile("|".join(re.escape(n) for n in sorted(names, key=len, reverse=True)))


@dataclass(frozen=True)
class ByteTokenizer:
    bos_id: int = 256
    eos_id: int = 257
    pad_id: int = 511
    vocab_size: int = 512
    media_pad_id: int | None = None     # None: the first free id (the toy preset's 258)
    specials: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        for name in ("bos_id", "eos_id", "pad_id", "media_pad_id"):
            v = getattr(self, name)
            if v is not None and not 256 <= v < self.vocab_size:
                raise ValueError(f"{name}={v}: special ids must lie in [256, vocab_size={self.vocab_size})")
        specials = {"[BOS]": self.bos_id, "[EOS]": self.eos_id, "[PAD]": self.pad_id}
        if self.media_pad_id is not None:
            specials[MEDIA_PAD] = self.media_pad_id
        free = (i for i in range(256, self.vocab_size) if i not in specials.values())
        for name in CHAT_TOKENS:
            if name not in specials:
                nxt = next(free, None)
                if nxt is None:     # a vocabulary too small for chat: plain text still works
                    break
                specials[name] = nxt
        object.__setattr__(self, "specials", specials)
        object.__setattr__(self, "_names", {i: n for n, i in specials.items()})
        object.__setattr__(self, "_split", _specials_pattern(specials))
        object.__setattr__(self, "_segment", _SegmentCache(self._encode_segment))

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_segment(self, text: str, special: bool) -> list[int]:
        """One chat segment: with `special`, special-token names become their ids."""
        return self._segment(text, special)

    def _encode_segment(self, text: str, special: bool) -> list[int]:
        if not special:
            return list(text.encode("utf-8"))
        out, pos = [], 0
        for m in self._split.finditer(text):
            out += text[pos:m.start()].encode("utf-8")
            out.append(self.specials[m.group()])
            pos = m.end()
        return out + list(text[pos:].encode("utf-8"))

    def token_id(self, name: str) -> int:
        if name not in self.specials:
            raise KeyError(f"{name!r} has no id in this byte vocabulary (vocab_size={self.vocab_size}); "
                           f"chat needs {len(CHAT_TOKENS)} free ids above 255")
        return self.specials[name]

    def decode(self, ids, specials: bool = False) -> str:
        """Text of ids; special ids are skipped, or with `specials` written as their names."""
        out = []
        for is_byte, run in itertools.groupby((int(i) for i in ids), key=lambda i: 0 <= i < 256):
            if is_byte:
                out.append(bytes(run).decode("utf-8", errors="replace"))
            elif specials:
                out.extend(self._names.get(i, "") for i in run)
        return "".join(out)

    @classmethod
    def for_config(cls, cfg) -> "ByteTokenizer":
        """The byte tokenizer of a ModelConfig, or of a K3Config (whose media_placeholder_token_id
        then fixes `<|media_pad|>`)."""
        media = None
        if hasattr(cfg, "text"):
            media = cfg.top.get("media_placeholder_token_id")
            cfg = cfg.text
        return cls(bos_id=cfg.bos_token_id, eos_id=cfg.eos_token_id, pad_id=cfg.pad_token_id,
                   vocab_size=cfg.vocab_size, media_pad_id=media if media is not None and media < cfg.vocab_size
                   else None)


def split_long_runs(text: str, max_run: int = MAX_RUN):
    """`text` in pieces, each holding no run of whitespace or of non-whitespace longer than
    `max_run`: a longer run is cut every `max_run` characters from its start."""
    if len(text) <= max_run:
        yield text
        return
    start, pos = 0, 0
    for _, run in itertools.groupby(text, key=str.isspace):
        n = sum(1 for _ in run)
        for cut in range(pos + max_run, pos + n, max_run):
            yield text[start:cut]
            start = cut
        pos += n
    yield text[start:]


class TiktokenTokenizer:
    """The real vocabulary: a tiktoken BPE file (`tiktoken.model`: one `base64(token) rank`
    per line) plus special tokens in the ids above the BPE ranks.

    `tiktoken` is imported here, not at module import, so the toy path never needs it.
    Specials take K3's names by their offset above the BPE ranks (`k3_special_tokens`), or
    `special_names` {id: name}; others are `<|reserved_token_{id}|>`, so every id decodes.
    `bpe_file` may be a checkpoint directory holding `tiktoken.model`. The pre-tokenizer
    regex defaults to K3's (`K3_PATTERN`); bos / eos / pad default to K3's `[BOS]`,
    `<|end_of_msg|>` (config.json's eos_token_id) and `[PAD]`.
    """
    DEFAULT_PATTERN = K3_PATTERN

    def __init__(self, bpe_file: str, *, vocab_size: int | None = None, bos_id: int | None = None,
                 eos_id: int | None = None, pad_id: int | None = None,
                 special_names: dict[int, str] | None = None, pattern: str | None = None):
        try:
            import tiktoken
            from tiktoken.load import load_tiktoken_bpe
        except ImportError as e:  # a clear message instead of a bare ModuleNotFoundError
            raise ImportError("the real-vocabulary tokenizer needs `pip install tiktoken`") from e
        bpe_file = os.fspath(bpe_file)
        if os.path.isdir(bpe_file):
            bpe_file = os.path.join(bpe_file, "tiktoken.model")
        if not os.path.isfile(bpe_file):
            raise FileNotFoundError(f"BPE file {bpe_file!r} not found (the checkpoint's tiktoken.model)")
        ranks = load_tiktoken_bpe(bpe_file)
        n_base = len(ranks)
        vocab_size = n_base + 256 if vocab_size is None else vocab_size
        if n_base > vocab_size:
            raise ValueError(f"{bpe_file}: {n_base} BPE ranks exceed vocab_size={vocab_size}")
        names = {n_base + k: t["name"] for k, t in enumerate(k3_special_tokens())
                 if not t["name"].startswith("<|reserved_token_")}
        names.update(special_names or {})
        specials = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(n_base, vocab_size)}
        if len(specials) != vocab_size - n_base:
            raise ValueError(f"{bpe_file}: special token names are not unique")
        default = {"bos_id": "[BOS]", "eos_id": END_OF_MSG, "pad_id": "[PAD]"}
        given = {"bos_id": bos_id, "eos_id": eos_id, "pad_id": pad_id}
        for name, i in given.items():
            if i is None:
                given[name] = i = specials.get(default[name])
            if i is not None and not n_base <= i < vocab_size:
                raise ValueError(f"{name}={i}: special ids must lie in [{n_base}, {vocab_size})")
        self._enc = tiktoken.Encoding(name="k3jax_bpe", pat_str=pattern or self.DEFAULT_PATTERN,
                                      mergeable_ranks=ranks, special_tokens=specials)
        self.n_base, self.vocab_size, self.specials = n_base, vocab_size, specials
        self.bos_id, self.eos_id, self.pad_id = given["bos_id"], given["eos_id"], given["pad_id"]
        self._names = {i: n for n, i in specials.items()}
        self._segment = _SegmentCache(self._encode)

    def _encode(self, text: str, special: bool) -> list[int]:
        out = []
        for c in range(0, len(text), MAX_CHUNK):
            for piece in split_long_runs(text[c:c + MAX_CHUNK]):
                out += self._enc.encode(piece, allowed_special="all") if special else self._enc.encode_ordinary(piece)
        return out

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        # Special-token strings inside user text stay ordinary text: no injected control ids.
        ids = self._encode(text, special=False)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_segment(self, text: str, special: bool) -> list[int]:
        """One chat segment, as the release's tokenizer encodes it: markup segments with every
        special-token name allowed, text segments with none."""
        return self._segment(text, special)

    def token_id(self, name: str) -> int:
        if name not in self.specials:
            raise KeyError(f"{name!r} is not a special token of this vocabulary")
        return self.specials[name]

    def decode(self, ids, specials: bool = False) -> str:
        """Text of ids; special ids are skipped, or with `specials` written as their names."""
        out = []
        for is_base, run in itertools.groupby((int(i) for i in ids), key=lambda i: 0 <= i < self.n_base):
            if is_base:
                out.append(self._enc.decode(list(run)))
            elif specials:
                out.extend(self._names.get(i, "") for i in run)
        return "".join(out)


def tokenizer_for(cfg, kind: str = "auto", bpe_file: str | None = None, pattern: str | None = None):
    """The tokenizer a train config names: 'byte' (toy), 'tiktoken' (needs bpe_file: the
    checkpoint's tiktoken.model or its directory) or 'auto' (tiktoken when bpe_file is set).
    `cfg`: a ModelConfig, or a K3Config (the byte tokenizer then takes its media pad id)."""
    if kind == "auto":
        kind = "tiktoken" if bpe_file else "byte"
    if kind == "byte":
        return ByteTokenizer.for_config(cfg)
    if kind == "tiktoken":
        if not bpe_file:
            raise ValueError("tokenizer 'tiktoken' needs data.bpe_file (the checkpoint's tiktoken.model)")
        text = getattr(cfg, "text", cfg)
        return TiktokenTokenizer(bpe_file, vocab_size=text.vocab_size, bos_id=text.bos_token_id,
                                 eos_id=text.eos_token_id, pad_id=text.pad_token_id, pattern=pattern)
    raise ValueError(f"unknown tokenizer {kind!r} (expected 'auto', 'byte' or 'tiktoken')")
