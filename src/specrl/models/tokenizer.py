"""Tokenizers: a checkpoint's tokenizer files, prompt encoding as HF consumers do it, the toy's.

A checkpoint's tokenizer files are the one source of truth for how text becomes token ids, for
specrl exactly as for ``transformers`` and vLLM (which tokenizes with ``transformers``):

- ``tokenizer.json``: the ``tokenizers`` pipeline (normalizer, pre-tokenizer, model and the
  post-processor that adds special tokens such as a BOS);
- ``tokenizer_config.json``: the named special tokens (``bos_token``, ``eos_token``, …),
  ``add_bos_token`` / ``add_eos_token``, ``chat_template`` (``chat_template.jinja`` in newer
  checkpoints); ``special_tokens_map.json`` fills named tokens it lacks (older checkpoints);
- ``generation_config.json``: the token ids generation stops at (``eos_token_id``, one or a list).

:class:`HFTokenizer` encodes as ``transformers.AutoTokenizer`` (5.x) does with the same files:
``encode(text)`` runs ``tokenizer.json``'s pipeline, whose post-processor adds the special tokens
(none when it has no post-processor; ``add_bos_token`` / ``add_eos_token`` in
``tokenizer_config.json`` do not override ``tokenizer.json``).  That is why a Qwen2 checkpoint,
whose ``config.json`` names ``<|endoftext|>`` as BOS, gets no BOS, and a Llama-3 one gets
``<|begin_of_text|>`` from its post-processor.  ``apply_chat_template(messages)`` renders the
chat template with jinja2 in a sandbox set up as ``transformers`` sets it up (``trim_blocks``,
``lstrip_blocks``, loop controls, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps
non-ASCII), with ``messages``, ``add_generation_prompt`` and the named special tokens as
variables, and encodes the text without adding special tokens (the template writes them).

Checkpoints specrl wrote before it wrote ``tokenizer_config.json`` (a ``tokenizer.json`` alone,
no post-processor) were encoded by prepending ``config.json``'s ``bos_token_id``.
:meth:`HFTokenizer.from_dir` recognises them (neither ``tokenizer_config.json`` nor
``special_tokens_map.json``) and keeps encoding them that way (a ``<bos> $A`` post-processor and
``add_bos_token: true``), with a warning; saving such a tokenizer writes the current files, so a
checkpoint specrl writes from one (``specrl train``'s) is read the same by every HF consumer.

The toy world's character tokenizer (:func:`char_tokenizer`) has one token per character plus
``<pad>``, ``<bos>``, ``<eos>``, ``<unk>``; its post-processor puts ``<bos>`` in front of every
encoded text (and its config says ``add_bos_token: true`` for consumers that read that flag), so
``12+34=`` is ``<bos>12+34=`` to every consumer.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from specrl.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
# every file a checkpoint's tokenizer may consist of: carried verbatim when specrl re-saves it
TOKENIZER_FILES = (
    TOKENIZER_FILE,
    TOKENIZER_CONFIG_FILE,
    SPECIAL_TOKENS_MAP_FILE,
    CHAT_TEMPLATE_FILE,
    "chat_template.json",
    GENERATION_CONFIG_FILE,
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
# the named special tokens transformers passes to chat templates (its SPECIAL_TOKENS_ATTRIBUTES)
NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARS = (
    "0123456789+-*/=;#:.,()[]{}<>_ \n?!'\"\\$%&|^~@"
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


# characters from which HFTokenizer.encode tokenizes with the GIL released
LONG_TEXT = 4096


class HFTokenizer:
    """A checkpoint's tokenizer files; encodes as ``transformers.AutoTokenizer`` does.

    ``backend`` is the ``tokenizer.json`` pipeline as read, ``config`` the
    ``tokenizer_config.json`` object (special tokens, flags, chat template), ``generation`` the
    ``generation_config.json`` object (or None).  ``files`` holds the checkpoint's tokenizer files
    verbatim (name → bytes) so that :meth:`save_pretrained` writes them back unchanged; files
    synthesised here (the toy's, a legacy checkpoint's upgrade) are generated from the objects.
    """

    def __init__(
        self,
        backend: Tokenizer,
        config: Mapping[str, Any] | None = None,
        *,
        generation: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
        files: Mapping[str, bytes] | None = None,
        source: str = "tokenizer",
    ) -> None:
        self.source = source
        self.raw = backend
        self.config: dict[str, Any] = dict(config or {})
        self.generation: dict[str, Any] | None = dict(generation) if generation else None
        self._chat_template = chat_template
        self._files = dict(files or {})
        self.special_tokens: dict[str, str] = {}
        for name in NAMED_SPECIAL_TOKENS:
            text = _token_text(self.config.get(name))
            if text is not None:
                self.special_tokens[name] = text
        self.backend = backend

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dir(
        cls, path: str | os.PathLike[str], *, bos_token_id: int | None = None
    ) -> HFTokenizer | None:
        """The tokenizer files of checkpoint ``path`` (None when it has no ``tokenizer.json``).

        ``bos_token_id`` (``config.json``'s; read from there when omitted) is used for
        checkpoints written before tokenizer_config.json (module docstring)."""
        p = Path(path)
        if not (p / TOKENIZER_FILE).is_file():
            return None
        files = {n: (p / n).read_bytes() for n in TOKENIZER_FILES if (p / n).is_file()}
        try:
            backend = Tokenizer.from_str(files[TOKENIZER_FILE].decode("utf-8"))
        except Exception as exc:
            raise CheckpointError(
                f"'{p / TOKENIZER_FILE}' is not a valid tokenizer.json ({exc})"
            ) from None

        def read(name: str) -> dict[str, Any] | None:
            if name not in files:
                return None
            try:
                data = json.loads(files[name].decode("utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise CheckpointError(f"'{p / name}' is not valid JSON ({exc})") from None
            if not isinstance(data, dict):
                raise CheckpointError(f"'{p / name}' must hold a JSON object")
            return data

        config = read(TOKENIZER_CONFIG_FILE)
        special_map = read(SPECIAL_TOKENS_MAP_FILE)
        generation = read(GENERATION_CONFIG_FILE)
        if config is None and special_map is None:
            return cls._legacy(backend, p, bos_token_id, generation)
        config = dict(config or {})
        for name, value in (special_map or {}).items():
            if name in NAMED_SPECIAL_TOKENS and config.get(name) is None:
                config[name] = value
        template = None
        if CHAT_TEMPLATE_FILE in files:
            template = files[CHAT_TEMPLATE_FILE].decode("utf-8")
        elif "chat_template.json" in files:
            template = (read("chat_template.json") or {}).get("chat_template")
        return cls(
            backend,
            config,
            generation=generation,
            chat_template=template,
            files=files,
            source=str(p),
        )

    @classmethod
    def _legacy(
        cls,
        backend: Tokenizer,
        path: Path,
        bos_token_id: int | None,
        generation: dict[str, Any] | None,
    ) -> HFTokenizer:
        """A checkpoint from before tokenizer_config.json: encoded as then (BOS prepended)."""
        cfg_file = path / "config.json"
        model_cfg: dict[str, Any] = {}
        if cfg_file.is_file():
            try:
                model_cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
            except json.JSONDecodeError:
                model_cfg = {}
        if bos_token_id is None:
            bos_token_id = model_cfg.get("bos_token_id")

        def name(i: Any) -> str | None:
            return backend.id_to_token(int(i)) if i is not None else None

        eos = _ids(model_cfg.get("eos_token_id"))
        bos = name(bos_token_id)
        backend = Tokenizer.from_str(backend.to_str())
        if bos is not None:
            backend.post_processor = _bos_processor(bos, int(bos_token_id))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": bos,
            "eos_token": name(eos[0]) if eos else None,
            "pad_token": name(model_cfg.get("pad_token_id")),
            "add_bos_token": bos is not None,
            "add_eos_token": False,
        }
        log.warning(
            "%s has tokenizer.json but no tokenizer_config.json (a checkpoint from an older "
            "specrl): its prompts are encoded as specrl did then (config.json's bos_token_id "
            "prepended); transformers and vLLM read it differently until it is re-saved by "
            "specrl, which writes tokenizer_config.json",
            path,
        )
        if generation is None and (bos_token_id is not None or eos):
            generation = _generation_config(bos_token_id, eos, model_cfg.get("pad_token_id"))
        return cls(backend, config, generation=generation, source=str(path))

    # ------------------------------------------------------------------ properties
    @property
    def chat_template(self) -> str | None:
        """The default chat template (tokenizer_config.json or chat_template.jinja), if any."""
        template = self._chat_template or self.config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": …, "template": …}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return template if isinstance(template, str) else None

    def token_id(self, name: str) -> int | None:
        """Id of a named special token (``"bos_token"``, ``"eos_token"`` …), or None."""
        text = self.special_tokens.get(name)
        return self.backend.token_to_id(text) if text is not None else None

    @property
    def bos_token_id(self) -> int | None:
        return self.token_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self.token_id("pad_token")

    def stop_ids(self, config_eos: int | Sequence[int] | None = None) -> tuple[int, ...]:
        """Token ids generation stops at, as vLLM collects them: ``config.json``'s eos, the
        tokenizer's ``eos_token`` and ``generation_config.json``'s ``eos_token_id`` (in that
        order, without repeats)."""
        out: list[int] = []
        for i in (
            *_ids(config_eos),
            *_ids(self.eos_token_id),
            *_ids((self.generation or {}).get("eos_token_id")),
        ):
            if i not in out:
                out.append(i)
        return tuple(out)

    def get_vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # ------------------------------------------------------------------ encoding
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (``add_special_tokens``: the post-processor's BOS/EOS).

        A long text goes through ``encode_batch``, which tokenizes with the GIL released
        (``encode`` holds it, ~10 ms per 1000 characters on a slow core): a server tokenizing
        long prompts in worker threads keeps answering on its event loop.  Short ones keep
        ``encode`` (``encode_batch`` marks the tokenizer's thread pool used, and a later fork
        then warns)."""
        if len(text) > LONG_TEXT:
            batch = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
            return batch[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        """The chat template rendered for ``messages`` (module docstring)."""
        template = self.chat_template
        if template is None:
            raise ConfigError(
                f"{self.source}: the tokenizer has no chat template "
                "(tokenizer_config.json 'chat_template' or chat_template.jinja)",
                hint="encode prompts as plain text (chat template off), or use a checkpoint "
                "whose tokenizer has a chat template",
            )
        variables = {
            **self.special_tokens,
            "messages": [{k: v for k, v in m.items() if v is not None} for m in messages],
            "tools": None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return _compiled_template(template).render(**variables)
        except Exception as exc:  # jinja2 TemplateError / SecurityError from the template
            raise ConfigError(f"{self.source}: the chat template failed: {exc}") from None

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered chat (no special tokens added: the template writes them)."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)

    # ------------------------------------------------------------------ saving
    def file_contents(self) -> dict[str, bytes]:
        """The files :meth:`save_pretrained` writes (name → bytes)."""
        out = dict(self._files)
        if TOKENIZER_FILE not in out:
            out[TOKENIZER_FILE] = self.backend.to_str(pretty=True).encode("utf-8")
        if TOKENIZER_CONFIG_FILE not in out:
            config = {k: v for k, v in self.config.items() if v is not None}
            config.setdefault("model_max_length", 1_000_000_000)
            config.setdefault("clean_up_tokenization_spaces", False)
            config.setdefault("added_tokens_decoder", _added_tokens(self.backend))
            out[TOKENIZER_CONFIG_FILE] = (json.dumps(config, indent=2) + "\n").encode("utf-8")
        if GENERATION_CONFIG_FILE not in out and self.generation:
            out[GENERATION_CONFIG_FILE] = (json.dumps(self.generation, indent=2) + "\n").encode()
        return out

    def save_pretrained(self, path: str | os.PathLike[str]) -> None:
        """Write the tokenizer files into directory ``path`` (the checkpoint's)."""
        p = Path(path)
        for name, data in self.file_contents().items():
            (p / name).write_bytes(data)


def _added_tokens(tok: Tokenizer) -> dict[str, dict[str, Any]]:
    """``added_tokens_decoder`` of tokenizer_config.json (as transformers writes it)."""
    out = {}
    for i, t in sorted(tok.get_added_tokens_decoder().items()):
        out[str(i)] = {
            "content": t.content,
            "lstrip": t.lstrip,
            "normalized": t.normalized,
            "rstrip": t.rstrip,
            "single_word": t.single_word,
            "special": t.special,
        }
    return out


def _bos_processor(bos: str, bos_id: int) -> processors.TemplateProcessing:
    """The post-processor that puts ``bos`` in front of every encoded text."""
    return processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
    )


def _generation_config(bos: int | None, eos: list[int], pad: int | None) -> dict[str, Any]:
    gen: dict[str, Any] = {}
    if bos is not None:
        gen["bos_token_id"] = int(bos)
    if eos:
        gen["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if pad is not None:
        gen["pad_token_id"] = int(pad)
    return gen


_TEMPLATES: dict[str, Any] = {}


def _compiled_template(source: str):
    """The chat template compiled in a jinja2 sandbox set up as transformers sets it up."""
    compiled = _TEMPLATES.get(source)
    if compiled is not None:
        return compiled
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # pragma: no cover - jinja2 is a dependency
        raise ConfigError("chat templates need jinja2", hint="pip install 'jinja2>=3.1'") from None
    from datetime import datetime

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}…{% endgeneration %}`` (assistant-mask markers): the body as is."""

        tags = {"generation"}  # noqa: RUF012 (jinja2's class attribute)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller):
            return caller()

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        compiled = env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ConfigError(f"the chat template does not compile: {exc}") from None
    _TEMPLATES[source] = compiled
    return compiled


# ----------------------------------------------------------------------------- the toy tokenizer
def char_tokenizer() -> HFTokenizer:
    """The toy world's character tokenizer, with the files every HF consumer reads alike."""
    vocab = {t: i for i, t in enumerate((*SPECIAL_TOKENS, *dict.fromkeys(CHARS)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = _bos_processor("<bos>", vocab["<bos>"])
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
    }
    generation = _generation_config(vocab["<bos>"], [vocab["<eos>"]], vocab["<pad>"])
    return HFTokenizer(tok, config, generation=generation, source="the toy tokenizer")


def special_ids(tok: HFTokenizer) -> dict[str, int | None]:
    """bos/eos/pad ids of a tokenizer (None where it names none)."""
    return {"bos": tok.bos_token_id, "eos": tok.eos_token_id, "pad": tok.pad_token_id}


class TextCodec:
    """Prompt/completion encoding for a model from its tokenizer files.

    ``encode_prompt(text)`` encodes as HF consumers do (:class:`HFTokenizer`); with ``chat`` the
    text becomes one user message rendered through the chat template, generation prompt
    included.  ``eos_ids`` are the ids generation stops at (default: the tokenizer's stop ids).
    """

    def __init__(
        self,
        tokenizer: HFTokenizer,
        eos_ids: int | Sequence[int] | None = None,
        *,
        chat: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        ids = _ids(eos_ids) if eos_ids is not None else list(tokenizer.stop_ids())
        self.eos_ids: tuple[int, ...] = tuple(ids)
        if chat and tokenizer.chat_template is None:
            tokenizer.render_chat([])  # raises the one-line error naming the files

    @classmethod
    def from_checkpoint(
        cls, path: str | os.PathLike[str], config: Any | None = None, *, chat: bool = False
    ) -> TextCodec:
        """The codec of checkpoint ``path`` (``config``: its ModelConfig, for bos/eos ids)."""
        bos = getattr(config, "bos_token_id", None)
        tok = HFTokenizer.from_dir(path, bos_token_id=bos)
        if tok is None:
            raise CheckpointError(
                f"'{path}' has no tokenizer.json",
                hint="prompts are encoded with the checkpoint's own tokenizer files",
            )
        eos = tok.stop_ids(getattr(config, "eos_token_id", None))
        return cls(tok, eos, chat=chat)

    @property
    def eos_id(self) -> int | None:
        return self.eos_ids[0] if self.eos_ids else None

    @property
    def bos_id(self) -> int | None:
        return self.tokenizer.bos_token_id

    def encode_prompt(self, text: str) -> list[int]:
        if self.chat:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        return self.tokenizer.encode(text)

    def encode_completion(self, text: str, *, eos: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ids + ([self.eos_id] if eos and self.eos_id is not None else [])

    def decode(self, ids: list[int]) -> str:
        ids = [i for i in ids if i not in self.eos_ids]
        return self.tokenizer.decode(ids, skip_special_tokens=True)
