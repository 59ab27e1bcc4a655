"""KDA speed on this machine: tokens/s per impl, chunk's FLOP rate against a dense matmul,
and flash-linear-attention's torch reference on the same inputs.

    python benchmarks/kda.py [--T 1024 4096 16384] [--H 8] [--K 128] [--reps 3] [--grad]
                             [--dtype bfloat16] [--gate-lower-bound none] [--cpu-devices N]
                             [--xla-cpu-dots onednn]

Prints one line per (T, impl) and the ratios the KDA issue asks for:
  chunk FLOP rate / dense-matmul FLOP rate (target >= 0.3; beside it, the fraction of a
  batched [K, K] matmul's rate, the shape the chunk loop multiplies, measured in the same run),
  chunk / recurrent tokens/s at the longest T (target >= 2),
  chunk / faster of fla's naive_recurrent_kda and naive_chunk_kda (target >= 2.5).
Each line also gives the output's relative RMS error against `recurrent` on the same inputs
(against the first impl listed when `recurrent` is not), so a run on new hardware checks
the kernels it times. `pallas` runs in interpret mode on CPU: it is checked for correctness
by the tests, never timed there. On a GPU or TPU it is timed like the others, e.g. the
KDA issue's device run (an H200):

    python benchmarks/kda.py --T 8192 --H 96 --dtype bfloat16 --impls recurrent pallas chunk --grad --no-fla

An impl that fails is reported and skipped; the script then exits non-zero.

The gates are K3's "safe" gate, g = -5·sigmoid(·), and every impl is told so
(`gate_lower_bound=-5`, as K3's layers do), which lets `chunk`, `assoc` and `pallas` score
16-token sub-chunks in one matmul each. `--gate-lower-bound none` times the path for gates with no
lower bound (Kimi-Linear's softplus gate) on the same inputs.

Every impl runs on one device. With more than one device, `recurrent` and `chunk` also run
with the heads split over all of them (`sharded_kda`, the KDA layer's path under a mesh that
shards heads), reported as IMPL/Ndev with their own FLOP fraction and ratio. On CPU the
script makes one device per core (`--cpu-devices`, default os.cpu_count()): XLA:CPU runs
each *batched* matmul on one core (YNNPACK in jax 0.10), and every matmul of the chunk
algorithm is batched, so on one device `chunk` uses half of this 2-core machine while the
dense reference uses all of it. Split over two devices each core runs its own heads.

`--xla-cpu-dots onednn` compiles every timed function (the dense and batched references
too, so the ratios stay like for like) with XLA:CPU's experimental oneDNN dot library.
oneDNN's batched dots use every core, even on one device. It is a measurement of that
ceiling, not a setting k3jax uses: runs with it abort now and then with heap corruption
inside XLA's oneDNN thread pool (seen in this script and in benchmarks/train_step.py,
jaxlib 0.10.2), so rerun one that dies.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax.config import load as load_config
from k3jax.ops.kda import kda
from k3jax.ops.kda_context import sharded_kda


def best_time(fn, reps):
    """Seconds for the fastest of `reps` runs, after one warm-up (compile) run."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return min(times)


# XLA:CPU compile options per --xla-cpu-dots (the enum is spelled as in its proto).
XLA_CPU_DOTS = {
    "default": None,
    "onednn": {"xla_cpu_use_onednn": True,
               "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"},
}


def dense_matmul_rate(n=2048, reps=5, compiler_options=None):
    """fp32 FLOP/s of one jitted [n, n] @ [n, n] (HIGHEST precision, as KDA uses)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    mm = jax.jit(lambda x: jnp.dot(x, x, precision=jax.lax.Precision.HIGHEST),
                 compiler_options=compiler_options)
    return 2 * n**3 / best_time(lambda: mm(a), reps)


def batched_matmul_rate(batch, n, reps=5, inner=50, compiler_options=None):
    """fp32 FLOP/s of `batch` independent [n, n] @ [n, n] (HIGHEST), `inner` times in one
    jitted loop. With batch = B·H and n = K this is the chunk loop's per-chunk product
    ([W; Q̃] h is [2C, K] @ [K, V], and 2C = K at C = 64): its rate, not the dense one,
    bounds what `chunk` can reach (XLA:CPU runs each batched matmul on one core here)."""
    a = jax.random.normal(jax.random.key(1), (batch, n, n), jnp.float32)
    # Entries of size n^-1/2 keep x's magnitude steady over the chained products.
    b = jax.random.normal(jax.random.key(2), (batch, n, n), jnp.float32) / n**0.5

    @functools.partial(jax.jit, compiler_options=compiler_options)
    def loop(a, b):
        # Each product feeds the next, so XLA can neither hoist nor drop one.
        step = lambda _, x: jnp.einsum("zmk,zkn->zmn", x, b,  # noqa: E731
                                       precision=jax.lax.Precision.HIGHEST)
        return jax.lax.fori_loop(0, inner, step, a)

    return inner * 2 * batch * n**3 / best_time(lambda: loop(a, b), reps)


def attempt(label, fn, failed):
    """fn(), or None after printing why it failed (a kernel that does not build or run on
    this backend), so that one impl's failure does not cost the rest of a device run."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 — any failure is reported, then the run goes on
        failed.append(" ".join(label.split()))
        first = (str(e).strip().splitlines() or [""])[0][:300]
        print(f"{label} FAILED: {type(e).__name__}: {first}")
        return None


def chunk_flops(T, H, K, V, C):
    """Matmul FLOPs of the chunk algorithm (SPEC.md §3), per sequence: per chunk, the
    scores P and A (2·2C²K), the triangular solve for [W | U] (C²(K+V)), and in the state
    loop W h, Q̃ h, K̃ᵀV' (3·2CKV) and P V' (2C²V)."""
    n = -(-T // C)
    per_chunk = 4 * C * C * K + C * C * (K + V) + 6 * C * K * V + 2 * C * C * V
    return H * n * per_chunk


# K3's linear_attn_config.gate_lower_bound, from its preset: make_inputs draws g in
# (K3_GATE_LOWER_BOUND, 0), K3's "safe" gate.
K3_GATE_LOWER_BOUND = load_config("k3").gate_lower_bound


def make_inputs(B, T, H, K, V, seed=0):
    rng = np.random.default_rng(seed)
    norm = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    return dict(
        q=norm(rng.standard_normal((B, T, H, K))).astype(np.float32),
        k=norm(rng.standard_normal((B, T, H, K))).astype(np.float32),
        v=rng.standard_normal((B, T, H, V)).astype(np.float32),
        g=(K3_GATE_LOWER_BOUND / (1.0 + np.exp(-2.0 * rng.standard_normal((B, T, H, K))))).astype(np.float32),
        beta=(1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, H))))).astype(np.float32),
    )


def load_fla_naive():
    """fla's torch reference, by file path (importing fla.ops would pull in triton)."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "ops", "kda", "naive.py")
    if not os.path.exists(path):
        return None
    mod_spec = importlib.util.spec_from_file_location("_fla_kda_naive", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def time_fla(fla, x, C):
    """tokens/s of the faster of fla's naive_recurrent_kda / naive_chunk_kda (one run each)."""
    import torch

    t = {n: torch.from_numpy(a.copy()) for n, a in x.items()}
    T = x["q"].shape[1]
    best = 0.0
    for name in ("naive_recurrent_kda", "naive_chunk_kda"):
        f = getattr(fla, name, None)
        if f is None:
            continue
        kw = dict(output_final_state=True, **({"chunk_size": C} if "chunk" in name else {}))
        with torch.no_grad():
            f(**{n: a[:, :C] for n, a in t.items()}, **kw)  # warm-up
            t0 = time.perf_counter()
            f(**t, **kw)
            secs = time.perf_counter() - t0
        best = max(best, T / secs)
        print(f"T={T:6d} fla.{name:20s} {secs * 1e3:9.1f} ms  {T / secs:10.0f} tok/s "
              f"(torch, {torch.get_num_threads()} threads)")
    return best


def summary_line(results, T, devices, fla_rate):
    """The issue's ratios at one T, for the runs on one device or with the heads split."""
    r = {k: v for (t, d, k), v in results.items() if (t, d) == (T, devices)}
    line = f"T={T:6d}" + (f"  heads over {devices} devices:" if devices > 1 else "  one device:")
    if "chunk_frac" in r:
        line += f"  chunk FLOP fraction {r['chunk_frac']:.2f} (target >= 0.3)"
    sizes = [(v, k) for k, v in r.items() if k.startswith("chunk") and not k.endswith(("_frac", "_grad"))]
    best = max(sizes) if "chunk" in r else None
    if best and best[1] != "chunk":
        line += f"  (fastest: {best[1]})"
    if "recurrent" in r and "chunk" in r:
        line += f"  chunk/recurrent {r['chunk'] / r['recurrent']:.2f}x"
        if best and best[1] != "chunk":  # the same outputs: the chunk size is a speed knob
            line += f" ({best[1]}: {best[0] / r['recurrent']:.2f}x)"
    if "recurrent_grad" in r and "chunk_grad" in r:
        line += f" (forward+backward {r['chunk_grad'] / r['recurrent_grad']:.2f}x)"
    if fla_rate and "chunk" in r:
        line += f"  chunk/fla-best {r['chunk'] / fla_rate:.2f}x (target >= 2.5)"
    return line


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--C", type=int, nargs="+", default=[64, 32, 16],
                    help="chunk sizes for chunk/assoc (the first is the reported one)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--impls", nargs="+", default=["recurrent", "chunk", "assoc"],
                    choices=("recurrent", "chunk", "assoc", "pallas"))
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="dtype of the inputs (every impl computes in fp32)")
    ap.add_argument("--grad", action="store_true",
                    help="also time forward+backward (jax.grad of a loss on o) per impl")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--fla-tokens", type=int, default=1024,
                    help="sequence length for the (linear-time) fla torch references")
    ap.add_argument("--xla-cpu-dots", choices=sorted(XLA_CPU_DOTS), default="default",
                    help="XLA:CPU dot library for every timed function (see above)")
    ap.add_argument("--gate-lower-bound", type=lambda s: None if s == "none" else float(s),
                    default=K3_GATE_LOWER_BOUND,
                    help="the gate bound every impl is told ('none': no bound; see above)")
    ap.add_argument("--cpu-devices", type=int, default=os.cpu_count(),
                    help="CPU devices, one per core by default (see above); 1: one device only")
    args = ap.parse_args()
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)  # before the backend starts
    lb = args.gate_lower_bound
    if lb is not None and lb > K3_GATE_LOWER_BOUND:
        ap.error(f"the inputs' gates reach down to {K3_GATE_LOWER_BOUND}: a bound above it is false")
    B, H, K, V = args.B, args.H, args.K, args.K
    opts = XLA_CPU_DOTS[args.xla_cpu_dots]
    if opts and jax.default_backend() != "cpu":
        ap.error("--xla-cpu-dots applies to the CPU backend only")

    try:
        peak = dense_matmul_rate(compiler_options=opts)
    except jax.errors.JaxRuntimeError as e:
        if not opts:
            raise
        # experimental options: a newer XLA may have renamed or dropped them
        ap.error(f"this jaxlib rejects --xla-cpu-dots {args.xla_cpu_dots}: {e}")
    batched = batched_matmul_rate(B * H, K, compiler_options=opts)
    dots = f" (XLA:CPU dots: {args.xla_cpu_dots})" if jax.default_backend() == "cpu" else ""
    print(f"backend {jax.default_backend()}{dots}, {os.cpu_count()} cpus; dense fp32 matmul "
          f"{peak / 1e9:.1f} GFLOP/s; {B * H} batched [{K},{K}]x[{K},{K}] (the chunk loop's "
          f"product) {batched / 1e9:.1f} GFLOP/s = {batched / peak:.2f} of dense")
    print(f"gates in ({K3_GATE_LOWER_BOUND:g}, 0); impls told gate_lower_bound={lb}")
    impls = list(args.impls)
    if jax.default_backend() == "cpu":
        print("pallas: interpret mode on CPU, correctness only (tests/ops/test_kda_engine.py); not timed")
        impls = [i for i in impls if i != "pallas"]
    impls.sort(key=lambda i: i != "recurrent")  # the oracle first: the others' errors are against it
    fla = None if args.no_fla else load_fla_naive()
    if fla is None and not args.no_fla:
        print("fla-core not installed: no torch reference")

    # Heads split over every device, each running `kda` on its own (sharded_kda, as the KDA
    # layer does under a mesh that shards heads): on CPU the devices are the cores.
    n_dev = jax.device_count()
    mesh = jax.make_mesh((n_dev,), ("heads",), axis_types=(jax.sharding.AxisType.Auto,))
    heads = P(None, None, "heads")
    split_impls = ("recurrent", "chunk") if n_dev > 1 and H % n_dev == 0 else ()
    if split_impls:
        print(f"{n_dev} devices: recurrent and chunk also run with the heads split over them "
              f"({H // n_dev} per device), the key's /{n_dev}dev")

    def call(x, impl, C, devices):
        if devices == 1:
            return kda(**x, impl=impl, chunk_size=C, output_final_state=True, gate_lower_bound=lb)
        return sharded_kda(**x, spec=heads, mesh=mesh, impl=impl, chunk_size=C,
                           output_final_state=True, gate_lower_bound=lb)

    fn = jax.jit(call, static_argnums=(1, 2, 3), compiler_options=opts)

    @functools.partial(jax.jit, static_argnums=(1, 2, 3), compiler_options=opts)
    def grad_fn(x, impl, C, devices):
        def loss(x):
            o, h = call(x, impl, C, devices)
            return jnp.sum(o * o) + jnp.sum(h)
        return jax.grad(loss)(x)

    # results[T, devices, key]: tokens/s; key "chunk", "chunk/C32", "chunk_frac", "chunk_grad", ...
    results, failed, fla_rate = {}, [], None
    if fla is not None:
        # Both torch references cost linear time in T (a Python loop over tokens or over
        # chunks), so one prefix of --fla-tokens tokens gives their tokens/s for every T.
        fla_rate = time_fla(fla, make_inputs(B, args.fla_tokens, H, K, V), args.C[0])
    for T in args.T:
        x1 = {n: jnp.asarray(a, args.dtype) for n, a in make_inputs(B, T, H, K, V).items()}
        xs = {1: x1}
        if split_impls:
            xs[n_dev] = {n: jax.device_put(a, NamedSharding(mesh, heads)) for n, a in x1.items()}
        sizes = lambda impl: args.C if impl in ("chunk", "assoc") else args.C[:1]  # noqa: E731
        runs = [(impl, C, 1) for impl in impls for C in sizes(impl)]
        runs += [(impl, C, n_dev) for impl in impls if impl in split_impls for C in sizes(impl)]
        ref = ref_key = None
        for impl, C, devices in runs:
            x = xs[devices]
            run = lambda: fn(x, impl, C, devices)  # noqa: E731
            reps = args.reps if T <= 4096 else max(1, args.reps - 1)
            key = impl if C == args.C[0] else f"{impl}/C{C}"
            shown = key + (f"/{devices}dev" if devices > 1 else "")
            label = f"T={T:6d} {shown:14s} C={C:3d}"
            secs = attempt(label, lambda: best_time(run, reps), failed)
            if secs is None:
                continue
            o = run()[0].astype(jnp.float32)
            if ref is None:
                ref, ref_key = o, shown
            err = float(jnp.sqrt(jnp.mean((o - ref) ** 2) / jnp.mean(ref**2)))
            results[T, devices, key] = B * T / secs
            extra = ""
            if impl == "chunk":
                rate = B * chunk_flops(T, H, K, V, C) / secs
                results[T, devices, key + "_frac"] = rate / peak
                extra = (f"  {rate / 1e9:.1f} GFLOP/s = {rate / peak:.2f} of dense matmul, "
                         f"{rate / batched:.2f} of batched")
            print(f"{label} {secs * 1e3:9.1f} ms  {B * T / secs:10.0f} tok/s{extra}"
                  + (f"  err {err:.1e} vs {ref_key}" if ref_key != shown else ""))
            if args.grad and impl == "recurrent" and B * T * H * K * V * 4 > 4 * 2**30:
                print(f"{label} forward+backward not timed: its autodiff keeps "
                      f"every token's state ({B * T * H * K * V * 4 / 2**30:.1f} GiB)")
            elif args.grad:
                secs = attempt(label + " forward+backward",
                               lambda: best_time(lambda: grad_fn(x, impl, C, devices), reps), failed)
                if secs is not None:
                    results[T, devices, key + "_grad"] = B * T / secs
                    print(f"{label} {secs * 1e3:9.1f} ms  {B * T / secs:10.0f} tok/s  forward+backward")
    Tmax = max(args.T)
    print("--- summary")
    for T in args.T:
        for devices in (1, n_dev) if split_impls else (1,):
            print(summary_line(results, T, devices, fla_rate))
    print(f"targets at T={Tmax}: chunk/recurrent >= 2x")
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
