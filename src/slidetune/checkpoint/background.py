"""Asynchronous checkpoints: the resumable checkpoint streams from the live host store while
training goes on (issue 33 item 7; benchmarks/NOTES.md "Asynchronous checkpoints").

The design: a snapshot taken unit by unit, in place. At a step boundary (every update of the
step done: engine.synchronize()) the save holds each unit's next update (engine.hold_updates,
engine/slide/update_hold.py) and returns; a background thread then writes the checkpoint exactly
as the blocking save does (same files, same bytes, same manifest, same atomic rename:
store.save_atomically), taking the weights and the moments straight from the live store,
and releases each unit as soon as both its weights and its moments have been written. The next
step's forward and backward only read the weights, so they run while the files are written; an
update waits only where it reaches a unit the writer has not passed. No copy of the state is
made: the extra host RAM is nothing (the page cache takes what the disk has not yet written).

Why this order: the files are written in unit order (embedding, layers 0..L-1, head), as streams
at once (the weight shards; the optimizer state's file, or its two parts of a large checkpoint),
which is the order the clipped schedule (the default recipe) sweeps its updates in: the writer
has the whole forward and backward of the next step as its lead, and the sweep follows it unit
by unit. The eager schedule
updates from the head down, the writer's last unit, so there an update waits for nearly the
whole write.

What the step loop pays: the boundary (synchronize, the holds, the RNG states; milliseconds) and
the updates that catch up with the writer; the fsyncs, the manifest, the read-back that verifies
the save, the rename and the pruning all run in the background. A failure in the writer never
reaches the pipeline's threads: every hold is released, the temporary directory removed (the
previous checkpoint intact, as in the blocking save) and the error is kept for the step loop
(PendingSave.wait raises it). A kill during the save leaves `<name>.tmp-<pid>`, which the next
start removes (store.recover_leftovers): the previous checkpoint is complete.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..engine.slide.disk_tier import StreamedTensor
from ..faults import maybe_stall
from .format import STATE_DIR, CheckpointError, rng_state, state_record
from .io import FileDigest, StreamCancelled
from .store import fresh_dir, save_atomically
from .writer import finish_checkpoint, one_reader, write_tensor_files


@dataclass
class SaveTiming:
    """How long a save took and what it cost the step loop (saves.jsonl's record, summary.json's sums)."""
    step: int
    mode: str                        # "async" or "blocking"
    started: float = 0.0             # time.time() at its start
    boundary_s: float = 0.0          # the step loop's part at the start (sync, holds, RNG); a blocking save: all
    written_s: float | None = None   # start -> every unit's state written (the last hold released)
    save_s: float | None = None      # start -> complete, verified, renamed, older ones pruned
    held_s: float = 0.0              # updates' waits for the writer, summed over the units
    # each tensor stream's seconds to its last byte ("weights", each optimizer file): which one bound it
    streams_s: dict[str, float] = field(default_factory=dict)
    waited_s: float = 0.0            # the step loop's waits for the save to end (the next save, a stop, the end)
    ok: bool | None = None           # None while in flight

    @property
    def blocked_s(self) -> float:
        """What the save blocked the step loop directly: its start and the waits for its end (the
        updates' waits, `held_s`, show in the following steps' step_s)."""
        return self.boundary_s + self.waited_s

    def record(self) -> dict:
        return {"step": self.step, "mode": self.mode, "ok": self.ok, "started": round(self.started, 3),
                "save_s": _round(self.save_s),
                "blocked_s": _round(self.blocked_s), "boundary_s": _round(self.boundary_s),
                "written_s": _round(self.written_s), "held_s": _round(self.held_s), "waited_s": _round(self.waited_s),
                "streams_s": {name: _round(s) for name, s in self.streams_s.items()}}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


class PendingSave:
    """One asynchronous save in flight: its background thread and its outcome."""

    def __init__(self, out_dir: Path, timing: SaveTiming, holds: list, t0: float):
        self.out_dir, self.timing, self.holds, self._t0 = out_dir, timing, holds, t0
        self._done = threading.Event()
        # set by a failing stream (the other one stops at its next chunk) or by abandon()
        self.cancel = threading.Event()
        self.abandoned = False
        self._path: Path | None = None
        self._error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def done(self) -> bool:
        return self._done.is_set()

    @property
    def path(self) -> Path | None:
        """The complete checkpoint (None while in flight, or if the save failed)."""
        return self._path

    @property
    def error(self) -> BaseException | None:
        """The save's CheckpointError once it has failed (the previous checkpoint is intact)."""
        return self._error

    def wait(self) -> Path:
        """Wait for the save to end (counted as the step loop's wait); its path, or its CheckpointError."""
        if not self._done.is_set():
            t0 = time.monotonic()
            self._done.wait()
            self.timing.waited_s += time.monotonic() - t0
        if self._error is not None:
            raise self._error
        return self._path

    def _finish(self, path: Path | None, error: BaseException | None) -> None:
        self.release_all()
        self._path, self._error = path, error
        self.timing.save_s = time.monotonic() - self._t0
        self.timing.held_s = sum(h.waited_s for h in self.holds)
        self.timing.ok = error is None
        self._done.set()

    def units_written(self) -> None:
        if self.timing.written_s is None:
            self.timing.written_s = time.monotonic() - self._t0

    def release_all(self) -> None:
        for hold in self.holds:
            hold.release()

    def abandon(self) -> None:
        """Give the save up now (the run is aborting): the writer stops at its next chunk, never
        renames what it wrote into place, and every held update goes on at once."""
        self.abandoned = True
        self.cancel.set()
        self.release_all()


def start_async_save(engine, out_dir: Path, *, step: int, tokenizer=None, trainer_state: dict | None = None,
                     after: Callable[[Path], None] | None = None, max_shard_bytes: int = 5 * 2**30,
                     writer_threads: int | None = None) -> PendingSave:
    """Start writing the resumable checkpoint of `engine` (FP32 weights, AdamW state, RNG states) to
    `out_dir` in the background; returns at once with the save in flight. `after(path)` runs in the
    background once the checkpoint is complete and verified (the pruning of older ones). The
    checkpoint is the one save_checkpoint(engine, out_dir, step=step, ...) would write, byte for
    byte but for state.json's time. One save at a time: the caller waits for the previous one.
    writer_threads: the writer's I/O threads (None: io.default_threads())."""
    refusal = engine.async_save_refusal()
    if refusal is not None:
        raise ValueError(f"an asynchronous save is not possible: {refusal}")
    t0 = time.monotonic()
    state, state_text = state_record(engine, step, save_dtype="fp32", with_optimizer=True,
                                     trainer_state=trainer_state)
    engine.synchronize()                 # every update of the step is done: the state the checkpoint holds
    holds = engine.hold_updates()
    try:
        timing = SaveTiming(step=int(step), mode="async", started=time.time() - (time.monotonic() - t0))
        pending = PendingSave(Path(out_dir), timing, holds, t0)
        _run_in_background(engine, pending, _UnitStreams(engine, pending, writer_threads), rng_state(),
                           tokenizer=tokenizer, state=state, state_text=state_text, after=after,
                           max_shard_bytes=max_shard_bytes)
    except BaseException:
        for hold in holds:           # no update may wait for a writer that never started
            hold.release()
        raise
    timing.boundary_s = time.monotonic() - t0
    return pending


def _run_in_background(engine, pending: PendingSave, streams: _UnitStreams, rng: dict, *, tokenizer, state: dict,
                       state_text: str, after: Callable[[Path], None] | None, max_shard_bytes: int) -> None:
    """Start the thread that writes the checkpoint (streams, then finish_checkpoint, atomically) and
    runs `after`; it ends with pending._finish, whatever happens."""
    step = pending.timing.step

    def write(tmp: Path) -> None:
        fresh_dir(tmp)
        streamed = streams.write(tmp, step, max_shard_bytes)
        if pending.abandoned:                # what was read after the release is not of this step
            raise CheckpointError("the save was abandoned")
        maybe_stall(step)                    # tests only (faults.py): a save a kill catches past its tensors
        finish_checkpoint(engine, tmp, step=step, tokenizer=tokenizer, state=state, state_text=state_text,
                          dtype=torch.float32, streamed=streamed, rng=rng, threads=streams.threads)

    def run() -> None:
        path, error = None, None
        try:
            path = save_atomically(pending.out_dir, write)
            if after is not None:
                after(path)
        except BaseException as e:  # noqa: BLE001 - kept for the step loop, which raises it
            error = e if isinstance(e, CheckpointError) else CheckpointError(
                f"saving the checkpoint {pending.out_dir} failed ({type(e).__name__}: {e})")
            error.__cause__ = error.__cause__ or e
        pending._finish(path, error)

    pending.thread = threading.Thread(target=run, name="slidetune-checkpoint", daemon=True)
    pending.thread.start()


class _UnitStreams:
    """The checkpoint's tensors as streams written at once in unit order (the weight shards; the
    optimizer state's file or parts: writer.optimizer_parts), each tensor a StreamedTensor read
    from the live store as it is written, and each unit's hold released once the streams have
    written all of its tensors."""

    def __init__(self, engine, pending: PendingSave, threads: int | None = None):
        self.pending, self.threads = pending, threads
        self.cancel = pending.cancel         # one stream failed (or the save was abandoned): stop
        # the disk tier's blocks are taken one reader at a time (DiskTier.acquire): the streams
        # read a disk unit's master and moments through one lock
        self.tier_lock = threading.Lock()
        self.left: list[int] = [0] * len(engine.units)      # tensors of each unit not yet written
        self.lock = threading.Lock()
        self.weights: list[tuple[str, StreamedTensor]] = []
        self.optim: dict[str, StreamedTensor] = {}
        seen = set()
        for i, unit in enumerate(engine.units):      # engine.named_master_params()'s order
            for name, t in unit.params().items():
                if name not in seen:                # a tied weight appears once (write_weights)
                    seen.add(name)
                    self.weights.append((name, self._streamed(t, i)))
        # the constant buffers (models/buffers.py) after them, as written by save_checkpoint: host
        # tensors no update changes, so no unit's hold waits on them
        self.buffers = dict(engine.named_buffers())
        self.weights.extend(self.buffers.items())
        for i, unit in enumerate(engine.units):      # engine.optimizer_tensors()'s order
            for k, t in unit.state_tensors().items():
                self.optim[f"{unit.spec.name}.{k}"] = self._streamed(t, i)
        for i, n in enumerate(self.left):
            if n == 0:
                pending.holds[i].release()

    def _streamed(self, t, unit: int) -> StreamedTensor:
        """`t` (a host view, a device tensor, or a disk tier's StreamedTensor) read when written; the
        unit's count goes down once its last byte has been handed to the file."""
        self.left[unit] += 1

        def source():
            if isinstance(t, StreamedTensor):
                for part in one_reader(t, self.tier_lock).chunks():
                    self._check_cancel()
                    yield part
            else:
                self._check_cancel()
                # a device unit's tensor is staged down in chunks by the writer (io.Stager)
                yield t.detach().reshape(-1)
            self._written(unit)
        return StreamedTensor(tuple(t.shape), t.dtype, source)

    def _check_cancel(self) -> None:
        if self.cancel.is_set():
            raise _Cancelled("the save was abandoned" if self.pending.abandoned
                             else "the other stream of this checkpoint failed")

    def _written(self, unit: int) -> None:
        with self.lock:
            self.left[unit] -= 1
            last = self.left[unit] == 0
        if last:
            self.pending.holds[unit].release()
            if all(h.released for h in self.pending.holds):
                self.pending.units_written()

    def write(self, tmp: Path, step: int, max_shard_bytes: int) -> dict[str, FileDigest]:
        """Both streams into `tmp`; their digests by relative path. The holds stay until both have
        ended, failed or not: a released update could otherwise race a stream still reading it."""
        (tmp / STATE_DIR).mkdir()
        return write_tensor_files(self.weights, self.optim, tmp, torch.float32, max_shard_bytes,
                                  threads=self.threads, step=step, cancel=self.cancel,
                                  stream_s=self.pending.timing.streams_s, own_dtype=frozenset(self.buffers))


class _Cancelled(CheckpointError, StreamCancelled):
    """A stream stopped because the other one failed (that one's error is the one raised)."""
