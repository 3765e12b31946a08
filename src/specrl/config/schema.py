"""Recipe schema: one dataclass per section, a one-line ``help`` per field.

A recipe YAML mirrors this tree (``run:``, ``task:``, ``policy:`` …).  Each component receives only
its own section.  Precedence: ``--set`` overrides > recipe YAML > the defaults below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from specrl.config.loader import doc


@dataclass
class RunConfig:
    """Where and how a run happens."""

    name: str = doc("run", "Run name (used in logs and as the default output directory name).")
    out_dir: str = doc("", "Run directory; empty → runs/<name>.")
    seed: int = doc(0, "Global seed (torch, Python, task sampling).")
    device: Literal["auto", "cpu", "cuda"] = doc("auto", "Device; auto picks cuda when present.")
    deterministic: bool = doc(True, "Deterministic torch algorithms (bit-reproducible on CPU).")
    threads: int = doc(0, "torch CPU threads; 0 keeps torch's default.")

    @property
    def directory(self) -> str:
        return self.out_dir or f"runs/{self.name}"


@dataclass
class TaskConfig:
    """The verifiable task rollouts are scored on."""

    name: Literal["addition", "multiplication", "mixed", "jsonl"] = doc(
        "addition", "Built-in toy task, or jsonl for user prompts/answers."
    )
    min_digits: int = doc(2, "Toy tasks: fewest digits of an operand.")
    max_digits: int = doc(5, "Toy tasks: most digits of an operand.")
    path: str | None = doc(None, "jsonl task: path of the prompt/answer file.")
    prompt_field: str = doc("prompt", "jsonl task: field holding the prompt.")
    answer_field: str = doc("answer", "jsonl task: field holding the reference answer.")
    verifier: Literal["exact", "numeric", "regex", "boxed"] = doc(
        "numeric", "jsonl task: how a completion is checked against the answer."
    )
    pattern: str | None = doc(None, "regex verifier: pattern whose group 1 is the answer.")
    eval_size: int = doc(128, "Held-out problems for evaluation (drawn with seed + 1).")

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(
                f"need 1 ≤ min_digits ≤ max_digits, got {self.min_digits}, {self.max_digits}"
            )


@dataclass
class WarmstartConfig:
    """Supervised warm-start that creates a toy target checkpoint from scratch."""

    preset: str = doc("toy-small", "Model preset to build (see specrl.models.presets).")
    steps: int = doc(600, "Optimizer steps of supervised training on worked solutions.")
    batch_size: int = doc(64, "Sequences per step.")
    lr: float = doc(3e-3, "Peak AdamW learning rate (linear warm-up, cosine decay).")
    warmup: int = doc(50, "Warm-up steps.")
    weight_decay: float = doc(0.01, "AdamW weight decay.")
    grad_clip: float = doc(1.0, "Gradient-norm clip.")
    eval_every: int = doc(20, "Evaluate held-out greedy accuracy every N steps (0: at the end).")
    target_accuracy: float | None = doc(
        0.5, "Stop at the first evaluation reaching this accuracy (leaves RL room); null: never."
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
    max_new_tokens: int = doc(64, "Generation budget per completion (evaluation and rollouts).")


@dataclass
class Recipe:
    """A complete specrl recipe."""

    run: RunConfig = doc(factory=RunConfig, help="Run name, directory, seed, device.")
    task: TaskConfig = doc(factory=TaskConfig, help="Task and verifier.")
    policy: PolicyConfig = doc(factory=PolicyConfig, help="Policy model and its warm-start.")
