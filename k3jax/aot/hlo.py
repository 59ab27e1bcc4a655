"""Loop-aware totals from a compiled program's optimized HLO text.

XLA's cost analysis (`compiled.cost_analysis()`) visits a while loop's body once, whatever
its trip count: K3's 22 scanned layer groups, the KDA chunk loop and Muon's Newton–Schulz
iterations all count as one iteration there. This module reads the optimized HLO, gives
every computation its true number of executions per step (loops multiply by their trip
counts, read off the loop condition's `counter < N`), and tallies per device:

  - matmul FLOPs: every dot and convolution (in fusions too), and the Mosaic kernels'
    own cost estimates (TPU ragged_dot, Pallas calls);
  - HBM bytes of the top-level instructions of each computation (operands + results,
    which is how XLA counts a fusion's traffic);
  - collective bytes per device, by kind, for a ring schedule over each replica group:
    all-gather (g−1)·shard, reduce-scatter and all-to-all (g−1)/g·input, all-reduce twice
    that, collective-permute its whole operand, ragged-all-to-all its send buffer's share.

`loop_corrected(...)` adds to XLA's own FLOP and byte counts what the body-once rule
leaves out: (executions − 1 per visit) × each loop body's tallies.

The totals are for balanced routing: the dropless `ep` exchange's overflow round (a
conditional under the `ep_overflow` scope, k3jax.ops.moe_dispatch) runs only when a
device receives more than its first round holds, so its taken branch counts 0 times and
its skip branch once.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

import numpy as np

from k3jax.ops.moe_dispatch import OVERFLOW_SCOPE

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
          "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5,
          "s2": 0.25, "u2": 0.25, "f4e2m1fn": 0.5, "f8e8m0fnu": 1, "token": 0}
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_NAME = re.compile(r"%([\w.\-]+)")
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute", "collective-broadcast")
_REDUCERS = {"reduce", "reduce-window", "scatter", "sort", "select-and-scatter", "map", "all-reduce",
             "all-reduce-start", "reduce-scatter"}
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id",
         "replica-id", "iota", "opt-barrier", "add-dependency"}


def _dtype_bytes(dt: str) -> float:
    if dt in _BYTES:
        return _BYTES[dt]
    m = re.match(r"[a-z]+(\d+)", dt)
    return int(m.group(1)) / 8 if m else 0


def shape_arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """[(dtype, dims)] of every array in an HLO shape string (tuples flattened)."""
    shape = re.sub(r"\{[^{}]*\}", "", shape)      # layouts / tiling
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(shape)]


def _hbm_arrays(shape: str) -> list[str]:
    """The arrays of a shape that live in device memory: a layout's S(n), n > 0, places an
    array in on-chip memory (TPU VMEM and the like), whose traffic is not HBM's."""
    out = []
    for m in re.finditer(r"([a-z][a-z0-9]*\[[0-9,]*\])(\{[^{}]*\})?", shape):
        space = re.search(r"S\((\d+)\)", m.group(2) or "")
        if not space or space.group(1) == "0":
            out.append(m.group(1))
    return out


def shape_bytes(shape: str, hbm_only: bool = False) -> float:
    arrays = _hbm_arrays(shape) if hbm_only else [shape]
    return sum(_dtype_bytes(dt) * math.prod(d) for a in arrays for dt, d in shape_arrays(a))


@dataclass
class Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    root: bool = False
    args: str = ""            # the text between the opcode's parentheses (a constant's value)


@dataclass
class Computation:
    name: str
    instrs: list[Instr] = field(default_factory=list)
    fused: bool = False

    def shapes(self) -> dict:
        return {i.name: i.shape for i in self.instrs}


def _matching(s: str, i: int, open_: str, close: str) -> int:
    depth = 0
    for j in range(i, len(s)):
        if s[j] == open_:
            depth += 1
        elif s[j] == close:
            depth -= 1
            if depth == 0:
                return j
    return len(s) - 1


def _parse_instr(line: str) -> Instr | None:
    s = line.strip()
    root = s.startswith("ROOT ")
    if root:
        s = s[5:]
    if " = " not in s:
        return None
    name, rest = s.split(" = ", 1)
    name = name.lstrip("%")
    if rest.startswith("("):
        end = _matching(rest, 0, "(", ")")
        shape, rest = rest[:end + 1], rest[end + 1:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    m = re.match(r"([\w\-]+)\(", rest)
    if not m:
        return None
    opcode = m.group(1)
    close = _matching(rest, m.end() - 1, "(", ")")
    operands = _NAME.findall(rest[m.end():close])
    return Instr(name, shape, opcode, operands, rest[close + 1:], root, rest[m.end():close])


def parse(text: str) -> tuple[dict[str, Computation], str]:
    """(computations by name, the entry computation's name)."""
    comps: dict[str, Computation] = {}
    entry, cur = None, None
    for line in text.splitlines():
        if not line.strip() or line.startswith("HloModule"):
            continue
        if not line.startswith(" ") and line.rstrip().endswith("{"):
            is_entry = line.startswith("ENTRY ")
            head = line[6:] if is_entry else line
            name = head.split(" ", 1)[0].lstrip("%")
            cur = comps[name] = Computation(name)
            if is_entry:
                entry = name
            continue
        if line.startswith("}"):
            cur = None
            continue
        if cur is not None:
            ins = _parse_instr(line)
            if ins is not None:
                cur.instrs.append(ins)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    for c in comps.values():           # fusion bodies and scalar reducers never touch HBM themselves
        for i in c.instrs:
            if i.opcode == "fusion" or i.opcode in _REDUCERS:
                for callee in _callees(i):
                    if callee in comps:
                        comps[callee].fused = True
    return comps, entry


def _attr_names(attrs: str, key: str) -> list[str]:
    m = re.search(rf"{key}=(\{{[^}}]*\}}|%?[\w.\-]+)", attrs)
    return _NAME.findall(m.group(1)) or [m.group(1).lstrip("%")] if m else []


def _callees(i: Instr) -> list[str]:
    out = []
    for key in ("calls", "to_apply", "body", "condition", "branch_computations", "true_computation",
                "false_computation", "called_computations", "async_wrapped_computation"):
        out += _attr_names(i.attrs, key)
    return out


def trip_count(comps: dict, cond: str) -> int | None:
    """N of a `counter < N` loop condition (JAX's scans and fori_loops count from 0 by 1)."""
    c = comps.get(cond)
    if c is None:
        return None
    consts = {i.name: i.args.strip() for i in c.instrs if i.opcode == "constant"}
    for i in c.instrs:
        if i.root and i.opcode == "compare" and "direction=LT" in i.attrs:
            for op in i.operands[1:]:
                if re.fullmatch(r"-?\d+", consts.get(op, "")):
                    return max(int(consts[op]), 0)
    return None


def _while_trip(comps, i: Instr) -> int | None:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', i.attrs)
    if m:
        return int(m.group(1))
    cond = _attr_names(i.attrs, "condition")
    return trip_count(comps, cond[0]) if cond else None


def multiplicities(comps: dict, entry: str, loops: bool = True) -> tuple[dict, list]:
    """Executions per step of every computation reachable from the entry; `loops=False`
    counts each loop body once (XLA's cost-analysis rule). Also returns the loops whose
    trip count could not be read (counted once)."""
    order, seen = [], set()

    def visit(name):
        if name in seen or name not in comps:
            return
        seen.add(name)
        for i in comps[name].instrs:
            for c in _callees(i):
                visit(c)
        order.append(name)
    visit(entry)
    mult = {n: 0 for n in order}
    mult[entry] = 1
    unknown = []
    for name in reversed(order):          # callers before callees
        m = mult[name]
        for i in comps[name].instrs:
            if i.opcode == "while":
                n = _while_trip(comps, i)
                if n is None:
                    unknown.append(i.name)
                    n = 1
                n = n if loops else 1
                for b in _attr_names(i.attrs, "body"):
                    mult[b] = mult.get(b, 0) + m * n
                for c in _attr_names(i.attrs, "condition"):
                    mult[c] = mult.get(c, 0) + m * (n + 1 if loops else 1)
            else:
                for c in _callees(i):
                    if c in mult:
                        mult[c] += 0 if c in _untaken(i) else m
    return mult, unknown


def _untaken(i: Instr) -> list[str]:
    """The branches of an `ep_overflow` conditional that do not run under balanced routing:
    lax.cond's true branch (HLO's true_computation, or the second of branch_computations)."""
    if i.opcode != "conditional" or f"/{OVERFLOW_SCOPE}/" not in i.attrs:
        return []
    return _attr_names(i.attrs, "true_computation") or _attr_names(i.attrs, "branch_computations")[1:]


def _dims_list(attrs: str, key: str) -> list[int]:
    m = re.search(rf"{key}=\{{([0-9,]*)\}}", attrs)
    return [int(x) for x in m.group(1).split(",") if x] if m else []


def dot_flops(i: Instr, shapes: dict) -> float:
    """2 × output elements × contracted elements, for dot and convolution; a Mosaic
    kernel's cost estimate for tpu_custom_call."""
    out = shape_arrays(i.shape)
    if i.opcode == "dot" and out and i.operands:
        lhs = shape_arrays(shapes.get(i.operands[0], ""))
        if not lhs:
            return 0.0
        contract = math.prod(lhs[0][1][d] for d in _dims_list(i.attrs, "lhs_contracting_dims"))
        return 2.0 * math.prod(out[0][1]) * contract
    if i.opcode == "convolution" and out and len(i.operands) > 1:
        return _conv_flops(i, shapes, out[0][1])
    if i.opcode == "ragged-dot" and out and i.operands:
        lhs = shape_arrays(shapes.get(i.operands[0], ""))
        if lhs:
            contract = math.prod(lhs[0][1][d] for d in _dims_list(i.attrs, "lhs_contracting_dims"))
            return 2.0 * math.prod(out[0][1]) * contract
    if i.opcode == "custom-call":
        est = _cost_estimate(i.attrs)
        return float(est.get("flops", 0))
    return 0.0


def _valid_taps(n_in: int, n_out: int, size: int, stride: int, lo: int, base: int, win: int) -> int:
    """Kernel taps over all output positions of one spatial dim that land on real input
    (not padding, not a base-dilation hole): what the MACs of a convolution count."""
    extent = (n_in - 1) * base
    o = np.arange(n_out) if base > 1 else None
    total = 0
    for t in range(size):
        c = t * win - lo                       # input position of output 0 for this tap
        if base == 1:                          # o·stride + c in [0, extent]: o from ⌈−c/s⌉ to ⌊(extent−c)/s⌋
            first, last = max(0, -(c // stride)), min(n_out - 1, (extent - c) // stride)
            total += max(0, last - first + 1)
        else:
            p = o * stride + c
            total += int(np.count_nonzero((p >= 0) & (p <= extent) & (p % base == 0)))
    return total


def _conv_flops(i: Instr, shapes: dict, out_dims) -> float:
    m = re.search(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)", i.attrs)
    lhs = shape_arrays(shapes.get(i.operands[0], ""))
    rhs = shape_arrays(shapes.get(i.operands[1], ""))
    if not m or not lhs or not rhs:
        return 0.0
    lhs_l, rhs_l, out_l = m.groups()
    lhs_d, rhs_d = lhs[0][1], rhs[0][1]
    in_feat = rhs_d[rhs_l.index("i")]
    dense = math.prod(d for k, d in enumerate(out_dims) if not out_l[k].isdigit())   # batch × features
    win = re.search(r"window=\{([^}]*)\}", i.attrs)
    w = win.group(1) if win else ""

    spatial = sorted({c for c in out_l if c.isdigit()})

    def field(key, default):
        f = re.search(rf"{key}=([0-9x_]+)", w)
        if not f:
            return list(default)
        return [tuple(int(v) for v in p.split("_")) if "_" in p else int(p) for p in f.group(1).split("x")]
    n = len(spatial)
    size = field("size", [rhs_d[rhs_l.index(c)] for c in spatial])
    stride, pad = field("stride", [1] * n), field("pad", [(0, 0)] * n)
    base, wdil = field("lhs_dilate", [1] * n), field("rhs_dilate", [1] * n)
    taps = 1
    for k, c in enumerate(spatial):
        n_in, n_out = lhs_d[lhs_l.index(c)], out_dims[out_l.index(c)]
        taps *= _valid_taps(n_in, n_out, size[k], stride[k], pad[k][0], base[k], wdil[k])
    return 2.0 * dense * taps * in_feat


def _cost_estimate(attrs: str) -> dict:
    m = re.search(r'"cost_estimate":(\{[^}]*\})', attrs)
    if not m:
        return {}
    try:
        return {k: float(v) for k, v in json.loads(m.group(1)).items()}
    except (ValueError, TypeError):
        return {}


def group_size(attrs: str) -> int:
    """Devices in each replica group of a collective, in any of HLO's three spellings."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", attrs)
    if m:
        sizes = {k.strip("'"): int(v) for k, v in re.findall(r"'?([\w]+)'?=(\d+)", m.group(1))}
        axes = re.findall(r"'?([\w]+)'?", m.group(2))
        return math.prod(sizes.get(a, 1) for a in axes) if axes else 1
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", attrs)
    if m:
        return len([x for x in m.group(1).split(",") if x])
    m = re.search(r"source_target_pairs=\{", attrs)
    return 2 if m else 1


def collective_bytes(i: Instr, shapes: dict) -> tuple[str, float] | None:
    """(kind, bytes this device sends) of one collective, or None."""
    op = i.opcode[:-6] if i.opcode.endswith("-start") else i.opcode
    if op not in COLLECTIVES:
        return None
    operand = sum(shape_bytes(shapes.get(o, "")) for o in i.operands[:1])
    g = group_size(i.attrs)
    if op == "all-gather":
        sent = operand * (g - 1)
    elif op == "all-reduce":
        sent = 2 * operand * (g - 1) / g
    elif op in ("reduce-scatter", "all-to-all", "ragged-all-to-all"):
        sent = operand * (g - 1) / g
    else:
        sent = operand
    return op, sent


_SLICING = {"dynamic-slice": 0, "slice": 0, "gather": 0}     # opcode -> the operand it reads a part of


def _in_place_update(comp: Computation) -> tuple[int, float] | None:
    """(parameter number, update bytes) when a fused computation's root is a
    dynamic-update-slice into one of its parameters: XLA updates that buffer in place, so
    the fusion reads none of it and writes only the update (a decode step's chosen experts
    copied one by one into a [k, in, out] buffer would otherwise count k whole buffers)."""
    root = next((i for i in comp.instrs if i.root), None)
    if root is None or root.opcode != "dynamic-update-slice" or len(root.operands) < 2:
        return None
    params = {i.name: int(i.args.strip() or 0) for i in comp.instrs if i.opcode == "parameter"}
    if root.operands[0] not in params:
        return None
    return params[root.operands[0]], shape_bytes(comp.shapes().get(root.operands[1], ""))


def _partial_reads(comp: Computation, comps: dict | None = None, in_place: bool = True) -> dict[int, float]:
    """For a fused computation: parameter number -> bytes read, for parameters every user
    of which only slices or gathers from them (the rest of such an operand is never read;
    a nested fusion's user counts by what it slices of that operand), and, for a top-level
    fusion (`in_place`), the buffer an in-place update writes into (`_in_place_update`:
    none of it)."""
    params = {i.name: int(i.args.strip() or 0) for i in comp.instrs if i.opcode == "parameter"}
    users: dict[str, list[Instr]] = {}
    for i in comp.instrs:
        for pos, o in enumerate(i.operands):
            if o in params:
                users.setdefault(o, []).append((i, pos))
    out = {}
    for name, us in users.items():
        read = 0.0
        for u, pos in us:
            if _SLICING.get(u.opcode) == pos:
                read += shape_bytes(u.shape)
                continue
            callee = _attr_names(u.attrs, "calls") if u.opcode == "fusion" and comps else []
            inner = _partial_reads(comps[callee[0]], comps, False) if callee and callee[0] in comps else {}
            if pos not in inner:
                break
            read += inner[pos]
        else:
            out[params[name]] = read
    update = _in_place_update(comp) if in_place else None
    if update is not None:
        out[update[0]] = 0.0
    return out


def instr_bytes(i: Instr, shapes: dict, hbm_only: bool = True, comps: dict | None = None) -> float:
    """Bytes one top-level instruction reads and writes (HBM only by default). A slice or
    gather, on its own or inside a fusion, reads only what it takes of its operand."""
    if i.opcode in _FREE or i.opcode.endswith("-done") or i.opcode == "while":
        return 0.0
    if i.opcode == "custom-call":
        est = _cost_estimate(i.attrs)
        if "bytes_accessed" in est:
            return est["bytes_accessed"]
    partial, written = {}, None
    if i.opcode in _SLICING:
        partial = {0: shape_bytes(i.shape)}
    elif i.opcode == "dynamic-update-slice" and len(i.operands) > 1:
        partial, written = {0: 0.0}, shape_bytes(shapes.get(i.operands[1], ""), hbm_only)
    elif i.opcode == "fusion" and comps is not None:
        callee = _attr_names(i.attrs, "calls")
        if callee and callee[0] in comps:
            partial = _partial_reads(comps[callee[0]], comps)
            update = _in_place_update(comps[callee[0]])
            written = update[1] if update is not None else None
    reads = 0.0
    for pos, o in enumerate(i.operands):
        full = shape_bytes(shapes.get(o, ""), hbm_only)
        reads += min(full, partial[pos]) if pos in partial and full else full
    if written is not None and shape_bytes(i.shape, hbm_only):
        return reads + min(written, shape_bytes(i.shape, hbm_only))
    out = i.shape
    if i.opcode.endswith("-start") and out.startswith("("):
        # async start: (operands..., destination, context): the destination is written,
        # the rest restates what is read
        parts = _tuple_elements(out)
        out = parts[0] if i.opcode == "copy-start" else (parts[1] if len(parts) > 1 else parts[0])
    return reads + shape_bytes(out, hbm_only)


def _tuple_elements(shape: str) -> list[str]:
    inner, parts, depth, cur = shape[1:-1], [], 0, ""
    for ch in inner:
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    parts.append(cur.strip())
    return [re.sub(r"/\*[^*]*\*/", "", p).strip() for p in parts if p.strip()]


@dataclass
class Totals:
    flops: float = 0.0                 # matmul FLOPs, every loop iteration counted
    flops_once: float = 0.0            # the same, loop bodies once (XLA's rule)
    bytes: float = 0.0                 # bytes of top-level instructions, any memory (XLA's measure)
    bytes_once: float = 0.0
    hbm_bytes: float = 0.0             # the same, HBM only, every loop iteration counted
    collectives: dict = field(default_factory=dict)   # kind -> bytes sent per device per step
    loops: list = field(default_factory=list)         # (while name, trip count)
    unknown_loops: list = field(default_factory=list)
    # top-level instruction -> (opcode, FLOPs with its fusion's, HBM bytes, collective bytes,
    # `scope`), every execution counted: what `costliest` and `by_scope` rank
    instructions: dict = field(default_factory=dict)

    @property
    def collective_bytes(self) -> float:
        return sum(self.collectives.values())


_OP_NAME = re.compile(r'op_name="([^"]*)"')
_WRAPPED = re.compile(r"(\w+)\((.*)\)")
# op_name components that are loop plumbing or layer indices, not the model's own scopes
_PLUMBING = re.compile(r"while|body|cond|branch_\d+_fun|closed_call|checkpoint|remat\w*|rematted_computation|"
                       r"layers_\d+|groups|sub_\d+|shard_map|custom_\w+|K3Model")


def _scope_name(part: str) -> str:
    """An op_name component without its transformations (`transpose(jvp(big))` -> 'big');
    '' for a function's own name (`jit(f)`) and for plumbing."""
    while m := _WRAPPED.fullmatch(part):
        if m.group(1) in ("jit", "pjit"):
            return ""
        part = m.group(2)
    return "" if _PLUMBING.fullmatch(part) else part


def scope(attrs: str) -> str:
    """Where an instruction comes from, read off its op_name: 'forward' (under a jvp) /
    'backward' (under its transpose) / 'other' (e.g. the optimizer), then its first two
    scopes (named scopes, model modules) with layers, loops and transformations left out,
    e.g. 'backward: block_sparse_moe/ep_overflow'."""
    m = _OP_NAME.search(attrs)
    name = m.group(1) if m else ""
    phase = "backward" if "transpose(" in name else "forward" if "jvp(" in name else "other"
    parts = [n for n in map(_scope_name, name.split("/")[:-1]) if n]
    return f"{phase}: {'/'.join(parts[:2]) or '-'}"


def _fused_flops(comps: dict, name: str) -> float:
    """Matmul FLOPs of one call of a fused computation, nested fusions included."""
    c = comps.get(name)
    if c is None:
        return 0.0
    shapes = c.shapes()
    return sum(dot_flops(i, shapes) + sum(_fused_flops(comps, n) for n in _attr_names(i.attrs, "calls"))
               for i in c.instrs)


def analyse(text: str) -> Totals:
    comps, entry = parse(text)
    mult, unknown = multiplicities(comps, entry)
    once, _ = multiplicities(comps, entry, loops=False)
    t = Totals(unknown_loops=unknown)
    for name, m in mult.items():
        c = comps[name]
        if not m:
            continue
        shapes = c.shapes()
        m1 = once.get(name, 0)
        for i in c.instrs:
            f = dot_flops(i, shapes)
            t.flops += m * f
            t.flops_once += m1 * f
            if c.fused:
                continue
            if i.opcode == "while":
                t.loops.append((i.name, _while_trip(comps, i)))
            b = instr_bytes(i, shapes, hbm_only=False, comps=comps)
            t.bytes += m * b
            t.bytes_once += m1 * b
            hbm = instr_bytes(i, shapes, comps=comps)
            t.hbm_bytes += m * hbm
            col = collective_bytes(i, shapes)
            if col:
                t.collectives[col[0]] = t.collectives.get(col[0], 0.0) + m * col[1]
            fused = sum(_fused_flops(comps, n) for n in _attr_names(i.attrs, "calls")) if i.opcode == "fusion" else 0.0
            if f or fused or hbm or col:
                t.instructions[i.name] = (i.opcode, m * (f + fused), m * hbm, m * col[1] if col else 0.0,
                                          scope(i.attrs))
    return t


def loop_corrected(xla_flops: float, xla_bytes: float, totals: Totals) -> tuple[float, float]:
    """XLA's FLOPs and bytes accessed plus what its body-once rule leaves out."""
    return (xla_flops + totals.flops - totals.flops_once, xla_bytes + totals.bytes - totals.bytes_once)
