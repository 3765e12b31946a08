"""Tokenizers: the toy world's character tokenizer and prompt encoding for any ``tokenizer.json``.

The character tokenizer has one token per character (digits, arithmetic symbols, letters, space,
newline) plus ``<pad>``, ``<bos>``, ``<eos>``, ``<unk>``; decoding concatenates.  Because it is an
ordinary ``tokenizer.json`` built with ``tokenizers``, a toy target is a standard HF checkpoint.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARS = (
    "0123456789+-*/=;#:.,()[]{}<>_ \n?!'\"\\$%&|^~@"
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
)


def char_tokenizer() -> Tokenizer:
    vocab = {t: i for i, t in enumerate((*SPECIAL_TOKENS, *dict.fromkeys(CHARS)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def special_ids(tok: Tokenizer) -> dict[str, int | None]:
    """bos/eos/pad ids of the character tokenizer (None when a tokenizer lacks them)."""
    return {
        "bos": tok.token_to_id("<bos>"),
        "eos": tok.token_to_id("<eos>"),
        "pad": tok.token_to_id("<pad>"),
    }


class TextCodec:
    """Prompt/completion encoding for a model: its tokenizer plus its bos/eos ids."""

    def __init__(self, tokenizer: Tokenizer, bos_id: int | None, eos_id: int | list[int] | None):
        self.tokenizer = tokenizer
        self.bos_id = bos_id
        eos = eos_id if isinstance(eos_id, list) else ([] if eos_id is None else [eos_id])
        self.eos_ids: tuple[int, ...] = tuple(eos)

    @property
    def eos_id(self) -> int | None:
        return self.eos_ids[0] if self.eos_ids else None

    def encode_prompt(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if self.bos_id is not None else []) + ids

    def encode_completion(self, text: str, *, eos: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ids + ([self.eos_id] if eos and self.eos_id is not None else [])

    def decode(self, ids: list[int]) -> str:
        ids = [i for i in ids if i not in self.eos_ids]
        return self.tokenizer.decode(ids, skip_special_tokens=True)
