"""Model sizes, importable without megatron-core (flag parsing happens before any heavy import)."""

from dataclasses import dataclass

# The audio front end's two stride-2 convolutions: one token per 4 spectrogram frames.
AUDIO_FRAMES_PER_TOKEN = 4


@dataclass(frozen=True)
class ModelSizes:
    """Model-size flags; the defaults make the CPU demo fast."""

    image_size: int = 32
    patch_size: int = 8
    enc_hidden_size: int = 64
    enc_num_layers: int = 2
    enc_num_attention_heads: int = 4
    audio_mel_bins: int = 16
    audio_frames: int = 32
    audio_hidden_size: int = 32
    audio_num_layers: int = 2
    audio_num_attention_heads: int = 4
    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    seq_length: int = 32
    vocab_size: int = 22
    # Padded vocabulary: fixed, so that every TP size (dividing it) builds the same model.
    vocab_multiple: int = 128

    @property
    def patches_per_image(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_clip(self) -> int:
        return self.audio_frames // AUDIO_FRAMES_PER_TOKEN
