"""The rollout server under hostile or careless clients (issue 28 items 10–14).

Each case is followed by a normal request whose answer must be exactly the engine's: the server
keeps serving, and correctly, after every abuse.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from safetensors.torch import save_file

from specrl.cli.rollout import serve_command
from specrl.errors import ConfigError
from specrl.models.decoder import Transformer
from specrl.models.draft import DraftConfig, Eagle3Draft, build_vocab_map, init_draft_weights
from specrl.models.generate import generate
from specrl.models.presets import preset_config
from specrl.models.tokenizer import LONG_TEXT, HFTokenizer, TextCodec, char_tokenizer, special_ids
from specrl.rollout import Request, RolloutEngine, SamplingParams, SpecConfig
from specrl.rollout.server import (
    EngineWorker,
    ServerLimits,
    StepFailure,
    create_app,
    prompt_char_bound,
)
from tests.unit.test_draft import make_pair
from tests.unit.test_engine import greedy, make_engine

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 5, 6, 7, 5, 6], [3, 4, 3, 4, 3], [9], [10, 11, 12, 13, 10, 11, 12], [2, 2]]


# ----------------------------------------------------------------------- engine.abort
@pytest.mark.parametrize("proposers", [("ngram",), ("eagle3", "ngram")], ids=["ngram", "eagle3"])
def test_aborting_requests_frees_their_slots_and_leaves_the_others_exact(proposers):
    """What the server does for a cancelled request or a failed step: the dropped requests'
    samples leave the engine mid-flight, waiting or running; the others finish exactly."""
    target, draft = make_pair()
    spec = SpecConfig(
        proposers=proposers, max_k=3, gate=False, proposer_options={"eagle3": {"draft": draft}}
    )
    engine = make_engine(target, max_batch_size=3, spec=spec)
    ids = engine.add_requests([Request(p, greedy(12)) for p in PROMPTS])
    engine.step()
    engine.step()
    assert engine.queued_requests() == set(ids[3:])
    dropped = engine.abort([ids[0], ids[4]])  # one running (slot 0), one still queued
    assert dropped == 2
    assert engine.queued_requests() == {ids[3]}
    results = {}
    while engine.has_unfinished():
        for r in engine.step():
            results[r.request_id] = r.tokens
    assert sorted(results) == sorted([ids[1], ids[2], ids[3]])
    expected = generate(target, PROMPTS, 12)
    for i in (1, 2, 3):
        assert results[ids[i]] == expected[i]
    assert engine.abort([ids[0]]) == 0  # gone already: nothing to drop
    again = engine.generate([Request(p, greedy(12)) for p in PROMPTS])  # slots all free again
    assert [r.tokens for r in again] == expected


def test_abort_after_a_step_that_failed_before_compacting_restores_the_slot_order():
    """A step that finished every running sample, then raised before compacting, leaves freed
    slots out of order; the server's recovery (abort the step's requests) puts them back, so
    the next requests hold slots 0..n−1 again (decode reads the cache as a slice, not a gather)
    and decode exactly."""
    target, _ = make_pair()
    engine = make_engine(target, max_batch_size=3)
    ids = engine.add_requests([Request(p, greedy(4)) for p in PROMPTS[:3]])

    def boom() -> None:
        raise RuntimeError("injected failure before compaction")

    engine._compact = boom  # the instance attribute shadows the method
    with pytest.raises(RuntimeError, match="before compaction"):
        while engine.has_unfinished():
            engine.step()
    del engine._compact
    assert engine.num_running == 0 and engine.num_waiting == 0  # all three finished in it
    engine.abort(ids)
    later = engine.add_requests([Request(p, greedy(8)) for p in PROMPTS[3:5]])
    results = engine.step()
    assert sorted(s.slot for s in engine.scheduler.running) == [0, 1]
    while engine.has_unfinished():
        results += engine.step()
    tokens = {r.request_id: r.tokens for r in results}
    assert [tokens[i] for i in later] == generate(target, PROMPTS[3:5], 8)


# ----------------------------------------------------------------------- the server
V_DRAFT = 24
TOKEN = "abuse-token"
LIMITS = ServerLimits(
    max_body_bytes=1 << 18, max_prompts=64, max_n=4, max_tokens=64, max_prompt_tokens=64
)


def _target(seed: int) -> Transformer:
    tok = char_tokenizer()
    ids = special_ids(tok)
    config = preset_config(
        "toy-tiny",
        vocab_size=tok.get_vocab_size(),
        num_hidden_layers=3,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
    )
    return Transformer(config).init_weights(seed, std=0.2).to(torch.float64)


def _draft(target: Transformer, seed: int) -> Eagle3Draft:
    cfg = DraftConfig.for_target(target.config, draft_vocab_size=V_DRAFT, tap_layers=(0, 1, 2))
    draft = init_draft_weights(Eagle3Draft(cfg), seed, std=0.2).to(torch.float64)
    counts = torch.randint(
        0, 100, (target.config.vocab_size,), generator=torch.Generator().manual_seed(seed)
    )
    draft.set_vocab_map(build_vocab_map(counts, V_DRAFT))
    return draft


class Served:
    """An eagle3 + n-gram engine behind the app, uvicorn in a thread on a free loopback port."""

    def __init__(self, weights_dir: Path, *, codec: TextCodec | None = None, batch: int = 16):
        self.target = _target(0)
        self.codec = codec or TextCodec(char_tokenizer())
        spec = SpecConfig(
            proposers=("eagle3", "ngram"),
            max_k=3,
            gate=False,  # always speculate: the drafters run in every decode step
            proposer_options={"eagle3": {"draft": _draft(self.target, 1)}},
        )
        engine = RolloutEngine(
            copy.deepcopy(self.target), codec=self.codec, max_batch_size=batch, spec=spec
        )
        self.worker = EngineWorker(engine)
        self.engine = engine
        app = create_app(
            self.worker,
            self.codec,
            limits=LIMITS,
            update_token=TOKEN,
            weights_dirs=[weights_dir],
        )
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def post(self, path: str, timeout: float = 60, **kw) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", timeout=timeout, **kw)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def still_serving(self) -> None:
        """A normal request after an abuse case answers exactly the target's greedy output."""
        prompt = "12+34="
        r = self.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        ids = self.codec.encode_prompt(prompt)
        eos = special_ids(char_tokenizer())["eos"]
        expected = generate(self.engine.model, [ids], 8, eos_id=eos)[0]
        assert r.json()["choices"][0]["text"] == self.codec.decode(expected)
        assert self.health()["status"] == "ok"


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("allowed")


@pytest.fixture(scope="module")
def srv(weights_dir):
    with Served(weights_dir) as s:
        yield s


def _error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    return body["message"]


# ----------------------------------------------------------------------- item 10
@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": "1+\\ud800="}',
        b'{"prompt": ["1+1=", "\\udfff"]}',
        b'{"prompt": "1+1=", "stop": ["\\ud800"]}',
        b'{"prompt": "1+1=", "model": "m\\ud83d"}',
        b'{"prompt": "1+1=", "\\ud800": 1}',
    ],
    ids=["prompt", "prompt-list", "stop", "model", "key"],
)
def test_a_lone_surrogate_anywhere_is_a_400(srv, body):
    r = srv.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert "lone surrogate" in _error(r, 400)
    srv.still_serving()


@pytest.mark.parametrize("depth", [100_000, 17], ids=["100k", "just-over"])
def test_json_nested_too_deep_is_a_400(srv, depth):
    nested = "[" * depth + "]" * depth
    body = f'{{"prompt": "1+1=", "extra": {nested}}}'.encode()
    r = srv.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert "nested deeper than 16" in _error(r, 400)
    srv.still_serving()


def test_json_nested_within_the_bound_is_fine(srv):
    nested = "[" * 14 + "]" * 14  # 15 levels with the body object
    body = f'{{"prompt": "1+1=", "max_tokens": 2, "extra": {nested}}}'.encode()
    r = srv.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


# ----------------------------------------------------------------------- item 11
def test_an_oversized_prompt_is_refused_before_it_is_tokenized(srv, monkeypatch):
    calls = []
    encode = srv.codec.encode_prompt
    monkeypatch.setattr(srv.codec, "encode_prompt", lambda t: calls.append(len(t)) or encode(t))
    bound = prompt_char_bound(srv.codec, LIMITS.max_prompt_tokens)
    assert bound is not None and bound < 100_000
    r = srv.post("/v1/completions", json={"prompt": ["1+1=", "1" * (bound + 1)]})
    assert f"has {bound + 1} characters" in _error(r, 400)
    assert calls == []  # neither prompt was tokenized
    r = srv.post("/v1/completions", json={"prompt": "1" * bound})  # too many tokens: tokenized
    assert "limit is 64" in _error(r, 400)
    assert calls == [bound]
    monkeypatch.undo()
    srv.still_serving()


def test_health_answers_while_a_prompt_is_being_tokenized(weights_dir):
    """Tokenizing happens off the event loop: /health answers while an encode is blocked (a
    tokenizer that holds its thread until the test has its /health answer)."""
    release, entered = threading.Event(), threading.Event()
    slow = TextCodec(char_tokenizer())
    fast = slow.encode_prompt

    def blocking(text: str) -> list[int]:
        if text.startswith("slow"):
            entered.set()
            release.wait(30)
        return fast(text)

    slow.encode_prompt = blocking
    with Served(weights_dir, codec=slow) as s, ThreadPoolExecutor(4) as pool:
        body = {"prompt": "slow 1+1=", "max_tokens": 2}
        futures = [pool.submit(s.post, "/v1/completions", json=body) for _ in range(4)]
        assert entered.wait(30)
        try:
            health = httpx.get(f"{s.url}/health", timeout=10)
        finally:
            release.set()
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert all(f.result().status_code == 200 for f in futures)
        s.still_serving()


# ----------------------------------------------------------------------- item 12
def test_a_client_that_disconnects_cancels_its_work(srv):
    before = srv.health()
    body = json.dumps(
        {"prompt": [f"{i}+{i}=" for i in range(64)], "n": 4, "max_tokens": 64, "temperature": 1}
    ).encode()
    total = 64 * 4
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.monotonic() + 60
        while srv.health()["running"] == 0:  # in the engine
            assert time.monotonic() < deadline, "the request never reached the engine"
            time.sleep(0.01)
    deadline = time.monotonic() + 60
    while (h := srv.health())["running"] + h["waiting"] > 0:  # dropped, not decoded
        assert time.monotonic() < deadline, "the abandoned work kept running"
        time.sleep(0.02)
    assert h["cancelled"] - before["cancelled"] == 64  # every request of the call
    assert h["finished"] - before["finished"] < total  # most samples never ran
    metrics = httpx.get(f"{srv.url}/metrics", timeout=30).text
    assert f"specrl_requests_cancelled_total {float(h['cancelled'])!r}" in metrics
    srv.still_serving()


# ----------------------------------------------------------------------- items 10/13: failing steps
class _Flaky:
    """Wraps a proposer's ``propose`` to raise on its next ``failures`` calls."""

    def __init__(self, proposer, failures: int) -> None:
        self.inner, self.left = proposer.propose, failures

    def __call__(self, batch, ks):
        if self.left > 0:
            self.left -= 1
            raise RuntimeError("injected drafting failure")
        return self.inner(batch, ks)


def test_a_failing_step_fails_its_requests_and_the_server_keeps_serving(srv, monkeypatch):
    before = srv.health()
    monkeypatch.setattr(
        srv.engine.proposers["ngram"], "propose", _Flaky(srv.engine.proposers["ngram"], 1)
    )
    monkeypatch.setattr(
        srv.engine.proposers["eagle3"], "propose", _Flaky(srv.engine.proposers["eagle3"], 1)
    )
    r = srv.post("/v1/completions", json={"prompt": "5+5=", "max_tokens": 8, "temperature": 0})
    message = _error(r, 500)
    assert "injected drafting failure" in message and "keeps serving" in message
    h = srv.health()
    assert h["step_failures"] == before["step_failures"] + 1
    assert h["running"] == h["waiting"] == 0
    srv.still_serving()  # and with speculation: the other proposers' state is intact
    r = srv.post("/v1/completions", json={"prompt": "5+5=", "max_tokens": 8, "n": 3})
    assert r.status_code == 200 and len(r.json()["choices"]) == 3


def test_a_failing_step_spares_the_requests_still_queued():
    """Deterministic at the worker: with one slot, A is in the failing step and B still waits;
    A fails, B is served exactly, and so is C after."""
    target = _target(0)
    codec = TextCodec(char_tokenizer())
    spec = SpecConfig(proposers=("ngram",), max_k=3, gate=False)
    engine = RolloutEngine(copy.deepcopy(target), codec=codec, max_batch_size=1, spec=spec)
    ngram = engine.proposers["ngram"]
    ngram.propose = _Flaky(ngram, 1)  # the first decode step (A's) raises
    worker = EngineWorker(engine)
    params = SamplingParams(max_tokens=6, temperature=0)
    a, b, c = (Request(codec.encode_prompt(p), params) for p in ("1+1=", "2+2=", "3+3="))

    async def main():
        ta = asyncio.ensure_future(worker.generate([a]))
        tb = asyncio.ensure_future(worker.generate([b]))
        await asyncio.sleep(0)  # both queued before the worker starts
        worker.start()
        out_a = await asyncio.gather(ta, return_exceptions=True)
        out_b = await tb
        out_c = await worker.generate([c])
        return out_a[0], out_b, out_c

    try:
        err, out_b, out_c = asyncio.run(main())
    finally:
        worker.stop(30)
    assert isinstance(err, StepFailure) and "injected drafting failure" in str(err)
    eos = special_ids(char_tokenizer())["eos"]
    for req, out in ((b, out_b), (c, out_c)):
        assert out[0].tokens == generate(target, [req.prompt], 6, eos_id=eos)[0]
    assert worker.failure is None and worker.step_failures == 1  # it kept serving


# ----------------------------------------------------------------------- items 13/14: weights
def _save(tensors: dict[str, torch.Tensor], path: Path) -> Path:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def _update(srv, path, target="policy", **extra) -> httpx.Response:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    return srv.post(
        "/v1/weights", json={"path": str(path), "target": target, **extra}, headers=auth
    )


@pytest.mark.parametrize(
    ("target", "case", "needle"),
    [
        ("policy", "int64", "dtype int64"),
        ("policy", "nan", "non-finite"),
        ("draft", "nan", "non-finite"),
        ("draft", "d2t", "outside the target vocabulary"),
    ],
)
def test_bad_weight_files_are_refused_and_nothing_changes(srv, weights_dir, target, case, needle):
    if target == "policy":
        state = {k: v.clone() for k, v in _target(3).state_dict().items()}
        name = "model.layers.0.mlp.down_proj.weight"
    else:
        d = _draft(srv.target, 4)
        state = {k: v.clone() for k, v in d.state_dict().items() if not k.startswith("embed")}
        name = "fc.weight"
    if case == "int64":
        state[name] = torch.ones_like(state[name], dtype=torch.int64)
    elif case == "nan":
        state[name][0, -1] = float("nan")
    else:
        state["d2t"][-1] += 10_000
    before = srv.health()
    r = _update(srv, _save(state, weights_dir / f"bad-{target}-{case}.safetensors"), target)
    assert needle in _error(r, 400)
    after = srv.health()
    assert (after["policy_version"], after["draft_version"]) == (
        before["policy_version"],
        before["draft_version"],
    )
    srv.still_serving()


def test_a_good_update_from_an_allowed_directory_is_applied(srv, weights_dir):
    state = srv.engine.model.state_dict()
    r = _update(srv, _save(state, weights_dir / "same.safetensors"), version=41)
    assert r.status_code == 200 and r.json()["policy_version"] == 41
    srv.still_serving()


def test_weight_paths_outside_the_allowed_directories_reveal_nothing(srv, weights_dir, tmp_path):
    outside = _save(srv.engine.model.state_dict(), tmp_path / "outside.safetensors")
    link = weights_dir / "link.safetensors"
    link.symlink_to(outside)
    secret = tmp_path / "secret.safetensors"
    secret.write_bytes(b"not weights at all" * 100)
    messages = set()
    for path in (
        outside,  # a real weight file, outside
        secret,  # an existing file, outside
        tmp_path / "missing.safetensors",  # no such file, outside
        link,  # inside by name, outside once resolved
        weights_dir / ".." / tmp_path.name / "outside.safetensors",  # '..' out of it
        "/etc/shadow",
        "/etc/passwd",
    ):
        messages.add(_error(_update(srv, path), 400))
    assert len(messages) == 1  # one answer whatever exists there
    (message,) = messages
    assert "--weights-dir" in message and "bytes" not in message
    assert "absolute" in _error(_update(srv, "relative/x.safetensors"), 400)
    fifo = weights_dir / "fifo.safetensors"
    os.mkfifo(fifo)
    assert "not a regular file" in _error(_update(srv, fifo), 400)  # and nothing hangs
    assert "does not exist" in _error(_update(srv, weights_dir / "nope.safetensors"), 400)
    srv.still_serving()


def test_without_allowed_directories_no_path_is_read(tmp_path):
    target = _target(0)
    codec = TextCodec(char_tokenizer())
    engine = RolloutEngine(target, codec=codec, max_batch_size=2)
    app = create_app(EngineWorker(engine), codec, update_token=TOKEN)
    weights = _save(target.state_dict(), tmp_path / "w.safetensors")

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(
                "/v1/weights",
                json={"path": str(weights)},
                headers={"Authorization": f"Bearer {TOKEN}"},
            )

    assert "--weights-dir" in _error(asyncio.run(main()), 400)


def test_serve_refuses_a_weights_dir_that_is_not_a_directory(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=r"--weights-dir '.*nope' is not a directory"):
        serve_command(target=tmp_path, weights_dir=[tmp_path, missing])


def test_long_texts_encode_through_the_gil_free_path_to_the_same_ids():
    """HFTokenizer.encode sends texts over LONG_TEXT characters through encode_batch (which
    releases the GIL, so tokenizing in the server's thread pool leaves the event loop free);
    the ids are those of encode, for the character tokenizer and a byte-level BPE alike."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = ["12+34=46", "the sum of 7 and 8 is 15", "ünïcödé ✓ text"] * 20
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    calls: list[int] = []

    class Spy:  # the real backend, recording the texts sent through encode_batch
        def __init__(self, backend) -> None:
            self.backend, self.encode = backend, backend.encode

        def encode_batch(self, texts, **kw):
            calls.append(len(texts[0]))
            return self.backend.encode_batch(texts, **kw)

    for tok in (char_tokenizer(), HFTokenizer(bpe, {})):
        backend = tok.backend
        tok.backend = Spy(backend)
        for n in (LONG_TEXT, LONG_TEXT + 1, 50_000):
            text = ("12+34=46 ünï ✓ " * (n // 14 + 1))[:n]
            assert tok.encode(text) == backend.encode(text).ids
            assert tok.encode(text, add_special_tokens=False) == (
                backend.encode(text, add_special_tokens=False).ids
            )
    assert calls == [LONG_TEXT + 1, LONG_TEXT + 1, 50_000, 50_000] * 2
