"""Checkpoints: a HF model directory plus the state needed to resume a run exactly.

The package, one concern a module (each imports the ones it needs directly, never through this
file, and only ones above it in this list):

    format.py      the on-disk format: names, versions, errors, state.json and the RNG states
    io.py          the bytes to the disk and back: pieces in parallel, hashed in order; GPU staging
    store.py       the directory store: atomic rename into place, fsyncs, find, prune, tidy leftovers
    reader.py      load_checkpoint, check_checkpoint, verify_files: everything checked before use
    export.py      final/ as a model repository holds it: no trainer state, the source's generation
                   config, the run's chat template, a model card
    push.py        `slidetune push`: an export checked against its manifest, then uploaded to the Hub
    writer.py      save_checkpoint: the tensor files as streams, the small files, manifest, COMPLETE
    background.py  asynchronous saves: streamed from the live store while training goes on
    saver.py       the run's saves one at a time, asynchronous or blocking, timed into saves.jsonl
    space.py       what a run will write to disk, checked against the free space before step 1
    lock.py        one run per output and checkpoint directory (or inside one): a lock held for the run
    manager.py     CheckpointManager: the run's save policy (resume, periodic and final saves, export),
                   what the trainer calls

(One file replaced as one operation, atomic_write.py, stays beside the package: the data caches and
the telemetry's files use it too, and importing it loads nothing of this package.)

Code outside the package imports the names below from `slidetune.checkpoint`; a test that replaces
a function or a constant replaces it in the module that reads it (writer.write_safetensors,
writer.OPTIM_PARTS_FROM_BYTES, io.WRITE_PIECE ...), not here.

Layout of one checkpoint (`<run_dir>/checkpoint-<step>/`):

    config.json                      HF config (dtype = the saved dtype, no quantization_config)
    generation_config.json           when the config carries generation defaults
    model.safetensors                weights, or shards model-0000i-of-0000N.safetensors
    model.safetensors.index.json       + index {"metadata": {"total_size"}, "weight_map"}
    tokenizer files                  when a tokenizer is given
    trainer_state/optimizer.safetensors   the engine's AdamW state (FP32 moments + step per unit),
      or optimizer-0000i-of-0000N.safetensors   in N parts of the units in order, written at once
    trainer_state/state.json         step, trainer state, slidetune and format versions
    trainer_state/rng.pt             torch CPU (+ CUDA), python `random` and numpy RNG states
    MANIFEST.json                    every file above: size and xxh3-128 digest
    COMPLETE                         written last: the directory is whole (and the manifest's digest)

so `AutoModelForCausalLM.from_pretrained(dir)` loads it as is. The run's `final/` is an export
(export.py): no `trainer_state/`, the source's generation_config.json, the tokenizer with the run's
chat template, and a model card (README.md).

Atomicity: everything is written into a sibling `<name>.tmp-<pid>`, every file fsynced,
then the COMPLETE marker, then the directory is renamed to its final name (an existing
one is first renamed to `<name>.old-<pid>` and deleted after). A crash or an error
(disk full) leaves the previous checkpoint as it was; the temporary directory is removed.
When an existing directory of the same name is overwritten, a crash between its two
renames leaves the old checkpoint whole in `<name>.old-<pid>` and the new one whole in
`<name>.tmp-<pid>` (both with COMPLETE): never a mix of the two.

Integrity: each file's digest is computed as it is written (the weights and moments as their
bytes pass to write(), no second read; the small files after writing) and recorded in
MANIFEST.json. Before the rename the new directory is read back from the disk (its pages were
dropped from the page cache after the fsync) and checked against the manifest: a checkpoint that
does not read back as written is set aside as `<name>.corrupt-<time>` and the save fails, so a
pruning never follows an unverified save. `check_checkpoint` verifies a directory before a resume
uses it (sizes, digests, then the type, dtype and structure of every file it reads):
`CheckpointCorrupt` names the file and what is wrong; `set_aside` renames such a checkpoint
(never deletes it). Where COMPLETE records the manifest's digest (every checkpoint this version
writes), a missing or altered MANIFEST.json, or a file a resume reads that it does not list, is
damage like any other. Only a checkpoint with no trace of a manifest (written before it existed)
loads unverified, once its tensors' names, shapes and dtypes fit the model (`LegacyLayout`), with
a warning. benchmarks/NOTES.md "Checkpoint digests" has the digest's and the
read-back's cost.

Memory: tensors are written one at a time straight from the engine's FP32 masters and
moments (views, no copy; write_safetensors streams a safetensors file, where
safetensors.torch.save_file first builds every tensor's bytes in RAM: 65 GB for an 8B's
moments); a BF16 export converts 64 MiB at a time, and state kept on the GPU comes to the
host through two pinned 64 MiB buffers per file being written (io.py: the writer's
threads, the staging, the parallel read-back). Loading reads one tensor at a time from the
memory-mapped files, so neither side ever holds a second copy of the model.
"""
from __future__ import annotations

from ..atomic_write import write_atomically
from .background import PendingSave, SaveTiming, start_async_save
from .export import CardFacts, ModelExport, model_card, run_export
from .format import (COMPLETE, DIGEST, FORMAT_VERSION, MANIFEST, MOMENT_DTYPES, OPTIM_FILE, READ_FORMAT_VERSIONS,
                     SAVE_DTYPES, STATE_DIR, CheckpointCorrupt, CheckpointError, checkpoint_dir)
from .io import FileDigest, digests_parallel
from .lock import LOCK_NAME, RunDirLocked, RunLock, lock_directory, lock_run_directories
from .manager import CheckpointManager, RunHooks, SavePolicy
from .reader import CheckedCheckpoint, LegacyLayout, check_checkpoint, load_checkpoint, optimizer_files, verify_files
from .saver import CheckpointSaver, overlap_note, resolve_async_save
from .space import DiskSpaceError, SavePlan, plan_saves, resolve_save_dtype
from .store import (complete_checkpoints, fsync_and_drop, latest_checkpoint, prune_checkpoints, recover_leftovers,
                    save_atomically, set_aside)
from .writer import (file_digest, finish_checkpoint, optimizer_parts, save_checkpoint, save_tensors, write_safetensors,
                     write_tensor_files, write_weights)

__all__ = [
    # format.py
    "COMPLETE", "DIGEST", "FORMAT_VERSION", "MANIFEST", "MOMENT_DTYPES", "OPTIM_FILE", "READ_FORMAT_VERSIONS",
    "SAVE_DTYPES", "STATE_DIR", "CheckpointCorrupt", "CheckpointError", "checkpoint_dir",
    # io.py, store.py
    "FileDigest", "digests_parallel",
    "complete_checkpoints", "fsync_and_drop", "latest_checkpoint", "prune_checkpoints", "recover_leftovers",
    "save_atomically", "set_aside",
    # reader.py, writer.py
    "CheckedCheckpoint", "LegacyLayout", "check_checkpoint", "load_checkpoint", "optimizer_files", "verify_files",
    "file_digest", "finish_checkpoint", "optimizer_parts", "save_checkpoint", "save_tensors", "write_safetensors",
    "write_tensor_files", "write_weights",
    # background.py, saver.py, space.py, lock.py, manager.py; atomic_write.py
    "PendingSave", "SaveTiming", "start_async_save",
    "CheckpointSaver", "overlap_note", "resolve_async_save",
    "DiskSpaceError", "SavePlan", "plan_saves", "resolve_save_dtype",
    "LOCK_NAME", "RunDirLocked", "RunLock", "lock_directory", "lock_run_directories",
    "CheckpointManager", "RunHooks", "SavePolicy",
    # export.py
    "CardFacts", "ModelExport", "model_card", "run_export",
    "write_atomically",
]
