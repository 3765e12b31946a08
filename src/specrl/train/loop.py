"""The RL loop with online draft co-training (``specrl train``).

One step (DESIGN.md "The job, end to end"):

1. **rollout** — ``prompts_per_step`` prompts × ``n`` samples through the speculative engine
   (drafter and k chosen each decode step by the bandit; lossless verification), with
   per-sample seeds derived from (seed, step, prompt), so sampling does not depend on batch
   composition;
2. **rewards** from the task's verifier, **group advantages** (GRPO; DAPO dynamic sampling);
3. **policy update** per minibatch from one packed forward that also yields the draft's taps and
   teacher logits (no extra target forward for the draft); PPO-clipped objective with
   clip-higher, token-level normalisation, optional k3 KL to the initial policy;
4. **draft update** (``draft.mode: cotrain``) — TTT on the detached taps of that same forward,
   its own optimizer, clip and loss weight, run before the policy's optimizer step so the draft's
   frozen token embedding (the policy's) is the one that produced its taps and teacher;
5. **sync** — versioned ``update_weights`` of policy and draft into the engine, verified by a
   parameter checksum; the engine's stale-draft alarm watches τ afterwards;
6. **metrics** (``metrics.jsonl``), **checkpoint** (atomic; every N steps and on SIGTERM/SIGINT).

Parallel layouts (``torchrun`` with dp × cp × pp processes; :mod:`specrl.train.parallelize` says
which rank does what and in which order the parallelisms are applied to the plain model):

- **dp**: each replica's rollout rank rolls out its slice of the prompts with its own engine.
- **cp**: the replica's samples reach every cp rank; each trains on its zigzag shard of every
  packed minibatch (:meth:`PackedBatch.shard`: ids, global positions, labels, loss mask, old
  log-probs and advantages with one plan; the TTT shifts are taken globally before sharding), the
  policy's attention runs the ring, the draft's TTT ``ttt_session(cp=…,
  mode=parallel.ttt_cp_mode)`` with the teacher shift gathered across shards.
- With pp = 1 the policy is wrapped in DDP over ``dp_cp`` and the loss scaled so the averaged
  gradient is that of the global token mean (token counts all-reduced over dp × cp); the draft's
  gradients are all-reduced explicitly (its TTT loss divides local sums by global counts).
- **pp**: each minibatch is cut into ``parallel.microbatches`` microbatches and run by
  :class:`~specrl.train.pipeline_cotrain.PipelineCotrainer` (the draft trains on the last stage
  from TapChannel taps); its loss function is the clipped policy loss summed over a microbatch's
  rows, divided by the global token count as everywhere.  The draft's objective there is the
  mean over microbatches (and replicas) of per-microbatch token means — the pp = 1 objective
  when ``parallel.microbatches`` = 1 and dp = 1.  ``algo.kl_coef > 0`` needs pp = 1 (the
  reference model would need its own pipeline); a frozen draft is not measured under pp.

Deterministic mode (``run.deterministic``) replaces the engine's wall clock with a unit cost per
forward so speculation decisions are reproducible: a run killed and resumed reproduces every
non-timing metric of an uninterrupted run.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from specrl.config.loader import dump_recipe
from specrl.config.schema import Recipe
from specrl.core.attention import ZigzagPlan
from specrl.core.runtime import pick_device, seed_everything, set_determinism
from specrl.errors import ConfigError, LayoutError, SpecrlError
from specrl.models.checkpoint import load_config, load_model, load_tokenizer, save_model
from specrl.models.draft import Eagle3Draft
from specrl.models.draft_io import draft_state, load_draft, save_draft
from specrl.models.presets import check_shape
from specrl.models.tokenizer import TextCodec
from specrl.rl.advantages import group_advantages, informative_groups
from specrl.rl.tasks import Problem, task_from_config
from specrl.rollout import Request, SamplingParams
from specrl.rollout.factory import build_engine
from specrl.rollout.types import Engine, Results
from specrl.train import checkpoint as ckpt
from specrl.train.artifacts import check_artifacts, ensure_artifacts, policy_ready
from specrl.train.batch import PackedBatch, Sample, microbatch_budget, microbatches, pack
from specrl.train.evaluate import evaluate
from specrl.train.metrics import MetricsWriter
from specrl.train.parallelize import (
    SCHEDULE_KINDS,
    StageSync,
    all_reduce_grads,
    check_model,
    setup_distributed,
    use_context_parallel,
)
from specrl.train.pipeline_cotrain import CotrainConfig, PipelineCotrainer
from specrl.train.policy_loss import clipped_policy_loss, token_logprobs
from specrl.train.state_io import (
    optimizer_from_flat,
    optimizer_to_flat,
    pyrandom_state,
    rng_from_flat,
    rng_to_flat,
    set_pyrandom_state,
)
from specrl.train.ttt import (
    HaloShift,
    TTTInputs,
    TTTLoss,
    teacher_from_logits,
    ttt_inputs,
    ttt_loss,
)

Progress = Callable[[str, int, int, str], None]
_STEP_COUNTERS = (
    "reward_sum",
    "count",
    "correct",
    "groups_kept",
    "groups",
    "response_tokens",
    "drafts",
    "accepted",
    "draft_tokens",
    "verifications",
    "target_forwards",
    "rollout_tokens",
    "alarms",
    "samples",
)


class Interrupted(SpecrlError):
    """Training stopped by a signal after saving a checkpoint."""


class UnitClock:
    """Deterministic engine clock: every reading advances one unit (one forward = one unit)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t

    def state(self) -> float:
        return self.t


class RLTrainer:
    """Owns the policy, draft, optimizers, rollout engine and the run directory."""

    def __init__(
        self,
        recipe: Recipe,
        *,
        source: str = "recipe",
        resume: bool = False,
        progress: Progress | None = None,
    ) -> None:
        self.recipe = recipe
        self.progress = progress
        check_artifacts(recipe, source)
        if (
            recipe.rollout.speculation
            and "eagle3" in recipe.rollout.speculation.proposers
            and recipe.draft.mode == "none"
        ):
            raise ConfigError(
                f"{source}: rollout.speculation.proposers has 'eagle3' but draft.mode is 'none'",
                hint="remove eagle3 or set a draft mode",
            )
        par = recipe.parallel
        # the policy's shape is checked against the layout before the process group starts when
        # its checkpoint exists, else once the warm-start has made it
        known = load_config(recipe.policy.path) if policy_ready(recipe) else None
        self.device = pick_device(recipe.run.device)
        self.layout = setup_distributed(par, self.device, known)
        if recipe.rollout.prompts_per_step % par.dp:
            raise LayoutError(
                f"rollout.prompts_per_step={recipe.rollout.prompts_per_step} is not divisible by "
                f"parallel.dp={par.dp}",
            )
        if par.pp > 1 and recipe.algo.kl_coef > 0:
            raise LayoutError(
                f"algo.kl_coef={recipe.algo.kl_coef} needs the reference model's forward, which "
                f"does not run pipelined (parallel.pp={par.pp})",
                hint="set algo.kl_coef: 0 or parallel.pp: 1",
            )
        self.rank, self.world = self.layout.rank, self.layout.world
        self.run_dir = Path(recipe.run.directory)
        set_determinism(recipe.run.deterministic, recipe.run.threads)
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            dump_recipe(recipe, self.run_dir / "recipe.resolved.yaml")
            self.created = ensure_artifacts(recipe, progress)
        else:
            self.created = {}
        self.layout.barrier()
        self.task = task_from_config(recipe.task)
        self.start_step = 0
        resume_from = ckpt.latest(self.run_dir) if resume else None
        if resume and resume_from is None and self.rank == 0 and progress:
            progress("resume", 0, 1, "no checkpoint yet: starting from step 0")
        policy_dir = resume_from / "policy" if resume_from else Path(recipe.policy.path)
        draft_dir = resume_from / "draft" if resume_from else Path(recipe.draft.path)
        seed_everything(recipe.run.seed)
        self.policy = load_model(policy_dir, dtype=recipe.policy.dtype, device=self.device)
        if recipe.policy.shape:
            check_shape(self.policy.config, recipe.policy.shape, f"{source}: policy.path")
        if known is None:
            check_model(self.layout.dims, self.policy.config)
        tok = load_tokenizer(policy_dir)
        if tok is None:
            raise ConfigError(f"'{policy_dir}' has no tokenizer.json; specrl train needs one")
        self.tokenizer = tok
        self.codec = TextCodec.from_checkpoint(
            policy_dir, self.policy.config, chat=recipe.policy.chat_template
        )
        self.pad_id = self.codec.bos_id if self.codec.bos_id is not None else 0
        self.reference = None
        if recipe.algo.kl_coef > 0:  # the initial policy (also on resume)
            self.reference = load_model(
                recipe.policy.path, dtype=recipe.policy.dtype, device=self.device
            ).eval()
            for p in self.reference.parameters():
                p.requires_grad_(False)
        self.draft: Eagle3Draft | None = None
        if recipe.draft.mode != "none":
            self.draft, _ = load_draft(draft_dir, self.policy, share_embedding=True)
            if recipe.draft.mode == "frozen":
                for p in self.draft.parameters():
                    p.requires_grad_(False)
        self.cotrain = self.draft is not None and recipe.draft.mode == "cotrain"
        self.prompt_rng = random.Random(recipe.run.seed)
        self.clock = UnitClock() if recipe.run.deterministic else None
        self.max_seq_len = self._max_seq_len()
        # parallelisms in their fixed order: the rollout copy of the plain policy first …
        self.engine = self._build_engine() if self.layout.is_rollout_rank else None
        # … then context parallel, then pipeline or data parallel (module docstring)
        self._parallelize()
        self.held_out = self.task.sample(random.Random(recipe.run.seed + 1), recipe.task.eval_size)
        if resume_from is not None:
            self._load_rank_state(resume_from)
        self._stop_signal: int | None = None

    def _parallelize(self) -> None:
        """Apply CP, then PP or DP, to the loaded policy; build the optimizers over what this
        rank trains."""
        lay, par, a, d = self.layout, self.recipe.parallel, self.recipe.algo, self.recipe.draft
        self.cp = lay.cp_context()
        if self.cp is not None:
            for model in (self.policy, self.reference):
                if model is not None:
                    use_context_parallel(model, self.cp)
        self.ddp = self.pipeline = self.stage_sync = None
        if lay.dims.pp > 1:
            assert lay.groups is not None
            r = self.recipe.rollout
            per_replica = r.prompts_per_step // lay.dims.dp * r.n  # samples, before DAPO filtering
            config = CotrainConfig(
                schedule=SCHEDULE_KINDS[par.pp_schedule],
                microbatch_tokens=microbatch_budget(
                    -(-per_replica // a.minibatches), par.microbatches, self.max_seq_len, par.cp
                ),
                ttt_steps=d.ttt_steps,
                ttt_loss=d.loss,
                ttt_decay=d.decay,
                draft_loss_weight=d.loss_weight,
                ttt_mode=par.ttt_cp_mode,
                policy_grad_clip=a.grad_clip,
                draft_grad_clip=d.grad_clip,
                pad_id=self.pad_id,
            )
            taps = self.draft.config.tap_layers if self.cotrain else ()
            self.pipeline = PipelineCotrainer(
                self.policy,
                lay.groups,
                config,
                num_microbatches=par.microbatches,
                tap_layers=taps,
                draft=self.draft if self.cotrain and lay.hosts_draft else None,
                loss_fn=self._microbatch_policy_loss,
            )
            self.stage_sync = StageSync(
                lay, self.pipeline.layout, self.policy, self.draft if self.cotrain else None
            )
            params = self.pipeline.policy_parameters()
        else:
            if lay.world > 1:
                from torch.nn.parallel import DistributedDataParallel

                self.ddp = DistributedDataParallel(self.policy, process_group=lay.group("dp_cp"))
            params = list(self.policy.parameters())
        self.opt = torch.optim.AdamW(
            params, lr=a.lr, betas=(0.9, 0.95), weight_decay=a.weight_decay
        )
        self.draft_opt = None
        if self.cotrain and lay.hosts_draft:
            self.draft_params = [p for p in self.draft.parameters() if p.requires_grad]
            self.draft_opt = torch.optim.AdamW(
                self.draft_params, lr=d.lr, betas=(0.9, 0.95), weight_decay=d.weight_decay
            )
        self._pp_sums: list[torch.Tensor] = []  # per microbatch [clipped, kl, ratio, nll, tokens]

    def _set_draft_lr(self) -> None:
        """Linear warm-up of the draft's learning rate over its first ``draft.warmup`` updates,
        counted by its optimizer's own step (so a resumed run continues the same ramp)."""
        if self.draft_opt is None:
            return
        d = self.recipe.draft
        state = self.draft_opt.state.get(self.draft_params[0])
        done = int(state["step"]) if state else 0
        scale = min(1.0, (done + 1) / d.warmup) if d.warmup > 0 else 1.0
        for group in self.draft_opt.param_groups:
            group["lr"] = d.lr * scale

    # ------------------------------------------------------------------ engine
    def _max_seq_len(self) -> int:
        """Longest prompt + response the engine admits (bounds the pipeline's token budget)."""
        longest_prompt = 0
        for p in self.task.sample(random.Random(0), 64):
            longest_prompt = max(longest_prompt, len(self.codec.encode_prompt(p.prompt)))
        return min(
            self.policy.config.max_position_embeddings,
            4 * longest_prompt + self.recipe.rollout.max_tokens + 16,
        )

    def _build_engine(self) -> Engine:
        """The replica's rollout engine: the recipe's rollout section over copies of the plain
        policy and draft (one factory for every command)."""
        return build_engine(
            self.recipe.rollout,
            self.policy,
            self.draft,
            codec=self.codec,
            seed=self.recipe.run.seed + 7919 * self.layout.dp_rank,
            max_model_len=self.max_seq_len,
            clock=self.clock,
        )

    def sync_engine(self, version: int) -> None:
        """Versioned weight sync into the engine, verified by parameter checksums.  Collective:
        under PP every stage's parameters and the draft's are gathered to the rollout rank
        first, which then holds the whole current policy and draft."""
        if self.stage_sync is not None:
            self.stage_sync.gather()
        if self.engine is None:
            return
        policy_state = {k: v.detach() for k, v in self.policy.state_dict().items()}
        # a co-trained draft no proposer uses (e.g. n-gram only) trains but is not synced
        draft = (
            draft_state(self.draft) if self.cotrain and self.engine.takes_draft_weights else None
        )
        self.engine.update_weights(policy=policy_state, draft=draft, version=version)
        mine = [float(p.detach().double().sum()) for p in self.policy.parameters()]
        theirs = [float(p.detach().double().sum()) for p in self.engine.model.parameters()]
        if mine != theirs:
            raise RuntimeError(f"weight sync to the rollout engine failed at version {version}")

    # ------------------------------------------------------------------ one step
    def _prompts(self) -> list[tuple[int, Problem]]:
        """This replica's slice of the step's prompts (every rank draws, keeping the generator
        in step everywhere)."""
        r = self.recipe.rollout
        problems = self.task.sample(self.prompt_rng, r.prompts_per_step)
        per_replica = r.prompts_per_step // self.layout.dims.dp
        start = self.layout.dp_rank * per_replica
        return list(enumerate(problems))[start : start + per_replica]

    def _rollout(self, step: int, prompts: list[tuple[int, Problem]]) -> Results:
        assert self.engine is not None
        r = self.recipe.rollout
        seed = self.recipe.run.seed
        requests = [
            Request(
                self.codec.encode_prompt(p.prompt),
                SamplingParams(
                    max_tokens=r.max_tokens,
                    temperature=r.temperature,
                    n=r.n,
                    seed=(seed * 1_000_003 + step * 10_007 + i) % 2**62,
                ),
                request_id=f"s{step}-p{i}",
            )
            for i, p in prompts
        ]
        return self.engine.generate(requests)

    def _samples(self, prompts, results) -> tuple[list[Sample], dict[str, Any]]:
        n = self.recipe.rollout.n
        rewards = []
        for j, res in enumerate(results):
            problem = prompts[j // n][1]
            rewards.append(float(self.task.reward(res.text, problem)))
        a = self.recipe.algo
        adv = group_advantages(rewards, n, std_normalize=a.std_normalize)
        keep_groups = (
            informative_groups(rewards, n) if a.dynamic_sampling else list(range(len(prompts)))
        )
        samples = [
            Sample(list(res.prompt_tokens), list(res.tokens), list(res.logprobs), adv[j])
            for j, res in enumerate(results)
            if j // n in set(keep_groups)
        ]
        lens = [len(res.tokens) for res in results]
        info = {
            "reward_sum": sum(rewards),
            "count": len(rewards),
            "correct": sum(1 for x in rewards if x >= 1.0),
            "groups_kept": len(keep_groups),
            "groups": len(prompts),
            "response_tokens": sum(lens),
        }
        return samples, info

    def update(self, samples: list[Sample]) -> dict[str, Any]:
        """The policy (and draft) update on one rollout batch: ``algo.minibatches`` optimizer
        steps; returns the metrics, identical on every rank.

        Collective: every rank of a data-parallel replica passes that replica's samples (each
        rank runs the same number of minibatch steps, empty ones included)."""
        m = self.recipe.algo.minibatches
        minibatch = self._pipelined_minibatch if self.pipeline else self._packed_minibatch
        recs = [minibatch(samples[i::m], first=i == 0) for i in range(m)]
        metrics: dict[str, Any] = {}
        for key in recs[0]:
            vals = [r[key] for r in recs if r.get(key) is not None]
            if key.startswith("time_"):
                metrics[key] = sum(vals)
            elif key == "draft_acc":
                metrics[key] = [sum(c) / len(c) for c in zip(*vals, strict=True)]
            elif vals:
                metrics[key] = sum(vals) / len(vals)
        return metrics

    def _packed_minibatch(self, samples: list[Sample], *, first: bool) -> dict[str, Any]:
        """One optimizer step from one packed forward (pp = 1): this rank's zigzag shard under
        CP; DDP over dp × cp."""
        a, d, lay = self.recipe.algo, self.recipe.draft, self.layout
        t0 = time.perf_counter()
        full = pack(samples, self.device, self.pad_id)  # [T]
        measure = self.draft is not None and (self.cotrain or first)  # frozen: first only
        ttt = ttt_inputs(full.ids, full.mask, full.layout, d.ttt_steps) if measure else None
        plan, local = None, full
        if self.cp is not None:
            plan = ZigzagPlan.build(full.layout, self.cp.size, self.cp.rank)
            local = full.shard(plan)  # [T_local]
            if ttt is not None:
                ttt = TTTInputs(
                    torch.stack([plan.shard(x) for x in ttt.step_ids]),  # [K, T_local]
                    torch.stack([plan.shard(x) for x in ttt.step_mask]),
                )
        total = float(lay.sum_(local.mask.sum(dtype=torch.float64), "dp_cp"))
        out = (self.ddp or self.policy)(local.ids, local.layout, taps=self._taps(measure))
        temperature = self.recipe.rollout.temperature
        logp = token_logprobs(out.logits, local.labels, temperature)  # [T_local]
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref_logits = self.reference(local.ids, local.layout).logits
                ref = token_logprobs(ref_logits, local.labels, temperature)
        pl = clipped_policy_loss(
            logp,
            local.old_logp,
            local.advantages,
            local.mask,
            clip_low=a.clip_low,
            clip_high=a.clip_high,
            normalizer=total,
            ref_logp=ref,
            kl_coef=a.kl_coef,
        )
        self.opt.zero_grad(set_to_none=True)
        # DDP averages over its dp × cp ranks: × their count → the gradient of the global sum
        (pl.loss * lay.dims.dp * lay.dims.cp).backward()
        t_policy = time.perf_counter() - t0

        t0 = time.perf_counter()
        tl, dnorm = None, None
        if self.cotrain:
            self.draft_opt.zero_grad(set_to_none=True)
            tl = self._ttt_loss(out, ttt, full, local, plan)
            (tl.loss * d.loss_weight).backward()
            if lay.world > 1:
                all_reduce_grads(self.draft_params, lay.group("dp_cp"))
        elif measure:  # frozen draft: how well it still matches the moving policy (no update)
            with torch.no_grad():
                tl = self._ttt_loss(out, ttt, full, local, plan)
        t_draft = time.perf_counter() - t0

        t0 = time.perf_counter()
        gnorm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), a.grad_clip or torch.inf)
        self.opt.step()
        t_policy += time.perf_counter() - t0
        t0 = time.perf_counter()
        if self.cotrain:
            dnorm = torch.nn.utils.clip_grad_norm_(self.draft_params, d.grad_clip or torch.inf)
            self._set_draft_lr()
            self.draft_opt.step()
        self._refresh_draft_embedding()
        t_draft += time.perf_counter() - t0

        draft_loss = tl.loss.detach().double().reshape(1) if tl is not None else torch.zeros(1)
        sums = torch.tensor([float(pl.loss.detach()), *pl.sums()], dtype=torch.float64)
        sums = lay.sum_(torch.cat([sums, draft_loss.to(sums)]), "dp_cp")
        rec = self._policy_metrics(float(sums[0]), sums[1:6], float(gnorm))
        rec.update(time_policy_update=t_policy, time_draft_update=t_draft)
        if tl is not None:
            rec.update(draft_sim_tau=tl.tau, draft_acc=tl.acc)
        if self.cotrain:
            rec.update(draft_loss=float(sums[6]), draft_grad_norm=float(dnorm))
            rec.update(draft_lr=self.draft_opt.param_groups[0]["lr"])
        return rec

    def _taps(self, want: bool) -> tuple[int, ...]:
        return tuple(self.draft.config.tap_layers) if want and self.draft is not None else ()

    def _ttt_loss(
        self,
        out,
        ttt: TTTInputs,
        full: PackedBatch,
        local: PackedBatch,
        plan: ZigzagPlan | None,
    ) -> TTTLoss:
        """The draft's TTT loss on this rank's rows of the policy forward ``out`` (counts
        all-reduced over dp × cp; under CP the teacher shift crosses shards)."""
        d = self.recipe.draft
        feats = Eagle3Draft.concat_taps(out.taps, self.draft.config.tap_layers)  # [T_local, 3H]
        res = self.draft.ttt_forward(
            feats, ttt.step_ids, local.layout, cp=self.cp, mode=self.recipe.parallel.ttt_cp_mode
        )
        shift = (
            HaloShift(plan, full.layout, self.cp, max_shift=d.ttt_steps)
            if plan is not None
            else None
        )
        return ttt_loss(
            res,
            teacher_from_logits(out.logits, self.draft),
            ttt,
            local.layout,
            kind=d.loss,
            decay=d.decay,
            shift=shift,
            reduce=lambda t: self.layout.sum_(t, "dp_cp"),
        )

    def _pipelined_minibatch(self, samples: list[Sample], *, first: bool) -> dict[str, Any]:
        """One optimizer step through the pipeline (pp > 1; the draft on the last stage)."""
        assert self.pipeline is not None
        mbs = microbatches(samples, self.recipe.parallel.microbatches, self.device, self.pad_id)
        self._pp_sums = []
        self._set_draft_lr()  # the draft steps once per pipeline step
        stats = self.pipeline.step(mbs, policy_optimizer=self.opt, draft_optimizer=self.draft_opt)
        t0 = time.perf_counter()
        self._refresh_draft_embedding()
        t_refresh = time.perf_counter() - t0
        sums = torch.zeros(5, dtype=torch.float64)
        for s in self._pp_sums:
            sums += s
        self.layout.sum_(sums)  # the last stage's dp × cp ranks hold every row once
        rec = self._policy_metrics(stats.policy_loss, sums, stats.policy_grad_norm)
        rec.update(
            time_policy_update=stats.seconds - stats.draft_seconds,
            time_draft_update=stats.draft_seconds + t_refresh,
        )
        if stats.draft_loss is not None:
            rec.update(
                draft_loss=stats.draft_loss,
                draft_grad_norm=stats.draft_grad_norm,
                draft_sim_tau=stats.draft_tau,
                draft_acc=stats.draft_acc,
            )
        return rec

    def _microbatch_policy_loss(
        self, logits: torch.Tensor, tokens: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """The pipeline's loss function: Σ of the clipped policy loss over this rank's rows of a
        microbatch (logits [T_local, V], tokens [T_local] each); keeps the metric sums."""
        a = self.recipe.algo
        logp = token_logprobs(logits, tokens["labels"], self.recipe.rollout.temperature)
        pl = clipped_policy_loss(
            logp,
            tokens["old_logp"],
            tokens["advantages"],
            tokens["loss_mask"],
            clip_low=a.clip_low,
            clip_high=a.clip_high,
            normalizer=1.0,  # a sum: the pipeline divides by the global token count
        )
        self._pp_sums.append(torch.tensor(pl.sums(), dtype=torch.float64))
        return pl.loss

    @staticmethod
    def _policy_metrics(loss: float, sums: torch.Tensor, grad_norm: float | None) -> dict:
        """Global policy metrics from the summed [clipped, kl, ratio, nll, tokens]."""
        clipped, kl, ratio, nll, tokens = sums.tolist()
        n = max(tokens, 1.0)
        return {
            "policy_loss": loss,
            "clip_frac": clipped / n,
            "kl": kl / n,
            "ratio": ratio / n,
            "nll": nll / n,
            "policy_grad_norm": grad_norm,
        }

    def _refresh_draft_embedding(self) -> None:
        """After a policy step: the draft's frozen embedding follows the policy's (under PP the
        table comes from stage 0; a draft of another dtype than the policy holds a copy)."""
        if self.stage_sync is not None:
            self.stage_sync.broadcast_embedding()
        if self.draft is None or not self.layout.hosts_draft:
            return
        table = self.policy.model.embed_tokens.weight
        if self.draft.embed_tokens.weight.data_ptr() != table.data_ptr():
            self.draft.refresh_embedding(table.to(self.draft.embed_tokens.weight.dtype))

    @staticmethod
    def _spec_counters(stats: dict[str, Any]) -> dict[str, Any]:
        """The step's speculation counters from its ``generate`` call's own statistics."""
        spec = stats["spec"]
        return {
            "tau_by_proposer": {
                name: st["tau"] for name, st in stats["proposers"].items() if st["drafts"]
            },
            "drafts": spec["drafts"],
            "accepted": spec["accepted"],
            "draft_tokens": spec["draft_tokens"],
            "verifications": spec["verifications"],
            "target_forwards": stats["target_forwards"],
            "rollout_tokens": stats["tokens"],
            "selections": stats["selections"],
            "alarms": stats["alarms"],
        }

    def _gather_step(self, local: dict[str, Any]) -> dict[str, Any]:
        """Sum the step's counters over every rank (only rollout ranks hold non-zero ones)."""
        t = torch.tensor([float(local.get(k, 0)) for k in _STEP_COUNTERS], dtype=torch.float64)
        self.layout.sum_(t)
        return dict(zip(_STEP_COUNTERS, t.tolist(), strict=True))

    def step(self, step: int) -> dict[str, Any]:
        t_start = time.perf_counter()
        prompts = self._prompts()
        t0 = time.perf_counter()
        local: dict[str, Any] = {}
        spec: dict[str, Any] = {"selections": {}, "tau_by_proposer": {}}
        per_pos: list[float] = []
        samples = None
        if self.engine is not None:
            results = self._rollout(step, prompts)
            samples, local = self._samples(prompts, results)
            spec = self._spec_counters(results.stats)
            per_pos = results.stats["spec"]["per_position"]
            local = {**local, **spec, "samples": len(samples)}
        t_rollout = time.perf_counter() - t0
        samples = self.layout.share(samples)
        upd = self.update(samples)
        t0 = time.perf_counter()
        self.sync_engine(step + 1)
        t_sync = time.perf_counter() - t0
        g = self._gather_step(local)
        rec: dict[str, Any] = {
            "step": step + 1,
            "reward": g["reward_sum"] / max(g["count"], 1),
            "accuracy": g["correct"] / max(g["count"], 1),
            "groups_kept": int(g["groups_kept"]),
            "samples_trained": int(g["samples"]),
            "response_len": g["response_tokens"] / max(g["count"], 1),
            "tau": 1 + g["accepted"] / g["drafts"] if g["drafts"] else None,
            "acceptance_rate": g["accepted"] / g["draft_tokens"] if g["draft_tokens"] else None,
            "per_position_acceptance": per_pos,
            "drafter_selections": spec["selections"],
            "tau_by_proposer": spec["tau_by_proposer"],
            "forwards_per_token": g["target_forwards"] / max(g["rollout_tokens"], 1),
            "spec_alarms": int(g["alarms"]),
            "rollout_tokens": int(g["rollout_tokens"]),
            "rollout_tokens_per_s": g["rollout_tokens"] / max(t_rollout, 1e-9),
            **upd,
            "time_rollout": t_rollout,
            "time_sync": t_sync,
            "time_step": time.perf_counter() - t_start,
        }
        return rec

    # ------------------------------------------------------------------ checkpoints
    def _rank_state(self, step: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors, meta = {}, {"step": step}
        t, m = optimizer_to_flat("policy", self.opt)
        tensors.update(t)
        meta["opt_policy"] = m
        if self.draft_opt is not None:
            t, m = optimizer_to_flat("draft", self.draft_opt)
            tensors.update(t)
            meta["opt_draft"] = m
        t, m = rng_to_flat()
        tensors.update(t)
        meta["rng"] = m
        meta["prompt_rng"] = pyrandom_state(self.prompt_rng)
        meta["engine"] = self.engine.state_dict() if self.engine is not None else None
        meta["clock"] = self.clock.state() if self.clock is not None else None
        return tensors, meta

    def _load_rank_state(self, path: Path) -> None:
        tensors, meta = ckpt.read_rank(path, self.rank)
        optimizer_from_flat("policy", self.opt, tensors, meta["opt_policy"])
        if self.draft_opt is not None:
            if "opt_draft" not in meta:
                raise ConfigError(
                    f"checkpoint '{path}' has no draft optimizer (was draft.mode changed?)",
                    hint="resume with the recipe it was written with",
                )
            optimizer_from_flat("draft", self.draft_opt, tensors, meta["opt_draft"])
        rng_from_flat(tensors, meta["rng"])
        set_pyrandom_state(self.prompt_rng, meta["prompt_rng"])
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
        ckpt.write_rank(tmp, self.rank, *self._rank_state(step))
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
        alternately (benchmarks interleave runs so machine noise hits them alike).
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
                        self.engine.model,  # the synced plain copy (no parallelism hooks)
                        self.codec,
                        self.task,
                        self.held_out,
                        self.recipe.rollout.max_tokens,
                    ).accuracy
                if writer is not None:
                    writer.write(rec)
                done = step + 1
                every = self.recipe.checkpoint.every
                stop = self._stop_flag()
                if stop or done == tr.steps or (every and done % every == 0):
                    self.save(done)
                if stop:
                    name = signal.Signals(stop).name
                    raise Interrupted(
                        f"stopped by {name} after step {done}; checkpoint saved",
                        hint="continue with: specrl train <recipe> --resume",
                    )
                yield rec
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            if writer is not None:
                writer.close()
        if self.rank == 0 and tr.plots:
            from specrl.train.plots import compare_siblings, plot_run

            plot_run(self.run_dir)
            compare_siblings(self.run_dir)  # co-trained vs frozen (vs none) when both exist

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


def summarize(run_dir: str | Path) -> dict[str, Any]:
    """Start/end figures of a run from its metrics.jsonl (for the CLI summary)."""
    from specrl.train.metrics import read_metrics

    recs = read_metrics(Path(run_dir) / "metrics.jsonl")
    if not recs:
        return {}
    head, tail = recs[: max(1, len(recs) // 10)], recs[-max(1, len(recs) // 10) :]

    def mean(rs, k):
        vals = [r[k] for r in rs if r.get(k) is not None]
        return sum(vals) / len(vals) if vals else None

    out = {"steps": recs[-1]["step"]}
    for k in ("reward", "tau", "rollout_tokens_per_s", "draft_sim_tau"):
        out[f"{k}_start"] = mean(head, k)
        out[f"{k}_end"] = mean(tail, k)
    evals = [r["heldout_accuracy"] for r in recs if "heldout_accuracy" in r]
    if evals:
        out["heldout_accuracy_last"] = evals[-1]
    out["spec_alarms"] = sum(r.get("spec_alarms", 0) for r in recs)
    out["time_split"] = {
        k: sum(r.get(k, 0.0) for r in recs)
        for k in ("time_rollout", "time_policy_update", "time_draft_update", "time_sync")
    }
    return out
