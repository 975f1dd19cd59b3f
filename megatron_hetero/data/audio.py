"""Audio files to waveforms: decoded by PyAV (FFmpeg: wav, flac, mp3, a video's audio track, ...),
mixed down to mono and resampled to a model's feature extractor's rate by FFmpeg's resampler. A
model's audio processing (families/*/media.py) turns the waveform into its encoder's features. The
items of an audio follow from its length at that rate (`AudioInfo`), which every rank reads by
decoding it (audio decodes fast; the features are computed only where the audio is encoded)."""

from dataclasses import dataclass

import numpy as np

from megatron_hetero.data.video import pyav_errors


class AudioError(ValueError):
    """An audio that cannot be used (missing, not audio, no samples)."""


@dataclass(frozen=True)
class AudioInfo:
    """What an audio's items need: its samples at the model's rate."""

    samples: int


def read_audio(source, rate: int) -> np.ndarray:
    """float32 [samples]: the first audio stream of a file (a path or a file object), mono at `rate`
    Hz; raises AudioError."""
    with pyav_errors(AudioError, "audio") as av, av.open(source) as container:
        if not container.streams.audio:
            raise AudioError("corrupt audio (no audio stream)")
        resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
        parts = [out.to_ndarray().reshape(-1) for frame in container.decode(container.streams.audio[0])
                 for out in resampler.resample(frame)]
        parts += [out.to_ndarray().reshape(-1) for out in resampler.resample(None)]
    waveform = np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)
    if not len(waveform):
        raise AudioError("corrupt audio (no samples)")
    return waveform.astype(np.float32, copy=False)
