"""`hf import --model ORG/NAME`: a Hub id resolves through huggingface_hub's cache, here filled in
advance (no machine of the tests reaches the Hub): offline (HF_HUB_OFFLINE=1) a cached model imports
as its directory does; one not in the cache is one line naming the command that downloads it; a
directory that exists is taken as given."""

import shutil

import pytest

from megatron_hetero.hf.hub import resolve_model
from tests.distributed import run_python
from tests.vlm_fixtures import qwen2_5_vl_dir

REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A Hugging Face cache holding tiny-org/tiny-qwen at REVISION, laid out as huggingface_hub writes
    it (blobs, a snapshot of links to them, refs/main), and the model's own directory."""
    tmp = tmp_path_factory.mktemp("hub")
    model = qwen2_5_vl_dir(tmp / "model")
    repo = tmp / "cache" / "models--tiny-org--tiny-qwen"
    snapshot = repo / "snapshots" / REVISION
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for n, file in enumerate(sorted(model.iterdir())):
        blob = repo / "blobs" / f"blob{n}"
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(blob)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return tmp


def test_resolve(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache / "cache"))
    snapshot = cache / "cache" / "models--tiny-org--tiny-qwen" / "snapshots" / REVISION
    assert resolve_model("tiny-org/tiny-qwen", "--model") == str(snapshot)
    assert resolve_model(f"tiny-org/tiny-qwen@{REVISION}", "--model") == str(snapshot)
    assert resolve_model(str(cache / "model"), "--model") == str(cache / "model")
    with pytest.raises(OSError) as error:
        resolve_model("other-org/not-cached", "--model")
    assert str(error.value) == ("--model other-org/not-cached: no such directory, and not in the Hugging Face "
                                "cache (HF_HUB_OFFLINE is set); download it with `hf download other-org/not-cached` "
                                "or give its directory")


def test_import_a_hub_id_offline(cache, tmp_path):
    """The cached model imports by its id offline, to the same checkpoint description as from its
    directory, with a progress bar on a terminal; the export's bar is not shown with --quiet."""
    import os

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache / "cache"))
    result = run_python(["-m", "megatron_hetero.cli", "hf", "import", "--model", "tiny-org/tiny-qwen",
                         "--save", tmp_path / "ckpt"], env=env, terminal=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "ckpt" / "model.json").is_file() and "wrote" in result.stdout
    assert "import: 100%" in result.stderr and "writing the checkpoint" in result.stderr
    quiet = run_python(["-m", "megatron_hetero.cli", "hf", "export", "--load", tmp_path / "ckpt", "--out",
                        tmp_path / "out", "--quiet"], env=env, terminal=True)
    assert quiet.returncode == 0 and "wrote" in quiet.stdout and "export" not in quiet.stderr, quiet.stderr[-3000:]
    missing = run_python(["-m", "megatron_hetero.cli", "hf", "import", "--model", "other-org/not-cached",
                          "--save", tmp_path / "none"], env=env)
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        "error: --model other-org/not-cached: no such directory, and not in the Hugging Face cache (HF_HUB_OFFLINE "
        "is set); download it with `hf download other-org/not-cached` or give its directory"]
