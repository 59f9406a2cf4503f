"""The disk tier: the AdamW moments (and, as an option, the FP32 master) of some units in files
on a local disk.

Which units: engine/placement.py (those whose state is in engine/tiers.py's tier with files, and
whose master is too where it lives here).
Their moments (8 B/param, two thirds of the host's state) live here; their FP32 masters stay in
host RAM (the uploads read them twice a step), or with --tuning.disk_master live here too, and
RAM keeps only the compute-dtype weights the uploads copy (2 B/param for BF16; host_store.py
writes them as each block's update lands). Blocks pass through a few page-locked buffers:

  file layout   one file per unit in a scratch directory made for the run; block b holds the
                state of elements [b*B, (b+1)*B) in the optimizer's format (BlockLayout): FP32
                exp_avg (B FP32) then exp_avg_sq (B FP32) at offset b * 8B, or for a unit whose
                master lives here master, exp_avg, exp_avg_sq at offset b * 12B; a compact
                format (--moments, --master) its fields in their dtypes, 8-bit moments' block
                scales last, the block padded to ALIGN (a unit's last block is padded too), so
                each block is one read and one write of a fixed, aligned size (the master rides
                in the read AdamW makes anyway: +8 B/param of I/O a step in FP32, not a
                separate pass);
  I/O           os.preadv / os.pwritev from a pool of threads (each call releases the GIL, so the
                compute thread keeps launching), on files opened with O_DIRECT where the
                filesystem allows it: no page cache, which would take back the RAM the tier
                frees. Where it does not (tmpfs, some network filesystems) the files are opened
                buffered and the tier says so;
  buffers       `disk_buffers` page-aligned (page-locked on CUDA) buffers of one block each:
                blocks are read ahead in the order the engine expects to update them
                (prefetch: one ticketed entry a block, which the block's next acquire
                consumes), handed to AdamW (acquire), written behind (release). Reads run at
                most a ring's width of tickets past the last block consumed: the engine's
                prefetch for step k comes before step k-1's sweep has run, and the next
                sweep's blocks must not take the buffers the current one waits for. A written
                block stays readable in its buffer until the buffer is needed again (a later
                entry for it takes it without a read). A block AdamW waits for goes first; only
                when every buffer holds a block kept for another entry (an update order the
                prefetch did not foresee, earliest-deadline-first) is the one furthest ahead
                dropped and queued again at its turn, so nothing deadlocks and nothing is read
                over and over (2026-11-25: the old rule, "take back a prefetched block and read
                it again first", read one unit ~20 times a step on a slow disk).

The directory is scratch space for one run: made at start (with a SCRATCH note saying so),
removed at close, never named or marked like a checkpoint. Stale directories of runs that
died are removed when the next run starts there. A checkpoint reads the moments through the
tier (StreamedTensor) and writes them into the checkpoint like any other tensor.

Why not a library: kvikio's POSIX backend and the alternatives are compared in
benchmarks/NOTES.md "Disk tier"; a pool of preadv/pwritev threads on O_DIRECT files
needs no compiled extension and measured as fast as the disk.
"""
from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ...device import PINNED
from ...telemetry.host_timeline import HostTimeline
from ..adamw import FP32_ADAMW, OptimizerState, StateField
from ..tiers import SCRATCH_PREFIX, TIERS, DiskTierError, check_directory

ALIGN = 4096                      # O_DIRECT: buffer address, size and offset aligned to this
SCRATCH_NOTE = "SCRATCH"


def block_elems(block_mb: float, state: OptimizerState = FP32_ADAMW) -> int:
    """Elements per block: block_mb MiB hold a block's two moments in `state`'s format (FP32: 8
    B/param), rounded to a multiple of ALIGN / 4 elements (so of the 8-bit moments' 256 too; a
    block with the master too is larger: the same elements, so one layout of blocks)."""
    per = int(int(block_mb * 2**20) // state.moment_bytes)
    return max(ALIGN // 4, per - per % (ALIGN // 4))


@dataclass(frozen=True)
class BlockLayout:
    """Where each field of a block of `block` elements sits in a block's bytes (OptimizerState.fields
    in order, each at a multiple of its dtype's size), and the block's size, padded to ALIGN."""
    fields: tuple[StateField, ...]
    block: int

    @property
    def offsets(self) -> dict[str, int]:
        out, at = {}, 0
        for f in self.fields:
            out[f.name] = at
            at += f.nbytes(self.block)
        return out

    @property
    def nbytes(self) -> int:
        raw = sum(f.nbytes(self.block) for f in self.fields)
        return -(-raw // ALIGN) * ALIGN

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def field(self, name: str) -> StateField:
        return next(f for f in self.fields if f.name == name)

    def file_bytes(self, numel: int) -> int:
        """Bytes a unit of `numel` parameters takes on disk: whole blocks."""
        return -(-numel // self.block) * self.nbytes


def block_layout(state: OptimizerState, with_master: bool, block: int) -> BlockLayout:
    """The blocks of a unit whose moments (and, `with_master`, master) the tier holds in `state`'s format."""
    return BlockLayout(state.fields(master=with_master), block)


def _plan_layouts(plan, block_mb: float) -> list[tuple[int, BlockLayout]]:
    """(numel, layout) of each of a placement plan's disk units (engine/placement.py)."""
    block = block_elems(block_mb, plan.host_state)
    files = TIERS.with_files
    return [(u.numel, block_layout(plan.host_state, files.holds_master(u), block))
            for u in plan.units if files.holds(u)]


def tier_bytes(plan, block_mb: float) -> int:
    """Bytes the disk tier's files take for a placement plan's disk units: FP32 8 B/param, 12 where
    the master lives there too, in whole blocks (a compact format: its own, plan.host_state)."""
    return sum(layout.file_bytes(n) for n, layout in _plan_layouts(plan, block_mb))


def tier_blocks(plan, block_mb: float) -> int:
    """Blocks of all the plan's disk units: a step reads and writes each once (read-ahead deeper
    than this has nothing left to read)."""
    return sum(-(-n // layout.block) for n, layout in _plan_layouts(plan, block_mb))


def buffer_bytes(plan, block_mb: float, buffers: int | None = None) -> int:
    """Page-locked bytes of the tier's block buffers for a plan (`buffers` of them; None: the
    plan's count): each holds a block of the widest layout its units use (FP32 with a master: 12
    B/param, else 8)."""
    widest = max((layout.nbytes for _, layout in _plan_layouts(plan, block_mb)), default=0)
    return (plan.disk_buffers if buffers is None else buffers) * widest


def _aligned_empty(nbytes: int, pinned: bool) -> torch.Tensor:
    """[nbytes] uint8 whose address is ALIGN-aligned (O_DIRECT), page-locked if `pinned`."""
    if pinned:
        # CUDA's host allocations are page-aligned; padding would round a 64 MiB block up to 128
        raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if raw.data_ptr() % ALIGN == 0:
            return PINNED.track(raw)
        del raw
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pinned)
    PINNED.track(raw)          # counted on the CPU too, as Device.host_empty's buffers are
    skip = -raw.data_ptr() % ALIGN
    return raw[skip:skip + nbytes]


@dataclass
class Block:
    """A block of a unit in a buffer, for AdamW: views of each field of its elements [lo, hi), in
    the state's dtypes: [hi - lo] each, an 8-bit moment's scales [ceil((hi - lo) / 256)]."""
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    master: torch.Tensor | None = None    # where the unit's master lives on disk
    exp_avg_scales: torch.Tensor | None = None      # 8-bit moments
    exp_avg_sq_scales: torch.Tensor | None = None

    def field(self, name: str) -> torch.Tensor:
        return getattr(self, name)

    @property
    def scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.exp_avg_scales is None else (self.exp_avg_scales, self.exp_avg_sq_scales)


@dataclass
class _Entry:
    """One foreseen read of a block: prefetch() queues one per block in the order the engine will
    update them; the block's next acquire consumes the earliest of its key's entries."""
    ticket: int                    # position in the order of every entry queued (demands: the front)
    key: tuple[int, int]           # (unit index, block)
    buf: "_Buffer | None" = None   # the buffer its block is read into, or held in; None: not started
    demanded: bool = False         # acquire() waits for it: read next, whatever the window


@dataclass
class _Buffer:
    data: torch.Tensor            # [bytes of the widest BlockLayout] uint8: (master,) exp_avg, exp_avg_sq, ...
    key: tuple[int, int] | None = None   # (unit index, block) it holds or is loading
    state: str = "free"           # free | reading | ready | busy | writing
    entry: _Entry | None = None   # the entry its block is kept for; None when ready: clean, reusable
    error: BaseException | None = None


class DiskTier:
    def __init__(self, directory: str | os.PathLike, units: dict[int, int], *, block_mb: float = 64,
                 buffers: int = 8, io_threads: int = 4, pinned: bool = False, names: dict[int, str] | None = None,
                 timeline: HostTimeline | None = None, masters: frozenset[int] = frozenset(),
                 state: OptimizerState = FP32_ADAMW):
        """units: unit index -> numel of each unit whose moments live here (zero at start, as
        AdamW's). masters: those of them whose master lives here too (written by the store
        before the first step). state: the optimizer's format (--moments, --master: the fields'
        dtypes, BlockLayout). The files are allocated in full now (fallocate), so a full disk
        shows here, not mid-run."""
        self.state = state
        self.block = block_elems(block_mb, state)
        self.units = dict(units)
        self.masters = frozenset(masters)
        if not self.masters <= set(self.units):
            raise ValueError("a master on disk needs its unit's moments there too")
        self._layouts = {m: block_layout(state, m, self.block) for m in (False, True)}
        self.names = names or {i: f"unit {i}" for i in units}
        need = sum(self.layout(i).file_bytes(n) for i, n in self.units.items())
        root = check_directory(directory, need, state=state)
        self.dir = root / f"{SCRATCH_PREFIX}{os.getpid()}-{time.time_ns()}"
        self.dir.mkdir()
        (self.dir / SCRATCH_NOTE).write_text(
            "Scratch space of a running slidetune job (the disk tier's AdamW moments, and masters with "
            "--tuning.disk_master). Not a checkpoint: "
            "it is removed when the run ends, and by the next run here if this one was killed.\n")
        self.timeline = timeline or HostTimeline(enabled=False)
        self.direct = True
        self._fds: dict[int, int] = {}
        try:
            for i, n in self.units.items():
                self._fds[i] = self._open(self.dir / f"unit-{i:04d}.{'state' if i in self.masters else 'moments'}",
                                          self.layout(i).file_bytes(n))
        except BaseException:
            self.close()
            raise
        widest = max((self.layout(i).nbytes for i in self.units), default=self._layouts[False].nbytes)
        self._buffers = [_Buffer(_aligned_empty(widest, pinned)) for _ in range(buffers)]
        self._where: dict[tuple[int, int], _Buffer] = {}
        # Foreseen reads (prefetch), in ticket order: the not yet started ones, and every key's
        # not yet consumed ones (started or not). The pump reads at most a ring's width of
        # tickets past the last one consumed (`_pos`), so blocks the next sweep needs are not
        # read while the current sweep still waits for its own.
        self._pending: deque[_Entry] = deque()
        self._by_key: dict[tuple[int, int], deque[_Entry]] = {}
        self._ticket = 0
        self._pos = -1
        self._cond = threading.Condition()
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="slidetune-disk")
        self._error: BaseException | None = None
        self.abort: threading.Event | None = None     # the engine's: waits give up when it is set
        self.bytes_read = 0
        self.bytes_written = 0
        self._closed = False

    # ------------------------------------------------------------------ files
    def _open(self, path: Path, size: int) -> int:
        flags = os.O_RDWR | os.O_CREAT
        fd = None
        if self.direct and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o600)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise DiskTierError(f"cannot create the disk tier's file {path}: {e}") from e
                self.direct = False       # this filesystem has no O_DIRECT (tmpfs): buffered
        else:
            self.direct = False
        if fd is None:
            fd = os.open(path, flags, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)     # reserved now: zeros, and no ENOSPC mid-run
        except OSError as e:
            os.close(fd)
            raise DiskTierError(f"cannot reserve {size / 2**30:.2f} GiB for {path}: {e}; free space on the "
                                f"disk or put fewer units there (--tuning.disk_units)") from e
        return fd

    def layout(self, unit: int) -> BlockLayout:
        """The unit's blocks: its fields, where each sits, the block's bytes."""
        return self._layouts[unit in self.masters]

    def fields(self, unit: int) -> tuple[str, ...]:
        """The unit's fields in a block, in file order."""
        return self.layout(unit).names

    def blocks(self, unit: int) -> int:
        return -(-self.units[unit] // self.block)

    def block_range(self, unit: int, b: int) -> tuple[int, int]:
        """Elements [lo, hi) of the unit that block b holds."""
        lo = b * self.block
        return lo, min(self.units[unit], lo + self.block)

    # ------------------------------------------------------------------ I/O threads
    def _io(self, buf: _Buffer, key: tuple[int, int], write: bool) -> None:
        unit, b = key
        width = self.layout(unit).nbytes                        # bytes of this unit's block
        view = memoryview(buf.data[:width].numpy())
        offset = b * width
        try:
            # the timeline's lane is the tier's name (bench.measure.lane_busy_fraction reads it)
            with self.timeline.span(TIERS.with_files.name, "write" if write else "read", self.names.get(unit, "")):
                done = 0
                while done < len(view):                     # short reads/writes: go on from where it stopped
                    part = [view[done:]]
                    n = (os.pwritev if write else os.preadv)(self._fds[unit], part, offset + done)
                    if n <= 0:
                        raise DiskTierError(f"disk tier {'write' if write else 'read'} of {self.names.get(unit)} "
                                            f"block {b} returned {n}")
                    done += n
        except BaseException as e:
            with self._cond:
                buf.error = e
                self._error = self._error or e
                self._cond.notify_all()
            return
        with self._cond:
            if write:
                self.bytes_written += len(view)
            else:
                self.bytes_read += len(view)
            buf.state = "ready"     # read: kept for its entry; written: clean (or kept for a later entry)
            self._cond.notify_all()
            self._pump()

    def _start(self, buf: _Buffer, key: tuple[int, int], write: bool) -> None:
        """(lock held) Give `buf` to an I/O thread."""
        buf.state = "writing" if write else "reading"
        self._pool.submit(self._io, buf, key, write)

    def _reusable(self) -> _Buffer | None:
        """(lock held) A buffer to load another block into: a free one, else a clean one (ready,
        kept for no entry: a block written back or released unchanged)."""
        pick = next((x for x in self._buffers if x.state == "free"), None)
        return pick or next((x for x in self._buffers if x.state == "ready" and x.entry is None), None)

    def _bind(self, buf: _Buffer, key: tuple[int, int], entry: _Entry | None) -> None:
        """(lock held) `buf` (a free or clean buffer) holds `key` from now on, kept for `entry`."""
        if buf.key is not None:
            self._where.pop(buf.key, None)
        buf.key, buf.entry, buf.error = key, entry, None
        self._where[key] = buf

    def _assign(self, buf: _Buffer, entry: _Entry) -> None:
        """(lock held) Load entry's block into `buf` (a free or clean buffer): its read starts."""
        self._bind(buf, entry.key, entry)
        entry.buf = buf
        self._start(buf, entry.key, write=False)

    def _pump(self) -> None:
        """(lock held) Start the reads of pending entries, in ticket order (demanded ones first),
        while buffers are free and within the window: at most one ring's width of tickets past the
        last consumed. A block already in a buffer (clean, or being written back) is kept for its
        entry without a read; one still held for an earlier entry or in use waits for it."""
        width = len(self._buffers)
        while self._pending and not self._closed:
            entry = self._pending[0]
            if not entry.demanded and entry.ticket > self._pos + width:
                return
            held = self._where.get(entry.key)
            if held is not None:
                if held.entry is None and held.state in ("ready", "writing"):
                    held.entry, entry.buf = entry, held           # its data is this block's latest
                    self._pending.popleft()
                    continue
                return                  # held for an earlier entry or in use: in order, after it
            buf = self._reusable()
            if buf is None:
                return
            self._pending.popleft()
            self._assign(buf, entry)

    def _enqueue(self, key: tuple[int, int], demanded: bool = False) -> _Entry:
        """(lock held) A new entry for `key`: last in ticket order, or, demanded, first."""
        if demanded:
            entry = _Entry(ticket=self._pos, key=key, demanded=True)
            self._pending.appendleft(entry)
            self._by_key.setdefault(key, deque()).appendleft(entry)
        else:
            entry = _Entry(ticket=self._ticket, key=key)
            self._ticket += 1
            self._pending.append(entry)
            self._by_key.setdefault(key, deque()).append(entry)
        return entry

    def _promote(self, entry: _Entry) -> None:
        """(lock held) A not yet started entry that acquire() waits for goes to the pending front."""
        if not entry.demanded:
            entry.demanded = True
            self._pending.remove(entry)
            self._pending.appendleft(entry)

    def _take_back(self, entry: _Entry) -> None:
        """(lock held) No buffer will come free by itself (none is free, clean or being written
        back) while `entry` waits, every one holding a block kept for another entry (an update
        order the prefetch did not foresee, earliest-deadline-first): the block kept for the entry
        furthest ahead is dropped, its entry pending again in ticket order (not first: read again
        at its turn, not at once), and the buffer reused. Never while a buffer will free itself."""
        if any(x.state in ("free", "writing") or (x.state in ("ready", "reading") and x.entry is None)
               for x in self._buffers):
            return
        kept = [x for x in self._buffers if x.state == "ready" and x.entry is not None and x.entry is not entry]
        if not kept:
            return
        victim = max(kept, key=lambda x: x.entry.ticket)
        dropped = victim.entry
        dropped.buf, victim.entry = None, None          # the buffer is clean now (its data stays valid)
        at = next((i for i, e in enumerate(self._pending) if not e.demanded and e.ticket > dropped.ticket),
                  len(self._pending))
        self._pending.insert(at, dropped)

    def _drop(self, entry: _Entry) -> None:
        """(lock held) Forget an entry nobody will consume: pending no more, its buffer (if its read
        started) clean once the read lands."""
        if entry.buf is None:
            self._pending.remove(entry)
        elif entry.buf.entry is entry:
            entry.buf.entry = None
        self._forget(entry)

    def _forget(self, entry: _Entry) -> None:
        """(lock held) The entry leaves its key's list of not yet consumed entries."""
        dq = self._by_key[entry.key]
        dq.remove(entry)
        if not dq:
            del self._by_key[entry.key]

    def _consume(self, entry: _Entry) -> None:
        """(lock held) acquire() has the entry's block: the entry is done, the window moves on."""
        self._forget(entry)
        if not entry.demanded:
            self._pos = max(self._pos, entry.ticket)

    # ------------------------------------------------------------------ the engine's side
    def prefetch(self, unit: int) -> None:
        """Read the unit's blocks ahead, in order, as buffers free up: one entry a block, which
        the block's next acquire consumes (each call foresees one more update of the unit)."""
        with self._cond:
            for b in range(self.blocks(unit)):
                key = (unit, b)
                # The engine foresees one update ahead: the step's prefetch comes before the previous
                # step's sweep has run. An entry older than that was never consumed (a step that
                # did not update the unit): dropped, so it holds no buffer for good.
                while len(self._by_key.get(key, ())) >= 2:
                    self._drop(self._by_key[key][0])
                self._enqueue(key)
            self._pump()

    def acquire(self, unit: int, b: int, abort: threading.Event | None = None, fresh: bool = False) -> Block:
        """Block b of the unit (views [hi - lo] of each field) for AdamW; waits for its read.
        Consumes the block's earliest prefetch entry; a block nobody prefetched is read on demand,
        first. fresh: the caller overwrites every field of the block (initial state, a
        checkpoint's): no read, the buffer comes as it is."""
        abort = abort or self.abort
        key = (unit, b)
        n = self.block_range(unit, b)[1] - b * self.block
        with self._cond:
            if self._where.get(key) is not None and self._where[key].state == "busy":
                raise DiskTierError(f"{self.names.get(unit)} block {b} acquired twice")
            entry = (self._by_key.get(key) or [None])[0] or self._enqueue(key, demanded=True)
            while True:
                self._raise_if_failed(abort)
                buf = entry.buf
                if buf is not None and buf.state == "ready":
                    self._consume(entry)
                    buf.state, buf.entry = "busy", None
                    self._pump()
                    return self._block(unit, buf, n)
                if buf is None and fresh:
                    held = self._where.get(key)
                    if held is not None and held.entry is None and held.state == "ready":
                        buf = held
                    else:
                        buf = self._reusable() if held is None else None
                    if buf is not None:
                        self._pending.remove(entry)
                        self._consume(entry)
                        self._bind(buf, key, None)
                        buf.state = "busy"
                        return self._block(unit, buf, n)
                if buf is None:
                    self._promote(entry)
                    self._pump()
                    if entry.buf is None:
                        self._take_back(entry)
                        self._pump()
                    if entry.buf is not None and entry.buf.state == "ready":
                        continue
                self._cond.wait(timeout=0.5)

    def _block(self, unit: int, buf: _Buffer, n: int) -> Block:
        """The unit's fields in `buf` for a block of n elements ([n] each, scales [ceil(n / 256)])."""
        layout = self.layout(unit)
        views = {f.name: buf.data[at:at + f.nbytes(n)].view(f.dtype)
                 for f, at in zip(layout.fields, layout.offsets.values())}
        return Block(**views)

    def release(self, unit: int, b: int, dirty: bool = True) -> None:
        """AdamW is done with block b: written behind (dirty) or kept as it was read."""
        with self._cond:
            buf = self._where[(unit, b)]
            if dirty:
                self._start(buf, (unit, b), write=True)
            else:
                buf.state = "ready"
                self._cond.notify_all()
            self._pump()

    def drain(self, abort: threading.Event | None = None) -> None:
        """Wait until every write has reached the file (a checkpoint reads the files after this)."""
        abort = abort or self.abort
        with self._cond:
            while any(x.state in ("writing", "reading") for x in self._buffers):
                self._raise_if_failed(abort)
                self._cond.wait(timeout=0.5)
            self._raise_if_failed(abort)

    def _raise_if_failed(self, abort: threading.Event | None) -> None:
        if self._error is not None:
            raise DiskTierError(f"disk tier I/O failed in {self.dir}: {self._error!r}") from self._error
        if abort is not None and abort.is_set():
            raise DiskTierError("gave up waiting for the disk tier: another pipeline thread failed")

    # ------------------------------------------------------------------ whole units (checkpoints)
    def read_range(self, unit: int, field: str, lo: int, hi: int):
        """Elements [lo, hi) of a field ("master", "exp_avg", "exp_avg_sq", an 8-bit moment's
        "..._scales"; in the field's own elements: a scale is one per 256) of a unit, block by
        block (CPU tensors, copies): a checkpoint streams a parameter or a moment without holding it."""
        per = self.block // self.layout(unit).field(field).per         # the field's elements a block
        for b in range(lo // per, -(-hi // per)):
            base = b * per
            blk = self.acquire(unit, b)
            out = blk.field(field)[max(lo, base) - base:min(hi, base + per) - base].clone()
            self.release(unit, b, dirty=False)
            yield out

    def write_unit(self, unit: int, **fields) -> None:
        """Overwrite fields of a unit, block by block (the initial master, a checkpoint's state).
        Each value: a tensor of the field's whole length, a float (every element), or a callable
        (lo, hi) -> [hi - lo] tensor (what is not in memory whole), indexed in the field's own
        elements (BlockLayout; a scale per 256). Blocks whose every field is given are not read."""
        layout = self.layout(unit)
        unknown = set(fields) - set(layout.names)
        if unknown:
            raise ValueError(f"{self.names.get(unit)} has no {sorted(unknown)} on disk")
        fresh = set(fields) == set(layout.names)
        for b in range(self.blocks(unit)):
            lo, hi = self.block_range(unit, b)
            blk = self.acquire(unit, b, fresh=fresh)
            for name, value in fields.items():
                view = blk.field(name)
                per = layout.field(name).per
                a, z = lo // per, -(-hi // per)
                if isinstance(value, float):
                    view.fill_(value)
                else:
                    view.copy_(value(a, z) if callable(value) else value[a:z])
            self.release(unit, b)
        self.drain()

    def pinned_bytes(self) -> int:
        return sum(x.data.numel() for x in self._buffers)

    def close(self) -> None:
        """Stop the I/O, close and remove the scratch files (the run's state is in its checkpoints)."""
        if self._closed:
            return
        self._closed = True
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = {}
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class StreamedTensor:
    """A tensor that is not in memory: its shape and dtype, and its values block by block
    (checkpoint/writer.py's write_safetensors writes it without holding it whole)."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    source: object                 # a callable returning an iterator of 1-D CPU tensors, in order

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def chunks(self):
        return self.source()

    def materialize(self) -> torch.Tensor:
        """The whole tensor in memory (tests, small tensors; a checkpoint streams chunks())."""
        return torch.cat([c.reshape(-1) for c in self.chunks()]).to(self.dtype).view(self.shape)
