"""The RL loop with online draft co-training (``specrl train``).

:func:`build_trainer` puts a run together in a fixed order — recipe checks, the parallel layout
(:mod:`specrl.train.layout`), the artifacts (:mod:`specrl.train.artifacts`: rank 0 warm-starts
the policy and initialises the draft where the recipe says how), the models
(:func:`~specrl.train.artifacts.load_models`, from the newest checkpoint on resume), then
:class:`RLTrainer`: the rollout engine from copies of the plain policy and draft
(:func:`specrl.rollout.factory.build_engine`), the parallelisms
(:func:`specrl.train.parallelize.parallelize_policy` → a
:class:`~specrl.train.strategy.PolicyStrategy`) and the optimizers.

One step (:meth:`RLTrainer.step`):

1. **rollout** — ``prompts_per_step`` prompts × ``n`` samples through the speculative engine,
   with per-sample seeds derived from (seed, step, prompt), so sampling does not depend on batch
   composition; the step's speculation metrics are the ``generate`` call's own statistics;
2. **rewards** from the task's verifier, **group advantages** (GRPO; DAPO dynamic sampling);
3. **policy and draft update** per minibatch — one path for every layout: the strategy's
   forward and backward (one policy forward whose detached taps and logits also give the draft
   its TTT loss, before the policy's optimizer step, so the draft's frozen embedding is the one
   that produced them), the policy's clip and optimizer step, the draft's (own optimizer, clip,
   loss weight, learning-rate warm-up), then the draft's embedding follows the policy;
4. **sync** — versioned ``update_weights`` of policy and draft into the engine, verified by a
   parameter checksum; the engine's stale-draft alarm watches τ afterwards;
5. **metrics** (``metrics.jsonl``; with the train/inference mismatch, |Δ log p| between the
   engine's and the trainer's logprobs of the step's rollout tokens,
   :mod:`specrl.train.mismatch`), **checkpoint** (atomic; every N steps and on SIGTERM/SIGINT).

Parallel layouts (``torchrun`` with dp × cp × pp processes): each replica's rollout rank rolls
out its slice of the prompts and shares the samples with the replica; the strategy says how the
update runs (DDP and zigzag CP shards, or pipeline stages with the draft on the last one).
``algo.kl_coef > 0`` needs pp = 1 (the reference model would need its own pipeline).

Deterministic mode (``run.deterministic``) replaces the engine's wall clock with a unit cost per
forward so speculation decisions are reproducible: a run killed and resumed reproduces every
non-timing metric of an uninterrupted run.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from specrl.config.schema import Recipe
from specrl.core import failpoint
from specrl.core.runtime import UnitClock, pick_device, set_determinism
from specrl.errors import SpecrlError
from specrl.models.checkpoint import load_config, save_model
from specrl.models.decoder import Transformer
from specrl.models.draft_io import draft_state, save_draft
from specrl.rl.tasks import task_from_config
from specrl.rollout.factory import build_engine
from specrl.rollout.types import Engine
from specrl.train import checkpoint as ckpt
from specrl.train import experience as exp
from specrl.train.artifacts import (
    Progress,
    RunModels,
    check_artifacts,
    load_models,
    policy_ready,
    prepare_run,
)
from specrl.train.batch import Sample
from specrl.train.evaluate import evaluate
from specrl.train.layout import TrainLayout, check_model, check_split, setup_distributed
from specrl.train.metrics import MetricsWriter, merge_minibatches
from specrl.train.mismatch import logprob_gap
from specrl.train.parallelize import check_backend, parallelize_policy
from specrl.train.rundir import RunDirLock
from specrl.train.state_io import load_trainer_state, trainer_state
from specrl.train.strategy import DraftMode, MinibatchOutput


class Interrupted(SpecrlError):
    """Training stopped by a signal after saving a checkpoint."""


def build_trainer(
    recipe: Recipe,
    *,
    source: str = "recipe",
    resume: bool = False,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> RLTrainer:
    """A ready trainer for ``recipe`` (module docstring: the order things are built in);
    ``resume``: from the run directory's newest usable checkpoint; ``overwrite``: start over in a
    run directory that holds a previous run (:mod:`specrl.train.rundir`).  Collective under
    torchrun."""
    check_artifacts(recipe, source)  # one-line errors before any process group starts
    check_backend(recipe)
    # the policy's shape is checked against the layout before the process group starts when
    # its checkpoint exists, else once the warm-start has made it
    known = load_config(recipe.policy.path) if policy_ready(recipe) else None
    device = pick_device(recipe.run.device)
    layout = setup_distributed(recipe.parallel, device, known)
    check_split(recipe)
    set_determinism(recipe.run.deterministic, recipe.run.threads)
    created, lock = prepare_run(recipe, layout, progress, resume=resume, overwrite=overwrite)
    try:
        trainer = _build(recipe, layout, source, known, device, created, resume, progress)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    trainer.run_lock = lock
    return trainer


def _build(recipe, layout, source, known, device, created, resume, progress) -> RLTrainer:
    """:func:`build_trainer` once the run directory is ready: the resume point, the models, the
    trainer."""
    warnings: list[str] = []
    resume_from = None
    if resume:
        resume_from, warnings = ckpt.resume_point(Path(recipe.run.directory), layout.world)
    if resume and resume_from is None and layout.rank == 0 and progress:
        progress("resume", 0, 1, "no checkpoint yet: starting from step 0")
    models = load_models(recipe, device, source=source, resume_from=resume_from)
    if known is None:  # the shape the warm-start made, against the layout
        check_model(layout.dims, models.policy.config)
    trainer = RLTrainer(recipe, layout, models, created=created)
    trainer.warnings = warnings
    if resume_from is not None:
        trainer.load(resume_from)
    return trainer


class RLTrainer:
    """Owns the policy, draft, optimizers, rollout engine and the run directory."""

    def __init__(
        self,
        recipe: Recipe,
        layout: TrainLayout,
        models: RunModels,
        *,
        created: dict[str, str] | None = None,
    ) -> None:
        """Assemble a run from its loaded models (:func:`build_trainer` loads them; the layout
        and the backends were checked first); ``created``: what the artifacts step made, for the
        run log."""
        policy, draft = models.policy, models.draft
        self.recipe, self.layout, self.policy, self.draft = recipe, layout, policy, draft
        self.tokenizer, self.codec, self.created = models.tokenizer, models.codec, created or {}
        self.rank, self.world = layout.rank, layout.world
        self.run_dir = Path(recipe.run.directory)
        self.device = policy.device
        self.pad_id = self.codec.bos_id if self.codec.bos_id is not None else 0
        self.task = task_from_config(recipe.task)
        self.held_out = self.task.sample(random.Random(recipe.run.seed + 1), recipe.task.eval_size)
        self.prompt_rng = random.Random(recipe.run.seed)
        self.clock = UnitClock() if recipe.run.deterministic else None
        self.cotrain = draft is not None and recipe.draft.mode == "cotrain"
        self.max_seq_len = exp.max_seq_len(
            self.task, self.codec, policy.config.max_position_embeddings, recipe.rollout.max_tokens
        )
        self.start_step = 0
        self.warnings: list[str] = []  # e.g. a newer checkpoint that was unusable on resume
        self.run_lock: RunDirLock | None = None  # rank 0: held until the last checkpoint
        # the engine decodes copies of the plain models; then the parallelisms, in their order
        self.engine: Engine | None = None
        self.vllm = recipe.rollout.backend == "vllm"  # in this process (world 1: check_backend)
        if layout.is_rollout_rank:
            self.engine = build_engine(
                recipe.rollout,
                models.policy_dir if self.vllm else policy,
                draft,
                codec=self.codec,
                seed=recipe.run.seed + 7919 * layout.dp_rank,
                max_model_len=self.max_seq_len,
                clock=self.clock,
                workdir=self.run_dir / "vllm" if self.vllm else None,
            )
        self.strategy = parallelize_policy(
            policy,
            layout,
            recipe,
            draft=draft,
            cotrain=self.cotrain,
            reference=models.reference,
            pad_id=self.pad_id,
            max_seq_len=self.max_seq_len,
        )
        a, d = recipe.algo, recipe.draft
        self.opt = torch.optim.AdamW(
            self.strategy.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=a.weight_decay
        )
        self.draft_params: list[torch.nn.Parameter] = []
        self.draft_opt = None
        if self.cotrain and layout.hosts_draft:
            self.draft_params = [p for p in draft.parameters() if p.requires_grad]
            self.draft_opt = torch.optim.AdamW(
                self.draft_params, lr=d.lr, betas=(0.9, 0.95), weight_decay=d.weight_decay
            )
        self._stop_signal: int | None = None

    # ------------------------------------------------------------------ the update
    def update(self, samples: list[Sample]) -> dict[str, Any]:
        """The policy (and draft) update on one rollout batch: ``algo.minibatches`` optimizer
        steps; returns the metrics, identical on every rank.

        Collective: every rank of a data-parallel replica passes that replica's samples (each
        rank runs the same number of minibatch steps, empty ones included)."""
        m = self.recipe.algo.minibatches
        return merge_minibatches([self._minibatch(samples[i::m], first=i == 0) for i in range(m)])

    def _minibatch(self, samples: list[Sample], *, first: bool) -> dict[str, Any]:
        """One optimizer step of the policy (and the draft), the same for every strategy."""
        a, d = self.recipe.algo, self.recipe.draft
        mode: DraftMode = "train" if self.cotrain else None
        if self.draft is not None and not self.cotrain and first:
            mode = "measure"  # a frozen draft: how well it still matches the moving policy
        out = self.strategy.forward_backward(samples, draft=mode)
        t0 = time.perf_counter()
        policy_norm = self.strategy.clip_policy_(a.grad_clip)
        self.opt.step()
        t_policy = out.policy_seconds + time.perf_counter() - t0
        t0 = time.perf_counter()
        draft_norm = None
        if self.cotrain:
            draft_norm = self.strategy.clip_draft_(self.draft_params, d.grad_clip)
            if self.draft_opt is not None:
                self._set_draft_lr()
                self.draft_opt.step()
        self.strategy.after_step()
        t_draft = out.draft_seconds + time.perf_counter() - t0
        return self._update_metrics(out, policy_norm, draft_norm, t_policy, t_draft)

    def _update_metrics(
        self, out: MinibatchOutput, policy_norm: float, draft_norm: float | None, t_policy, t_draft
    ) -> dict[str, Any]:
        rec = {**out.policy_metrics(), "policy_grad_norm": policy_norm}
        rec.update(time_policy_update=t_policy, time_draft_update=t_draft)
        if out.draft is not None:
            rec.update(draft_sim_tau=out.draft.tau, draft_acc=out.draft.acc)
            if self.cotrain:
                rec.update(draft_loss=out.draft.loss, draft_grad_norm=draft_norm)
            if self.draft_opt is not None:
                rec.update(draft_lr=self.draft_opt.param_groups[0]["lr"])
        return rec

    def _set_draft_lr(self) -> None:
        """Linear warm-up of the draft's learning rate over its first ``draft.warmup`` updates,
        counted by its optimizer's own step (so a resumed run continues the same ramp)."""
        assert self.draft_opt is not None
        d = self.recipe.draft
        state = self.draft_opt.state.get(self.draft_params[0])
        done = int(state["step"]) if state else 0
        scale = min(1.0, (done + 1) / d.warmup) if d.warmup > 0 else 1.0
        for group in self.draft_opt.param_groups:
            group["lr"] = d.lr * scale

    def sync_engine(self, version: int) -> None:
        """Versioned weight sync into the engine, verified by parameter checksums.  Collective:
        the strategy first gathers every stage's parameters (and the draft's) to the rollout
        rank, which then holds the whole current policy and draft."""
        self.strategy.gather_weights()
        if self.engine is None:
            return
        policy_state = {k: v.detach() for k, v in self.policy.state_dict().items()}
        # a co-trained draft no proposer uses (e.g. n-gram only) trains but is not synced
        takes = self.cotrain and self.engine.takes_draft_weights
        draft = draft_state(self.draft) if takes else None
        self.engine.update_weights(policy=policy_state, draft=draft, version=version)
        if self.vllm:
            return  # the vLLM engine verifies what it loaded itself (per-tensor checksums)
        mine = [float(p.detach().double().sum()) for p in self.policy.parameters()]
        theirs = [float(p.detach().double().sum()) for p in self.engine.model.parameters()]
        if mine != theirs:
            raise RuntimeError(f"weight sync to the rollout engine failed at version {version}")

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> dict[str, Any]:
        """Rollout, update, sync (module docstring); the step's metrics record."""
        t_start = time.perf_counter()
        r, lay = self.recipe.rollout, self.layout
        prompts = exp.replica_prompts(
            self.task, self.prompt_rng, r.prompts_per_step, lay.dims.dp, lay.dp_rank
        )
        t0 = time.perf_counter()
        counters: dict[str, float] = {}
        stats: dict[str, Any] = {}
        samples = results = None
        if self.engine is not None:
            requests = exp.rollout_requests(prompts, self.codec, r, self.recipe.run.seed, step)
            results = self.engine.generate(requests)
            samples, counters = exp.score(self.task, prompts, results, r.n, self.recipe.algo)
            stats = results.stats
        t_rollout = time.perf_counter() - t0
        gap: dict[str, Any] = {}
        if samples is not None:  # the rollout rank
            gap = logprob_gap(self._plain_policy(), samples, r.temperature, self.pad_id)
        samples = lay.share(samples)
        upd = self.update(samples)
        t0 = time.perf_counter()
        self.sync_engine(step + 1)
        t_sync = time.perf_counter() - t0
        return {
            "step": step + 1,
            **exp.rollout_metrics(exp.sum_counters(counters, lay.sum_), stats, t_rollout),
            **exp.wave_metrics(results),
            **gap,  # this replica's (rank 0's, in the metrics file)
            **upd,
            "time_rollout": t_rollout,
            "time_sync": t_sync,
            "time_step": time.perf_counter() - t_start,
        }

    def _plain_policy(self) -> Transformer:
        """The trainer's weights in a plain module for the mismatch forward: the policy itself
        in one process (and with vLLM); under parallelism (hooks, stages) the embedded engine's
        synced copy, checksum-equal to it (:meth:`sync_engine`)."""
        if self.world == 1 or self.vllm or self.engine is None:
            return self.policy
        return self.engine.model

    # ------------------------------------------------------------------ checkpoints
    def _optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {"policy": self.opt, **({"draft": self.draft_opt} if self.draft_opt else {})}

    def load(self, path: Path) -> None:
        """Continue from checkpoint ``path``: this rank's optimizers, random states, data cursor
        and engine state (the models were loaded from it by :func:`build_trainer`)."""
        tensors, meta = ckpt.read_rank(path, self.rank)
        load_trainer_state(path, tensors, meta, self._optimizers(), self.prompt_rng)
        if self.clock is not None and meta.get("clock") is not None:
            self.clock.t = float(meta["clock"])
        if self.engine is not None:
            self.engine.load_state_dict(meta["engine"])
            self.engine.update_weights(
                policy={k: v.detach() for k, v in self.policy.state_dict().items()},
                draft=draft_state(self.draft) if self.cotrain else None,
                version=meta["step"],
            )
            self.engine.load_state_dict(meta["engine"])  # restore counters/alarm after the sync
        self.start_step = int(meta["step"])

    def save(self, step: int) -> Path | None:
        """Checkpoint (collective): rank 0 writes the policy and draft — whole on it, the rollout
        rank of replica 0, after every step's sync — and every rank its own state."""
        tmp = ckpt.begin(self.run_dir, step) if self.rank == 0 else None
        if self.world > 1:
            holder = [str(tmp) if tmp else None]
            dist.broadcast_object_list(holder, src=0)
            tmp = Path(holder[0])
        assert tmp is not None
        if self.rank == 0:
            save_model(self.policy, tmp / "policy", tokenizer=self.tokenizer)
            if self.draft is not None:
                save_draft(
                    self.draft,
                    tmp / "draft",
                    target=self.policy,
                    provenance={"created_by": "specrl train", "step": step},
                )
        engine = self.engine.state_dict() if self.engine is not None else None
        clock = self.clock.state() if self.clock is not None else None
        state = trainer_state(step, self._optimizers(), self.prompt_rng, engine=engine, clock=clock)
        ckpt.write_rank(tmp, self.rank, *state)
        self.layout.barrier()
        final = None
        if self.rank == 0:
            final = ckpt.commit(self.run_dir, tmp, step, self.recipe.checkpoint.keep)
        self.layout.barrier()
        return final

    # ------------------------------------------------------------------ the run
    def _on_signal(self, signum, frame) -> None:
        self._stop_signal = signum

    def steps(self):
        """Run the remaining steps one at a time, yielding each step's metrics record.

        Metrics are appended to ``metrics.jsonl``, checkpoints saved on schedule and on
        SIGTERM/SIGINT (then :class:`Interrupted` is raised).  Several trainers can be stepped
        alternately (benchmarks interleave runs so machine noise hits them alike).  The run
        directory's lock is released when the steps end, fail or are abandoned.
        """
        tr = self.recipe.train
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        writer = None
        if self.rank == 0:
            writer = MetricsWriter(
                self.run_dir / "metrics.jsonl", truncate_after_step=self.start_step
            )
        try:
            if self.start_step == 0:
                self.sync_engine(0)
            for step in range(self.start_step, tr.steps):
                rec = self.step(step)
                if tr.eval_every and (step + 1) % tr.eval_every == 0 and self.rank == 0:
                    assert self.engine is not None  # rank 0 rolls out
                    rec["heldout_accuracy"] = evaluate(
                        # the synced plain copy (no parallelism hooks); vLLM: the policy itself
                        self.policy if self.vllm else self.engine.model,
                        self.codec,
                        self.task,
                        self.held_out,
                        self.recipe.rollout.max_tokens,
                    ).accuracy
                done = step + 1
                if writer is not None:
                    writer.write(rec)
                    failpoint.hit("after_metrics", done)
                every = self.recipe.checkpoint.every
                stop = self._stop_flag()
                if stop or done == tr.steps or (every and done % every == 0):
                    if writer is not None:
                        writer.sync()  # the records this checkpoint counts are durable first
                    self.save(done)
                if stop:
                    name = signal.Signals(stop).name
                    raise Interrupted(
                        f"stopped by {name} after step {done}; checkpoint saved",
                        hint="continue with: specrl train <recipe> --resume",
                    )
                yield rec
        except BaseException:  # a failed, interrupted or abandoned run frees its directory too
            self.close()
            raise
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            if writer is not None:
                writer.close()
        try:
            if self.rank == 0 and tr.plots:
                from specrl.train.plots import compare_siblings, plot_run, plot_waves

                plot_run(self.run_dir)
                plot_waves(self.run_dir)  # the live batch over a rollout wave, response lengths
                compare_siblings(self.run_dir)  # co-trained vs frozen (vs none) when both exist
        finally:
            self.close()

    def close(self) -> None:
        """Release the run directory (another trainer may take it from here on)."""
        if self.run_lock is not None:
            self.run_lock.release()
            self.run_lock = None

    def run(self, on_step: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """All remaining steps; ``on_step(record)`` after each; returns the last record."""
        last: dict[str, Any] = {}
        for rec in self.steps():
            last = rec
            if on_step is not None:
                on_step(rec)
        return last

    def _stop_flag(self) -> int:
        flag = torch.tensor([float(self._stop_signal or 0)])
        return int(self.layout.sum_(flag, op=dist.ReduceOp.MAX).item())
