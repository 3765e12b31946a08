"""The rollout engine: exactness against plain decoding, losslessness, taps, weights, stats.

Models are tiny random decoders in float64, so greedy comparisons across different batch
shapes are exact.  Test-only proposers (registered under ``test-*`` names) draft garbage,
random-q samples, or the target's own greedy continuation, to exercise rejections, the q path
and full acceptance.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import random

import numpy as np
import pytest
import torch
from scipy import stats

from specrl.config.loader import from_dict
from specrl.core.attention import PackedLayout
from specrl.errors import CheckpointError, ConfigError
from specrl.models.decoder import Transformer
from specrl.models.generate import generate
from specrl.models.presets import preset_config
from specrl.rollout import Request, RolloutEngine, SamplingParams, SpecConfig
from specrl.rollout.proposers import Draft, ProposerBase, build_proposer, register_proposer
from specrl.rollout.proposers.ngram import NgramProposer
from specrl.rollout.sampling import RowParams, sampling_probs

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(seed: int = 0, vocab: int = 32) -> Transformer:
    model = Transformer(preset_config("toy-tiny", vocab_size=vocab)).init_weights(seed, std=0.2)
    return model.to(torch.float64)


# ------------------------------------------------------------------------- test proposers
class Garbage(ProposerBase):
    """Uniformly random one-hot drafts: almost always rejected."""

    name = "test-garbage"
    tap_layers: tuple[int, ...] = ()

    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab = vocab
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, batch, ks):
        return [Draft(torch.randint(0, self.vocab, (k,), generator=self.gen).tolist()) for k in ks]

    def observe(self, batch, accepted, taps, committed):
        pass

    def reset(self, seq):
        pass

    def release(self, seq):
        pass


class RandomQ(Garbage):
    """Drafts sampled from random distributions q, which it reports (the non-one-hot path)."""

    name = "test-randq"

    def propose(self, batch, ks):
        out = []
        for k in ks:
            x = -(torch.rand(k, self.vocab, generator=self.gen, dtype=torch.float64).log() ** 3)
            q = x / x.sum(-1, keepdim=True)
            out.append(Draft(torch.multinomial(q, 1, generator=self.gen)[:, 0].tolist(), q))
        return out


class Recorder(Garbage):
    """Drafts garbage and records the taps it is handed, per sequence and position."""

    name = "test-recorder"
    tap_layers = (0, 1)

    def __init__(self, vocab: int, seed: int) -> None:
        super().__init__(vocab, seed)
        self.taps: dict[int, dict[int, dict[int, torch.Tensor]]] = {}  # seq → pos → layer → [H]
        self.final: dict[int, list[int]] = {}

    def observe(self, batch, accepted, taps, committed):
        row = 0
        for seq, n in zip(batch, committed, strict=True):
            first = seq.kv_len - n
            for j in range(n):
                got = self.taps.setdefault(seq.seq_id, {})
                assert first + j not in got, "position handed over twice"
                got[first + j] = {layer: h[row + j] for layer, h in taps.items()}
            row += n
        assert row == next(iter(taps.values())).shape[0]

    def release(self, seq):
        self.final[seq.seq_id] = list(seq.tokens)


class Oracle(Garbage):
    """Drafts the greedy continuation of its own copy of the target; has loadable weights."""

    name = "test-oracle"

    def __init__(self, target: Transformer) -> None:
        self.draft = copy.deepcopy(target)

    def propose(self, batch, ks):
        outs = generate(self.draft, [s.tokens for s in batch], max(ks))
        return [Draft(o[:k]) for o, k in zip(outs, ks, strict=True)]

    def check_weights(self, state):
        if set(state) != set(self.draft.state_dict()):
            raise CheckpointError("test-oracle: weights do not match its draft")

    def load_weights(self, state):
        self.draft.load_state_dict(state)


register_proposer(
    "test-garbage", lambda ctx: Garbage(ctx.target.config.vocab_size, ctx.seed), replace=True
)
register_proposer(
    "test-randq", lambda ctx: RandomQ(ctx.target.config.vocab_size, ctx.seed), replace=True
)
register_proposer(
    "test-recorder", lambda ctx: Recorder(ctx.target.config.vocab_size, ctx.seed), replace=True
)
register_proposer("test-oracle", lambda ctx: Oracle(ctx.target), replace=True)


# ------------------------------------------------------------------------- helpers
class Tick:
    """A deterministic clock (1 ms per call): bandit rewards and gate decisions reproduce."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1e-3
        return self.now


def make_engine(model: Transformer, **kwargs) -> RolloutEngine:
    return RolloutEngine(model, clock=Tick(), **kwargs)


PROMPTS = [
    [1, 5, 6, 7, 5, 6],
    [3, 4, 3, 4, 3],
    [9],
    [10, 11, 12, 13, 10, 11, 12],
    [2, 2],
    [7, 8, 9, 7],
]


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def run(engine: RolloutEngine, prompts, params) -> list:
    return engine.generate([Request(p, params) for p in prompts])


# ------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("slots", [1, 3], ids=["batch1", "continuous"])
def test_plain_engine_matches_reference_greedy(slots):
    model = tiny()
    ref = generate(model, PROMPTS, 24)
    out = run(make_engine(model, max_batch_size=slots), PROMPTS, greedy())
    assert [r.tokens for r in out] == ref
    assert all(r.finish_reason == "length" for r in out)


@pytest.mark.parametrize("slots", [1, 3], ids=["batch1", "continuous"])
@pytest.mark.parametrize(
    "proposers",
    [("ngram",), ("ngram", "test-garbage", "test-randq")],
    ids=["ngram", "best-of-n"],
)
@pytest.mark.parametrize("gate", [False, True], ids=["always", "gated"])
def test_speculative_greedy_matches_reference(slots, proposers, gate):
    model = tiny()
    ref = generate(model, PROMPTS, 24)
    spec = SpecConfig(proposers=proposers, max_k=4, gate=gate)
    engine = make_engine(model, max_batch_size=slots, spec=spec)
    out = run(engine, PROMPTS, greedy())
    assert [r.tokens for r in out] == ref
    s = engine.stats()
    if not gate:
        asked = {arm.split("/")[0] for arm in s["gating"]["selections"]}
        assert asked == set(proposers)  # the bandit tried every drafter
        assert 0 < s["spec"]["accepted"] < s["spec"]["draft_tokens"]  # hits and rejections


def test_group_samples_share_one_prefill():
    model = tiny()
    engine = make_engine(
        model, max_batch_size=8, spec=SpecConfig(proposers=["ngram"], max_k=3, gate=False)
    )
    out = engine.generate([Request(PROMPTS[0], greedy(n=3)), Request(PROMPTS[1], greedy(n=2))])
    ref = generate(model, PROMPTS[:2], 24)
    assert [(r.request_id, r.index) for r in out] == [
        ("req-0", 0),
        ("req-0", 1),
        ("req-0", 2),
        ("req-1", 0),
        ("req-1", 1),
    ]
    assert [r.tokens for r in out] == [ref[0]] * 3 + [ref[1]] * 2
    assert engine.stats()["prefill_forwards"] == 1


# ------------------------------------------------------------------------- sampling
def test_seeded_sampling_does_not_depend_on_the_batch():
    model = tiny()
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=123)
    alone = run(make_engine(model, max_batch_size=4), [PROMPTS[0]], params)[0]
    others = SamplingParams(max_tokens=16, temperature=1.0)
    crowd = make_engine(model, max_batch_size=4).generate(
        [Request(PROMPTS[1], others), Request(PROMPTS[0], params), Request(PROMPTS[2], others)]
    )
    assert crowd[1].tokens == alone.tokens
    again = run(make_engine(model, max_batch_size=1), [PROMPTS[0]], params)[0]
    assert again.tokens == alone.tokens


def _exact_marginals(model, prompt, steps, params) -> list[np.ndarray]:
    """Marginal distribution of each generated position under the processed policy."""
    v = model.config.vocab_size
    joint = np.ones(1)
    prefixes = [tuple(prompt)]
    marginals = []
    for _ in range(steps):
        seqs = [list(p) for p in prefixes]
        layout = PackedLayout.from_lengths([len(s) for s in seqs])
        with torch.no_grad():
            logits = model(
                torch.tensor([t for s in seqs for t in s]),
                layout,
                logits_index=layout.cu_seqlens[1:] - 1,
            ).logits
        probs = sampling_probs(logits, RowParams.build([params], [len(seqs)], "cpu")).numpy()
        joint = (joint[:, None] * probs).reshape(-1)  # over all prefixes of the next length
        prefixes = [(*p, t) for p in prefixes for t in range(v)]
        marginals.append(joint.reshape(-1, v).sum(0))
    return marginals


def test_speculative_sampling_follows_the_policy_through_the_engine():
    model = tiny(seed=3, vocab=12)
    params = SamplingParams(max_tokens=4, temperature=0.9, top_k=8, n=4000, seed=0)
    spec = SpecConfig(proposers=("test-randq", "ngram"), max_k=2, gate=False)
    engine = make_engine(model, max_batch_size=256, max_model_len=8, spec=spec)
    out = engine.generate([Request([1, 2], params)])
    assert engine.stats()["spec"]["drafts"] > 1000
    tokens = np.array([r.tokens for r in out])  # [n, 4]
    for pos, exact in enumerate(_exact_marginals(model, [1, 2], 4, params)):
        obs = np.bincount(tokens[:, pos], minlength=12)
        assert obs[exact == 0].sum() == 0
        keep = exact * len(out) >= 5
        pool = (exact > 0) & ~keep  # cells expecting < 5 draws are pooled into one
        f_obs = np.append(obs[keep], obs[pool].sum()) if pool.any() else obs[keep]
        f_exp = (np.append(exact[keep], exact[pool].sum()) if pool.any() else exact[keep]) * len(
            out
        )
        # 1 % for the four positions together (Bonferroni), so the test is not flaky
        assert stats.chisquare(f_obs, f_exp).pvalue > 0.01 / 4, f"position {pos}"


def test_logprobs_are_the_processed_and_the_raw_policy_distributions():
    model = tiny(seed=1)
    params = SamplingParams(max_tokens=12, temperature=0.7, top_k=5, seed=0, n=2)
    spec = SpecConfig(proposers=("test-randq", "ngram"), max_k=3, gate=False)
    out = run(make_engine(model, max_batch_size=4, spec=spec), PROMPTS[:2], params)
    for r in out:
        seq = r.prompt_tokens + r.tokens
        with torch.no_grad():
            logits = model(torch.tensor(seq), PackedLayout.from_lengths([len(seq)])).logits
        rows = logits[len(r.prompt_tokens) - 1 : len(seq) - 1]  # the rows that produced r.tokens
        idx = torch.tensor(r.tokens)
        policy = torch.log_softmax(rows, -1)[torch.arange(len(idx)), idx]
        processed = sampling_probs(rows, RowParams.build([params], [len(idx)], "cpu"))
        sampled = processed[torch.arange(len(idx)), idx].log()
        torch.testing.assert_close(torch.tensor(r.policy_logprobs, dtype=torch.float64), policy)
        torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), sampled)


def test_sampling_tensors_are_reused_only_for_the_same_parameters_and_rows():
    """A launch reuses the previous launch's RowParams only for the same parameter objects
    with the same rows each; anything else rebuilds them (and they match a fresh build)."""
    engine = make_engine(tiny())
    a, b = SamplingParams(max_tokens=4, temperature=0.7), SamplingParams(max_tokens=4, top_k=3)
    first = engine.batches.row_params([a, b], [1, 3])
    assert engine.batches.row_params([a, b], [1, 3]) is first
    equal = SamplingParams(max_tokens=4, temperature=0.7)  # equal, but another request's
    for params, rows in (([a, b], [1, 2]), ([b, a], [3, 1]), ([equal, b], [1, 3]), ([a], [1])):
        got = engine.batches.row_params(params, rows)
        assert got is not first
        want = RowParams.build(params, rows, "cpu")
        for name in ("temperature", "top_k", "top_p", "greedy"):
            assert torch.equal(getattr(got, name), getattr(want, name))
        assert (got.all_greedy, got.any_greedy, got.any_filter) == (
            want.all_greedy,
            want.any_greedy,
            want.any_filter,
        )


def test_greedy_logprobs_are_zero_under_the_one_hot_distribution():
    out = run(make_engine(tiny()), PROMPTS[:1], greedy(8))[0]
    assert out.logprobs == [0.0] * 8
    assert all(lp < 0 for lp in out.policy_logprobs)


# ------------------------------------------------------------------------- stops
def test_stop_token_ends_the_sample_and_is_kept():
    model = tiny()
    free = run(make_engine(model), PROMPTS[:1], greedy(24))[0].tokens
    stop = free[5]
    cut = free.index(stop) + 1
    engine = make_engine(model, spec=SpecConfig(proposers=["ngram"], max_k=4, gate=False))
    out = run(engine, PROMPTS[:1], greedy(24, stop_token_ids=(stop,)))[0]
    assert out.tokens == free[:cut]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert len(out.logprobs) == len(out.tokens)


def test_eos_and_stop_strings_with_a_codec():
    from specrl.models.tokenizer import TextCodec, char_tokenizer

    tok = char_tokenizer()
    codec = TextCodec(tok)
    model = tiny(seed=5, vocab=tok.get_vocab_size())
    prompt = "12+34="
    free = make_engine(model, codec=codec, eos_token_ids=[]).generate(
        [Request(prompt, greedy(20))]
    )[0]
    assert len(free.text) >= 8
    needle = free.text[4:6]
    spec = SpecConfig(proposers=["ngram"], max_k=4, gate=False)
    out = make_engine(model, codec=codec, eos_token_ids=[], spec=spec).generate(
        [Request(prompt, greedy(20, stop=(needle,)))]
    )[0]
    start = free.text.index(needle)
    assert out.text == free.text[:start]
    assert (out.finish_reason, out.stop_reason) == ("stop", needle)
    assert codec.decode(out.tokens).endswith(needle)  # tokens run through the match
    # the model's eos stops by default and is not part of the text
    eos_engine = make_engine(model, codec=codec, eos_token_ids=[free.tokens[3]])
    stopped = eos_engine.generate([Request(prompt, greedy(20))])[0]
    assert stopped.tokens == free.tokens[: free.tokens.index(free.tokens[3]) + 1]
    assert stopped.finish_reason == "stop"


# ------------------------------------------------------------------------- proposer hooks
def test_taps_of_committed_positions_reach_observe():
    model = tiny(seed=2)
    spec = SpecConfig(proposers=("test-recorder", "ngram"), max_k=3, gate=False)
    engine = make_engine(model, max_batch_size=3, spec=spec)
    run(engine, PROMPTS[:4], greedy(12, n=2))
    rec = engine.proposers["test-recorder"]
    assert len(rec.final) == 8
    for seq_id, tokens in rec.final.items():
        got = rec.taps[seq_id]
        with torch.no_grad():
            full = model(
                torch.tensor(tokens), PackedLayout.from_lengths([len(tokens)]), taps=[0, 1]
            )
        # every position once, except the final token: it is emitted but never fed
        assert sorted(got) == list(range(len(tokens) - 1))
        for pos, layers in got.items():
            for layer, h in layers.items():
                torch.testing.assert_close(h, full.taps[layer][pos])


def test_ngram_drafts_from_own_context_siblings_and_history():
    from specrl.rollout.proposers import SeqState

    ngram = NgramProposer(min_n=2, max_n=4)
    prompt = [1, 2, 3]

    def seq(i, out):
        s = SeqState(i, f"r{i}", 0, prompt + out, len(prompt), SamplingParams(), None)
        ngram.reset(s)
        return s

    own = seq(0, [7, 8, 9, 4, 7, 8])
    assert ngram.propose([own], [3])[0].tokens == [9, 4, 7]  # own context: after "7 8"
    sib = seq(1, [5, 6, 1, 2, 9, 9, 2, 2, 7])
    me = seq(2, [5, 6, 1, 2])
    # the longest match wins: "5 6 1 2" in the sibling beats "1 2" of the own prompt
    assert ngram.propose([me], [2])[0].tokens == [9, 9]
    ngram.release(sib)
    later = seq(3, [0, 5, 6, 1, 2])
    assert ngram.propose([later], [4])[0].tokens == [9, 9, 2, 2]  # from the finished history
    assert ngram.propose([seq(4, [42, 43])], [3])[0].tokens == []  # nothing matches


def test_ngram_history_raises_acceptance_on_a_repeated_prompt():
    model = tiny(seed=4)
    engine = make_engine(
        model, max_batch_size=2, spec=SpecConfig(proposers=["ngram"], max_k=4, gate=False)
    )
    first = run(engine, PROMPTS[3:4], greedy(24))
    tau_first = engine.stats()["spec"]["tau"]
    again = run(engine, PROMPTS[3:4], greedy(24))
    spec = engine.stats()["spec"]
    assert again[0].tokens == first[0].tokens
    assert again[0].spec["acceptance_rate"] == 1.0  # every draft of the repeat comes true
    assert spec["tau"] > tau_first


# ------------------------------------------------------------------------- weights, alarm, stats
def test_update_weights_switches_the_policy_and_reports_versions():
    model, other = tiny(seed=0), tiny(seed=9)
    engine = make_engine(model, max_batch_size=2, spec=SpecConfig(proposers=["ngram"], max_k=2))
    engine.update_weights(policy=other.state_dict(), version=7)
    out = run(engine, PROMPTS[:3], greedy(10))
    assert [r.tokens for r in out] == generate(other, PROMPTS[:3], 10)
    assert out[0].policy_versions == (7, 7)
    assert engine.stats()["policy_version"] == 7
    bad = {k: v for k, v in other.state_dict().items() if "lm_head" not in k}
    with pytest.raises(CheckpointError, match="missing"):
        engine.update_weights(policy=bad)
    wrong = dict(other.state_dict(), **{"model.norm.weight": torch.ones(3)})
    with pytest.raises(CheckpointError, match="shape"):
        engine.update_weights(policy=wrong)
    with pytest.raises(ConfigError, match="no proposer"):
        engine.update_weights(draft=other.state_dict())


def test_stale_draft_raises_the_alarm_and_a_fresh_one_clears_it(caplog):
    model, other = tiny(seed=0), tiny(seed=9)
    spec = SpecConfig(
        proposers=("test-oracle",), max_k=4, gate=False, alarm_window=8, alarm_tau=1.2
    )
    engine = make_engine(model, max_batch_size=4, spec=spec)
    run(engine, PROMPTS, greedy(16))
    assert engine.stats()["spec"]["acceptance_rate"] == 1.0  # the draft is the target
    engine.update_weights(policy=other.state_dict(), version=1)  # draft not updated: stale
    with caplog.at_level(logging.WARNING, logger="specrl.rollout"):
        run(engine, PROMPTS, greedy(16))
    s = engine.stats()
    assert s["alarms"] >= 1
    assert "stale or broken" in caplog.text
    engine.update_weights(draft=other.state_dict(), version=1)
    assert (engine.stats()["policy_version"], engine.stats()["draft_version"]) == (1, 1)
    alarms = s["alarms"]
    run(engine, PROMPTS, greedy(16))
    s = engine.stats()
    assert s["alarms"] == alarms and s["alarm_armed"] == []  # a healthy window disarmed it


def test_tau_and_per_position_acceptance_with_a_perfect_draft():
    model = tiny()
    spec = SpecConfig(proposers=("test-oracle",), max_k=4, gate=False)
    engine = make_engine(model, max_batch_size=2, spec=spec)
    out = run(engine, PROMPTS[:4], greedy(20))
    s = engine.stats()
    spec_stats = s["spec"]
    assert spec_stats["accepted"] == spec_stats["draft_tokens"]
    assert spec_stats["tau"] == 1 + spec_stats["accepted"] / spec_stats["drafts"]
    assert spec_stats["per_position"] == [1.0] * 4
    assert s["forwards_per_token"] < 0.5
    for r in out:
        assert r.spec["tau"] == 1 + r.spec["accepted"] / r.spec["drafts"]
        assert r.spec["forwards"] == 1 + r.spec["verifications"]
    assert s["tokens"] == sum(len(r.tokens) for r in out)


# ------------------------------------------------------------------------- validation
def test_bad_requests_and_registry_errors():
    engine = make_engine(tiny(), max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([Request([1] * 10, greedy(10))])
    with pytest.raises(ValueError, match="codec"):
        engine.generate([Request("text", greedy(4))])
    with pytest.raises(ValueError, match=r"in \[0, 32\)"):
        engine.generate([Request([99], greedy(4))])
    with pytest.raises(ValueError, match="already in use"):
        engine.generate([Request([1], greedy(4), "a"), Request([2], greedy(4), "a")])
    assert not engine.has_unfinished()  # nothing was queued by the failed calls
    with pytest.raises(ConfigError, match="unknown proposer"):
        make_engine(tiny(), spec=SpecConfig(proposers=("nope",)))
    with pytest.raises(ConfigError, match="bad options"):
        build_proposer("test-garbage", None, colour="red")  # type: ignore[arg-type]
    for bad in ({"max_k": 0}, {"max_k": 4, "draft_lengths": [2, 5]}):  # a recipe's one-line error
        with pytest.raises(ConfigError, match=r"max_k'? must|draft_lengths must"):
            from_dict(SpecConfig, {"proposers": ["ngram"], **bad}, prefix="rollout.speculation")
    engine = make_engine(tiny(), spec=SpecConfig(("ngram",), max_k=8, draft_lengths=(8, 2, 2)))
    assert [arm.k for arm in engine.controller.arms] == [2, 8]
    with pytest.raises(ValueError, match="already registered"):
        register_proposer("test-garbage", lambda ctx: None)


def test_continuous_batching_reuses_slots_under_load():
    model = tiny()
    prompts = [list(p) for p in itertools.islice(itertools.cycle(PROMPTS), 11)]
    engine = make_engine(model, max_batch_size=3, spec=SpecConfig(proposers=["ngram"], max_k=2))
    lengths = [SamplingParams(max_tokens=m, temperature=0) for m in (3, 9, 17)]
    reqs = [Request(p, lengths[i % 3], request_id=str(i)) for i, p in enumerate(prompts)]
    engine.add_requests(reqs)
    out, slot_of, moves = {}, {}, 0
    while engine.has_unfinished():
        out.update({int(r.request_id): r for r in engine.step()})
        running = engine.scheduler.running
        # slots stay compact, in list order: decode steps slice the cache, never gather it
        assert [s.slot for s in running] == list(range(len(running)))
        moves += sum(slot_of.get(s.seq_id, s.slot) != s.slot for s in running)
        slot_of = {s.seq_id: s.slot for s in running}
    assert moves > 0
    for i, r in sorted(out.items()):
        assert r.tokens == generate(model, [prompts[i]], lengths[i % 3].max_tokens)[0]
    s = engine.stats()
    assert s["finished"] == 11 and s["running"] == 0 and s["prefill_forwards"] > 3


def _byte_level_tokenizer():
    """A small byte-level BPE (multi-byte characters span several tokens, like GPT-2's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["héllo wörld ünïcode </answer> 42 日本語 テキスト ⟨x⟩"] * 20, trainer)
    return tok


def test_stop_strings_found_from_the_tail_as_from_the_whole_text():
    """``stop_string_hit`` (tail decode per token) finds the same stop, at the same token and
    with the same text, as decoding the whole output after every token: multi-byte
    characters split across tokens, special tokens decoding to nothing, long outputs."""
    from specrl.models.tokenizer import HFTokenizer, TextCodec
    from specrl.rollout.scheduler import stop_string_hit

    codec = TextCodec(HFTokenizer(_byte_level_tokenizer(), {"eos_token": "</s>"}))
    vocab = codec.tokenizer.get_vocab_size()
    rng = random.Random(0)
    stops_sets = [("</answer>",), ("日本",), ("ö", "wör"), ("テキスト", "42"), ("x⟩",)]
    found = 0
    for trial in range(60):
        stops = stops_sets[trial % len(stops_sets)]
        prompt = [rng.randrange(vocab) for _ in range(5)]
        # a random output, with some stop string's tokens (or a part) planted at times
        out: list[int] = []
        while len(out) < 400:
            if rng.random() < 0.02:
                out += codec.tokenizer.encode(rng.choice(stops))
            elif rng.random() < 0.05:
                out.append(rng.choice([0, 1]))  # special tokens: decode to nothing
            else:
                out.append(rng.randrange(vocab))
        tokens = prompt[:]
        for tok in out:
            tokens.append(tok)
            text = codec.decode(tokens[len(prompt) :])
            hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
            want = None if not hits else (text[: min(hits)[0]], min(hits)[1])
            got = stop_string_hit(codec.decode, tokens, len(prompt), stops)
            assert got == want, (trial, len(tokens))
            if want is not None:
                found += 1
                break
    assert found >= 40  # most outputs do hit a stop string: the check is exercised


def test_generate_returns_the_calls_own_speculation_statistics():
    """``Results.stats`` counts one call: its spec counters are the sum of its samples', its
    tokens their lengths, and the engine's lifetime counters are the sum over calls."""
    spec = SpecConfig(proposers=("ngram", "test-garbage"), max_k=3, gate=False)
    engine = make_engine(tiny(), max_batch_size=3, spec=spec)
    calls = [run(engine, PROMPTS[:3], greedy(12)), run(engine, PROMPTS[3:], greedy(16, n=2))]
    for out in calls:
        stats = out.stats
        assert stats["tokens"] == sum(len(r.tokens) for r in out)
        for key in ("drafts", "accepted", "draft_tokens", "verifications"):
            assert stats["spec"][key] == sum(r.spec[key] for r in out)
        assert sum(stats["selections"].values()) >= stats["spec"]["drafts"] > 0
        by_proposer = sum(p["drafts"] for p in stats["proposers"].values())
        assert by_proposer == stats["spec"]["drafts"]
    total = engine.stats()
    for key in ("tokens", "target_forwards", "steps"):
        assert total[key] == sum(out.stats[key] for out in calls)
    assert total["spec"]["accepted"] == sum(out.stats["spec"]["accepted"] for out in calls)


def test_generate_reports_its_rollout_wave():
    """``Results.stats["wave"]``: per engine step the live batch (prefilled or decoded) and
    how many of them drafted; the wave of a batch with a length tail shrinks to its longest."""
    spec = SpecConfig(proposers=("test-garbage",), max_k=2, gate=False)
    engine = make_engine(tiny(), max_batch_size=4, spec=spec)
    lengths = (2, 3, 5, 14)
    out = engine.generate([Request(p, greedy(m)) for p, m in zip(PROMPTS, lengths, strict=False)])
    wave = out.stats["wave"]
    assert len(wave) == out.stats["steps"]
    assert wave[0] == [4, 0]  # the prefill of all four
    live = [w[0] for w in wave]
    assert live == sorted(live, reverse=True) and live[-1] == 1
    assert all(0 <= d <= n for n, d in wave) and any(d for _, d in wave)
    # every step's decoded sequences emitted ≥ 1 token each
    assert sum(live[1:]) <= sum(len(r.tokens) for r in out)
    assert engine.stats()["wave"] is None  # lifetime counters keep no per-step list


# ------------------------------------------------------------------------- resumable state
def _sampled_round(engine: RolloutEngine, seed: int) -> list:
    params = SamplingParams(max_tokens=12, temperature=1.0, n=2)
    out = engine.generate([Request(p, params) for p in PROMPTS[seed % 3 : seed % 3 + 3]])
    return [r.tokens for r in out]


def test_engine_state_through_json_replays_the_run_exactly():
    """Resume identity: an engine rebuilt from a JSON'd state (policy, counters, n-gram history,
    sampling seeds) decodes what the original goes on to decode, token for token."""
    model = tiny(seed=2)
    spec = SpecConfig(proposers=["ngram"], max_k=3)
    first = make_engine(model, max_batch_size=3, spec=spec, seed=9)
    for r in range(3):
        _sampled_round(first, r)
    state = json.loads(json.dumps(first.state_dict()))
    second = make_engine(model, max_batch_size=3, spec=spec, seed=123)
    second.load_state_dict(state)
    second.clock.now = first.clock.now  # the clock is the caller's: the same timings
    for r in range(3, 6):
        assert _sampled_round(first, r) == _sampled_round(second, r)
    assert first.state_dict() == second.state_dict()
    assert state["proposers"]["ngram"]["history"]  # the history travelled with it


def test_engine_state_of_the_older_format_keeps_versions_and_seed(caplog):
    engine = make_engine(tiny(), spec=SpecConfig(proposers=["ngram"], max_k=2), seed=1)
    rng = random.Random(5)
    version, internal, gauss = rng.getstate()
    legacy = {
        "controller": {"__obj__": "specrl.rollout.gating.SpecController", "attrs": {}},
        "_rng": {"__random__": [version, list(internal), gauss]},
        "policy_version": 4,
        "draft_version": 2,
        "_next_seq": 10,
        "_next_request": 5,
    }
    with caplog.at_level(logging.WARNING, logger="specrl.rollout"):
        engine.load_state_dict(legacy)
    assert (engine.policy_version, engine.draft_version) == (4, 2)
    assert "older format" in caplog.text
    assert engine.add_requests([Request([1], greedy(2))]) == ["req-5"]
    with pytest.raises(CheckpointError, match="no format"):
        engine.load_state_dict({"controller": {}})


def test_a_speculation_policy_state_in_another_layout_is_a_one_line_error():
    """E.g. an unreleased build's (the target's cost in two curves; no settling counters; the
    estimates not yet under ``costs``; no stretch lengths per batch size)."""
    engine = make_engine(tiny(), spec=SpecConfig(proposers=["ngram"], max_k=2))
    state = engine.state_dict()
    older = copy.deepcopy(state)
    older["controller"]["costs"]["target"] = [{"buckets": []}, {"buckets": []}]
    fewer = copy.deepcopy(state)
    del fewer["controller"]["costs"]["last_mode"]
    flat = copy.deepcopy(state)  # the estimates beside the policy's own state, not under costs
    flat["controller"] |= flat["controller"].pop("costs")
    stretchless = copy.deepcopy(state)
    del stretchless["controller"]["stretches"], stretchless["controller"]["caught_up"]
    for bad in (older, fewer, flat, stretchless):
        with pytest.raises(CheckpointError, match="malformed"):
            engine.load_state_dict(json.loads(json.dumps(bad)))
    engine.load_state_dict(state)  # the current layout still loads


def test_saved_state_with_an_unknown_proposer_is_refused():
    saved = make_engine(tiny(), spec=SpecConfig(proposers=["ngram", "test-garbage"], max_k=2))
    state = saved.state_dict()
    engine = make_engine(tiny(), spec=SpecConfig(proposers=["ngram"], max_k=2))
    with pytest.raises(ConfigError, match="test-garbage"):
        engine.load_state_dict(state)
