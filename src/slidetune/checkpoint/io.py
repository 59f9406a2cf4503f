"""The checkpoint writer's and read-back's I/O: large pieces, several threads, the digest in order.

writer.write_safetensors decides what a file holds (its header, its tensors in order); this
module puts the bytes on the disk and reads them back (benchmarks/NOTES.md "Checkpoint writer").

Writing one file: its bytes come as pieces in file order (a host tensor's own memory, no copy;
a cast's or a GPU tensor's staged chunk). Each piece is cut into WRITE_PIECE slices written with
`os.pwrite` at their offsets by the shared pool's threads, while the file's own thread hashes
the same piece (xxh3-128 streams: its bytes must go in order, so one thread per file hashes;
`update` releases the GIL, so the hash runs beside the writes). The next piece is taken only
once every slice of this one is written: a staging buffer is reused only after its writes, and
an asynchronous save's unit is released (its tensors' last piece asked for) only once its
bytes are in the file. The bytes and the digest are those of a plain sequential write.

GPU tensors come down in STAGE_BYTES chunks through two pinned buffers per file being written
(2 x 64 MiB pinned each): chunk k+1 is copied on a side stream while chunk k is written.

Reading back: every file at once, each read in READ_PIECE pieces by the pool (READ_AHEAD of
them in flight a file) and hashed in order by the file's own thread.
"""
from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from ..engine.slide.disk_tier import StreamedTensor

WRITE_PIECE = 32 * 2**20     # one pwrite(): a 256 MiB tensor is 8 slices for the pool's threads
INLINE_BYTES = 2**20         # smaller pieces (norms, scalars, headers) are written by the file's thread
STAGE_BYTES = 64 * 2**20     # one pinned staging buffer (two per file with GPU tensors) or cast buffer
READ_PIECE = 32 * 2**20      # one pread() of the read-back
READ_AHEAD = 4               # read-back pieces in flight per file (4 x 32 MiB of buffers a file)


def default_threads() -> int:
    """The writer's pool: a quarter of the cores, 1 to 8. A blocking save has every core, but an
    asynchronous one runs beside the host AdamW, which uses all but one; the writes are copies
    into the page cache (~1-2 GB/s a thread), so 8 reach the 10+ GB/s a tmpfs or a fast NVMe array
    takes, and more threads would only take cores from the step. One below 8 cores: on 2 busy
    vCPUs a second thread made the read-back 0.9 s slower per 4 GiB and the writes no faster
    (NOTES.md "Checkpoint writer")."""
    return max(1, min(8, (os.cpu_count() or 2) // 4))


@dataclass(frozen=True)
class FileDigest:
    size: int
    digest: str                # hex, of algorithm format.DIGEST (xxh3-128)

    def record(self) -> dict:
        return {"size": self.size, "digest": self.digest}


class StreamCancelled(RuntimeError):
    """A file stopped being written because another stream of the same save failed (or it was
    abandoned); the other stream's error is the one to report."""


@contextmanager
def io_pool(pool: ThreadPoolExecutor | None, threads: int | None) -> Iterator[ThreadPoolExecutor]:
    """`pool`, or a pool of `threads` (default_threads()) for the duration of the block."""
    if pool is not None:
        yield pool
        return
    with ThreadPoolExecutor(threads or default_threads(), thread_name_prefix="slidetune-ckpt-io") as own:
        yield own


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data.nbytes:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _wait_all(futures: Iterable[Future]) -> None:
    """Wait for every future (none may still write once the file is closed), then raise the first error."""
    error = None
    for f in futures:
        try:
            f.result()
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the others ended
            error = error or e
    if error is not None:
        raise error


class ParallelFile:
    """A new file written piece by piece in order: each piece's slices pwritten by `pool` while
    this thread hashes it. Closes on leaving the `with` block."""

    def __init__(self, path: Path, pool: ThreadPoolExecutor, cancel: threading.Event | None = None):
        self.pool, self.cancel = pool, cancel
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
        self.hash, self.size = xxhash.xxh3_128(), 0

    def __enter__(self) -> ParallelFile:
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)

    def write(self, data) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise StreamCancelled("stopped: another stream of this checkpoint failed, or the save was abandoned")
        view = memoryview(data).cast("B")
        n = view.nbytes
        if n <= INLINE_BYTES:
            _pwrite_all(self.fd, view, self.size)
            self.hash.update(view)
        else:
            futures = [self.pool.submit(_pwrite_all, self.fd, view[a:a + WRITE_PIECE], self.size + a)
                       for a in range(0, n, WRITE_PIECE)]
            try:
                self.hash.update(view)
            finally:
                _wait_all(futures)
        self.size += n

    def digest(self) -> FileDigest:
        return FileDigest(self.size, self.hash.hexdigest())


def _host_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, no copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def host_pieces(t: torch.Tensor | StreamedTensor, dt: torch.dtype, stager: Stager) -> Iterator[memoryview]:
    """`t`'s bytes as `dt`, in order, in pieces valid until the next one is asked for: a host
    tensor of that dtype as it is (no copy), a cast in STAGE_BYTES chunks, a GPU tensor staged."""
    if isinstance(t, StreamedTensor):               # the disk tier's blocks, an async save's parts
        for part in t.chunks():
            yield from host_pieces(part, dt, stager)
        return
    src = t.detach()
    if src.device.type != "cpu":
        yield from stager.pieces(src, dt)
    elif src.dtype == dt:
        yield _host_bytes(src.contiguous())
    else:
        yield from _cast_pieces(src.reshape(-1), dt)


def _cast_pieces(flat: torch.Tensor, dt: torch.dtype) -> Iterator[memoryview]:
    """A CPU cast (the BF16 export) through one reused buffer: no whole tensor's copy."""
    n = flat.numel()
    step = STAGE_BYTES // torch.empty((), dtype=dt).element_size()
    buf = torch.empty(min(step, n), dtype=dt)
    for a in range(0, n, step):
        part = buf[:min(step, n - a)]
        part.copy_(flat[a:a + step])                 # the rounding of .to(dt), chunk by chunk
        yield _host_bytes(part)


class Stager:
    """GPU tensors to the host through two pinned buffers (per dtype), chunk k+1's copy on a
    side stream while chunk k is written: 2 x STAGE_BYTES of pinned memory, allocated on first use."""

    def __init__(self):
        self.buffers: dict[torch.dtype, list[torch.Tensor]] = {}

    def _buffers(self, dt: torch.dtype) -> list[torch.Tensor]:
        if dt not in self.buffers:
            elems = STAGE_BYTES // torch.empty((), dtype=dt).element_size()
            self.buffers[dt] = [torch.empty(elems, dtype=dt, pin_memory=True) for _ in range(2)]
        return self.buffers[dt]

    def pieces(self, src: torch.Tensor, dt: torch.dtype) -> Iterator[memoryview]:
        flat = src.reshape(-1)
        n = flat.numel()
        bufs = self._buffers(dt)
        step = bufs[0].numel()
        stream = torch.cuda.Stream(flat.device)
        stream.wait_stream(torch.cuda.current_stream(flat.device))   # whatever wrote `src` is done
        events = [torch.cuda.Event(), torch.cuda.Event()]
        keep: list[torch.Tensor | None] = [None, None]      # a cast chunk lives until its copy ends

        def launch(k: int) -> None:
            a = k * step
            with torch.cuda.stream(stream):
                part = flat[a:a + step]
                part = part if part.dtype == dt else part.to(dt)
                bufs[k % 2][:part.numel()].copy_(part, non_blocking=True)
                keep[k % 2] = part
                events[k % 2].record(stream)

        chunks = (n + step - 1) // step
        if chunks:
            launch(0)
        for k in range(chunks):
            if k + 1 < chunks:
                launch(k + 1)            # its buffer's previous piece was written before we resumed
            events[k % 2].synchronize()
            yield _host_bytes(bufs[k % 2][:min(step, n - k * step)])


# --------------------------------------------------------------------------- read-back
def _pread_into(fd: int, buf: bytearray, n: int, offset: int) -> int:
    view, got = memoryview(buf)[:n], 0
    while got < n:
        r = os.preadv(fd, [view[got:]], offset + got)
        if r == 0:
            break                        # shorter than its stat said: the digest will differ
        got += r
    return got


def file_digest_parallel(path: Path, pool: ThreadPoolExecutor) -> FileDigest:
    """A file's size and digest: its pieces read by `pool` (READ_AHEAD in flight), hashed in order here."""
    h, size = xxhash.xxh3_128(), 0
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        total = os.fstat(fd).st_size
        offsets = list(range(0, total, READ_PIECE))
        bufs = [bytearray(min(READ_PIECE, total)) for _ in range(min(READ_AHEAD, len(offsets)))]
        inflight: deque[Future] = deque()
        try:
            for k, off in enumerate(offsets):
                if k >= len(bufs):
                    size += _hash_next(inflight, bufs, k - len(bufs), h)
                inflight.append(pool.submit(_pread_into, fd, bufs[k % len(bufs)], min(READ_PIECE, total - off), off))
            for k in range(len(offsets) - len(inflight), len(offsets)):
                size += _hash_next(inflight, bufs, k, h)
        finally:
            _wait_all(inflight)
    finally:
        os.close(fd)
    return FileDigest(size, h.hexdigest())


def _hash_next(inflight: deque[Future], bufs: Sequence[bytearray], k: int, h) -> int:
    """Hash the oldest read in flight (piece k); its byte count."""
    got = inflight.popleft().result()
    h.update(memoryview(bufs[k % len(bufs)])[:got])
    return got


def digests_parallel(paths: Sequence[Path], threads: int | None = None) -> dict[Path, FileDigest]:
    """Every file's digest, the files read at once (one hashing thread each, up to the pool's
    size; the pool's threads do the reads)."""
    n = threads or default_threads()
    out: dict[Path, FileDigest] = {}
    if not paths:
        return out
    with ThreadPoolExecutor(n, thread_name_prefix="slidetune-ckpt-read") as reads, \
            ThreadPoolExecutor(min(n, len(paths)), thread_name_prefix="slidetune-ckpt-hash") as files:
        futures = {p: files.submit(file_digest_parallel, p, reads) for p in paths}
        for p, f in futures.items():
            out[p] = f.result()
    return out


def run_streams(first: Callable[[], dict], others: Sequence[Callable[[], FileDigest]],
                cancel: threading.Event) -> tuple[dict, list[FileDigest]]:
    """`first()` here and each of `others` in a thread of its own, all at once. The first to fail
    sets `cancel` (the rest stop at their next piece) and its error is raised once all have ended:
    never a StreamCancelled where another stream's error is the cause."""
    if not others:
        return first(), []

    def guarded(stream: Callable[[], FileDigest]) -> Callable[[], FileDigest]:
        def run() -> FileDigest:
            try:
                return stream()
            except BaseException:
                cancel.set()
                raise
        return run
    with ThreadPoolExecutor(len(others), thread_name_prefix="slidetune-checkpoint-optim") as side:
        futures = [side.submit(guarded(stream)) for stream in others]
        try:
            out = first()
        except BaseException as e:
            cancel.set()
            cause = _root_cause(futures)
            if cause is not None and isinstance(e, StreamCancelled):
                raise cause              # another stream's failure is the save's
            raise
        cause = _root_cause(futures)
        if cause is not None:
            raise cause
        return out, [f.result() for f in futures]


def _root_cause(futures: Sequence[Future]) -> BaseException | None:
    """Once every future has ended: the first error that is not a StreamCancelled (the stream
    that failed, not those it stopped), else the first error."""
    errors = [f.exception() for f in futures]
    errors = [e for e in errors if e is not None]
    real = [e for e in errors if not isinstance(e, StreamCancelled)]
    return (real or errors or [None])[0]
