"""Conversations to token ids: which tokens are the assistant's (the loss), and the `<image>` tag of
each image expanded to the encoder rows that image sends into the sequence.

Two tokenizers: a Hugging Face tokenizer from a local directory (`--tokenizer-type
HuggingFaceTokenizer --tokenizer-model DIR`, rendered with the model's chat template), and this
project's sentencepiece caption tokenizer (the default; `--tokenizer-type SentencePieceTokenizer
--tokenizer-model FILE` for another model with an `<image>` piece): `<bos>`, then the turns' text,
each assistant turn followed by `<eos>`.
"""

import functools
from dataclasses import dataclass
from pathlib import Path

from megatron_hetero.data.media import ImageTokens
from megatron_hetero.data.tokenizer import IMAGE_TOKEN, CaptionTokenizer

# LLaVA's `from` values and the chat template's roles.
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


class TokenizerError(ValueError):
    """A tokenizer that cannot serve this data (no image token, a template that is not prefix-stable)."""


@dataclass(frozen=True)
class Turn:
    role: str  # a value of ROLES
    text: str


class HFChatTokenizer:
    """A Hugging Face tokenizer directory with a chat template, and an `<image>` token unless the
    model's family names its own image tokens (`image_token=False`: data/media.py's ImageTokens)."""

    def __init__(self, directory: str, image_token: bool = True):
        from transformers import AutoTokenizer

        self.directory = directory
        if not Path(directory, "tokenizer_config.json").is_file():  # a local directory, never the Hub
            raise TokenizerError(f"{directory} is not a Hugging Face tokenizer directory (no tokenizer_config.json)")
        self._tok = AutoTokenizer.from_pretrained(directory)
        if not self._tok.chat_template:
            raise TokenizerError(f"the tokenizer in {directory} has no chat template; set chat_template in "
                                 f"its tokenizer_config.json")
        self.image_id = self.token_id(IMAGE_TOKEN)
        if self.image_id is None and image_token:
            raise TokenizerError(f"the tokenizer in {directory} has no {IMAGE_TOKEN} token; add it "
                                 f"(tokenizer.add_special_tokens) and save the tokenizer again")
        self.eos_id = self._tok.eos_token_id
        self.pad_id = self._tok.pad_token_id if self._tok.pad_token_id is not None else self.eos_id
        self.vocab_size = len(self._tok)
        self.pieces([Turn("user", "a"), Turn("assistant", "b")] * 2)  # a template that cannot serve fails here

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        """The id of a token of the vocabulary (e.g. a model's image tags); None if it has none."""
        token_id = self._tok.convert_tokens_to_ids(token)
        return None if token_id == self._tok.unk_token_id else token_id

    def _render(self, turns: list[Turn], generation_prompt: bool = False) -> str:
        return self._tok.apply_chat_template([{"role": t.role, "content": t.text} for t in turns], tokenize=False,
                                             add_generation_prompt=generation_prompt)

    def pieces(self, turns: list[Turn]) -> list[tuple[str | list[int], bool]]:
        """The rendered conversation cut into (text, assistant?) pieces: an assistant turn is what its
        rendering adds after the previous turns with the generation prompt (its end-of-turn included)."""
        full = self._render(turns)
        pieces, done = [], 0
        for i, turn in enumerate(turns):
            if turn.role != "assistant":
                continue
            prompt, upto = self._render(turns[:i], True), self._render(turns[: i + 1])
            if not (upto.startswith(prompt) and full.startswith(upto) and len(prompt) >= done):
                raise TokenizerError(f"the chat template of {self.directory} does not render a conversation's "
                                     f"prefix as the prefix of the whole; it cannot mark assistant tokens")
            pieces += [(full[done:len(prompt)], False), (full[len(prompt):len(upto)], True)]
            done = len(upto)
        return pieces + [(full[done:], False)]


class CaptionChatTokenizer:
    """This project's sentencepiece caption tokenizer: `<bos>` turn turn ...; assistant turns end in `<eos>`."""

    def __init__(self, model_path: str | None = None):
        self._tok = CaptionTokenizer(model_path)
        self.image_id, self.eos_id, self.pad_id = self._tok.image_id, self._tok.eos_id, self._tok.pad_id
        self.vocab_size = self._tok.vocab_size

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def pieces(self, turns: list[Turn]) -> list[tuple[str | list[int], bool]]:
        out = [([self._tok.bos_id], False)]
        for turn in turns:
            assistant = turn.role == "assistant"
            out.append((turn.text, assistant))
            if assistant:
                out.append(([self.eos_id], True))
        return out


def encode_conversation(tokenizer, turns: list[Turn], rows_per_image: list[int],
                        image_tokens: ImageTokens | None = None) -> tuple[list[int], list[bool]]:
    """(token ids, assistant flags) of a conversation, the k-th `<image>` tag expanded to
    image_tokens' prefix, rows_per_image[k] placeholders and suffix (default: the tokenizer's image
    token per row). Raises ValueError when tags and images differ in number."""
    image_tokens = image_tokens or ImageTokens((), tokenizer.image_id)
    ids, assistant, tags = [], [], 0
    for piece, is_assistant in tokenizer.pieces(turns):
        if not isinstance(piece, str):
            ids += piece
            assistant += [is_assistant] * len(piece)
            continue
        for k, text in enumerate(piece.split(IMAGE_TOKEN)):
            if k:
                rows = rows_per_image[tags] if tags < len(rows_per_image) else 0
                expanded = [*image_tokens.prefix, *[image_tokens.placeholder] * rows, *image_tokens.suffix]
                ids += expanded
                assistant += [False] * len(expanded)  # image tokens are inputs, never predicted
                tags += 1
            if text:
                encoded = tokenizer.encode(text)
                ids += encoded
                assistant += [is_assistant] * len(encoded)
    if tags != len(rows_per_image):
        raise ValueError(f"{tags} {IMAGE_TOKEN} tags for {len(rows_per_image)} images")
    return ids, assistant


@functools.lru_cache(maxsize=4)
def chat_tokenizer(tokenizer_type: str | None, tokenizer_model: str | None, image_token: bool = True):
    """The tokenizer Megatron's --tokenizer-type / --tokenizer-model name (None or NullTokenizer:
    the shipped caption tokenizer); image_token: a Hugging Face tokenizer must have `<image>` (False:
    the model's family names its image tokens)."""
    if tokenizer_type in (None, "NullTokenizer"):
        return CaptionChatTokenizer()
    if tokenizer_type == "SentencePieceTokenizer" and tokenizer_model:
        return CaptionChatTokenizer(tokenizer_model)
    if tokenizer_type == "HuggingFaceTokenizer" and tokenizer_model:
        return HFChatTokenizer(tokenizer_model, image_token)
    raise TokenizerError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model; this script reads "
                         f"HuggingFaceTokenizer (a directory) or SentencePieceTokenizer (a .model file)")
