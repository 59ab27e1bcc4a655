"""Chat data throughput: render + per-segment tokenize (+ the SFT mask) of a JSONL file, in
tokens/s, beside one plain encode of each conversation's whole rendered text (what a Jinja
template path costs; wrong for K3, shown as the yardstick), all in one run.

    python benchmarks/chat_tokenize.py [FILE.jsonl] [--copies N] [--bpe tiktoken.model]

Default data: data/chat_sample.jsonl repeated --copies times. Without --bpe the tiktoken
rows use a small BPE learned here from data/corpus.txt (a few hundred merges), so their
absolute speed is only indicative of the real 163,584-rank vocabulary.
"""
from __future__ import annotations

import argparse
import base64
import collections
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from k3jax.chat import render, sft_example, tokenize  # noqa: E402
from k3jax.chat.packing import read_conversations  # noqa: E402
from k3jax.tokenizer import ByteTokenizer, TiktokenTokenizer  # noqa: E402


def learn_bpe(text: bytes, merges: int) -> list[bytes]:
    """Greedy byte-pair merges over whitespace-split words (a toy BPE for the benchmark)."""
    words = collections.Counter(text.split())
    seqs = {w: [bytes([b]) for b in w] for w in words}
    ranks = [bytes([i]) for i in range(256)]
    for _ in range(merges):
        pairs = collections.Counter()
        for w, seq in seqs.items():
            for a, b in zip(seq, seq[1:]):
                pairs[a, b] += words[w]
        if not pairs:
            break
        (a, b), _ = pairs.most_common(1)[0]
        ranks.append(a + b)
        for w, seq in seqs.items():
            out, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and seq[i] == a and seq[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            seqs[w] = out
    return ranks


def timed(fn, rows):
    t = time.perf_counter()
    n = sum(fn(r) for r in rows)
    return n, time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("file", nargs="?", default=os.path.join(ROOT, "data", "chat_sample.jsonl"))
    ap.add_argument("--copies", type=int, default=200)
    ap.add_argument("--bpe", help="a tiktoken.model (e.g. K3's) instead of the learned toy BPE")
    args = ap.parse_args()
    base = [(r, folder) for _, folder, r in read_conversations(args.file)]
    # copies differ in every text body (content, reasoning), as real data does: only markup,
    # tag names and attribute pieces repeat; images stay as they are
    def vary(m, c):
        m = dict(m)
        for key in ("content", "reasoning_content"):
            if isinstance(m.get(key), str) and m[key]:
                m[key] = f"{m[key]} (#{c})"
        return m
    rows = [{**r, "messages": [vary(m, c) for m in r["messages"]]} for c in range(args.copies) for r, _ in base]
    toks = {"byte": ByteTokenizer()}
    if args.bpe:
        toks["tiktoken"] = TiktokenTokenizer(args.bpe)
    else:
        with open(os.path.join(ROOT, "data", "corpus.txt"), "rb") as f:
            ranks = learn_bpe(f.read(), 400)
        path = os.path.join(tempfile.mkdtemp(), "tiktoken.model")
        with open(path, "w") as f:
            f.writelines(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks))
        toks["tiktoken (toy BPE)"] = TiktokenTokenizer(path)

    def opts(r):
        return {k: r[k] for k in ("thinking", "thinking_effort") if k in r}
    def sizes(r):
        return [(56, 56)] * sum(1 for m in r["messages"] if isinstance(m.get("content"), list)
                                for p in m["content"] if p.get("type") == "image_url")
    n_segs, t_render = timed(lambda r: len(render(r["messages"], r.get("tools"), image_sizes=sizes(r) or None,
                                                 add_generation_prompt=False, **opts(r))), rows)
    print(f"{len(rows)} conversations, {n_segs:,d} segments; render alone {t_render:.2f} s "
          f"({n_segs / t_render:,.0f} segments/s)")
    print(f"{'tokenizer':<20} {'tokens':>10} {'render+tokenize':>17} {'sft_example':>13} {'one encode':>12} "
          f"{'per-segment / one':>18}")
    for name, tok in toks.items():
        def per_segment(r, tok=tok):
            return len(tokenize(render(r["messages"], r.get("tools"), image_sizes=sizes(r) or None,
                                       add_generation_prompt=False, **opts(r)), tok))

        def sft(r, tok=tok):
            return len(sft_example(r["messages"], tok, r.get("tools"), image_sizes=sizes(r) or None, **opts(r))["ids"])
        texts = ["".join(s.text for s in render(r["messages"], r.get("tools"), image_sizes=sizes(r) or None,
                                                add_generation_prompt=False, **opts(r))) for r in rows]
        n, t_seg = timed(per_segment, rows)
        _, t_sft = timed(sft, rows)
        n_one, t_one = timed(lambda s, tok=tok: len(tok.encode_segment(s, True)), texts)
        print(f"{name:<20} {n:>10,d} {n / t_seg:>13,.0f} t/s {n / t_sft:>9,.0f} t/s {n_one / t_one:>8,.0f} t/s "
              f"{t_seg / t_one:>17.2f}x")


if __name__ == "__main__":
    main()
