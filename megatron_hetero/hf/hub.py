"""A Hugging Face model named by its directory or by its Hub id (`ORG/NAME`, `ORG/NAME@REVISION`).

A Hub id resolves through huggingface_hub's cache (`HF_HUB_CACHE`, else `HF_HOME`'s): a cached
snapshot is used as it is; online, what is missing is downloaded into the cache (with huggingface_hub's
progress bars); with `HF_HUB_OFFLINE=1` only the cache is read, and a model not in it is one line
naming the command that downloads it.
"""

import os
from pathlib import Path

TRUE = ("1", "on", "yes", "true")


def resolve_model(name: str, flag: str) -> str:
    """The directory of `name`: a path that exists as given; else, for ORG/NAME[@REVISION], the Hub
    snapshot in the cache (downloaded first where online). OSError: one line saying what to do."""
    repo, _, revision = str(name).partition("@")
    if Path(name).exists() or repo.count("/") != 1 or repo.startswith((".", "/", "~")):
        return name
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in TRUE
    try:
        return snapshot_download(repo, revision=revision or None, cache_dir=os.environ.get("HF_HUB_CACHE") or None,
                                 local_files_only=offline)
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline else "the Hub is unreachable"
        raise OSError(f"{flag} {name}: no such directory, and not in the Hugging Face cache ({why}); download it "
                      f"with `hf download {repo}{f' --revision {revision}' if revision else ''}` or give its "
                      f"directory") from None
    except (HfHubHTTPError, ValueError) as error:  # no such repository or revision, a malformed id
        raise OSError(f"{flag} {name}: no such directory, and the Hugging Face Hub cannot give it: "
                      f"{str(error).splitlines()[0]}") from None
