"""`k3jax serve DIR`: an OpenAI-compatible server over k3jax's continuous-batching engine.

DIR is any model directory `k3jax generate` takes; a LoRA run is served with its adapters
applied unmerged. Needs the `serve` extra (`pip install -e ".[serve]"`). docs/serve.md has
the endpoints, the options and the limits.
"""
from __future__ import annotations

from k3jax.commands import add_expert_format, number


def register(sub):
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions) with continuous batching")
    p.add_argument("model_dir", help="HF safetensors directory, k3jax checkpoint, training run directory "
                                     "(LoRA runs served unmerged) or its checkpoints/N")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=number(int, 0, 65535), default=8000, help="0: any free port (printed)")
    p.add_argument("--slots", type=number(int, 1), default=8, help="sequences decoded at once (cache rows)")
    p.add_argument("--max-len", type=number(int, 2), default=512, help="tokens per sequence, prompt and reply")
    p.add_argument("--chunk", type=number(int, 1), default=32, help="prompt tokens fed per slot per step")
    p.add_argument("--max-waiting", type=number(int, 0), default=64,
                   help="requests queued beyond the slots; more get HTTP 429")
    p.add_argument("--prefix-cache", type=number(int, 0), default=8, help="saved prompt prefixes (0: no reuse)")
    p.add_argument("--served-model-name", default=None, help="the model id clients see (default: DIR's name)")
    p.add_argument("--tokenizer", help="tiktoken BPE file of the real vocabulary (default: DIR's tiktoken.model)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="params and compute dtype (default: float32; a run's own training dtypes)")
    add_expert_format(p, "held")
    p.add_argument("--mesh", default=None, help="mesh preset (configs/meshes/*.yaml) or YAML path to shard over")
    p.set_defaults(fn=run)


def run(args) -> int:
    import os

    from k3jax.infer.generator import Generator
    from k3jax.serve import serve

    from k3jax.errors import require
    for module in ("fastapi", "uvicorn"):
        require(module, "serve", "k3jax serve")
    gen = Generator.load(args.model_dir, dtype=args.dtype, mesh=args.mesh, expert_format=args.expert_format,
                         tokenizer=args.tokenizer)
    gen.tokenizer                      # the tokenizer rule's one-line error before anything starts
    engine = gen.engine(args.slots, args.max_len, args.chunk, tokenizer=gen.tokenizer, max_waiting=args.max_waiting,
                        prefix_entries=args.prefix_cache)
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model_dir))
    return serve(gen, engine, name, args.host, args.port)

