"""Samples a loader cannot use: why, where, and the run's count of them.

A loader passes over a bad sample to the next usable one (a pure function of the sample index, so
every rank and a resumed run make the same choice) and reports it with the sample it returns; the
training process counts the reports (SkipReport), or with --strict-data stops at the first.
"""

from collections import Counter
from dataclasses import dataclass

# Why a sample was skipped, in the order the end-of-run summary lists them.
REASONS = ("missing_image", "corrupt_image", "missing_video", "corrupt_video", "missing_audio", "corrupt_audio",
           "too_long", "image_count_mismatch", "video_count_mismatch", "audio_count_mismatch", "unsupported_media",
           "empty_conversation", "non_utf8", "malformed")


class DataError(ValueError):
    """Data no skipping can serve (an unreadable file, no usable sample, images the runtime cannot
    batch); one line naming the file and the fix."""


def one_line(error: DataError) -> str:
    """The DataError's message, also when a DataLoader worker raised it (torch re-raises it with the
    worker's traceback as its message, the original `module.DataError: message` last)."""
    text = str(error)
    return text.splitlines()[-1].split(": ", 1)[1] if "Original Traceback" in text else text


@dataclass(frozen=True)
class BadSample:
    reason: str  # one of REASONS
    file: str  # the data file (or the media file for a missing or corrupt image, video or audio)
    sample: str  # the sample's id, or its index in the file
    detail: str

    def __post_init__(self):
        assert self.reason in REASONS, self.reason

    def line(self) -> str:
        return f"{self.file}: sample {self.sample}: {self.detail} ({self.reason})"


class SkipReport:
    """The training process's count of skipped samples, by reason."""

    def __init__(self):
        self.counts = Counter()

    def record(self, bad: list[BadSample]) -> None:
        self.counts.update(b.reason for b in bad)

    def summary(self) -> str:
        if not self.counts:
            return " data: no sample skipped"
        return " data: skipped samples: " + ", ".join(f"{r} {self.counts[r]}" for r in REASONS if self.counts[r])
