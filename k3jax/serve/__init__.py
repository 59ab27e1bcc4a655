"""The OpenAI-compatible server (`k3jax serve`) over the continuous-batching engine of
`k3jax.infer.engine`; needs the `serve` extra (FastAPI + uvicorn). `protocol` checks
requests and builds responses, `app` holds the routes, `serve` runs them.

SIGTERM (or Ctrl-C) drains: the listener closes, running and queued requests finish and
are answered, then the process exits 0."""
from __future__ import annotations

import signal
import socket


def serve(generator, engine, model_name: str, host: str = "127.0.0.1", port: int = 8000) -> int:
    """Compile the engine's steps, start it, and answer HTTP until SIGTERM / SIGINT."""
    import uvicorn

    from k3jax.serve.app import Service, make_app

    engine.warmup()
    engine.start()
    app = make_app(Service(generator, engine, model_name))
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))          # bound here so that --port 0 can say which port it got
    # listening before the line below: a client that connects on reading it waits in the
    # backlog until uvicorn accepts, where a bound socket not yet listening refuses it
    sock.listen(2048)
    print(f"serving {model_name} on http://{host}:{sock.getsockname()[1]}/v1 "
          f"({engine.slots} slots, max_len {engine.max_len}, chunk {engine.chunk})", flush=True)
    # uvicorn's own SIGTERM handling stops accepting and waits for every open request to be
    # answered; the engine keeps stepping until they are, and is shut down after
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=None))
    # uvicorn re-raises the signal it caught once it has shut down, to the handler found
    # before it: a quiet one, so that a drained server exits 0 and not by the signal
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown(drain=True)
    return 0
