"""A plain PyTorch training loop over an unchanged HF model with one memory technique applied.

Run as a worker: `python -m slidetune.bench.baselines.hf_train SPEC.json OUT.json` (one
configuration per process, so peaks are clean). SPEC keys (see TechniqueSpec):
  precision  fp32 | bf16      bf16 = torch.autocast(bfloat16) over FP32 weights (the study's AMP)
  attention  eager | sdpa | local   eager = HF's math attention (materializes S x S scores);
                                    sdpa = torch SDPA (flash kernel on CUDA in bf16);
                                    local = ops.attention banded kernel with `window`
  recompute  bool              HF gradient checkpointing (non-reentrant), every decoder layer
  head       full | chunked    full logits + CE, or ops.cross_entropy chunked (no B*S*V logits)
  engine     hf | slide        slide = slidetune's slide engine on the same initial weights
The recipe follows seeds/003: AdamW lr 5e-4, linear warm-up, global-norm clipping 1.0.
Dropout: the Llama-family presets have none (the study used 0.1), stated in the report.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ...device import Device
from ..workload import BenchWorkload, WorkloadSpec


@dataclass
class TechniqueSpec(WorkloadSpec):
    name: str = "fp32"
    # steps: optimizer steps, the warm-up's included (the whole run trains); warmup: the first steps
    # left out of the timing statistics
    workload: BenchWorkload = field(default_factory=lambda: BenchWorkload("study-12x768", batch_size=8, steps=20,
                                                                          lr=5e-4))
    lr_warmup_steps: int = 20       # linear LR warm-up, as in the study
    max_grad_norm: float = 1.0
    precision: str = "fp32"
    attention: str = "eager"
    window: int | None = None
    local_backend: str = "auto"
    recompute: bool = False
    head: str = "full"
    head_chunk_tokens: int = 4096
    engine: str = "hf"
    data: str = "corpus"            # corpus (built-in English, real text) | synthetic (random ids; probes)
    eval: bool = True               # perplexity on the held-out split after training
    eval_batch_size: int = 8
    max_eval_batches: int | None = None
    dataset_path: str | None = None   # save_datasets file (train, heldout, pad_id): tokenized once per scenario
    threads: int | None = None
    device: str = "auto"
    # per-layer spans and memory points per step (telemetry.module_probe for HF models,
    # the engine's own timer for slide): the common per-layer, breakdown and memory plots
    per_layer: bool = False


def _device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda" and dev.index is None:
        # set_per_process_memory_fraction refuses a device without an index
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _data(spec: TechniqueSpec, vocab: int):
    """(train_batch(k) -> Batch, heldout iterator factory). Rows drawn with replacement, so
    any batch size works on the ~1 MB built-in corpus (a 463 x 1024 batch is larger than it)."""
    from ..measure import synthetic_batches
    wl = spec.workload
    if spec.data == "synthetic":
        return (lambda k: synthetic_batches(vocab, wl.batch_size, wl.seq_len, 1, wl.seed * 1000 + k)[0]), None
    from ...data import collate, eval_batches
    if spec.dataset_path:
        train, heldout, pad = load_datasets(spec.dataset_path)
    else:
        train, heldout, pad = corpus_datasets(wl.seq_len, wl.seed)
    if int(train.tokens.max()) >= vocab:
        raise ValueError(f"token ids reach {int(train.tokens.max())}, model vocab {vocab}")

    def batch(k: int):
        g = torch.Generator().manual_seed(wl.seed * 1_000_003 + k)
        rows = torch.randint(0, len(train), (wl.batch_size,), generator=g).tolist()
        return collate(train, rows, pad)
    return batch, (lambda: eval_batches(heldout, spec.eval_batch_size, pad))


def corpus_datasets(seq_len: int, seed: int = 0):
    """(train, heldout, pad_id): the built-in English corpus, embedded SmolLM2 tokenizer."""
    from ...data import DataConfig, build_datasets, default_pad_id
    from ...models.load import embedded_tokenizer
    tok = embedded_tokenizer()
    train, heldout = build_datasets(DataConfig(seq_len=seq_len, seed=seed), tok)
    return train, heldout, default_pad_id(tok)


# ------------------------------------------------------------------ tokenized dataset files
#
# The scenario tokenizes once and every worker process reads the result (the GPU host has no
# tokenizer, so the file is also carried there with --dataset). The file is a safetensors file:
# tensors and a JSON string, nothing that can run code when read (it used to be a torch.save'd
# pickle, which runs arbitrary code from whoever wrote the file). Layout:
#   tensors   "<split>.tokens" int32 [T], "<split>.targets" bool [T], "<split>.starts" int64 [N],
#             "<split>.lengths" int64 [N]   for split in train, heldout (the TokenDataset fields)
#   metadata  "format": DATASET_FORMAT, "version": DATASET_VERSION,
#             "slidetune": JSON {"pad_id": int, "train": {...}, "heldout": {...}} with each split's
#             scalar fields (seq_len, packed, split, source, format, num_examples, ...)

DATASET_SUFFIX = ".safetensors"
DATASET_FORMAT = "slidetune-token-datasets"
DATASET_VERSION = "1"
_SPLITS = ("train", "heldout")
_TENSOR_DTYPES = {"tokens": torch.int32, "targets": torch.bool, "starts": torch.int64, "lengths": torch.int64}
_INFO_TYPES = {"seq_len": int, "packed": bool, "split": str, "source": str, "format": str,
               "num_examples": int, "num_truncated": int, "num_dropped": int}
_REGENERATE = (f"regenerate it: `slidetune bench techniques --dataset NEW{DATASET_SUFFIX} ...` writes the "
               "tokenized corpus to a path that does not exist yet (and reads it on later runs)")


class DatasetFileError(ValueError):
    """A dataset file that is not save_datasets' format (it is refused, never unpickled)."""


def check_dataset_path(path) -> Path:
    """`path` as a Path if it names a dataset file of this format, else DatasetFileError.

    Reads at most 9 bytes and never unpickles: an old torch.save'd file (zip or raw pickle) is
    refused with how to regenerate it."""
    path = Path(path)
    if path.suffix != DATASET_SUFFIX:
        old = path.suffix in (".pt", ".pth", ".pkl", ".pickle", ".bin")
        raise DatasetFileError(
            f"{path}: tokenized dataset files are now {DATASET_SUFFIX} (safetensors); "
            + (f"{path.suffix} files were torch.save'd pickles, which can run arbitrary code when read, "
               "and are no longer loaded; " if old else f"not a {DATASET_SUFFIX} path; ")
            + _REGENERATE)
    if path.exists():
        with open(path, "rb") as f:
            head = f.read(9)
        if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":
            raise DatasetFileError(
                f"{path}: a torch.save'd (pickle) dataset file, the format before {DATASET_SUFFIX}; it is not "
                f"loaded (unpickling can run arbitrary code); {_REGENERATE}")
        if len(head) < 9 or head[8:9] != b"{":
            raise DatasetFileError(f"{path}: not a safetensors file; {_REGENERATE}")
    return path


def save_datasets(path, train, heldout, pad_id: int) -> Path:
    """Write (train, heldout, pad_id) to `path` (a .safetensors file; see the layout above).

    Written to a temporary file and renamed, so a reader never sees a half-written file."""
    from safetensors.torch import save_file
    path = Path(path)
    if path.suffix != DATASET_SUFFIX:
        check_dataset_path(path)          # raises: a pickle-era name (.pt) or another suffix
    tensors: dict[str, torch.Tensor] = {}
    info: dict[str, object] = {"pad_id": int(pad_id)}
    for name, ds in zip(_SPLITS, (train, heldout)):
        for field, dtype in _TENSOR_DTYPES.items():
            # own contiguous storage: safetensors refuses views and tensors sharing memory
            tensors[f"{name}.{field}"] = getattr(ds, field).detach().to("cpu", dtype).contiguous().clone()
        info[name] = {k: t(getattr(ds, k)) for k, t in _INFO_TYPES.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata={"format": DATASET_FORMAT, "version": DATASET_VERSION,
                                               "slidetune": json.dumps(info)})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_datasets(path):
    """(train, heldout, pad_id) from a save_datasets file; DatasetFileError for anything else
    (an old torch.save'd .pt file included, which is refused without being unpickled)."""
    from safetensors import safe_open
    from ...data import TokenDataset
    path = check_dataset_path(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            if meta.get("format") != DATASET_FORMAT:
                raise DatasetFileError(f"{path}: a safetensors file, but not a slidetune dataset file "
                                       f"(metadata format {meta.get('format')!r}); {_REGENERATE}")
            if meta.get("version") != DATASET_VERSION:
                raise DatasetFileError(f"{path}: dataset file version {meta.get('version')!r}, this slidetune "
                                       f"reads {DATASET_VERSION!r}; {_REGENERATE}")
            info = json.loads(meta["slidetune"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except DatasetFileError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt or foreign file: say which and how to fix it
        raise DatasetFileError(f"{path}: cannot read it as a dataset file ({type(e).__name__}: {e}); "
                               f"{_REGENERATE}") from e
    splits = []
    for name in _SPLITS:
        fields = {}
        for field, dtype in _TENSOR_DTYPES.items():
            t = tensors.get(f"{name}.{field}")
            if t is None or t.dtype != dtype or t.dim() != 1:
                raise DatasetFileError(f"{path}: {name}.{field} missing or not a 1-D {dtype} tensor; {_REGENERATE}")
            fields[field] = t
        starts, lengths = fields["starts"], fields["lengths"]
        if (fields["tokens"].numel() != fields["targets"].numel() or starts.numel() != lengths.numel()
                or (starts.numel() and (bool((starts < 0).any()) or bool((lengths < 0).any())
                                        or int((starts + lengths).max()) > fields["tokens"].numel()))):
            raise DatasetFileError(f"{path}: the {name} split's rows do not fit its tokens; {_REGENERATE}")
        try:
            scalars = {k: t(info[name][k]) for k, t in _INFO_TYPES.items()}
        except (KeyError, TypeError, ValueError) as e:
            raise DatasetFileError(f"{path}: the {name} split's metadata is incomplete ({e}); {_REGENERATE}") from e
        splits.append(TokenDataset(**fields, **scalars))
    return splits[0], splits[1], int(info["pad_id"])


def _lr(spec: TechniqueSpec, step: int) -> float:
    if spec.lr_warmup_steps <= 0:
        return spec.workload.lr
    return spec.workload.lr * min(1.0, (step + 1) / spec.lr_warmup_steps)


class _HFRunner:
    def __init__(self, spec: TechniqueSpec, dev: torch.device):
        from transformers import AutoModelForCausalLM
        from ...models.presets import preset_config
        self.spec, self.dev = spec, dev
        config = preset_config(spec.workload.model, spec.workload.num_layers)
        impl = {"eager": "eager", "sdpa": "sdpa", "local": "sdpa"}[spec.attention]
        torch.manual_seed(spec.workload.seed)
        self.model = AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=torch.float32)
        if spec.attention == "local":
            from ...ops.attention import use_local_attention
            if not spec.window:
                raise ValueError("attention=local needs window")
            use_local_attention(self.model, spec.window, spec.local_backend)
        self.model.to(dev).train()
        if spec.recompute:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=spec.workload.lr, weight_decay=0.1,
                                     fused=dev.type == "cuda")
        self.vocab = config.vocab_size
        self.params = sum(p.numel() for p in self.model.parameters())
        self.probe = None
        self.timer = None

    def instrument(self):
        """Per-layer spans and memory points from hooks: (timer, memory, host timeline or None)."""
        from ...telemetry.events import EventTimer
        from ...telemetry.memory_timeline import MemoryTimeline
        from ...telemetry.module_probe import ModuleProbe
        device = Device(self.dev)
        self.timer = EventTimer(device)
        memory = MemoryTimeline(device, enabled=True)
        self.probe = ModuleProbe(self.model.model.layers, self.timer, memory)
        return self.timer, memory, None

    def _autocast(self):
        if self.spec.precision == "bf16":
            return torch.autocast(self.dev.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _loss_sum(self, b) -> torch.Tensor:
        ids, labels = b.input_ids.to(self.dev), b.labels.to(self.dev)
        mask = b.attention_mask.to(self.dev) if b.attention_mask is not None else None
        with self._autocast():
            h = self.model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        timed = self.probe is not None and self.timer.enabled
        head_start = self.timer.mark("head") if timed else None
        loss = self._head(h, labels)
        if timed:
            self.probe.head(h, head_start)
        return loss

    def _head(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.spec.head == "chunked":
            # outside autocast: the op runs its own mixed precision (compute dtype in, fp32 loss)
            from ...ops.cross_entropy import linear_cross_entropy
            dt = torch.bfloat16 if self.spec.precision == "bf16" else torch.float32
            w = self.model.lm_head.weight
            return linear_cross_entropy(h.reshape(-1, h.shape[-1]).to(dt), w.to(dt), labels.reshape(-1),
                                        impl="chunked", chunk_tokens=self.spec.head_chunk_tokens)
        with self._autocast():
            logits = self.model.lm_head(h)                                    # [B, S, V]
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                               ignore_index=-100, reduction="sum")

    def train_step(self, b, lr: float) -> float:
        n = b.num_target_tokens()
        loss = self._loss_sum(b)
        if self.probe is not None:
            self.probe.backward_begin()
        (loss / n).backward()
        if self.probe is not None:
            self.probe.backward_end()
        with self.timer.span("optimizer", -1) if self.timer is not None else contextlib.nullcontext():
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.max_grad_norm)
            for g in self.opt.param_groups:
                g["lr"] = lr
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        if self.probe is not None:
            self.probe.memory.mark("optimizer")
        return float(loss.detach()) / n

    @torch.no_grad()
    def eval_loss(self, b) -> tuple[float, int]:
        return float(self._loss_sum(b)), b.num_target_tokens()

    def close(self):
        pass


class _SlideRunner:
    """slidetune's slide engine, started from the same initial weights as the HF runs."""

    def __init__(self, spec: TechniqueSpec, device: Device):
        from transformers import AutoModelForCausalLM
        from ...engine import AdamWConfig, RuntimeConfig, build_engine
        from ...models.load import LoadedModel, StateDictSource, skeleton
        from ...models.presets import preset_config
        from ...models.units import SplitModel
        config = preset_config(spec.workload.model, spec.workload.num_layers)
        torch.manual_seed(spec.workload.seed)
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        state = {k: v.detach() for k, v in hf.state_dict().items()}
        loaded = LoadedModel(spec.workload.model, SplitModel(skeleton(config)), StateDictSource(state), None)
        dtype = "bf16" if spec.precision == "bf16" else "fp32"
        rt = RuntimeConfig(mode="slide", dtype=dtype, device=device.device.type, head_impl="chunked", cache_units=3,
                           head_chunk_tokens=spec.head_chunk_tokens)
        self.engine = build_engine(loaded, rt, AdamWConfig(lr=spec.workload.lr, weight_decay=0.1), device,
                                   grad_accum=1, max_grad_norm=spec.max_grad_norm)
        del hf, state
        self.vocab = config.vocab_size
        self.params = loaded.split.num_params()

    def instrument(self):
        """The engine's own per-layer timer, memory points and host timeline."""
        from ...telemetry.events import EventTimer
        self.engine.timer = EventTimer(self.engine.device)
        self.engine.memory.enabled = True
        self.engine.timeline.enabled = True
        return self.engine.timer, self.engine.memory, self.engine.timeline

    def train_step(self, b, lr: float) -> float:
        return self.engine.train_step([b], lr).loss

    def eval_loss(self, b) -> tuple[float, int]:
        return self.engine.eval_loss(b)

    def close(self):
        self.engine.close()


def _recorded_steps(recorded: list, walls: list[float], losses: list[float], warmup: int, timer) -> list[dict]:
    """Steps in bench.measure's form: spans (recompute taken out of backward), memory points, host time."""
    from ...telemetry.host_timeline import summarize
    from ...telemetry.module_probe import step_spans
    steps = []
    for k, ((cut, mem, host_spans, t0, t1), wall, loss) in enumerate(zip(recorded, walls, losses)):
        steps.append({"step": k, "warmup": k < warmup, "wall_s": wall, "loss": loss,
                      "spans": step_spans(timer.resolve(cut)),
                      "memory": [p.row() for p in mem],
                      "host_s": summarize(host_spans, t0, t1) if host_spans else {}, "overlap": {}})
    return steps


def run_technique(spec_dict: dict) -> dict:
    from ...telemetry.machine import machine_info, peak_rss_bytes
    spec = TechniqueSpec.from_dict(spec_dict)
    wl = spec.workload
    if spec.threads:
        torch.set_num_threads(spec.threads)
    device = None
    if spec.engine == "slide":
        # Device.resolve before anything opens the CUDA context: it asks for host waits that
        # sleep, so slide's host AdamW does not share its cores with spinning waits
        device = Device.resolve(spec.device)
    dev = device.device if device is not None else _device(spec.device)
    if dev.type == "cuda" and wl.gpu_memory_limit_gib:
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, wl.gpu_memory_limit_gib * 2**30 / total), dev)
    result: dict = {"spec": spec.to_dict(), "machine": machine_info(),
                    "cuda_context_waits": device.context_waits if device is not None else "n/a"}
    runner = _SlideRunner(spec, device) if device is not None else _HFRunner(spec, dev)
    result["params"] = runner.params
    batch_fn, heldout = _data(spec, runner.vocab)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    walls, losses = [], []
    timer, memory, timeline = runner.instrument() if spec.per_layer else (None, None, None)
    recorded = []                 # per step: (unresolved spans, memory points, host spans, start, end)
    prev_end = None
    try:
        for k in range(wl.steps):
            b = batch_fn(k)
            if k == wl.warmup and dev.type == "cuda":
                sync()
                torch.cuda.reset_peak_memory_stats(dev)
            t = time.perf_counter()
            loss = runner.train_step(b, _lr(spec, k))
            sync()                                   # once per step: whole-step wall time
            end = time.perf_counter()
            # from the previous step's end: the slide engine's host updates run on after its
            # call returns (cuda synchronize does not wait for them), so the call alone under-reads
            start = t if prev_end is None else prev_end
            walls.append(end - start)
            if timer is not None:
                recorded.append((timer.cut(), memory.take(), timeline.take() if timeline is not None else [],
                                 start, end))
            prev_end = end
            losses.append(loss)
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {k}")
        if dev.type == "cuda":
            result["gpu_peak_alloc_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
            result["gpu_peak_reserved_gib"] = torch.cuda.max_memory_reserved(dev) / 2**30
        else:
            result["gpu_peak_alloc_gib"] = result["gpu_peak_reserved_gib"] = None
        result["cpu_peak_rss_gib"] = peak_rss_bytes() / 2**30
        if timer is not None:
            timer.enabled = memory.enabled = False          # the held-out evaluation is not a step
            result["steps"] = _recorded_steps(recorded, walls, losses, wl.warmup, timer)
        measured = walls[wl.warmup:] or walls
        result["step_s"] = walls
        result["loss"] = losses
        result["step_s_mean"] = statistics.mean(measured)
        result["step_s_std"] = statistics.stdev(measured) if len(measured) > 1 else 0.0
        result["tokens_per_s"] = wl.batch_size * wl.seq_len / result["step_s_mean"]
        result["final_loss"] = losses[-1]
        if spec.eval and heldout is not None:
            tot, n = 0.0, 0
            for i, eb in enumerate(heldout()):
                if spec.max_eval_batches is not None and i >= spec.max_eval_batches:
                    break
                s, c = runner.eval_loss(eb)
                tot, n = tot + s, n + c
            result["heldout_tokens"] = n
            result["perplexity"] = math.exp(tot / max(n, 1))
        result["status"] = "ok"
    finally:
        runner.close()
    return result


if __name__ == "__main__":
    import sys
    from .proc import worker_main
    sys.exit(worker_main(run_technique))
