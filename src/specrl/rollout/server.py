"""OpenAI-compatible HTTP server over one :class:`~specrl.rollout.engine.RolloutEngine`.

Endpoints:

- ``POST /v1/completions``: OpenAI's completions API (``prompt`` string or list of strings,
  ``max_tokens``, ``temperature``, ``top_p``, ``top_k`` (vLLM's extension; 0 or −1 is off),
  ``n``, ``stop``, ``seed``, ``logprobs``).  ``logprobs: 0`` returns ``token_logprobs`` under the
  sampling distribution actually used and, as an extension, ``policy_token_logprobs`` (raw
  policy at temperature 1; what RL importance ratios need).  Top alternatives are not computed,
  so ``logprobs`` > 0 is refused.  Each choice also carries ``spec`` (its speculation stats).
- ``GET /health``: liveness plus policy/draft versions and queue sizes.
- ``GET /metrics``: Prometheus text format (engine counters, τ, per-position acceptance…).
- ``POST /v1/weights``: ``{"path": file.safetensors, "target": "policy"|"draft", "version"}``
  loads weights from the server's own disk, guarded by a bearer token; refused (403) when the
  server was started without one.  Only files inside the operator's ``weights_dirs`` are read
  (symlinks and ``..`` resolved first); any other path gets one and the same 400, whether or not
  it exists, so the endpoint tells nothing about files outside.  The update is validated
  completely (:mod:`specrl.rollout.weights`: names, shapes, dtypes, finite values, the draft's
  vocabulary map) before any weight is replaced.

Concurrency: one :class:`EngineWorker` thread owns the engine.  Handlers put requests on its
queue and await a future; the worker admits everything queued between two steps, so requests
of many clients share one continuous batch.  Weight updates run between steps.  The event loop
never does request-sized work: bodies are parsed and prompts tokenized in a thread pool, and
``/health`` reads a few counters without waiting for the engine.

Bounds, all checked before tokenizing: request body bytes (413), JSON nesting depth, strings
that are not Unicode text (lone surrogates such as ``"\\ud800"``), prompts per request, prompt
characters, ``max_tokens``, ``n`` and stop strings (400, with a message naming the field); then
prompt tokens.  Errors use OpenAI's error object, unexpected ones too (500).

Failure and abandonment: a client that disconnects cancels its request — its samples leave the
engine (queued or running) at the next step boundary.  An engine step that raises fails the
requests that were in it (500 with the error) and the worker goes on serving the others and
later ones; only a failure of the worker itself answers 503.
Shutdown: uvicorn stops accepting on SIGINT/SIGTERM and lets in-flight requests finish; then the
lifespan hook stops the worker after it drained its queue.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import os
import queue
import stat
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, PlainTextResponse

from specrl.errors import SpecrlError
from specrl.models.checkpoint import read_safetensors
from specrl.models.tokenizer import TextCodec
from specrl.rollout.engine import Request, Result, RolloutEngine
from specrl.rollout.sampling import SamplingParams

log = logging.getLogger("specrl.rollout.server")


@dataclass(frozen=True)
class ServerLimits:
    """Per-request bounds (the engine's max_model_len bounds prompt + max_tokens as well)."""

    max_body_bytes: int = 1 << 20
    max_prompts: int = 64  # prompts in one request
    max_prompt_tokens: int = 4096
    # characters of one prompt, checked before tokenizing; None: the most that max_prompt_tokens
    # tokens can cover (prompt_char_bound)
    max_prompt_chars: int | None = None
    max_tokens: int = 4096
    max_n: int = 16
    max_stop: int = 4  # stop strings (OpenAI's limit)
    max_json_depth: int = 16  # nesting of arrays/objects in a request body


class ApiError(Exception):
    """A client error rendered as OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class StepFailure(Exception):
    """The engine step a request was in raised; the request was dropped (the server goes on)."""


class ClientGone(Exception):
    """The client disconnected before its results were ready; its work was cancelled."""


# ---------------------------------------------------------------------------- engine worker
class _Job:
    """Futures of one HTTP call waiting for the worker (results, or a weight update)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.future: asyncio.Future = loop.create_future()
        self.results: list[Result] = []
        self.pending = 0

    def resolve(self, value: Any = None, error: BaseException | None = None) -> None:
        def settle() -> None:
            if self.future.done():  # the client went away
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(value)

        self.loop.call_soon_threadsafe(settle)


class EngineWorker:
    """Owns the engine in one thread; requests of many clients join its continuous batch."""

    poll_seconds = 0.05  # how often a waiting handler checks that its client is still there

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[tuple[str, Any, _Job | None]] = queue.SimpleQueue()
        self._jobs: dict[str, _Job] = {}  # request id → job
        self._lock = threading.Lock()  # engine state, for stats() from other threads
        self._thread = threading.Thread(target=self._loop, name="specrl-engine", daemon=True)
        self._next = 0
        self.failure: BaseException | None = None  # the worker itself failed: no more serving
        self.delivered = 0  # samples returned to clients
        self.cancelled = 0  # requests dropped because their client went away
        self.step_failures = 0  # engine steps that raised (their requests failed)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Finish everything queued, then end the thread."""
        if self._thread.is_alive():
            self._inbox.put(("stop", None, None))
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.failure is None

    def snapshot(self) -> dict[str, Any]:
        """The engine's stats (waits for the step under way) and the worker's counters."""
        with self._lock:
            stats = self.engine.stats()
        return {**stats, "server": self.counters()}

    def counters(self) -> dict[str, int]:
        return {
            "delivered": self.delivered,
            "cancelled": self.cancelled,
            "step_failures": self.step_failures,
        }

    def health(self) -> dict[str, Any]:
        """Versions and queue sizes, read without waiting for the engine (ints the worker
        thread updates; a read may be one step old)."""
        e = self.engine
        return {
            "policy_version": e.policy_version,
            "draft_version": e.draft_version,
            "running": e.num_running,
            "waiting": e.num_waiting,
            "finished": self.delivered,
            **{k: v for k, v in self.counters().items() if k != "delivered"},
        }

    async def generate(
        self,
        requests: list[Request],
        disconnected: Callable[[], Awaitable[bool]] | None = None,
    ) -> list[Result]:
        """Results of all samples of ``requests`` (request-major, then sample index).

        ``disconnected``: polled while waiting; once it answers True the requests leave the
        engine and :class:`ClientGone` is raised (as they do when the handler is cancelled)."""
        job = _Job(asyncio.get_running_loop())
        self._inbox.put(("generate", requests, job))
        try:
            while True:
                done, _ = await asyncio.wait({job.future}, timeout=self.poll_seconds)
                if done:
                    return job.future.result()
                if disconnected is not None and await disconnected():
                    self._inbox.put(("cancel", None, job))
                    raise ClientGone("the client disconnected; its requests were cancelled")
        except asyncio.CancelledError:
            self._inbox.put(("cancel", None, job))
            raise

    async def update_weights(self, **kwargs: Any) -> None:
        job = _Job(asyncio.get_running_loop())
        self._inbox.put(("weights", kwargs, job))
        await job.future

    def _loop(self) -> None:
        stopping = False
        while True:
            busy = self.engine.has_unfinished()
            if not busy and stopping:
                return
            try:
                item = self._inbox.get(block=not busy)
            except queue.Empty:
                item = None
            while item is not None:
                stopping |= self._handle(*item)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    item = None
            if not self.engine.has_unfinished():
                continue
            try:
                with self._lock:
                    finished = self.engine.step()
            except Exception as exc:
                if not self._fail_step(exc):
                    return
                continue
            for r in finished:
                self._deliver(r)

    def _fail_step(self, exc: Exception) -> bool:
        """A step raised: fail the requests that were in it (every request with a sample out of
        the queue), drop them from the engine, keep serving.  False when even that failed."""
        self.step_failures += 1
        log.error("engine step failed; failing the requests in it", exc_info=exc)
        first = (str(exc).splitlines() or [""])[0][:200]
        error = StepFailure(f"the engine step failed ({type(exc).__name__}: {first})")
        try:
            with self._lock:
                queued = self.engine.queued_requests()
                failed = {id(job): job for rid, job in self._jobs.items() if rid not in queued}
                ids = [rid for rid, job in self._jobs.items() if id(job) in failed]
                self.engine.abort(ids)
        except Exception as again:  # the engine cannot recover: fail everyone, stop serving
            self.failure = again
            log.error("the engine could not drop the failed requests; stopping", exc_info=again)
            for job in {id(j): j for j in self._jobs.values()}.values():
                job.resolve(error=error)
            self._jobs.clear()
            return False
        for rid in ids:
            del self._jobs[rid]
        for job in failed.values():
            job.resolve(error=error)
        return True

    def _handle(self, kind: str, payload: Any, job: _Job | None) -> bool:
        """Apply one inbox item; True for the stop sentinel."""
        if kind == "stop":
            return True
        assert job is not None
        if kind == "cancel":
            self._cancel(job)
            return False
        try:
            with self._lock:
                if kind == "weights":
                    self.engine.update_weights(**payload)
                    job.resolve(None)
                    return False
                for r in payload:
                    r.request_id = f"srv-{self._next}"
                    self._next += 1
                ids = self.engine.add_requests(payload)
        except (ValueError, SpecrlError) as exc:
            job.resolve(error=exc)
            return False
        except Exception as exc:  # a bug, but only this call's: answer 500, keep serving
            log.error("engine call %r failed", kind, exc_info=exc)
            job.resolve(error=StepFailure(f"the engine failed ({type(exc).__name__}: {exc})"))
            return False
        job.pending = sum(r.params.n for r in payload)
        for rid in ids:
            self._jobs[rid] = job
        return False

    def _cancel(self, job: _Job) -> None:
        """Drop a job's requests from the engine (its client is gone); no-op once answered."""
        ids = [rid for rid, j in self._jobs.items() if j is job]
        if not ids:
            return
        with self._lock:
            self.engine.abort(ids)
        for rid in ids:
            del self._jobs[rid]
        self.cancelled += len(ids)

    def _deliver(self, result: Result) -> None:
        job = self._jobs[result.request_id]
        job.results.append(result)
        job.pending -= 1
        self.delivered += 1
        if job.pending == 0:
            order = {rid: i for i, rid in enumerate(self._jobs)}
            job.results.sort(key=lambda r: (order[r.request_id], r.index))
            for r in job.results:
                self._jobs.pop(r.request_id, None)
            job.resolve(job.results)


# ---------------------------------------------------------------------------- parsing
async def read_body(request: HttpRequest, max_bytes: int) -> bytes:
    """A request body, read with a byte cap (413)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"request body of {declared} bytes exceeds the {max_bytes}-byte limit")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise ApiError(413, f"request body exceeds the {max_bytes}-byte limit")
    return bytes(body)


def parse_json(body: bytes, max_depth: int) -> dict[str, Any]:
    """The JSON object of a body (400 unless it is one): nested at most ``max_depth`` arrays or
    objects deep, every string (keys too) Unicode text — a lone surrogate escape such as
    ``"\\ud800"`` decodes to a str that no tokenizer or encoder takes."""
    try:
        data = json.loads(body)
    except RecursionError:  # the C scanner's own guard, long before the interpreter's stack
        raise ApiError(400, f"JSON nested deeper than {max_depth} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"malformed JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    stack: list[tuple[Any, int, str]] = [(data, 1, "")]
    while stack:
        value, depth, where = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > max_depth:
                raise ApiError(400, f"JSON nested deeper than {max_depth} levels", where or None)
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    _text(key, where or "body")
                    path = f"{where}.{key}" if where else key
                else:
                    path = f"{where}[{key}]"
                stack.append((item, depth + 1, path))
        elif isinstance(value, str):
            _text(value, where)
    return data


def _text(value: str, where: str) -> None:
    if value.isascii():
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = ord(value[exc.start])
        raise ApiError(
            400,
            f"'{where}' is not valid Unicode text: lone surrogate \\u{char:04x} at character "
            f"{exc.start}",
            where.split(".")[0].split("[")[0] or None,
        ) from None


def prompt_char_bound(codec: TextCodec, max_prompt_tokens: int) -> int | None:
    """The most characters ``max_prompt_tokens`` tokens can cover, so longer prompts are refused
    before tokenizing: tokens × the longest vocabulary entry (a byte-level BPE entry is one
    character per byte, so it bounds characters too), × 4 when the tokenizer normalizes text
    (NFC composes at most 4 code points into one).  None where no such bound exists (a
    WordPiece model maps an arbitrarily long unknown word to one token)."""
    backend = getattr(codec.tokenizer, "backend", None)
    get_vocab = getattr(backend, "get_vocab", None)
    if get_vocab is None or type(getattr(backend, "model", None)).__name__ == "WordPiece":
        return None
    longest = max((len(t) for t in get_vocab(with_added_tokens=True)), default=1)
    return max_prompt_tokens * longest * (4 if backend.normalizer is not None else 1)


def _int(body: dict, name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"'{name}' must be an integer", name)
    if v < lo or (hi is not None and v > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise ApiError(400, f"'{name}' must be {bound}, got {v}", name)
    return v


def _float(body: dict, name: str, default: float, lo: float, hi: float, lo_open=False) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ApiError(400, f"'{name}' must be a number", name)
    if v < lo or v > hi or (lo_open and v == lo):
        interval = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise ApiError(400, f"'{name}' must be in {interval}, got {v}", name)
    return float(v)


def parse_completion(
    body: dict[str, Any],
    codec: TextCodec,
    limits: ServerLimits,
    max_model_len: int,
    max_chars: int | None = None,
) -> tuple[list[Request], list[int]]:
    """Engine requests (one per prompt) and prompt token counts from a completions body.

    Everything that needs no tokenizer is checked first (fields, counts, each prompt's length
    against ``max_chars``), so an oversized prompt is refused without being tokenized."""
    prompts = _prompts(body, limits)
    params = _sampling_params(body, limits)
    if max_chars is not None:
        for i, text in enumerate(prompts):
            if len(text) > max_chars:
                raise ApiError(
                    400,
                    f"prompt {i} has {len(text)} characters; at most {max_chars} can fit in "
                    f"the {limits.max_prompt_tokens}-token limit",
                    "prompt",
                )
    requests, counts = [], []
    for i, text in enumerate(prompts):
        ids = codec.encode_prompt(text)
        if not ids:
            raise ApiError(400, f"prompt {i} is empty", "prompt")
        if len(ids) > limits.max_prompt_tokens:
            raise ApiError(
                400,
                f"prompt {i} has {len(ids)} tokens; the limit is {limits.max_prompt_tokens}",
                "prompt",
            )
        if len(ids) + params.max_tokens > max_model_len:
            raise ApiError(
                400,
                f"prompt {i} ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"the model length {max_model_len}",
                "max_tokens",
            )
        requests.append(Request(ids, params))
        counts.append(len(ids))
    return requests, counts


def _prompts(body: dict[str, Any], limits: ServerLimits) -> list[str]:
    """The body's prompts (a string or a list of them), refusing what is not supported."""
    if body.get("stream"):
        raise ApiError(400, "streaming is not supported", "stream")
    if body.get("echo"):
        raise ApiError(400, "echo is not supported", "echo")
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ApiError(400, "'prompt' must be a string or a non-empty list of strings", "prompt")
    if len(prompts) > limits.max_prompts:
        raise ApiError(400, f"at most {limits.max_prompts} prompts per request", "prompt")
    return prompts


def _sampling_params(body: dict[str, Any], limits: ServerLimits) -> SamplingParams:
    """The body's sampling fields, each checked against its type and bounds."""
    max_tokens = _int(body, "max_tokens", 16, 1, limits.max_tokens)
    n = _int(body, "n", 1, 1, limits.max_n)
    top_k = _int(body, "top_k", 0, -1)
    seed = _int(body, "seed", None, -(2**63))
    if _int(body, "logprobs", None, 0):
        raise ApiError(
            400,
            "only logprobs=0 is supported (sampled-token logprobs, no alternatives)",
            "logprobs",
        )
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "'stop' must be a non-empty string or a list of them", "stop")
    if len(stops) > limits.max_stop:
        raise ApiError(400, f"at most {limits.max_stop} stop strings", "stop")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_float(body, "temperature", 1.0, 0.0, 100.0),
        top_p=_float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=max(top_k, 0),
        seed=seed,
        n=n,
        stop=tuple(stops),
    )


def completion_response(
    results: list[Result],
    prompt_tokens: list[int],
    codec: TextCodec,
    model_name: str,
    want_logprobs: bool,
) -> dict[str, Any]:
    choices = []
    for i, r in enumerate(results):
        choice: dict[str, Any] = {
            "index": i,
            "text": r.text,
            "logprobs": None,
            "finish_reason": r.finish_reason,
            "stop_reason": r.stop_reason,
            "spec": r.spec,
        }
        if want_logprobs:
            pieces = [codec.decode([t]) for t in r.tokens]
            offsets, pos = [], 0
            for piece in pieces:
                offsets.append(pos)
                pos += len(piece)
            choice["logprobs"] = {
                "tokens": pieces,
                "token_logprobs": r.logprobs,
                "policy_token_logprobs": r.policy_logprobs,
                "top_logprobs": None,
                "text_offset": offsets,
            }
        choices.append(choice)
    completion = sum(len(r.tokens) for r in results)
    prompt = sum(prompt_tokens)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }


# ---------------------------------------------------------------------------- metrics text
def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _at(*path: str) -> Callable[[dict[str, Any]], list[tuple[dict[str, str], Any]]]:
    """One unlabelled sample: the stats value at ``path`` (keys, outermost first)."""

    def samples(stats: dict[str, Any]) -> list[tuple[dict[str, str], Any]]:
        value: Any = stats
        for key in path:
            value = value[key]
        return [({}, value)]

    return samples


# (name, kind, help, samples of the stats dict): the /metrics page, in order.  The stats are
# RolloutEngine.stats() (Counters.to_dict() and the engine's state), plus the HTTP worker's own
# counters under "server" (EngineWorker.counters) for _SERVER_METRICS.
_Samples = Callable[[dict[str, Any]], list[tuple[dict[str, str], Any]]]
_METRICS: tuple[tuple[str, str, str, _Samples], ...] = (
    ("tokens_total", "counter", "Tokens emitted.", _at("tokens")),
    ("steps_total", "counter", "Engine steps.", _at("steps")),
    (
        "target_forwards_total",
        "counter",
        "Target model forwards.",
        lambda s: [
            ({"kind": "prefill"}, s["prefill_forwards"]),
            ({"kind": "decode"}, s["decode_forwards"]),
        ],
    ),
    ("busy_seconds_total", "counter", "Seconds spent in engine steps.", _at("seconds")),
    ("sequences_finished_total", "counter", "Finished samples.", _at("finished")),
    ("sequences_running", "gauge", "Samples in KV-cache slots.", _at("running")),
    ("sequences_waiting", "gauge", "Samples waiting for a slot.", _at("waiting")),
    ("spec_drafts_total", "counter", "Verifications that carried a draft.", _at("spec", "drafts")),
    ("spec_draft_tokens_total", "counter", "Draft tokens verified.", _at("spec", "draft_tokens")),
    ("spec_accepted_tokens_total", "counter", "Draft tokens accepted.", _at("spec", "accepted")),
    ("spec_tau", "gauge", "Mean acceptance length 1 + accepted/drafts.", _at("spec", "tau")),
    (
        "spec_position_acceptance",
        "gauge",
        "Acceptance rate at each draft position.",
        lambda s: [({"position": str(i + 1)}, v) for i, v in enumerate(s["spec"]["per_position"])],
    ),
    (
        "spec_proposer_drafts_total",
        "counter",
        "Drafts per proposer.",
        lambda s: [({"proposer": k}, v) for k, v in sorted(s["spec"]["selections"].items())],
    ),
    (
        "spec_gate_on",
        "gauge",
        "1 while the batch-size gate allows speculation (at the batch size of the last step).",
        _at("gating", "gate_on"),
    ),
    ("spec_gate_switches_total", "counter", "Gate state changes.", _at("gating", "gate_switches")),
    (
        "spec_alarms_total",
        "counter",
        "Stale-draft alarms (τ ≈ 1 after a weight update).",
        _at("alarms"),
    ),
    ("policy_version", "gauge", "Policy weights version.", _at("policy_version")),
    ("draft_version", "gauge", "Draft weights version.", _at("draft_version")),
)
_SERVER_METRICS: tuple[tuple[str, str, str, _Samples], ...] = (
    (
        "requests_cancelled_total",
        "counter",
        "Requests dropped because their client disconnected.",
        _at("server", "cancelled"),
    ),
    (
        "step_failures_total",
        "counter",
        "Engine steps that raised (the requests in them failed).",
        _at("server", "step_failures"),
    ),
)


def prometheus_text(stats: dict[str, Any]) -> str:
    """Engine stats in the Prometheus text exposition format (version 0.0.4): every metric of
    :data:`_METRICS` (and :data:`_SERVER_METRICS` when the stats carry the worker's counters),
    its HELP and TYPE lines, then one line per sample whose value is known."""
    table = _METRICS + (_SERVER_METRICS if stats.get("server") is not None else ())
    lines: list[str] = []
    for name, kind, help_, samples in table:
        lines += [f"# HELP specrl_{name} {help_}", f"# TYPE specrl_{name} {kind}"]
        for labels, value in samples(stats):
            if value is None:
                continue
            tag = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
            sample = f"specrl_{name}{{{tag}}}" if tag else f"specrl_{name}"
            lines.append(f"{sample} {float(value)!r}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- weight files
OUTSIDE = (
    "'path' must name a .safetensors file inside a directory this server loads weights from "
    "(rollout serve --weights-dir DIR)"
)


def confine(path: Any, allowed: Sequence[Path]) -> Path:
    """The real path of weight file ``path`` if it lies inside one of the ``allowed``
    directories (already resolved), after resolving symlinks and ``..``; otherwise the one
    :data:`OUTSIDE` error, the same whether the file exists or not."""
    if not isinstance(path, str) or not path.endswith(".safetensors") or "\0" in path:
        raise ApiError(400, OUTSIDE, "path")
    if not os.path.isabs(path):
        raise ApiError(400, "'path' must be an absolute path", "path")
    real = Path(os.path.realpath(path))
    if not any(real.is_relative_to(root) for root in allowed):
        raise ApiError(400, OUTSIDE, "path")
    try:  # inside an allowed directory the operator can be told what is wrong
        info = os.stat(real)
    except OSError:
        raise ApiError(400, f"'{path}' does not exist", "path") from None
    if not stat.S_ISREG(info.st_mode):
        raise ApiError(400, f"'{path}' is not a regular file", "path")
    return real


# ---------------------------------------------------------------------------- the app
@dataclass(frozen=True)
class _Server:
    """What the route handlers read (``app.state.server``)."""

    worker: EngineWorker
    codec: TextCodec
    model_name: str
    limits: ServerLimits
    max_chars: int | None  # prompt characters refused before tokenizing (prompt_char_bound)
    update_token: str | None  # None: POST /v1/weights is refused
    allowed: list[Path]  # resolved directories weight files may be read from
    on_shutdown: Callable[[], None] | None


def create_app(
    worker: EngineWorker,
    codec: TextCodec,
    *,
    model_name: str = "specrl",
    limits: ServerLimits | None = None,
    update_token: str | None = None,
    weights_dirs: Sequence[str | os.PathLike[str]] = (),
    on_shutdown: Callable[[], None] | None = None,
) -> FastAPI:
    """The FastAPI app; its lifespan starts the worker and stops it after the last request.

    ``weights_dirs``: the directories ``POST /v1/weights`` may read files from (none: every
    path is refused)."""
    limits = limits or ServerLimits()
    max_chars = (
        limits.max_prompt_chars
        if limits.max_prompt_chars is not None
        else prompt_char_bound(codec, limits.max_prompt_tokens)
    )
    allowed = [Path(os.path.realpath(d)) for d in weights_dirs]
    app = FastAPI(title="specrl rollout server", lifespan=_lifespan)
    app.state.server = _Server(
        worker, codec, model_name, limits, max_chars, update_token, allowed, on_shutdown
    )
    app.add_exception_handler(ApiError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _internal_error)
    app.add_api_route("/v1/completions", _completions, methods=["POST"])
    app.add_api_route("/health", _health, methods=["GET"])
    app.add_api_route("/metrics", _metrics, methods=["GET"])
    app.add_api_route("/v1/weights", _weights, methods=["POST"])
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    server: _Server = app.state.server
    server.worker.start()
    yield
    await run_in_threadpool(server.worker.stop)
    if server.on_shutdown is not None:
        server.on_shutdown()


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    """OpenAI's error object."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status)


async def _api_error(_request: HttpRequest, exc: ApiError) -> JSONResponse:
    return _error(exc.status, exc.message, exc.param)


async def _internal_error(_request: HttpRequest, exc: Exception) -> JSONResponse:
    log.error("unexpected error in a request handler", exc_info=exc)
    return _error(500, f"internal server error ({type(exc).__name__})")


async def _read_json(request: HttpRequest) -> dict[str, Any]:
    limits = request.app.state.server.limits
    body = await read_body(request, limits.max_body_bytes)
    return await run_in_threadpool(parse_json, body, limits.max_json_depth)


async def _completions(request: HttpRequest) -> JSONResponse:
    """``POST /v1/completions``."""
    server: _Server = request.app.state.server
    worker = server.worker
    body = await _read_json(request)
    # tokenizing is request-sized work: off the event loop, after every cheaper check
    requests, counts = await run_in_threadpool(
        parse_completion,
        body,
        server.codec,
        server.limits,
        worker.engine.max_model_len,
        server.max_chars,
    )
    if not worker.alive:
        raise ApiError(503, "the engine is not running")
    try:
        results = await worker.generate(requests, request.is_disconnected)
    except ClientGone as exc:  # nobody reads this answer; uvicorn drops it
        raise ApiError(499, str(exc)) from None
    except StepFailure as exc:
        raise ApiError(500, f"{exc}; the request was dropped, the server keeps serving") from None
    except (ValueError, SpecrlError) as exc:
        raise ApiError(400, str(exc)) from None
    name = body.get("model") if isinstance(body.get("model"), str) else server.model_name
    want = body.get("logprobs") is not None
    response = await run_in_threadpool(
        completion_response, results, counts, server.codec, name, want
    )
    return JSONResponse(response)


async def _health(request: HttpRequest) -> JSONResponse:
    """``GET /health``: answered without waiting for the engine."""
    worker = request.app.state.server.worker
    body = {"status": "ok" if worker.alive else "failed", **worker.health()}
    return JSONResponse(body, status_code=200 if worker.alive else 503)


async def _metrics(request: HttpRequest) -> PlainTextResponse:
    """``GET /metrics``: waits for the step under way."""
    stats = await run_in_threadpool(request.app.state.server.worker.snapshot)
    return PlainTextResponse(prometheus_text(stats), media_type="text/plain; version=0.0.4")


async def _weights(request: HttpRequest) -> JSONResponse:
    """``POST /v1/weights``: bearer token, a file inside ``weights_dirs``, validated by the
    engine before any weight is replaced."""
    server: _Server = request.app.state.server
    if server.update_token is None:
        raise ApiError(
            403,
            "weight updates are disabled: start the server with --update-token-file FILE "
            "or SPECRL_UPDATE_TOKEN set",
        )
    given = request.headers.get("authorization", "")
    expected = f"Bearer {server.update_token}"
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise ApiError(401, "missing or wrong bearer token")
    body = await _read_json(request)
    target = body.get("target", "policy")
    if target not in ("policy", "draft"):
        raise ApiError(400, "'target' must be 'policy' or 'draft'", "target")
    version = _int(body, "version", None, 0)
    path = await run_in_threadpool(confine, body.get("path"), server.allowed)
    try:
        state = await run_in_threadpool(read_safetensors, [path])
        # validated completely by the engine before anything is replaced
        await server.worker.update_weights(**{target: state}, version=version)
    except SpecrlError as exc:
        raise ApiError(400, exc.message) from None
    except StepFailure as exc:
        raise ApiError(500, str(exc)) from None
    h = server.worker.health()
    return JSONResponse(
        {"status": "ok", "policy_version": h["policy_version"], "draft_version": h["draft_version"]}
    )
