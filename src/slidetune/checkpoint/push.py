"""`slidetune push DIR --repo org/name`: a run's `final/` to a model repository on the Hugging Face
Hub (huggingface_hub's `create_repo` and `upload_folder`, the token from where huggingface_hub
reads it: `HF_TOKEN`, or `hf auth login`'s file).

What goes up is checked first, without the network: a complete export (its COMPLETE marker and
every file its manifest lists, read back against their digests), holding what a model repository
holds (checkpoint/export.py): a resumable checkpoint, with its trainer state and pickled RNG
states, is refused. `--dry-run` lists the files and stops there.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .format import COMPLETE, STATE_DIR, CheckpointError
from .reader import verify_files


@dataclass(frozen=True)
class PushRequest:
    directory: Path
    repo: str                      # org/name
    private: bool = False
    message: str = "Upload a model fine-tuned with slidetune"
    dry_run: bool = False


def files_to_upload(directory: Path) -> list[str]:
    """The export's files, relative, sorted; ValueError naming what makes `directory` no model export."""
    if not directory.is_dir():
        raise ValueError(f"{directory}: no such directory (give a run's final/)")
    if not (directory / COMPLETE).exists():
        raise ValueError(f"{directory}: no {COMPLETE} marker: not a finished export (a run's final/ has one)")
    if (directory / STATE_DIR).exists():
        raise ValueError(f"{directory}: holds {STATE_DIR}/ (optimizer state, pickled RNG states): a resumable "
                         f"checkpoint, not a model to publish; push the run's final/")
    try:
        verify_files(directory)
    except CheckpointError as e:
        raise ValueError(f"{directory}: its files do not match its manifest: {e}") from e
    files = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
    if "config.json" not in files or not any(f.endswith(".safetensors") for f in files):
        raise ValueError(f"{directory}: no config.json and safetensors weights: not a model directory")
    return files


def _check_repo(repo: str) -> None:
    parts = repo.split("/")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"--repo {repo!r}: a Hub repository is named org/name (or user/name)")


def push(req: PushRequest) -> str | None:
    """Upload (or, dry-run, list) the export; returns the commit's URL (None for a dry run)."""
    _check_repo(req.repo)
    files = files_to_upload(req.directory)
    print(f"{req.directory} -> {req.repo}: {len(files)} files")
    for f in files:
        print(f"  {f}")
    if req.dry_run:
        return None
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise RuntimeError("HF_HUB_OFFLINE is set: pushing to the Hub needs the network (unset it, or copy "
                           f"{req.directory} by other means)")
    from huggingface_hub import create_repo, upload_folder
    try:
        create_repo(req.repo, repo_type="model", private=req.private, exist_ok=True)
        info = upload_folder(repo_id=req.repo, folder_path=str(req.directory), repo_type="model",
                             commit_message=req.message)
    except OSError as e:              # requests' connection errors and huggingface_hub's HTTP errors
        raise RuntimeError(f"could not push to {req.repo}: {type(e).__name__}: {e} (is the network reachable, "
                           f"and a token with write access set: HF_TOKEN or `hf auth login`?)") from e
    url = str(getattr(info, "commit_url", info))
    print(f"pushed: {url}")
    return url
