"""Conversations to token ids: which tokens are the assistant's (the loss), and the `<image>` /
`<video>` tag of each image or video expanded to the encoder rows it sends into the sequence.

Two tokenizers: a Hugging Face tokenizer from a local directory (`--tokenizer-type
HuggingFaceTokenizer --tokenizer-model DIR`, rendered with the model's chat template), and this
project's sentencepiece caption tokenizer (the default; `--tokenizer-type SentencePieceTokenizer
--tokenizer-model FILE` for another model with an `<image>` piece): `<bos>`, then the turns' text,
each assistant turn followed by `<eos>`.
"""

import functools
import re
from dataclasses import dataclass
from pathlib import Path

from megatron_hetero.data.media import ImageTokens
from megatron_hetero.data.tokenizer import AUDIO_TOKEN, IMAGE_TOKEN, VIDEO_TOKEN, CaptionTokenizer

# LLaVA's `from` values and the chat template's roles.
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
# The media tags, split out of the text in order (the captured tag is every odd part).
MEDIA_TAGS = re.compile(f"({'|'.join(map(re.escape, (IMAGE_TOKEN, VIDEO_TOKEN, AUDIO_TOKEN)))})")


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


def encode_conversation(tokenizer, turns: list[Turn], media: list, image_tokens: ImageTokens | None = None
                        ) -> tuple[list[int], list[bool]]:
    """(token ids, assistant flags) of a conversation, the k-th media tag (`<image>`, `<video>`,
    `<audio>` in text order) expanded by media[k]: rows (an int: image_tokens' prefix, that many
    placeholders, its suffix; default the tokenizer's image token per row) or an item's expansion
    (data/media.py: text, which is tokenized with the text before it, as a processor expands the tag
    in the text, and token ids). Media tokens are inputs, never predicted. Raises ValueError when
    tags and media differ in number."""
    image_tokens = image_tokens or ImageTokens((), tokenizer.image_id)
    ids, assistant, tags = [], [], 0

    def add(part, flag: bool) -> None:
        encoded = tokenizer.encode(part) if isinstance(part, str) else list(part)
        ids.extend(encoded)
        assistant.extend([flag] * len(encoded))

    for piece, is_assistant in tokenizer.pieces(turns):
        if not isinstance(piece, str):
            add(piece, is_assistant)
            continue
        text = ""  # not yet tokenized: an expansion's text joins it
        for k, part in enumerate(MEDIA_TAGS.split(piece)):
            if not k % 2:
                text += part
                continue
            item = media[tags] if tags < len(media) else 0
            if isinstance(item, int):
                item = ((*image_tokens.prefix, *[image_tokens.placeholder] * item, *image_tokens.suffix),)
            for part in item:
                if isinstance(part, str) and not is_assistant:
                    text += part
                    continue
                if text:
                    add(text, is_assistant)
                add(part, False)
                text = ""
            tags += 1
        if text:
            add(text, is_assistant)
    if tags != len(media):
        raise ValueError(f"{tags} media tags for {len(media)} images, videos and audios")
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
