"""How long ``GET /health`` of the rollout server takes while clients post huge prompts.

A toy server (character tokenizer, ``max_prompt_tokens`` 64) runs in a process of its own; a
client polls ``/health`` back to back while ``--clients`` threads each post one prompt of
``--prompt-chars`` characters.  Variants: ``bound`` (the default: the prompt's length is checked
against the character bound before tokenizing) and ``tokenize`` (``max_prompt_chars`` lifted,
so every prompt is tokenized — in the server's thread pool — before its token count is
refused).  Every reply is a 400 either way; what differs is how long the server is busy and
whether ``/health`` answers meanwhile.

    python benchmarks/server_health.py [--prompt-chars 1000000] [--clients 4] [--quick]
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

try:
    from benchmarks import harness
except ImportError:  # run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import harness

VARIANTS = ("bound", "tokenize")


def _serve(variant: str, port: int) -> None:
    import torch
    import uvicorn

    from specrl.models.decoder import Transformer
    from specrl.models.presets import preset_config
    from specrl.models.tokenizer import TextCodec, char_tokenizer
    from specrl.rollout.engine import RolloutEngine
    from specrl.rollout.server import EngineWorker, ServerLimits, create_app

    torch.set_num_threads(1)
    codec = TextCodec(char_tokenizer())
    config = preset_config("toy-tiny", vocab_size=char_tokenizer().get_vocab_size())
    engine = RolloutEngine(Transformer(config).init_weights(0), codec=codec, max_batch_size=4)
    limits = ServerLimits(
        max_body_bytes=8 << 20,
        max_prompt_tokens=64,
        max_tokens=8,
        max_prompt_chars=None if variant == "bound" else 1 << 40,
    )
    app = create_app(EngineWorker(engine), codec, limits=limits)
    uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical")).run()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(variant: str, chars: int, clients: int) -> dict:
    port = _free_port()
    proc = multiprocessing.get_context("spawn").Process(target=_serve, args=(variant, port))
    proc.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(f"{url}/health", timeout=2)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise RuntimeError("the server did not start") from None
                time.sleep(0.2)
        body = json.dumps({"prompt": ("1+2=" * (chars // 4 + 1))[:chars], "max_tokens": 4})
        latencies: list[float] = []
        stop = threading.Event()

        def poll() -> None:
            with httpx.Client(timeout=600) as c:
                while not stop.is_set():
                    t = time.perf_counter()
                    c.get(f"{url}/health")
                    latencies.append(time.perf_counter() - t)
                    time.sleep(0.01)

        replies: list[tuple[int, float]] = []

        def post() -> None:
            t = time.perf_counter()
            r = httpx.post(
                f"{url}/v1/completions",
                content=body.encode(),
                headers={"content-type": "application/json"},
                timeout=600,
            )
            replies.append((r.status_code, time.perf_counter() - t))

        poller = threading.Thread(target=poll)
        poller.start()
        time.sleep(0.5)
        idle = statistics.median(latencies)
        posts = [threading.Thread(target=post) for _ in range(clients)]
        for t in posts:
            t.start()
        for t in posts:
            t.join()
        time.sleep(0.3)
        stop.set()
        poller.join()
    finally:
        proc.terminate()
        proc.join(30)
    return {
        "variant": variant,
        "prompt_chars": chars,
        "clients": clients,
        "health_idle_ms": round(idle * 1e3, 1),
        "health_max_s": round(max(latencies), 3),
        "health_polls": len(latencies),
        "slowest_reply_s": round(max(d for _, d in replies), 2),
        "statuses": ",".join(str(s) for s in sorted({s for s, _ in replies})),
    }


def main() -> None:
    ap = harness.parser(__doc__, "server_health", repeats=None, threads=False, clock=False)
    ap.add_argument("--prompt-chars", type=int, default=1_000_000)
    ap.add_argument("--clients", type=int, default=4)
    args = ap.parse_args()
    chars = 100_000 if args.quick else args.prompt_chars
    rows = [measure(v, chars, args.clients) for v in VARIANTS]
    columns = ["variant", "prompt_chars", "clients", "health_idle_ms", "health_max_s"]
    columns += ["health_polls", "slowest_reply_s", "statuses"]
    title = "/health while clients post huge prompts"
    harness.report(args, [(title, rows, columns)], {"rows": rows})


if __name__ == "__main__":
    main()
