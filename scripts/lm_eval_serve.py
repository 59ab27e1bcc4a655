#!/usr/bin/env python3
"""lm-evaluation-harness against `k3jax serve`: its `local-chat-completions` model runs a small
generation task (a local JSONL, nothing fetched) through the server's /v1/chat/completions.

    pip install -e ".[serve]" "lm-eval[api]"
    python scripts/lm_eval_serve.py runs/toy_grpo_sft [--port 8123] [--max-len 640]

It starts `k3jax serve MODEL_DIR` in a subprocess, waits for /health, runs `lm_eval` with a
task of eight "Last letter: WORD" questions (exact match, greedy, stop at <|end_of_msg|>),
prints lm-eval's table and how many requests came back, and stops the server. The score is
the model's business (a toy answers nothing useful); the check is that every request of the
harness got an answer over the OpenAI protocol.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

WORDS = ["river", "stone", "cloud", "apple", "grape", "lemon", "melon", "peach"]
TASK = """task: k3jax_last_letter
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["<|end_of_msg|>"]
  max_gen_toks: 24
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def wait_healthy(url: str, server: subprocess.Popen, timeout: float = 600) -> None:
    t = time.time()
    while time.time() - t < timeout:
        if server.poll() is not None:
            raise SystemExit(f"k3jax serve exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(2)
    raise SystemExit(f"k3jax serve did not answer /health within {timeout:.0f} s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--max-len", type=int, default=640, help="the server's --max-len (prompt and reply)")
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="k3jax_lm_eval_")
    data = os.path.join(work, "data.jsonl")
    with open(data, "w") as f:
        for w in WORDS:
            f.write(json.dumps({"question": f"Last letter: {w}", "answer": w[-1]}) + "\n")
    with open(os.path.join(work, "k3jax_last_letter.yaml"), "w") as f:
        f.write(TASK.format(data=data))
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen([sys.executable, "-m", "k3jax.cli", "serve", args.model_dir, "--port", str(args.port),
                               "--slots", "4", "--max-len", str(args.max_len), "--served-model-name", "k3jax"])
    try:
        wait_healthy(url, server)
        t = time.time()
        model_args = (f"base_url={url}/v1/chat/completions,model=k3jax,num_concurrent=4,max_retries=1,"
                      "tokenized_requests=False,tokenizer_backend=None")
        rc = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-chat-completions",
                             "--model_args", model_args, "--tasks", "k3jax_last_letter", "--include_path", work,
                             "--apply_chat_template", "--output_path", os.path.join(work, "out"),
                             "--log_samples"]).returncode
        samples = [json.loads(line) for p in glob.glob(os.path.join(work, "out", "*", "samples_*.jsonl"))
                   for line in open(p)]
        print(f"lm_eval exit {rc}; {len(samples)} of {len(WORDS)} requests answered in {time.time() - t:.1f} s; "
              f"exact match {sum(s['exact_match'] for s in samples) / max(len(samples), 1):.3f}")
        return rc if len(samples) == len(WORDS) else 1
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
