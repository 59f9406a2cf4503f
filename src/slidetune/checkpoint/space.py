"""What a run will write to disk, checked against the free space before step 1.

A run writes `final/` (the model in HF format, in `save_dtype`) and resumable checkpoints
(FP32 masters 4 B/param + AdamW moments 8 B/param + a few files: engine/adamw.py's FP32_ADAMW):
12 B/param, 98 GB for an 8B model, more than the GPU machine's 64 GiB disk. While a periodic checkpoint is written
the previous `keep_last` stay until it is complete (store.py saves atomically), so
`keep_last + 1` of them exist at once.

The rules (issue 18):
- `final/` is written first, and must fit, or the run is refused before step 1;
- periodic checkpoints (`--save-every N`) that cannot fit are refused, with the options that
  do: final model only, fewer kept, or checkpoints on another disk (`--checkpoint-dir`);
- with none asked for, the end-of-run resumable checkpoint is written only where it fits
  beside `final/`; otherwise the run goes on and says up front that only `final/` will be
  written (and that an interruption cannot leave a resumable checkpoint).
Free space is what `shutil.disk_usage` reports for the directory (or its nearest existing
parent) now, less a margin; checkpoints already in the directory count as used.
"""
from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..engine.adamw import FP32_ADAMW

GiB = 2**30
# config, tokenizer, index and state files beside the tensors, and filesystem slack
FILES_MARGIN = 256 * 2**20
# leave this much of the free space unused (logs, metrics, other writers)
FREE_MARGIN = 0.02
SAVE_DTYPE_BYTES = {"fp32": 4, "bf16": 2}


class DiskSpaceError(RuntimeError):
    """What the run would write does not fit; the message has the sizes and the options."""


@dataclass
class SavePlan:
    final_bytes: int                 # final/ in save_dtype
    checkpoint_bytes: int            # one resumable checkpoint
    resumable: bool                  # resumable checkpoints will be written (periodic, at the end, on a stop)
    notes: list[str] = field(default_factory=list)
    # the scratch files (the disk tier) are removed before final/ is written: the two do not fit
    # that disk together, and nothing needs the tier's moments once no resumable state is kept
    release_scratch_first: bool = False

    def summary(self) -> str:
        return (f"final/ {self.final_bytes / GiB:.1f} GiB; a resumable checkpoint {self.checkpoint_bytes / GiB:.1f} GiB"
                + ("" if self.resumable else " (not written: it does not fit)"))


def resolve_save_dtype(save_dtype: str, config, compute_dtype: str) -> str:
    """auto: the checkpoint's own dtype (its config's), bf16 or fp32; for a model without one
    (a preset shape with random weights), the run's compute dtype (fp16 -> fp32)."""
    if save_dtype != "auto":
        return save_dtype
    # transformers 5 names it `dtype` (reading the old `torch_dtype` alias only prints a deprecation)
    own = getattr(config, "dtype", None)
    if isinstance(own, str):
        own = getattr(torch, own, None)
    if own == torch.bfloat16:
        return "bf16"
    if own == torch.float32:
        return "fp32"
    return "bf16" if compute_dtype == "bf16" else "fp32"


def free_bytes(path: Path) -> int:
    """Free space for `path` (its nearest existing parent when it does not exist yet)."""
    p = Path(path).resolve()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def _device_id(path: Path) -> int:
    p = Path(path).resolve()
    while not p.exists():
        p = p.parent
    return p.stat().st_dev


def plan_saves(num_params: int, *, save_dtype: str, output_dir: Path, checkpoint_dir: Path, save_every: int,
               keep_last: int, output_free: int | None = None, checkpoint_free: int | None = None,
               same_disk: bool | None = None, scratch: tuple[Path, int] | None = None,
               scratch_holds_weights: bool = False, existing_checkpoints: int = 0,
               checkpoint_bytes: int | None = None) -> SavePlan:
    """The run's writes against the free space; raises DiskSpaceError with options where the run
    cannot keep its promise (final/ must fit; periodic checkpoints asked for must fit).
    output_free, checkpoint_free, same_disk: as measured here unless given.
    scratch: (directory, bytes) the run takes before it saves anything (the disk tier's files,
    allocated in full when the engine starts): off the free space of whichever of the two
    directories shares its disk. scratch_holds_weights: the tier holds FP32 masters
    (--tuning.disk_master), which final/ is written from: its files cannot go first.
    existing_checkpoints: complete checkpoints already in checkpoint_dir (a resumed run's, an
    earlier run's). Their bytes are already off the free space, and the first save prunes them to
    keep_last, so only max(1, keep_last + 1 - existing) new ones must still find room.
    checkpoint_bytes: a resumable checkpoint's tensors where known (PlacementPlan.checkpoint_bytes:
    compact moments are smaller); None: 12 B/param, the FP32 state's."""
    final = num_params * SAVE_DTYPE_BYTES[save_dtype] + FILES_MARGIN
    ckpt = (num_params * FP32_ADAMW.bytes_per_param if checkpoint_bytes is None else checkpoint_bytes) + FILES_MARGIN
    if same_disk is None:
        same_disk = _device_id(output_dir) == _device_id(checkpoint_dir)
    out_free = free_bytes(output_dir) if output_free is None else output_free
    ck_free = (out_free if same_disk else free_bytes(checkpoint_dir)) if checkpoint_free is None else checkpoint_free

    taken = ""          # said in the refusals: what the scratch files took of that disk
    out_free_alone = out_free       # the output's disk without the scratch files
    on_out = False
    if scratch and scratch[1]:
        out_free, ck_free, on_out, taken = _after_scratch(scratch, output_dir, checkpoint_dir, out_free, ck_free)
    out_usable = int(out_free * (1 - FREE_MARGIN))
    ck_usable = int(ck_free * (1 - FREE_MARGIN))

    if final > out_usable and on_out and not save_every and not scratch_holds_weights \
            and final <= int(out_free_alone * (1 - FREE_MARGIN)):
        # final/ fits once the tier's files are gone: remove them first (the moments die with
        # them, so no resumable state can follow final/)
        return SavePlan(final, ckpt, False, [
            f"note: the disk tier's {_gib(scratch[1])} of files and final/ ({_gib(final)}, {save_dtype}) do not fit "
            f"the {_gib(out_free_alone)} free for {output_dir} together: the tier's files are removed when training "
            f"ends, then final/ is written. No resumable checkpoint will be written (it needs the tier's AdamW "
            f"moments), so an interrupted run cannot be resumed; for one, --checkpoint-dir on a disk with at least "
            f"{_gib(math.ceil(ckpt / (1 - FREE_MARGIN)))} free"], release_scratch_first=True)
    if final > out_usable:
        _refuse_final(num_params, final, save_dtype=save_dtype, output_dir=output_dir, out_free=out_free,
                      out_usable=out_usable, out_free_alone=out_free_alone, on_out=on_out,
                      scratch_holds_weights=scratch_holds_weights, taken=taken)
    # what the checkpoints' disk has left once final/ is written there too
    room = ck_usable - (final if same_disk else 0)
    if save_every:
        if new_checkpoints_at_once(keep_last, existing_checkpoints) * ckpt <= room:
            return SavePlan(final, ckpt, True)
        _refuse_checkpoints(final, ckpt, room, save_every=save_every, keep_last=keep_last,
                            checkpoint_dir=checkpoint_dir, ck_free=ck_free, taken=taken,
                            existing=existing_checkpoints)
    if ckpt <= room:
        return SavePlan(final, ckpt, True)
    note = (f"note: only final/ ({_gib(final)}, {save_dtype}) will be written: a resumable checkpoint "
            f"({_gib(ckpt)}, FP32 weights and AdamW moments) does not fit beside it in the {_gib(ck_free)} free for "
            f"{checkpoint_dir}{taken}, so an interrupted run cannot be resumed; for one, use --checkpoint-dir on a disk "
            f"with at least {_gib(math.ceil((ckpt + (final if same_disk else 0)) / (1 - FREE_MARGIN)))} free")
    return SavePlan(final, ckpt, False, [note])


def new_checkpoints_at_once(keep_last: int, existing: int) -> int:
    """The checkpoints a run with `existing` complete ones in its directory must still find room for:
    keep_last + 1 exist at once while one is written (the previous keep_last stay until it is
    complete), and those already there are off the free space."""
    return max(1, keep_last + 1 - existing)


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def _after_scratch(scratch: tuple[Path, int], output_dir: Path, checkpoint_dir: Path, out_free: int,
                   ck_free: int) -> tuple[int, int, bool, str]:
    """(out_free, ck_free, on_out, taken): the free space left once the disk tier's scratch files are
    taken from whichever of the two directories shares their disk; `taken` is what the refusals say."""
    scratch_dev = _device_id(scratch[0])
    on_out = scratch_dev == _device_id(output_dir)
    on_ck = scratch_dev == _device_id(checkpoint_dir)
    if on_out:
        out_free = max(0, out_free - scratch[1])
    if on_ck:
        ck_free = max(0, ck_free - scratch[1])
    taken = ""
    if on_out or on_ck:
        taken = (f" (after the disk tier's {_gib(scratch[1])} of files in {scratch[0]}; --disk-dir on another "
                 f"disk leaves that room to the saves)")
    return out_free, ck_free, on_out, taken


def _refuse_final(num_params: int, final: int, *, save_dtype: str, output_dir: Path, out_free: int,
                  out_usable: int, out_free_alone: int, on_out: bool, scratch_holds_weights: bool,
                  taken: str) -> None:
    """Raise DiskSpaceError: final/ does not fit the output's disk; the options that would."""
    options = []
    if save_dtype == "fp32":
        bf16 = num_params * 2 + FILES_MARGIN
        if bf16 <= out_usable:
            options.append(f"--save-dtype bf16 (final/ {_gib(bf16)})")
    options.append(f"--output-dir on a disk with at least {_gib(math.ceil(final / (1 - FREE_MARGIN)))} free")
    if scratch_holds_weights and on_out and final <= int(out_free_alone * (1 - FREE_MARGIN)):
        # it would fit once the tier's files were gone, but they hold masters final/ is written from
        options.append("--tuning.disk_master off (the tier's files then hold only AdamW moments, removed "
                       "before final/ is written)")
    raise DiskSpaceError(f"slidetune: final/ ({_gib(final)} in {save_dtype}) does not fit the {_gib(out_free)} "
                         f"free for {output_dir}{taken}. Options: " + "; ".join(options))


def _refuse_checkpoints(final: int, ckpt: int, room: int, *, save_every: int, keep_last: int,
                        checkpoint_dir: Path, ck_free: int, taken: str, existing: int = 0) -> None:
    """Raise DiskSpaceError: the periodic checkpoints asked for (keep_last + 1 at once, `existing` of
    them already there) do not fit `room`, the checkpoints' disk once final/ is there too; the options
    that would."""
    at_once = keep_last + 1
    options = ["--save-every 0 (final model only" + (", and a resumable checkpoint at the end)" if ckpt <= room
                                                      else ")")]
    fits = room // ckpt - 1 + existing
    if fits >= 1:
        options.append(f"--keep-last {fits} ({fits + 1} checkpoints of {_gib(ckpt)} at once while one is written)")
    options.append(f"--checkpoint-dir on a disk with at least {_gib(math.ceil(at_once * ckpt / (1 - FREE_MARGIN)))} "
                   f"free")
    raise DiskSpaceError(
        f"slidetune: --save-every {save_every} with --keep-last {keep_last} keeps up to {at_once} resumable "
        f"checkpoints of {_gib(ckpt)} (FP32 weights and AdamW moments, {FP32_ADAMW.bytes_per_param} B/param) "
        f"at once beside final/ "
        f"({_gib(final)}), but {checkpoint_dir} has {_gib(ck_free)} free{taken}"
        + (f" beside the {existing} already there" if existing else "") + ". Options that fit: " + "; ".join(options))
