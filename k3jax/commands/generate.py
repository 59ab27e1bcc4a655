"""`k3jax generate DIR --prompt TEXT`: prefill + cached decode, streaming the text.

DIR is an HF safetensors directory or a `k3jax convert` output. Text prompts use the
byte tokenizer for byte-level vocabularies (≤ 512 ids, the toy configs); the real
163,840-id vocabulary needs the checkpoint's tokenizer file (`--tokenizer
tiktoken.model`), or token ids made with it (`--prompt-ids`). `--out` writes the
generated ids as JSON for scripts.
"""
from __future__ import annotations

import json
import sys


def register(sub):
    p = sub.add_parser("generate", help="prefill + cached decode; streams text or writes generated ids")
    p.add_argument("model_dir", help="HF safetensors directory or k3jax checkpoint")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (byte-level vocabularies only)")
    src.add_argument("--prompt-ids", help=".npy of token ids, [T] or [B, T] (rows must be full length)")
    p.add_argument("--tokenizer", help="tiktoken BPE file of the real vocabulary (tiktoken.model)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-eos-stop", action="store_true", help="keep generating past the eos token")
    p.add_argument("--out", help="write {'prompt_ids', 'generated_ids'} as JSON here")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="params and compute dtype (default: the checkpoint's)")
    p.set_defaults(fn=run)


def load(model_dir, dtype=None):
    """(ModelConfig, params) through the shared loader when present, else straight from
    an HF directory."""
    runtime = {"param_dtype": dtype, "dtype": dtype} if dtype else None
    try:
        from k3jax.checkpoint.load import load_model_dir
    except ImportError:
        load_model_dir = None
    if load_model_dir is not None:
        k3, params = load_model_dir(model_dir, runtime)
        return k3.text, params
    import os

    from k3jax.checkpoint.hf_params import load_hf_params
    from k3jax.config import K3Config
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(f"{model_dir}: no config.json")
    cfg = K3Config.from_hf(os.path.join(model_dir, "config.json")).text
    if runtime:
        cfg = cfg.with_runtime(**runtime)
    return cfg, load_hf_params(cfg, model_dir)


def run(args) -> int:
    import numpy as np

    from k3jax.infer.generate import generate
    from k3jax.infer.sampling import SamplingParams
    from k3jax.tokenizer import ByteTokenizer

    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    cfg, params = load(args.model_dir, args.dtype)
    tok = None
    if args.prompt is not None:
        if args.tokenizer:
            from k3jax.tokenizer import tokenizer_for
            tok = tokenizer_for(cfg, "tiktoken", args.tokenizer)
        elif cfg.vocab_size > 512:
            raise ValueError(f"--prompt needs a tokenizer file: this model's vocabulary has {cfg.vocab_size:,d} ids "
                             "and only byte-level vocabularies (<= 512 ids) are built in; pass the checkpoint's "
                             "--tokenizer tiktoken.model, or token ids made with it as --prompt-ids IDS.npy")
        else:
            tok = ByteTokenizer.for_config(cfg)
        prompts = np.array([tok.encode(args.prompt)], np.int32)
    else:
        prompts = np.load(args.prompt_ids)
        if prompts.ndim == 1:
            prompts = prompts[None]
        if prompts.ndim != 2 or not np.issubdtype(prompts.dtype, np.integer):
            raise ValueError(f"{args.prompt_ids}: expected integer ids [T] or [B, T], got {prompts.dtype} {prompts.shape}")

    stream = None
    if tok is not None and args.out is None:
        shown, new_ids = [""], []

        def print_new_text(step, ids):
            # decode everything so far and print what is new; a trailing U+FFFD is a
            # character still split across tokens, held back until it completes
            if ids[0] >= 0:
                new_ids.append(int(ids[0]))
            text = tok.decode(new_ids)
            done = text.rstrip("\ufffd")
            if len(done) > len(shown[0]) and done.startswith(shown[0]):
                sys.stdout.write(done[len(shown[0]):])
                sys.stdout.flush()
                shown[0] = done
        stream = print_new_text
        sys.stdout.write(args.prompt)
        sys.stdout.flush()
    eos = None if args.no_eos_stop else cfg.eos_token_id
    out = generate(cfg, params, prompts.tolist(), args.max_new_tokens, sampling, eos_id=eos, on_tokens=stream)
    if stream is not None:
        text = tok.decode(new_ids)
        sys.stdout.write((text[len(shown[0]):] if text.startswith(shown[0]) else "") + "\n")
    if args.out:
        import os
        tmp = f"{args.out}.tmp"   # renamed when complete: never a half-written result
        with open(tmp, "w") as f:
            json.dump({"prompt_ids": prompts.tolist(), "generated_ids": out}, f)
        os.replace(tmp, args.out)
    elif tok is None:
        for row in out:
            print(" ".join(map(str, row)))
    return 0
