"""The collectives of a compiled step's optimised HLO (kept by `K3JAX_HLO_DIR=DIR k3jax
compile ...`), summed by opcode and op_name, largest first: which part of the model sends
the bytes `--json`'s collective_bytes_per_step adds up (every loop iteration counted).

    python scripts/hlo_collectives.py DIR/train-93-layers.hlo [--top 20]
"""
import argparse
import re
from collections import defaultdict

from k3jax.aot import hlo


def collectives(text: str) -> dict:
    """{(opcode, op_name with numbers as #): [bytes per device per step, instructions]}."""
    comps, entry = hlo.parse(text)
    mult, _ = hlo.multiplicities(comps, entry)
    rows = defaultdict(lambda: [0.0, 0])
    for name, m in mult.items():
        c = comps[name]
        if not m or c.fused:
            continue
        shapes = c.shapes()
        for i in c.instrs:
            col = hlo.collective_bytes(i, shapes)
            if col:
                op = re.search(r'op_name="([^"]*)"', i.attrs)
                key = (col[0], re.sub(r"\d+", "#", op.group(1)) if op else "- (inserted by XLA)")
                rows[key][0] += m * col[1]
                rows[key][1] += m
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("hlo", help="an optimised HLO text file")
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args()
    with open(args.hlo) as f:
        rows = collectives(f.read())
    for (opcode, op), (size, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{size / 2**30:9.1f} GiB  x{n:6d}  {opcode:<18} {op[-160:]}")


if __name__ == "__main__":
    main()
