"""Prompt encoding from a checkpoint's tokenizer files == ``transformers.AutoTokenizer``'s.

Tokenizer files are built here in three styles (no model hub): Llama-3 (byte-level BPE, BOS
from the post-processor, header/eot chat template), Qwen2 (byte-level BPE, no BOS although
config.json names one, ChatML template) and specrl's toy (characters, ``<bos>`` always).  For
each, plain and chat-templated encodings must equal transformers'; the toy's greedy generation
from text through specrl's engine must equal ``AutoModelForCausalLM.generate``'s.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from specrl.errors import ConfigError
from specrl.models.tokenizer import HFTokenizer, TextCodec, char_tokenizer

transformers = pytest.importorskip("transformers")

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CORPUS = [
    "What is 12+34? Let me think step by step: 2+4=6, 1+3=4, so the answer is 46.",
    "Hello, world! The quick brown fox jumps over the lazy dog.\n\nNew paragraph.",
    "ünïcode text, 日本語のテキスト, and emoji-free symbols: ⟨x⟩ ≤ y ≥ z.",
    "def f(x):\n    return x * 2  # doubled\n",
] * 30

# Llama-3 style: the BOS comes from the template (the encode adds none)
LLAMA3_TEMPLATE = """{{- bos_token }}
{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] | trim %}
    {% set messages = messages[1:] %}
{% else %}
    {% set system = "You are a helpful assistant." %}
{% endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" + system + "<|eot_id|>" }}
{% for message in messages %}
    {% if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception("roles must be user or assistant") }}
    {% endif %}
    {{- "<|start_header_id|>" + message['role'] + "<|end_header_id|>\\n\\n" }}
    {{- message['content'] | trim + "<|eot_id|>" }}
{% endfor %}
{% if add_generation_prompt %}
    {{- "<|start_header_id|>assistant<|end_header_id|>\\n\\n" }}
{% endif %}
"""
# Qwen2 style (ChatML); tojson and loop variables exercised
QWEN2_TEMPLATE = """{%- for message in messages %}
    {%- if loop.first and message.role != 'system' %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
    {%- if message.meta is defined %}
        {{- '<|im_start|>' + message.role + '\\n' + message.meta | tojson + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
TOY_TEMPLATE = """{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}
{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"""


def _byte_level_bpe(split: str, specials: list[str], nfc: bool) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _write(path: Path, tok: Tokenizer, config: dict, model_config: dict | None = None) -> Path:
    path.mkdir(parents=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    if model_config is not None:
        (path / "config.json").write_text(json.dumps(model_config))
    return path


def llama3_style(path: Path) -> Path:
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>"]
    specials += ["<|end_header_id|>", "<|eot_id|>"]
    tok = _byte_level_bpe(LLAMA3_SPLIT, specials, nfc=False)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                special_tokens=[("<|begin_of_text|>", bos)],
            ),
        ]
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "clean_up_tokenization_spaces": True,
        "model_max_length": 131072,
        "chat_template": LLAMA3_TEMPLATE,
    }
    return _write(path, tok, config, {"bos_token_id": bos, "eos_token_id": bos + 1})


def qwen2_style(path: Path) -> Path:
    tok = _byte_level_bpe(QWEN2_SPLIT, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], nfc=True)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_prefix_space": False,
        "errors": "replace",
        "split_special_tokens": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
        "chat_template": QWEN2_TEMPLATE,
    }
    # config.json names <|endoftext|> as BOS, which the tokenizer never adds
    eot = tok.token_to_id("<|endoftext|>")
    return _write(path, tok, config, {"bos_token_id": eot, "eos_token_id": eot + 2})


def toy_style(path: Path) -> Path:
    path.mkdir(parents=True)
    char_tokenizer().save_pretrained(path)
    return path


def toy_with_template(path: Path) -> Path:
    toy_style(path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TOY_TEMPLATE}))
    return path


STYLES = {"llama3": llama3_style, "qwen2": qwen2_style, "toy": toy_with_template}
TEXTS = [
    "12+34=",
    "Hello world",
    " leading and trailing spaces  ",
    "a\n\nb\n",
    "ünïcode 日本語 ⟨x⟩",
    "What is 7*8? 56.",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is 12+34?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": " 9*9 = ? "},
    ],
]


@pytest.fixture(scope="module", params=list(STYLES))
def style(request, tmp_path_factory):
    path = STYLES[request.param](tmp_path_factory.mktemp("tok") / request.param)
    return request.param, path, transformers.AutoTokenizer.from_pretrained(str(path))


def _hf_ids(hf, text: str) -> list[int]:
    return list(hf(text)["input_ids"])


def test_plain_encoding_equals_auto_tokenizer(style):
    name, path, hf = style
    ours = HFTokenizer.from_dir(path)
    for text in TEXTS:
        assert ours.encode(text) == _hf_ids(hf, text), (name, text)
        assert ours.decode(ours.encode(text)) == hf.decode(
            _hf_ids(hf, text), skip_special_tokens=True
        )
    bos = ours.encode("12+34=")[:1]
    if name == "qwen2":  # config.json's bos_token_id is not the tokenizer's: nothing prepended
        cfg = json.loads((path / "config.json").read_text())
        assert bos != [cfg["bos_token_id"]] and ours.bos_token_id is None
    else:
        assert bos == [ours.bos_token_id] and ours.bos_token_id is not None


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("0123456789+=* aZé日\n\t?!.<>|_")), max_size=40))
def test_random_texts_encode_as_auto_tokenizer(text):
    for name, (ours, hf) in _ENCODERS.items():
        assert ours.encode(text) == _hf_ids(hf, text), (name, text)


_ENCODERS: dict[str, tuple[HFTokenizer, object]] = {}


@pytest.fixture(scope="module", autouse=True)
def _encoders(tmp_path_factory):
    for name, build in STYLES.items():
        path = build(tmp_path_factory.mktemp("enc") / name)
        _ENCODERS[name] = (
            HFTokenizer.from_dir(path),
            transformers.AutoTokenizer.from_pretrained(str(path)),
        )
    yield
    _ENCODERS.clear()


def test_chat_template_equals_apply_chat_template(style):
    name, path, hf = style
    ours = HFTokenizer.from_dir(path)
    for messages in CHATS:
        text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert ours.render_chat(messages) == text, name
        ids = hf.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert ours.apply_chat_template(messages) == list(ids), name
        no_prompt = hf.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
        assert ours.render_chat(messages, add_generation_prompt=False) == no_prompt
    if name == "qwen2":  # tojson as transformers defines it (non-ASCII kept)
        meta = [{"role": "user", "meta": {"q": "日本", "n": [1, 2]}}]
        assert ours.render_chat(meta) == hf.apply_chat_template(
            meta, add_generation_prompt=True, tokenize=False
        )
    codec = TextCodec(ours, chat=True)
    user = [{"role": "user", "content": "12+34="}]
    assert codec.encode_prompt("12+34=") == list(
        hf.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=False)
    )


def test_template_errors_are_one_line_config_errors(tmp_path):
    path = llama3_style(tmp_path / "l3")
    ours = HFTokenizer.from_dir(path)
    with pytest.raises(ConfigError, match="roles must be user or assistant"):
        ours.render_chat([{"role": "tool", "content": "x"}])
    plain = HFTokenizer.from_dir(toy_style(tmp_path / "toy"))
    with pytest.raises(ConfigError, match="no chat template"):
        TextCodec(plain, chat=True)


def test_template_is_sandboxed(tmp_path):
    path = toy_style(tmp_path / "toy")
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ messages.__class__.__mro__ }}"
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="chat template failed"):
        HFTokenizer.from_dir(path).render_chat([{"role": "user", "content": "x"}])


def test_chat_template_jinja_file_and_named_templates(tmp_path):
    path = toy_style(tmp_path / "toy")
    (path / "chat_template.jinja").write_text(TOY_TEMPLATE)
    hf = transformers.AutoTokenizer.from_pretrained(str(path))
    ours = HFTokenizer.from_dir(path)
    msgs = CHATS[0]
    assert ours.apply_chat_template(msgs) == list(
        hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    named = HFTokenizer(
        ours.raw, {**ours.config, "chat_template": [{"name": "default", "template": "X{{ 1 }}"}]}
    )
    assert named.render_chat(msgs) == "X1"


@pytest.mark.parametrize("flags", [{}, {"add_bos_token": True, "add_eos_token": True}])
def test_no_post_processor_adds_no_special_tokens(tmp_path, flags):
    """tokenizer.json without a post-processor: nothing added, whatever tokenizer_config's
    add_bos_token / add_eos_token say (transformers reads tokenizer.json's pipeline)."""
    path = toy_style(tmp_path / "toy")
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    raw.post_processor = None
    raw.save(str(path / "tokenizer.json"))
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if k not in ("add_bos_token", "add_eos_token")}
    cfg.update(flags)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    hf = transformers.AutoTokenizer.from_pretrained(str(path))
    ours = HFTokenizer.from_dir(path)
    for text in TEXTS:
        assert ours.encode(text) == _hf_ids(hf, text), (flags, text)
    assert ours.encode("12") == [ours.token_to_id("1"), ours.token_to_id("2")]


def test_checkpoint_from_before_tokenizer_config_still_loads(tmp_path, caplog):
    """A toy checkpoint written by an older specrl: tokenizer.json without post-processor,
    no tokenizer_config.json.  Encoded as then (config.json's BOS first), with a warning;
    re-saved, it carries files that transformers reads the same way."""
    old = tmp_path / "old"
    old.mkdir()
    raw = Tokenizer.from_str(char_tokenizer().raw.to_str())
    raw.post_processor = None
    raw.save(str(old / "tokenizer.json"))
    bos, eos = raw.token_to_id("<bos>"), raw.token_to_id("<eos>")
    (old / "config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}))
    with caplog.at_level(logging.WARNING, logger="specrl.models.tokenizer"):
        codec = TextCodec.from_checkpoint(old)
    assert "no tokenizer_config.json" in caplog.text
    text = "12+34="
    assert codec.encode_prompt(text) == [bos, *raw.encode(text, add_special_tokens=False).ids]
    assert codec.eos_ids == (eos,)
    new = tmp_path / "new"
    new.mkdir()
    codec.tokenizer.save_pretrained(new)
    assert {"tokenizer_config.json", "generation_config.json"} <= {p.name for p in new.iterdir()}
    hf = transformers.AutoTokenizer.from_pretrained(str(new))
    assert _hf_ids(hf, text) == codec.encode_prompt(text)
    assert TextCodec.from_checkpoint(new).encode_prompt(text) == codec.encode_prompt(text)


def test_resave_keeps_the_files_verbatim(tmp_path):
    src = qwen2_style(tmp_path / "q")
    ours = HFTokenizer.from_dir(src)
    dst = tmp_path / "copy"
    dst.mkdir()
    ours.save_pretrained(dst)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (dst / name).read_bytes() == (src / name).read_bytes()


def test_stop_ids_collect_config_tokenizer_and_generation_config(tmp_path):
    path = llama3_style(tmp_path / "l3")
    gen = {"eos_token_id": [7, 8]}
    (path / "generation_config.json").write_text(json.dumps(gen))
    codec = TextCodec.from_checkpoint(path, type("C", (), {"eos_token_id": 3})())
    eot = HFTokenizer.from_dir(path).eos_token_id
    assert codec.eos_ids == (3, eot, 7, 8)


@pytest.mark.usefixtures("one_thread")
def test_toy_text_generation_equals_transformers(tmp_path):
    """From text, greedy: specrl's engine through its codec == AutoTokenizer +
    AutoModelForCausalLM.generate, on a toy checkpoint written by specrl."""
    from specrl.models.checkpoint import load_model, save_model
    from specrl.models.decoder import Transformer
    from specrl.models.presets import preset_config
    from specrl.models.tokenizer import special_ids
    from specrl.rollout import Request, RolloutEngine, SamplingParams

    tok = char_tokenizer()
    ids = special_ids(tok)
    cfg = preset_config(
        "toy-tiny",
        vocab_size=tok.get_vocab_size(),
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
    )
    path = tmp_path / "toy"
    save_model(Transformer(cfg).init_weights(1, std=0.2), path, tokenizer=tok, dtype="float64")
    prompts = ["12+34=", "905+7=", "1+1="]
    engine = RolloutEngine(
        load_model(path), codec=TextCodec.from_checkpoint(path, cfg), max_batch_size=4
    )
    ours = engine.generate(
        [Request(p, SamplingParams(max_tokens=12, temperature=0)) for p in prompts]
    )
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64)
    for p, r in zip(prompts, ours, strict=True):
        enc = hf_tok(p, return_tensors="pt")
        assert enc["input_ids"][0].tolist() == r.prompt_tokens
        out = hf_model.generate(**enc, max_new_tokens=12, do_sample=False)
        hf_new = out[0, enc["input_ids"].shape[1] :].tolist()
        assert hf_new == r.tokens, p
        assert hf_tok.decode(hf_new, skip_special_tokens=True) == r.text
