"""Hub ids (``org/name``) through the local HuggingFace cache, for models and datasets alike.

An id resolves to the directory of its cached snapshot (``<hub cache>/models--org--name/snapshots/
<commit>/``, ``datasets--org--name`` for a dataset), which the rest of slidetune reads like any
local directory. The cache is looked at first; the Hub is asked only when the id is not cached and
the Hub may be reached (``HF_HUB_OFFLINE`` unset). An id that is neither cached nor downloadable
gets `HubIdNotCached`, which names the cache directory and how to fill it.

The cache locations and ``HF_HUB_OFFLINE`` are read from the environment at each call (huggingface_hub
and datasets read them once, when imported), so a variable set after import is honoured.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

# org/name: one slash, names of letters, digits, '-', '_' and '.' (the Hub's own rule), not
# starting with '.' or '-' (a relative path like ./x or ../x is a path)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9_][\w.-]*$")
# endings of local files: "data/train.jsonl" that does not exist is a missing file, not an id
_FILE_SUFFIXES = (".jsonl", ".ndjson", ".json", ".csv", ".tsv", ".parquet", ".arrow", ".txt", ".text",
                  ".md", ".bin", ".npy", ".gguf", ".safetensors", ".yaml", ".yml")
_TRUE = ("1", "true", "yes", "on")


class HubIdNotCached(ValueError):
    """A Hub id that is not in the local cache and cannot be downloaded now."""


def looks_like_hub_id(spec: str) -> bool:
    """``org/name`` that is no existing local path and does not end like a data or model file."""
    return (bool(_HUB_ID.match(spec)) and not os.path.exists(spec)
            and not spec.lower().endswith(_FILE_SUFFIXES))


def _hf_home() -> Path:
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "huggingface"


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps models and dataset repos (HF_HUB_CACHE, else HF_HOME/hub)."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    return _hf_home() / "hub"


def datasets_cache_dir() -> Path:
    """Where `datasets` keeps prepared Arrow files (HF_DATASETS_CACHE, else HF_HOME/datasets)."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return Path(os.environ["HF_DATASETS_CACHE"]).expanduser()
    return _hf_home() / "datasets"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or the older TRANSFORMERS_OFFLINE / HF_DATASETS_OFFLINE) is set."""
    return any(os.environ.get(name, "").strip().lower() in _TRUE
               for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"))


def _not_cached(repo_id: str, kind: str, cache: Path, why: str) -> HubIdNotCached:
    flag = "--repo-type dataset " if kind == "dataset" else ""
    return HubIdNotCached(
        f"{kind} {repo_id!r} is not in the local HuggingFace cache ({cache}) and {why}; on a machine with network "
        f"run `hf download {flag}{repo_id}` (older huggingface_hub: `huggingface-cli download {flag}{repo_id}`), "
        f"then copy the cache here or point HF_HOME / HF_HUB_CACHE at a cache that holds it "
        f"(HF_HUB_OFFLINE=1 keeps the Hub from being asked)")


def snapshot_dir(repo_id: str, kind: str = "model", allow_patterns: list[str] | None = None) -> Path:
    """The local directory of ``repo_id``'s snapshot (kind "model" or "dataset"): the cached one, else
    downloaded (only ``allow_patterns``) when the Hub may be reached. Raises `HubIdNotCached`."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError
    cache = hub_cache_dir()
    repo_type = "dataset" if kind == "dataset" else None
    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, cache_dir=str(cache), local_files_only=True,
                                      allow_patterns=allow_patterns))
    except LocalEntryNotFoundError:
        pass
    if hub_offline():
        raise _not_cached(repo_id, kind, cache, "HF_HUB_OFFLINE is set") from None
    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, cache_dir=str(cache),
                                      allow_patterns=allow_patterns))
    except RepositoryNotFoundError as e:     # GatedRepoError is one: it exists, access is refused
        if isinstance(e, GatedRepoError):
            raise HubIdNotCached(f"{kind} {repo_id!r} is gated on the Hub: accept its terms on its page and log "
                                 f"in (`hf auth login`), or use a cache that holds it ({cache})") from e
        raise HubIdNotCached(f"{kind} {repo_id!r}: no such {kind} on the Hub (or it is private: log in with "
                             f"`hf auth login`), and it is not in the local cache ({cache})") from e
    except Exception as e:   # no network, DNS, timeouts: httpx's errors, OSError, OfflineModeIsEnabled
        raise _not_cached(repo_id, kind, cache, f"the Hub cannot be reached ({type(e).__name__}: {e})") from e
