"""Caption tokenizer for the shapes dataset: a thin wrapper over a sentencepiece word model.

The shipped model (``shapes_caption.model``, built by ``tools/build_tokenizer.py``) maps every
caption word to one token, with pad=0, unk=1, bos=2, eos=3 and the image placeholder
``<image>``=4. ``<image>`` is a control symbol: text never encodes to it, callers insert
``image_id`` themselves where the vision embeddings go.
"""

from pathlib import Path

import sentencepiece as spm

DEFAULT_MODEL_PATH = Path(__file__).parent / "shapes_caption.model"
IMAGE_TOKEN = "<image>"
# The tags of the other media a conversation may hold (data/conversations.py), each where its item goes.
VIDEO_TOKEN, AUDIO_TOKEN = "<video>", "<audio>"


class CaptionTokenizer:
    def __init__(self, model_path: str | Path | None = None):
        self.model_path = Path(model_path) if model_path is not None else DEFAULT_MODEL_PATH
        self._sp = spm.SentencePieceProcessor(model_file=str(self.model_path))
        self._image_id = self._sp.piece_to_id(IMAGE_TOKEN)
        if self._image_id == self._sp.unk_id():
            raise ValueError(f"{self.model_path} has no {IMAGE_TOKEN} piece")
        self._skipped_ids = {self.pad_id, self.bos_id, self.image_id}

    @property
    def vocab_size(self) -> int:
        return self._sp.vocab_size()

    @property
    def pad_id(self) -> int:
        return self._sp.pad_id()

    @property
    def unk_id(self) -> int:
        return self._sp.unk_id()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def image_id(self) -> int:
        return self._image_id

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without bos/eos."""
        return self._sp.encode(text)

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` up to the first eos; pad, bos and image ids are dropped."""
        kept = []
        for token_id in ids:
            token_id = int(token_id)  # accepts tensors / numpy ints as well
            if token_id == self.eos_id:
                break
            if token_id not in self._skipped_ids:
                kept.append(token_id)
        return self._sp.decode(kept)
