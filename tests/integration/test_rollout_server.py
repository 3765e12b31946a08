"""The OpenAI-compatible rollout server on loopback: concurrency, errors, weights, shutdown.

A tiny float64 checkpoint with the character tokenizer is served in-process (uvicorn in a
thread, port 0); the shutdown test runs ``specrl rollout serve`` as a subprocess and sends it
SIGTERM while requests are in flight.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from safetensors.torch import save_file

from specrl.cli.rollout import rollout_config
from specrl.models.checkpoint import save_model
from specrl.models.decoder import Transformer
from specrl.models.presets import preset_config
from specrl.models.tokenizer import HFTokenizer, char_tokenizer, special_ids
from specrl.rl.tasks import AdditionTask
from specrl.rollout import Request, SamplingParams
from specrl.rollout.factory import build_engine
from specrl.rollout.server import EngineWorker, ServerLimits, create_app

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]
TOKEN = "s3cret-token"


def _model(seed: int, eos: bool = True) -> Transformer:
    tok = char_tokenizer()
    ids = special_ids(tok)
    config = preset_config(
        "toy-tiny",
        vocab_size=tok.get_vocab_size(),
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"] if eos else None,
        pad_token_id=ids["pad"],
    )
    return Transformer(config).init_weights(seed, std=0.2).to(torch.float64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("serve") / "target"
    save_model(_model(0), path, tokenizer=char_tokenizer(), dtype=torch.float64)
    return path


class _Server:
    """uvicorn in a background thread on a free loopback port."""

    def __init__(
        self, checkpoint: Path, token: str | None, limits: ServerLimits, weights_dirs=()
    ) -> None:
        engine = build_engine(rollout_config("ngram", 4, 16, False, None), checkpoint, device="cpu")
        codec = engine.codec
        app = create_app(
            EngineWorker(engine),
            codec,
            limits=limits,
            update_token=token,
            weights_dirs=weights_dirs,
        )
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


LIMITS = ServerLimits(max_body_bytes=4096, max_n=4, max_tokens=64, max_prompt_tokens=64)


@pytest.fixture(scope="module")
def url(checkpoint, tmp_path_factory):
    # weight files may come from any of this session's temporary directories
    with _Server(checkpoint, TOKEN, LIMITS, [tmp_path_factory.getbasetemp()]) as base:
        yield base


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return [p.prompt for p in AdditionTask().sample(random.Random(0), 64)]


def test_64_concurrent_clients_get_the_direct_engine_output(url, checkpoint, prompts):
    async def call(client: httpx.AsyncClient, i: int) -> dict:
        body = {"prompt": prompts[i], "max_tokens": 12, "temperature": 0, "logprobs": 0}
        if i % 8 == 0:
            body["n"] = 2
        r = await client.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    async def main() -> list[dict]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(call(client, i) for i in range(64)))

    replies = asyncio.run(main())
    direct = build_engine(rollout_config("none", 4, 8, False, None), checkpoint, device="cpu")
    codec = direct.codec
    params = SamplingParams(max_tokens=12, temperature=0)
    expected = direct.generate([Request(p, params) for p in prompts])
    for i, reply in enumerate(replies):
        assert reply["object"] == "text_completion"
        choices = reply["choices"]
        assert len(choices) == (2 if i % 8 == 0 else 1)
        for j, choice in enumerate(choices):
            assert choice["index"] == j
            assert choice["text"] == expected[i].text
            lp = choice["logprobs"]
            assert lp["token_logprobs"] == [0.0] * len(expected[i].tokens)
            assert lp["policy_token_logprobs"] == pytest.approx(expected[i].policy_logprobs)
            assert "".join(lp["tokens"]) == codec.decode(expected[i].tokens)
        usage = reply["usage"]
        assert usage["prompt_tokens"] == len(codec.encode_prompt(prompts[i]))
        assert usage["completion_tokens"] == sum(len(expected[i].tokens) for _ in choices)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{not json", 400, "malformed JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (json.dumps({"prompt": "x" * 5000}).encode(), 413, "byte limit"),
        (json.dumps({"prompt": 3}).encode(), 400, "'prompt'"),
        (json.dumps({"prompt": []}).encode(), 400, "'prompt'"),
        (json.dumps({"prompt": "1+1=", "temperature": -1}).encode(), 400, "'temperature'"),
        (json.dumps({"prompt": "1+1=", "top_p": 0}).encode(), 400, "'top_p'"),
        (json.dumps({"prompt": "1+1=", "n": 99}).encode(), 400, "'n'"),
        (json.dumps({"prompt": "1+1=", "max_tokens": 10_000}).encode(), 400, "'max_tokens'"),
        (json.dumps({"prompt": "1+1=", "max_tokens": True}).encode(), 400, "'max_tokens'"),
        (json.dumps({"prompt": "1" * 100}).encode(), 400, "limit is 64"),
        (json.dumps({"prompt": "1+1=", "stop": ["a", ""]}).encode(), 400, "'stop'"),
        (json.dumps({"prompt": "1+1=", "logprobs": 5}).encode(), 400, "logprobs"),
        (json.dumps({"prompt": "1+1=", "stream": True}).encode(), 400, "streaming"),
    ],
    ids=[
        "malformed",
        "not-object",
        "too-big",
        "prompt-type",
        "prompt-empty",
        "temperature",
        "top_p",
        "n",
        "max_tokens",
        "bool-int",
        "prompt-tokens",
        "stop",
        "logprobs",
        "stream",
    ],
)
def test_bad_requests_get_a_4xx_with_a_message_and_the_server_keeps_serving(
    url, body, status, needle
):
    headers = {"content-type": "application/json"}
    r = httpx.post(f"{url}/v1/completions", content=body, headers=headers, timeout=30)
    assert r.status_code == status
    error = r.json()["error"]
    assert needle in error["message"]
    assert error["type"] == "invalid_request_error"
    ok = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": "12+3=", "max_tokens": 4, "temperature": 0},
        timeout=30,
    )
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 1


def test_chunked_body_over_the_limit_is_refused(url):
    def chunks():
        for _ in range(10):
            yield b" " * 1000

    r = httpx.post(f"{url}/v1/completions", content=chunks(), timeout=30)
    assert r.status_code == 413


def test_health_and_prometheus_metrics(url):
    health = httpx.get(f"{url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    httpx.post(f"{url}/v1/completions", json={"prompt": "5+5=", "max_tokens": 8}, timeout=30)
    text = httpx.get(f"{url}/metrics", timeout=10).text
    assert "# TYPE specrl_tokens_total counter" in text
    samples = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert samples["specrl_tokens_total"] >= 8
    assert samples['specrl_target_forwards_total{kind="prefill"}'] >= 1
    assert "specrl_policy_version" in samples


def test_weight_endpoint_needs_the_configured_bearer_token(url, checkpoint, tmp_path):
    other = _model(7)
    weights = tmp_path / "policy.safetensors"
    save_file({k: v.contiguous() for k, v in other.state_dict().items()}, str(weights))
    body = {"path": str(weights), "target": "policy", "version": 3}
    missing = httpx.post(f"{url}/v1/weights", json=body, timeout=30)
    wrong = httpx.post(
        f"{url}/v1/weights", json=body, headers={"Authorization": "Bearer nope"}, timeout=30
    )
    assert missing.status_code == wrong.status_code == 401
    auth = {"Authorization": f"Bearer {TOKEN}"}
    bad_path = httpx.post(f"{url}/v1/weights", json={"path": "/nope"}, headers=auth, timeout=30)
    assert bad_path.status_code == 400 and "path" in bad_path.json()["error"]["message"]
    no_draft = httpx.post(
        f"{url}/v1/weights", json={**body, "target": "draft"}, headers=auth, timeout=30
    )
    assert no_draft.status_code == 400 and "no proposer" in no_draft.json()["error"]["message"]
    ok = httpx.post(f"{url}/v1/weights", json=body, headers=auth, timeout=60)
    assert ok.status_code == 200 and ok.json()["policy_version"] == 3
    assert httpx.get(f"{url}/health", timeout=10).json()["policy_version"] == 3
    # the new policy answers now
    tok = char_tokenizer()
    from specrl.models.generate import generate
    from specrl.models.tokenizer import TextCodec

    ids = special_ids(tok)
    codec = TextCodec(tok)
    reply = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": "77+8=", "max_tokens": 10, "temperature": 0},
        timeout=30,
    ).json()
    expected = generate(other, [codec.encode_prompt("77+8=")], 10, eos_id=ids["eos"])[0]
    assert reply["choices"][0]["text"] == codec.decode(expected)
    # restore the original weights for the other tests of this module
    original = tmp_path / "original.safetensors"
    save_file({k: v.contiguous() for k, v in _model(0).state_dict().items()}, str(original))
    restore = {"path": str(original), "version": 4}
    assert (
        httpx.post(f"{url}/v1/weights", json=restore, headers=auth, timeout=60).status_code == 200
    )


def test_weight_updates_are_refused_without_a_configured_token(checkpoint, tmp_path):
    with _Server(checkpoint, None, LIMITS) as base:
        r = httpx.post(
            f"{base}/v1/weights",
            json={"path": str(tmp_path)},
            headers={"Authorization": "Bearer anything"},
            timeout=30,
        )
    assert r.status_code == 403 and "disabled" in r.json()["error"]["message"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_finishes_in_flight_requests(tmp_path):
    checkpoint = tmp_path / "no-eos"  # without eos every request runs its full max_tokens
    tok = char_tokenizer()  # its files name no eos either (HF consumers stop at the tokenizer's)
    no_eos = HFTokenizer(tok.raw, {**tok.config, "eos_token": None})
    save_model(_model(0, eos=False), checkpoint, tokenizer=no_eos)
    port = _free_port()
    env = dict(os.environ, SPECRL_UPDATE_TOKEN=TOKEN, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "specrl", "rollout", "serve", "--target", str(checkpoint)]
    proc = subprocess.Popen(
        # 2 slots for 6 requests of 500 tokens: three waves, so requests are still running (or
        # waiting) well after the last one reached the engine, however slowly /health answers
        [*cmd, "--port", str(port), "--batch-size", "2", "--device", "cpu"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)

        # the served checkpoint's own directory is where weight files may come from by default
        auth = {"Authorization": f"Bearer {TOKEN}"}
        own = {"path": str(checkpoint / "model.safetensors"), "version": 5}
        reloaded = httpx.post(f"{base}/v1/weights", json=own, headers=auth, timeout=60)
        assert reloaded.status_code == 200 and reloaded.json()["policy_version"] == 5
        elsewhere = {"path": str(tmp_path / "elsewhere.safetensors")}
        (tmp_path / "elsewhere.safetensors").write_bytes(
            (checkpoint / "model.safetensors").read_bytes()
        )
        refused = httpx.post(f"{base}/v1/weights", json=elsewhere, headers=auth, timeout=60)
        assert refused.status_code == 400 and "--weights-dir" in refused.json()["error"]["message"]

        def call(i: int) -> httpx.Response:
            body = {"prompt": f"{i}+1=", "max_tokens": 500, "temperature": 0}
            return httpx.post(f"{base}/v1/completions", json=body, timeout=120)

        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(call, i) for i in range(6)]
            while True:  # every request has reached the engine
                h = httpx.get(f"{base}/health", timeout=5).json()
                if h["running"] + h["waiting"] + h["finished"] == 6:
                    break
                time.sleep(0.02)
            assert h["running"] > 0
            proc.send_signal(signal.SIGTERM)
            replies = [f.result() for f in futures]
        assert all(r.status_code == 200 for r in replies)
        for r in replies:
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "length" and len(choice["text"]) > 0
            assert r.json()["usage"]["completion_tokens"] == 500
        proc.wait(60)
        assert proc.returncode in (0, -signal.SIGTERM)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{base}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
