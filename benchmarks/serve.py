"""Serving throughput: `k3jax serve` driven by N concurrent `openai` clients vs the same N
requests sent one after another, side by side in one run (issue 36: the done-when wants
8 concurrent at >= 3x the tokens/s of 8 sequential, toy, CPU).

Each request is a streamed chat completion (the toy's byte vocabulary, thinking off) of
exactly --tokens new tokens (ignore_eos), sampled at temperature 0.8 with its own seed.
Reported per run: generated tokens/s over the wall time, time to first token and request
latency (p50 / p99). The server is the real one: `k3jax serve DIR` in a subprocess with
--model, else the toy preset with random weights served in-process (uvicorn on a thread;
the clients are threads of the same process).

    python benchmarks/serve.py [--model DIR] [--clients 8] [--tokens 64] [--slots 8]
"""
from __future__ import annotations

import argparse
import concurrent.futures as futures
import os
import statistics
import subprocess
import sys
import threading
import time

import openai

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def serve_toy(args) -> tuple[str, callable]:
    """The toy preset, random weights, served in this process; (base url, stop)."""
    import jax
    import uvicorn

    from k3jax import config as C
    from k3jax.infer.generator import Generator
    from k3jax.model import init_params
    from k3jax.serve.app import Service, make_app

    k3 = C.load_k3("toy")
    gen = Generator(k3, init_params(k3.text, jax.random.PRNGKey(0)))
    engine = gen.engine(args.slots, args.max_len, args.chunk, tokenizer=gen.tokenizer)
    t = time.perf_counter()
    engine.warmup()
    print(f"compiled the engine's steps in {time.perf_counter() - t:.1f} s")
    engine.start()
    server = uvicorn.Server(uvicorn.Config(make_app(Service(gen, engine, "toy")), host="127.0.0.1", port=args.port,
                                           log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)

    def stop():
        server.should_exit = True
        engine.shutdown()
    return f"http://127.0.0.1:{args.port}/v1", stop


def serve_dir(args) -> tuple[str, callable]:
    p = subprocess.Popen([sys.executable, "-m", "k3jax.cli", "serve", args.model, "--port", str(args.port),
                          "--slots", str(args.slots), "--max-len", str(args.max_len), "--chunk", str(args.chunk)],
                         cwd=ROOT, stdout=subprocess.PIPE, text=True)
    for line in p.stdout:
        print(line.rstrip())
        if line.startswith("serving "):
            break
    return f"http://127.0.0.1:{args.port}/v1", lambda: (p.terminate(), p.wait())


def one(client, i: int, tokens: int) -> dict:
    t0 = time.perf_counter()
    first, n = None, 0
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": f"Tell me about river number {i}."}], max_tokens=tokens,
        temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True},
        extra_body={"reasoning_effort": "none", "ignore_eos": True})
    for ch in stream:
        if first is None and ch.choices and (ch.choices[0].delta.content
                                             or getattr(ch.choices[0].delta, "reasoning_content", None)):
            first = time.perf_counter() - t0
        if ch.usage is not None:
            n = ch.usage.completion_tokens
    return {"tokens": n, "ttft": first if first is not None else time.perf_counter() - t0,
            "latency": time.perf_counter() - t0}


def run(client, n: int, tokens: int, concurrent: bool) -> dict:
    t0 = time.perf_counter()
    if concurrent:
        with futures.ThreadPoolExecutor(n) as pool:
            rows = list(pool.map(lambda i: one(client, i, tokens), range(n)))
    else:
        rows = [one(client, i, tokens) for i in range(n)]
    wall = time.perf_counter() - t0
    total = sum(r["tokens"] for r in rows)
    assert total == n * tokens, f"expected {n * tokens} tokens, got {total}"

    def pct(key, q):
        xs = sorted(r[key] for r in rows)
        return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]
    return {"tok_s": total / wall, "wall": wall, "ttft50": statistics.median(r["ttft"] for r in rows),
            "ttft99": pct("ttft", 0.99), "lat50": statistics.median(r["latency"] for r in rows),
            "lat99": pct("latency", 0.99)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a model directory for `k3jax serve` (default: the toy, random weights)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--port", type=int, default=8123)
    args = ap.parse_args()
    url, stop = (serve_dir if args.model else serve_toy)(args)
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    try:
        one(client, 0, 4)                       # first request: nothing left to compile after it
        seq = run(client, args.clients, args.tokens, concurrent=False)
        par = run(client, args.clients, args.tokens, concurrent=True)
    finally:
        stop()
    print(f"{args.clients} requests x {args.tokens} tokens, {args.slots} slots, chunk {args.chunk}, "
          f"{os.cpu_count()} CPUs")
    print(f"{'':12s} {'tokens/s':>9s} {'wall s':>7s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'lat p50':>8s} {'lat p99':>8s}")
    for name, r in (("sequential", seq), ("concurrent", par)):
        print(f"{name:12s} {r['tok_s']:9.1f} {r['wall']:7.2f} {r['ttft50']:9.3f} {r['ttft99']:9.3f} "
              f"{r['lat50']:8.2f} {r['lat99']:8.2f}")
    print(f"concurrent / sequential tokens/s: {par['tok_s'] / seq['tok_s']:.2f}x (target >= 3x)")


if __name__ == "__main__":
    main()
