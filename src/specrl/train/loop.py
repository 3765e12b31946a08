"""The RL loop with online draft co-training (``specrl train``).

One step (DESIGN.md "The job, end to end"):

1. **rollout** — ``prompts_per_step`` prompts × ``n`` samples through the speculative engine
   (drafters chosen per request by the bandit; lossless verification), with per-sample seeds
   derived from (seed, step, prompt), so sampling does not depend on batch composition;
2. **rewards** from the task's verifier, **group advantages** (GRPO; DAPO dynamic sampling);
3. **policy update** per minibatch from one packed forward that also yields the draft's taps and
   teacher logits (no extra target forward for the draft); PPO-clipped objective with
   clip-higher, token-level normalisation, optional k3 KL to the initial policy;
4. **draft update** (``draft.mode: cotrain``) — TTT on the detached taps of that same forward,
   its own optimizer, clip and loss weight; the draft's frozen embedding *is* the policy's
   (shared storage), so it follows the policy without a copy;
5. **sync** — versioned ``update_weights`` of policy and draft into the engine, verified by a
   parameter checksum; the engine's stale-draft alarm watches τ afterwards;
6. **metrics** (``metrics.jsonl``), **checkpoint** (atomic; every N steps and on SIGTERM/SIGINT).

Data parallel (``torchrun``, ``parallel.dp``): every rank rolls out its slice of the prompts with
its own engine; the policy is wrapped in DDP and the loss is scaled so the all-reduced gradient
is that of the global token mean; the draft's gradients are all-reduced explicitly (its TTT loss
divides local sums by global counts).  Deterministic mode (``run.deterministic``) replaces the
engine's wall clock with a unit cost per forward so speculation decisions are reproducible:
a run killed and resumed reproduces every non-timing metric of an uninterrupted run.
"""

from __future__ import annotations

import copy
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from specrl.config.loader import dump_recipe
from specrl.config.schema import Recipe
from specrl.core.attention import PackedLayout
from specrl.core.runtime import pick_device, seed_everything, set_determinism
from specrl.errors import ConfigError, LayoutError, SpecrlError
from specrl.models.checkpoint import load_model, load_tokenizer, save_model
from specrl.models.draft import Eagle3Draft
from specrl.models.draft_io import draft_state, load_draft, save_draft
from specrl.models.tokenizer import TextCodec
from specrl.rl.advantages import group_advantages, informative_groups
from specrl.rl.tasks import Problem, task_from_config
from specrl.rollout import Request, RolloutEngine, SamplingParams, SpecConfig
from specrl.train import checkpoint as ckpt
from specrl.train.artifacts import check_artifacts, ensure_artifacts
from specrl.train.evaluate import evaluate
from specrl.train.metrics import MetricsWriter
from specrl.train.policy_loss import clipped_policy_loss, token_logprobs
from specrl.train.state_io import (
    optimizer_from_flat,
    optimizer_to_flat,
    pyrandom_state,
    rng_from_flat,
    rng_to_flat,
    set_pyrandom_state,
)
from specrl.train.ttt import teacher_from_logits, ttt_inputs, ttt_loss

Progress = Callable[[str, int, int, str], None]


class Interrupted(SpecrlError):
    """Training stopped by a signal after saving a checkpoint."""


@dataclass
class Sample:
    prompt: list[int]
    response: list[int]
    old_logp: list[float]  # behaviour log-probs of the response tokens
    advantage: float


class UnitClock:
    """Deterministic engine clock: every reading advances one unit (one forward = one unit)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t

    def state(self) -> float:
        return self.t


def _dist_info() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def setup_distributed(recipe: Recipe) -> tuple[int, int]:
    """Join the torchrun group (if launched by torchrun) and check the layout."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if recipe.run.device == "cuda" else "gloo"
        dist.init_process_group(backend)
    rank, world = _dist_info()
    p = recipe.parallel
    if p.world_size != world:
        raise LayoutError(
            f"parallel layout dp={p.dp} × cp={p.cp} × pp={p.pp} = {p.world_size} does not match "
            f"the {world} process(es) launched",
            hint=f"torchrun --nproc-per-node {p.world_size} … or change parallel.dp/cp/pp",
        )
    if p.cp > 1 or p.pp > 1:
        raise LayoutError(
            f"specrl train runs dp only so far (got cp={p.cp}, pp={p.pp}); context and pipeline "
            "parallel co-training live in specrl.core / train.pipeline_cotrain",
            hint="set parallel.cp: 1 and parallel.pp: 1",
        )
    if recipe.rollout.prompts_per_step % p.dp:
        raise LayoutError(
            f"rollout.prompts_per_step={recipe.rollout.prompts_per_step} is not divisible by "
            f"parallel.dp={p.dp}",
        )
    return rank, world


def _all_reduce_(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


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
        self.rank, self.world = setup_distributed(recipe)
        self.run_dir = Path(recipe.run.directory)
        set_determinism(recipe.run.deterministic, recipe.run.threads)
        self.device = pick_device(recipe.run.device)
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            dump_recipe(recipe, self.run_dir / "recipe.resolved.yaml")
            self.created = ensure_artifacts(recipe, progress)
        else:
            self.created = {}
        _barrier()
        self.task = task_from_config(recipe.task)
        self.start_step = 0
        resume_from = ckpt.latest(self.run_dir) if resume else None
        if resume and resume_from is None and self.rank == 0 and progress:
            progress("resume", 0, 1, "no checkpoint yet: starting from step 0")
        policy_dir = resume_from / "policy" if resume_from else Path(recipe.policy.path)
        draft_dir = resume_from / "draft" if resume_from else Path(recipe.draft.path)
        seed_everything(recipe.run.seed)
        self.policy = load_model(policy_dir, dtype=recipe.policy.dtype, device=self.device)
        tok = load_tokenizer(policy_dir)
        if tok is None:
            raise ConfigError(f"'{policy_dir}' has no tokenizer.json; specrl train needs one")
        self.tokenizer = tok
        self.codec = TextCodec(
            tok, self.policy.config.bos_token_id, self.policy.config.eos_token_id
        )
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
        self.ddp = None
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.ddp = DistributedDataParallel(self.policy)
        a = recipe.algo
        self.opt = torch.optim.AdamW(
            self.policy.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=a.weight_decay
        )
        self.draft_opt = None
        if self.draft is not None and recipe.draft.mode == "cotrain":
            self.draft_params = [p for p in self.draft.parameters() if p.requires_grad]
            d = recipe.draft
            self.draft_opt = torch.optim.AdamW(
                self.draft_params, lr=d.lr, betas=(0.9, 0.95), weight_decay=d.weight_decay
            )
        self.prompt_rng = random.Random(recipe.run.seed)
        self.clock = UnitClock() if recipe.run.deterministic else None
        self.engine = self._build_engine()
        self.held_out = self.task.sample(random.Random(recipe.run.seed + 1), recipe.task.eval_size)
        if resume_from is not None:
            self._load_rank_state(resume_from)
        self._stop_signal: int | None = None

    # ------------------------------------------------------------------ engine
    def _build_engine(self) -> RolloutEngine:
        r = self.recipe.rollout
        spec = None
        if r.speculation is not None:
            names = tuple(r.speculation.proposers)
            options = {}
            if "eagle3" in names:
                assert self.draft is not None
                options["eagle3"] = {
                    "draft": copy.deepcopy(self.draft),
                    "max_k": r.speculation.max_k,
                }
            spec = SpecConfig(
                proposers=names,
                max_k=r.speculation.max_k,
                gate=r.speculation.gate,
                epsilon=r.speculation.epsilon,
                proposer_options=options,
            )
        longest_prompt = 0
        for p in self.task.sample(random.Random(0), 64):
            longest_prompt = max(longest_prompt, len(self.codec.encode_prompt(p.prompt)))
        max_len = min(
            self.policy.config.max_position_embeddings, 4 * longest_prompt + r.max_tokens + 16
        )
        kwargs: dict[str, Any] = {}
        if self.clock is not None:
            kwargs["clock"] = self.clock
        return RolloutEngine(
            copy.deepcopy(self.policy).eval(),
            codec=self.codec,
            max_batch_size=r.max_batch_size,
            max_model_len=max_len,
            spec=spec,
            seed=self.recipe.run.seed + 7919 * self.rank,
            **kwargs,
        )

    def _sync_engine(self, version: int) -> None:
        """Versioned weight sync into the engine, verified by parameter checksums."""
        policy_state = {k: v.detach() for k, v in self.policy.state_dict().items()}
        draft = None
        if self.draft is not None and self.recipe.draft.mode == "cotrain":
            draft = draft_state(self.draft)
        self.engine.update_weights(policy=policy_state, draft=draft, version=version)
        mine = [float(p.detach().double().sum()) for p in self.policy.parameters()]
        theirs = [float(p.detach().double().sum()) for p in self.engine.model.parameters()]
        if mine != theirs:
            raise RuntimeError(f"weight sync to the rollout engine failed at version {version}")

    # ------------------------------------------------------------------ one step
    def _prompts(self, step: int) -> list[tuple[int, Problem]]:
        r = self.recipe.rollout
        problems = self.task.sample(self.prompt_rng, r.prompts_per_step)
        per_rank = r.prompts_per_step // self.world
        start = self.rank * per_rank
        return list(enumerate(problems))[start : start + per_rank]

    def _rollout(self, step: int, prompts: list[tuple[int, Problem]]):
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
        before = self.engine.stats()
        results = self.engine.generate(requests)
        after = self.engine.stats()
        return results, before, after

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

    def _pack(self, samples: list[Sample]):
        ids, lens, mask, old, adv, nxt = [], [], [], [], [], []
        for s in samples:
            seq = s.prompt + s.response
            p, r = len(s.prompt), len(s.response)
            ids.extend(seq)
            lens.append(len(seq))
            nxt.extend([*seq[1:], 0])
            # row t predicts seq[t + 1]: response tokens are predicted by rows p−1 … p+r−2
            m = [0.0] * (p - 1) + [1.0] * r + [0.0]
            mask.extend(m)
            old.extend([0.0] * (p - 1) + s.old_logp + [0.0])
            adv.extend([s.advantage] * len(seq))
        dev = self.device
        f = lambda x: torch.tensor(x, dtype=torch.float32, device=dev)
        return (
            torch.tensor(ids, device=dev),
            PackedLayout.from_lengths(lens, device=dev),
            torch.tensor(nxt, device=dev),
            f(mask),
            f(old),
            f(adv),
        )

    def _update(self, samples: list[Sample]) -> dict[str, Any]:
        a, d = self.recipe.algo, self.recipe.draft
        order = list(range(len(samples)))
        chunks = [order[i :: a.minibatches] for i in range(a.minibatches)]
        model = self.ddp or self.policy
        taps = self.draft.config.tap_layers if self.draft is not None else ()
        acc: dict[str, list[float]] = {}
        t_policy = t_draft = 0.0
        for chunk in chunks:
            # every rank must run the same number of minibatch updates (DDP collectives)
            batch = [samples[i] for i in chunk]
            t0 = time.perf_counter()
            ids, layout, nxt, mask, old, adv = self._pack(batch) if batch else self._empty()
            total = float(_all_reduce_(mask.sum().detach().clone()))
            out = model(ids, layout, taps=taps)
            logp = token_logprobs(out.logits, nxt, self.recipe.rollout.temperature)
            ref = None
            if self.reference is not None:
                with torch.no_grad():
                    ref = token_logprobs(
                        self.reference(ids, layout).logits, nxt, self.recipe.rollout.temperature
                    )
            pl = clipped_policy_loss(
                logp,
                old,
                adv,
                mask,
                clip_low=a.clip_low,
                clip_high=a.clip_high,
                normalizer=total,
                ref_logp=ref,
                kl_coef=a.kl_coef,
            )
            self.opt.zero_grad(set_to_none=True)
            (pl.loss * self.world).backward()  # DDP averages: × world → gradient of the sum
            gnorm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), a.grad_clip)
            self.opt.step()
            t_policy += time.perf_counter() - t0
            for k, v in (
                ("policy_loss", pl.loss.item() * self.world),
                ("clip_frac", pl.clip_frac),
                ("kl", pl.kl),
                ("ratio", pl.ratio_mean),
                ("nll", pl.entropy_proxy),
                ("policy_grad_norm", float(gnorm)),
            ):
                acc.setdefault(k, []).append(v)
            if self.draft is not None and self.draft_opt is None and chunk is chunks[0]:
                # frozen draft: measure (no update) how well it still matches the moving policy
                with torch.no_grad():
                    inputs = ttt_inputs(ids, mask, layout, d.ttt_steps)
                    feats = Eagle3Draft.concat_taps(out.taps, self.draft.config.tap_layers)
                    res = self.draft.ttt_forward(feats, inputs.step_ids, layout)
                    tl = ttt_loss(
                        res,
                        teacher_from_logits(out.logits, self.draft),
                        inputs,
                        layout,
                        kind=d.loss,
                        decay=d.decay,
                        reduce=_all_reduce_,
                    )
                acc.setdefault("draft_sim_tau", []).append(tl.tau)
                acc.setdefault("draft_acc", []).append(tl.acc)  # type: ignore[arg-type]
            if self.draft_opt is None:
                continue
            t0 = time.perf_counter()
            inputs = ttt_inputs(ids, mask, layout, d.ttt_steps)
            feats = Eagle3Draft.concat_taps(out.taps, self.draft.config.tap_layers)
            res = self.draft.ttt_forward(feats, inputs.step_ids, layout)
            tl = ttt_loss(
                res,
                teacher_from_logits(out.logits, self.draft),
                inputs,
                layout,
                kind=d.loss,
                decay=d.decay,
                reduce=_all_reduce_,
            )
            self.draft_opt.zero_grad(set_to_none=True)
            (tl.loss * d.loss_weight).backward()
            for p in self.draft_params:
                if p.grad is not None:
                    _all_reduce_(p.grad)
            dnorm = torch.nn.utils.clip_grad_norm_(self.draft_params, d.grad_clip)
            self.draft_opt.step()
            t_draft += time.perf_counter() - t0
            for k, v in (
                ("draft_loss", float(_all_reduce_(tl.loss.detach().clone()))),
                ("draft_grad_norm", float(dnorm)),
                ("draft_sim_tau", tl.tau),
            ):
                acc.setdefault(k, []).append(v)
            acc.setdefault("draft_acc", []).append(tl.acc)  # type: ignore[arg-type]
        metrics: dict[str, Any] = {k: sum(v) / len(v) for k, v in acc.items() if k != "draft_acc"}
        if "draft_acc" in acc:
            cols = list(zip(*acc["draft_acc"], strict=True))
            metrics["draft_acc"] = [sum(c) / len(c) for c in cols]
        metrics["time_policy_update"] = t_policy
        metrics["time_draft_update"] = t_draft
        return metrics

    def _empty(self):
        """A one-token dummy minibatch with zero loss mask (keeps ranks in lock-step)."""
        dev = self.device
        bos = self.codec.bos_id if self.codec.bos_id is not None else 0
        z = torch.zeros(1, device=dev)
        return (
            torch.tensor([bos], device=dev),
            PackedLayout.from_lengths([1], device=dev),
            torch.zeros(1, dtype=torch.int64, device=dev),
            z,
            z.clone(),
            z.clone(),
        )

    @staticmethod
    def _spec_delta(before: dict, after: dict) -> dict[str, Any]:
        b, a = before["spec"], after["spec"]
        drafts = a["drafts"] - b["drafts"]
        accepted = a["accepted"] - b["accepted"]
        draft_tokens = a["draft_tokens"] - b["draft_tokens"]
        sel_b, sel_a = before["gating"].get("selections", {}), after["gating"].get("selections", {})
        by_proposer = {}
        for name, st in after["proposers"].items():
            st0 = before["proposers"].get(name, {"drafts": 0, "accepted": 0})
            if st["drafts"] > st0["drafts"]:
                by_proposer[name] = 1 + (st["accepted"] - st0["accepted"]) / (
                    st["drafts"] - st0["drafts"]
                )
        return {
            "tau_by_proposer": by_proposer,
            "drafts": drafts,
            "accepted": accepted,
            "draft_tokens": draft_tokens,
            "verifications": a["verifications"] - b["verifications"],
            "target_forwards": after["target_forwards"] - before["target_forwards"],
            "rollout_tokens": after["tokens"] - before["tokens"],
            "selections": {k: v - sel_b.get(k, 0) for k, v in sel_a.items() if v - sel_b.get(k, 0)},
            "alarms": after["alarms"] - before["alarms"],
        }

    def _gather_step(self, local: dict[str, Any]) -> dict[str, Any]:
        """Sum the rank-local counters of a step across data-parallel ranks."""
        keys = [
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
        ]
        t = torch.tensor([float(local[k]) for k in keys], dtype=torch.float64)
        _all_reduce_(t)
        return dict(zip(keys, t.tolist(), strict=True))

    def step(self, step: int) -> dict[str, Any]:
        t_start = time.perf_counter()
        prompts = self._prompts(step)
        t0 = time.perf_counter()
        results, before, after = self._rollout(step, prompts)
        t_rollout = time.perf_counter() - t0
        samples, info = self._samples(prompts, results)
        spec = self._spec_delta(before, after)
        per_pos = self._per_position(before, after)
        upd = self._update(samples)
        t0 = time.perf_counter()
        self._sync_engine(step + 1)
        t_sync = time.perf_counter() - t0
        g = self._gather_step({**info, **spec, "samples": len(samples)})
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

    @staticmethod
    def _per_position(before: dict, after: dict) -> list[float]:
        """Acceptance rate at draft positions 1..K over this step's drafts only."""
        db, ab = before["spec"]["position_drafts"], before["spec"]["position_accepted"]
        da, aa = after["spec"]["position_drafts"], after["spec"]["position_accepted"]
        out = []
        for i in range(len(da)):
            d = da[i] - (db[i] if i < len(db) else 0)
            if d:
                out.append((aa[i] - (ab[i] if i < len(ab) else 0)) / d)
        return out

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
        meta["engine"] = self.engine.state_dict()
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
        self.engine.load_state_dict(meta["engine"])
        if self.clock is not None and meta.get("clock") is not None:
            self.clock.t = float(meta["clock"])
        self.engine.update_weights(
            policy={k: v.detach() for k, v in self.policy.state_dict().items()},
            draft=draft_state(self.draft) if self.draft_opt is not None else None,
            version=meta["step"],
        )
        self.engine.load_state_dict(meta["engine"])  # restore counters/alarm after the sync
        self.start_step = int(meta["step"])

    def save(self, step: int) -> Path | None:
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
        _barrier()
        final = None
        if self.rank == 0:
            final = ckpt.commit(self.run_dir, tmp, step, self.recipe.checkpoint.keep)
        _barrier()
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
                self._sync_engine(0)
            for step in range(self.start_step, tr.steps):
                rec = self.step(step)
                if tr.eval_every and (step + 1) % tr.eval_every == 0 and self.rank == 0:
                    rec["heldout_accuracy"] = evaluate(
                        self.policy,
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
            from specrl.train.plots import plot_run

            plot_run(self.run_dir)

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
        if self.world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


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
