"""Split a HF decoder-only model into sliding units: embedding, decoder layers, head.

The model itself is never modified: it is built on the `meta` device as a
skeleton, and each unit's computation runs the skeleton's own modules through
`torch.func.functional_call` with parameter tensors supplied by the engine (views
of a flat buffer on the compute device), and a decoder layer's constant buffers (MoE
routers' correction biases: buffers.py) beside them. What the decoder layers receive besides
the hidden states (attention masks per layer type, rotary embeddings, position
ids) is recorded by running the base model's own forward with the layers
replaced by recorders, so every family's mask and rotary logic is HF's own.
What the family's forward computes between the units (embedding multiplier, logit
scaling and softcapping) is applied here too: see `transforms.py`; what it hands the layers
beside hidden_states from the tokens or from other layers (Gemma 4's per-layer inputs and
shared K/V) is `layer_sides.py`'s.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F
from torch.func import functional_call

from ..ops.cross_entropy import RowNorm, linear_cross_entropy, linear_cross_entropy_grads, linear_token_losses
from .buffers import BufferSlot, DeviceBuffers, non_persistent_buffers, unit_buffer_slots
from .layer_sides import LayerSides, SharedKV
from .transforms import ModelTransforms, model_transforms


class UnsupportedModelError(ValueError):
    pass


@dataclass
class ParamSlot:
    """Where one parameter lives inside its unit's flat buffer."""

    local_name: str        # name relative to the unit's module (e.g. "self_attn.q_proj.weight")
    full_name: str         # name in the HF state dict (e.g. "model.layers.3.self_attn.q_proj.weight")
    shape: tuple[int, ...]
    offset: int            # element offset in the unit's flat buffer
    decay: bool            # weight decay applies (matrices); not to norms and biases

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class UnitSpec:
    """One sliding unit: a module of the skeleton and the layout of its parameters."""

    name: str              # "embed", "layer.{i}", "head"
    kind: str              # "embed" | "layer" | "head"
    index: int             # position in the unit list (embed = 0, layers 1..L, head = L+1)
    module: nn.Module      # skeleton module (meta); the head's is a container of norm and lm_head
    params: list[ParamSlot] = field(default_factory=list)
    numel: int = 0
    n_decay: int = 0       # params[:k] with decay occupy flat[:n_decay]; the rest follow
    # constant buffers read beside the parameters, never in the flat buffer (buffers.py: MoE
    # routers' score-correction biases); decoder layers only
    buffers: list[BufferSlot] = field(default_factory=list)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parameter views (local names) of a flat buffer laid out like this unit."""
        return {p.local_name: flat[p.offset:p.offset + p.numel].view(p.shape) for p in self.params}

    def signature(self) -> tuple:
        return tuple((p.local_name, p.shape) for p in self.params)


class LayerKwargs(list):
    """One micro-batch's kwargs of each decoder layer (a list of dicts), and its side inputs the
    units compute (layer_sides.LayerSides: Gemma 4's per-layer inputs and KV store; None for every
    other family), set by SplitModel.attach_sides after the embedding."""

    sides: LayerSides | None = None


# Gemma 4's per-layer input modules on the base model (E2B / E4B): parameters of the embedding unit
_PER_LAYER_MODULES = ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm")


class _HeadModule(nn.Module):
    """Groups the final norm with an untied lm_head so the head is one unit."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module | None):
        super().__init__()
        self.norm = norm
        if lm_head is not None:
            self.lm_head = lm_head


class _LayerRecorder(nn.Module):
    """Replaces a decoder layer for one call of the base model: records its kwargs. A positional
    extra is recorded under its name in the layer's forward (Gemma 4 passes `per_layer_input`
    positionally) when it is None; a tensor there would be computed outside the layers from the
    tokens, which the stand-in embeddings cannot give, so it refuses (Gemma 4's per-layer inputs are
    switched off for the recording and computed by the units: SplitModel.attach_sides)."""

    def __init__(self, sink: list, layer: nn.Module):
        super().__init__()
        self.sink = sink
        params = inspect.signature(layer.forward).parameters.values()
        self.names = [q.name for q in params if q.kind is q.POSITIONAL_OR_KEYWORD][1:]   # after hidden_states

    def forward(self, hidden_states, *args, **kwargs):
        for name, value in zip(self.names, args, strict=False):
            if value is not None or name in kwargs:
                raise UnsupportedModelError(
                    f"decoder layers are called with the positional extra {name!r} = {type(value).__name__}; "
                    f"slidetune carries keyword arguments besides hidden_states, made once per micro-batch")
            kwargs[name] = value
        if len(args) > len(self.names):
            raise UnsupportedModelError("decoder layers are called with more positional extras than they name")
        self.sink.append(kwargs)
        return hidden_states


class _NoSharedKV(dict):
    """Stands for Gemma 4's `shared_kv_states` in the recorded kwargs of a model without KV-shared
    layers (`num_kv_shared_layers` 0). transformers' layers store their keys and values there for
    the KV-shared layers at the end of the stack to read (the last layer of each attention type
    stores, shared layers or not); with none to read them a store is dropped: kept, it would hold a
    micro-batch's K/V, and the autograd graph behind them, as long as the kwargs live. With
    KV-shared layers the store is a real one (layer_sides.SharedKV)."""

    def __setitem__(self, key, value) -> None:
        pass

    def __getitem__(self, key):
        raise UnsupportedModelError(f"a decoder layer reads another layer's keys and values ({key!r}: "
                                    f"KV sharing); the sliding units run each layer on its own")


def _layout(unit: UnitSpec, named: list[tuple[str, str, nn.Parameter]]) -> None:
    """Decayed matrices first, then norms/biases: each group is one contiguous range. Biases are not
    decayed whatever their shape (gpt-oss's experts' [E, 2I] / [E, H] biases: HF's Trainer decays no
    name holding "bias"); every other tensor of 2 or more dims is."""
    def decays(local: str, p: nn.Parameter) -> bool:
        return p.dim() >= 2 and "bias" not in local.lower()
    decay = [(l, f, p) for l, f, p in named if decays(l, p)]
    rest = [(l, f, p) for l, f, p in named if not decays(l, p)]
    offset = 0
    for group, is_decay in ((decay, True), (rest, False)):
        for local, full, p in group:
            unit.params.append(ParamSlot(local, full, tuple(p.shape), offset, is_decay))
            offset += p.numel()
        if is_decay:
            unit.n_decay = offset
    unit.numel = offset


class SplitModel:
    """A HF causal LM skeleton split into units, with the per-unit compute functions."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = model.config
        if getattr(self.config, "is_heterogeneous", False):
            # transformers' per_layer_config (Gemma 4: the full layers' head_dim and KV heads) makes
            # reading those fields on the model's config raise; the layers read their own. slidetune's
            # shape readers (fit, FLOPs) get the global value, the sliding layers' (the writer leaves
            # this flag out of config.json)
            self.config.allow_global_per_layer_attribute_access = True
        self.transforms: ModelTransforms = model_transforms(self.config)
        base = self._find_base(model)
        self.base = base
        layers = getattr(base, "layers", None)
        if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
            raise UnsupportedModelError(
                f"{type(model).__name__}: could not find the decoder layer stack "
                f"(expected an nn.ModuleList at {type(base).__name__}.layers)")
        embed = model.get_input_embeddings()
        if not isinstance(embed, nn.Embedding):
            raise UnsupportedModelError(f"{type(model).__name__}: input embeddings are "
                                        f"{type(embed).__name__}, expected nn.Embedding")
        norm = getattr(base, "norm", None)
        if norm is None:
            raise UnsupportedModelError(f"{type(model).__name__}: could not find the final norm "
                                        f"(expected {type(base).__name__}.norm)")
        lm_head = model.get_output_embeddings()
        if lm_head is None or not isinstance(lm_head, nn.Linear):
            raise UnsupportedModelError(f"{type(model).__name__}: could not find an nn.Linear lm_head")
        self.tied = bool(getattr(self.config, "tie_word_embeddings", False))
        names: dict[int, str] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), n)      # a tied weight keeps its first name (the embedding's)
        buffer_names = {id(b): n for n, b in model.named_buffers(remove_duplicate=False)}
        self.embed_module = embed
        self.norm_module = norm
        self.lm_head_module = lm_head
        self.layer_modules = list(layers)

        def full(module: nn.Module, local: str) -> str:
            return names[id(dict(module.named_parameters())[local])]

        self.units: list[UnitSpec] = []
        eu = UnitSpec("embed", "embed", 0, embed)
        # Gemma 4's per-layer inputs are computed from the tokens and the embeddings: their
        # parameters are the embedding unit's, after the embedding's own (layer_sides.py)
        self.per_layer_modules: dict[str, nn.Module] = \
            {n: getattr(base, n) for n in _PER_LAYER_MODULES} if getattr(base, "hidden_size_per_layer_input", 0) else {}
        self._embed_names = [n for n, _ in embed.named_parameters()]
        named = [(n, full(embed, n), p) for n, p in embed.named_parameters()]
        for prefix, module in self.per_layer_modules.items():
            named += [(f"{prefix}.{n}", full(module, n), p) for n, p in module.named_parameters()]
        _layout(eu, named)
        self.units.append(eu)
        # Gemma 4's KV-shared layers read an earlier layer's K/V (layer_sides.SharedKV)
        self.kv_sharing = bool(getattr(self.config, "num_kv_shared_layers", 0))
        for i, layer in enumerate(self.layer_modules):
            lu = UnitSpec(f"layer.{i}", "layer", i + 1, layer)
            _layout(lu, [(n, full(layer, n), p) for n, p in layer.named_parameters()])
            lu.buffers = unit_buffer_slots(model, layer, buffer_names)
            self.units.append(lu)
        head = _HeadModule(norm, None if self.tied else lm_head)
        hu = UnitSpec("head", "head", len(self.units), head)
        named = [("norm." + n, full(norm, n), p) for n, p in norm.named_parameters()]
        if not self.tied:
            named += [("lm_head." + n, full(lm_head, n), p) for n, p in lm_head.named_parameters()]
        _layout(hu, named)
        self.units.append(hu)
        if self.transforms.norm_embeddings and any(True for _ in norm.parameters()):
            raise UnsupportedModelError(f"{type(model).__name__}: the final norm also runs on the embeddings, "
                                        f"and it has parameters (they would belong to two units)")
        self._check_buffers()
        self.layer_buffers = DeviceBuffers([u.buffers for u in self.layer_units])
        self._rotary_cache: dict = {}
        self._buffer_cache: dict = {}

    @staticmethod
    def _find_base(model: nn.Module) -> nn.Module:
        for attr in ("model", "transformer", "decoder"):
            base = getattr(model, attr, None)
            if isinstance(base, nn.Module) and hasattr(base, "layers"):
                return base
        raise UnsupportedModelError(
            f"{type(model).__name__}: could not find the base decoder model (looked for .model, "
            f".transformer, .decoder with a .layers stack)")

    def _check_buffers(self) -> None:
        """Buffers are not in the flat parameter buffers. The embedding's `embed_scale` (Gemma's
        sqrt(hidden) normalizer) is rebuilt from its scalar, and a decoder layer's persistent
        buffers travel beside its parameters (buffers.py); any other buffer would be a meta tensor
        at run time, so it refuses here."""
        for unit in self.units:
            carried = {b.local_name for b in unit.buffers}
            for name, _ in unit.module.named_buffers():
                if unit.kind == "embed" and name == "embed_scale" and hasattr(unit.module, "scalar_embed_scale"):
                    continue
                if name in carried:
                    continue
                what = "a non-persistent buffer (HF recomputes it)" if name in non_persistent_buffers(unit.module) \
                    else "a buffer"
                raise UnsupportedModelError(
                    f"{type(self.model).__name__}: unit {unit.name} has {what} {name!r}, which the "
                    f"sliding units do not carry (only parameters and decoder layers' persistent buffers slide)")

    # ---- constant buffers (buffers.py) -----------------------------------------
    def named_buffers(self):
        """(HF name, FP32 host value) of every buffer the units carry, in unit order."""
        for unit in self.units:
            for b in unit.buffers:
                yield b.full_name, b.value

    def set_buffers(self, values) -> None:
        """Every carried buffer from `values` (HF name -> tensor: a checkpoint's or a source's)."""
        with torch.no_grad():
            for unit in self.units:
                for b in unit.buffers:
                    t = values[b.full_name]
                    if tuple(t.shape) != b.shape:
                        raise ValueError(f"{b.full_name}: shape {tuple(t.shape)}, the model expects {b.shape}")
                    b.value.copy_(t)
        self.layer_buffers.forget()

    def _embed_buffers(self, device: torch.device, module: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """The embedding's `embed_scale` buffer (or `module`'s: Gemma 4's per-layer embedding) on `device`."""
        module = self.embed_module if module is None else module
        if not hasattr(module, "scalar_embed_scale"):
            return {}
        key = (device, id(module))
        if key not in self._buffer_cache:
            # HF keeps it as a float32 0-dim buffer and casts it to the weight's dtype in forward
            self._buffer_cache[key] = {"embed_scale": torch.tensor(
                float(module.scalar_embed_scale), dtype=torch.float32, device=device)}
        return self._buffer_cache[key]

    # ---- shapes -------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layer_modules)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def layer_units(self) -> list[UnitSpec]:
        return self.units[1:-1]

    @property
    def embed_unit(self) -> UnitSpec:
        return self.units[0]

    @property
    def head_unit(self) -> UnitSpec:
        return self.units[-1]

    def num_params(self) -> int:
        return sum(u.numel for u in self.units)

    # ---- per micro-batch layer inputs ----------------------------------------
    def layer_kwargs(self, batch_size: int, seq_len: int, dtype: torch.dtype, device: torch.device,
                     attention_mask: torch.Tensor | None = None,
                     position_ids: torch.Tensor | None = None) -> LayerKwargs:
        """What each decoder layer receives besides hidden_states, from the base model's own forward
        (what the units compute, Gemma 4's per-layer inputs, follows the embedding: attach_sides)."""
        rotary = self._rotary(device)
        # A zero-stride stand-in for the embeddings: the mask and rotary code read only
        # its shape, dtype and device, so it costs no memory.
        stand_in = torch.zeros((), dtype=dtype, device=device).expand(batch_size, seq_len, self.hidden_size)
        sink = LayerKwargs()
        saved = (self.base.layers, self.base.norm, getattr(self.base, "rotary_emb", None))
        try:
            self.base.layers = nn.ModuleList([_LayerRecorder(sink, m) for m in self.layer_modules])
            self.base.norm = nn.Identity()
            if rotary is not None:
                self.base.rotary_emb = rotary
            if self.per_layer_modules:
                # the per-layer inputs need the tokens (the stand-in has none): the units compute them
                # (attach_sides); the layers are recorded with per_layer_input None
                self.base.hidden_size_per_layer_input = 0
            with torch.no_grad():
                self.base(inputs_embeds=stand_in, attention_mask=attention_mask,
                          position_ids=position_ids, use_cache=False)
        finally:
            self.base.layers, self.base.norm = saved[0], saved[1]
            if saved[2] is not None:
                self.base.rotary_emb = saved[2]
            if self.per_layer_modules:
                self.base.hidden_size_per_layer_input = self.config.hidden_size_per_layer_input
        if len(sink) != self.num_layers:
            raise UnsupportedModelError(f"base model called {len(sink)} of {self.num_layers} layers")
        store = SharedKV() if self.kv_sharing else None          # one per micro-batch, its layers' own
        for kwargs in sink:
            if "shared_kv_states" in kwargs:
                kwargs["shared_kv_states"] = store if store is not None else _NoSharedKV()
        return sink

    def attach_sides(self, kwargs: LayerKwargs, embed_params: dict[str, torch.Tensor], input_ids: torch.Tensor,
                     embeddings: torch.Tensor) -> LayerSides | None:
        """A micro-batch's side inputs (layer_sides.py) into its layers' kwargs, after the embedding:
        layer i's per-layer input, the slice [B, S, D_pl] of per_layer_inputs. Sets and returns
        kwargs.sides; None (nothing to carry) for every family but Gemma 4 E2B / E4B."""
        per_layer = self.per_layer_inputs(embed_params, input_ids, embeddings) if self.per_layer_modules else None
        store = kwargs[0].get("shared_kv_states") if self.kv_sharing else None
        if per_layer is None and store is None:
            return None
        if per_layer is not None:
            for i, kw in enumerate(kwargs):
                kw["per_layer_input"] = per_layer[:, :, i]                        # [B, S, D_pl]
        kwargs.sides = LayerSides(per_layer, store)
        return kwargs.sides

    def per_layer_inputs(self, params: dict[str, torch.Tensor], input_ids: torch.Tensor,
                         embeddings: torch.Tensor) -> torch.Tensor:
        """Gemma 4's per-layer inputs [B, S, L, D_pl] on the embedding unit's parameters, as
        transformers' get_per_layer_inputs and project_per_layer_inputs compute them: the tokens'
        per-layer embedding plus the normed projection of the embeddings [B, S, d], over sqrt(2)."""
        base, (b, s) = self.base, input_ids.shape
        shape = (b, s, self.num_layers, int(self.config.hidden_size_per_layer_input))

        def run(name: str, x: torch.Tensor, extra: dict | None = None) -> torch.Tensor:
            module = self.per_layer_modules[name]
            tensors = {n: params[f"{name}.{n}"] for n, _ in module.named_parameters()}
            return functional_call(module, {**tensors, **(extra or {})}, (x,))
        tokens = run("embed_tokens_per_layer", input_ids,
                     self._embed_buffers(input_ids.device, self.per_layer_modules["embed_tokens_per_layer"]))
        projected = run("per_layer_model_projection", embeddings) * base.per_layer_model_projection_scale
        projected = run("per_layer_projection_norm", projected.reshape(shape))
        return (projected + tokens.reshape(shape)) * base.per_layer_input_scale

    def _rotary(self, device: torch.device) -> nn.Module | None:
        skeleton = getattr(self.base, "rotary_emb", None)
        if skeleton is None:
            return None
        if device not in self._rotary_cache:
            self._rotary_cache[device] = type(skeleton)(config=self.config).to(device)
        return self._rotary_cache[device]

    # ---- unit computations ----------------------------------------------------
    def embed_forward(self, params: dict[str, torch.Tensor], input_ids: torch.Tensor) -> torch.Tensor:
        tensors = {**{n: params[n] for n in self._embed_names}, **self._embed_buffers(input_ids.device)}
        x = functional_call(self.embed_module, tensors, (input_ids,))            # [B, S, d]
        if self.transforms.embed_multiplier != 1.0:
            x = x * self.transforms.embed_multiplier      # as the base model's forward does (Granite)
        if self.transforms.norm_embeddings:
            x = self.norm_module(x)                       # parameter-free (checked at init): NanoChat
        return x

    def embed_grads(self, params: dict[str, torch.Tensor], input_ids: torch.Tensor, grad: torch.Tensor,
                    sides: LayerSides | None = None) -> tuple[torch.Tensor, ...]:
        """The embedding unit's gradients, one per entry of `params` (autograd leaves), against `grad`
        [B, S, d] reaching the embeddings and, with Gemma 4's per-layer inputs, the layers' gradients
        of them (sides.per_layer_grad [B, S, L, D_pl])."""
        with torch.enable_grad():
            e = self.embed_forward(params, input_ids)                                 # [B, S, d]
            outs, grads = [e], [grad]
            if sides is not None and sides.per_layer_grad is not None:
                outs.append(self.per_layer_inputs(params, input_ids, e))
                grads.append(sides.per_layer_grad)
            return torch.autograd.grad(outs, list(params.values()), grads, materialize_grads=True)

    def layer_forward(self, i: int, params: dict[str, torch.Tensor], hidden: torch.Tensor,
                      kwargs: dict) -> torch.Tensor:
        return run_layer(self.layer_modules[i], params, hidden, kwargs,
                         self.layer_buffers.of(i, hidden.device, hidden.dtype))

    def layer_template(self, i: int) -> nn.Module:
        """The first decoder layer built like layer i: same class and the same attention
        attributes (type, sliding window) and the same parameters and buffers (an MoE family's
        dense first layers are the same class as its MoE layers), so running layer i's parameters
        through it is running layer i. A compiled layer forward keyed on the template compiles
        once per kind of layer instead of once per layer."""
        def kind(j: int):
            m, unit = self.layer_modules[j], self.layer_units[j]
            attn = getattr(m, "self_attn", None)
            # Gemma 4 with KV sharing: a producer (stores its K/V) or a shared layer (reads them)
            sharing = (getattr(attn, "store_full_length_kv", None), getattr(attn, "is_kv_shared_layer", None)) \
                if self.kv_sharing else None
            return (type(m), getattr(m, "attention_type", None), getattr(attn, "sliding_window", None),
                    getattr(attn, "is_causal", None), sharing, unit.signature(),
                    tuple((b.local_name, b.shape, b.keep_fp32) for b in unit.buffers))
        want = kind(i)
        return self.layer_modules[next(j for j in range(self.num_layers) if kind(j) == want)]

    def head_loss(self, params: dict[str, torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor,
                  lm_weight: torch.Tensor | None = None, impl: str = "chunked",
                  chunk_tokens: int = 4096) -> torch.Tensor:
        """Sum of token losses. `lm_weight` is the tied embedding when the head has no weight of its own."""
        norm, weight, bias = self._head_parts(params, lm_weight)
        return linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1),
                                    impl=impl, chunk_tokens=chunk_tokens, bias=bias,
                                    transform=self.transforms.logits, norm=norm)

    def head_loss_and_grads(self, params: dict[str, torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor,
                            scale: float | torch.Tensor, lm_weight: torch.Tensor | None = None, impl: str = "chunked",
                            chunk_tokens: int = 4096) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(the summed loss, d(scale * loss)/d hidden [B, S, d], {parameter name: its gradient}) without
        an autograd graph (ops.cross_entropy.linear_cross_entropy_grads: the chunked heads scale their
        gradients in place). A tied head's weight gradient is under "lm_head.weight". `scale` may be a
        tensor [N] of each token's factor (a preference objective's second pass)."""
        norm, weight, bias = self._head_parts(params, lm_weight)
        loss, g_h, g_w, g_b, g_n = linear_cross_entropy_grads(
            hidden, weight, labels, scale, impl=impl, chunk_tokens=chunk_tokens, bias=bias,
            transform=self.transforms.logits, norm=norm)
        grads = {f"norm.{k}": g for k, g in g_n.items()}
        grads["lm_head.weight"] = g_w
        if g_b is not None:
            grads["lm_head.bias"] = g_b
        return loss, g_h, grads

    def head_token_losses(self, params: dict[str, torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor,
                          lm_weight: torch.Tensor | None = None, impl: str = "chunked",
                          chunk_tokens: int = 4096) -> torch.Tensor:
        """Each token's loss [N] (0 where ignored), the forward alone (ops.cross_entropy.
        linear_token_losses): a preference objective's first pass over the head."""
        norm, weight, bias = self._head_parts(params, lm_weight)
        return linear_token_losses(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), impl=impl,
                                   chunk_tokens=chunk_tokens, bias=bias, transform=self.transforms.logits, norm=norm)

    def head_logits(self, params: dict[str, torch.Tensor], hidden: torch.Tensor,
                    lm_weight: torch.Tensor | None = None) -> torch.Tensor:
        """The next-token logits of a few positions, as the loss sees them (final norm, output layer,
        the family's logit transform): hidden [N, d] -> [N, V] float32 (float64 in float64). For generation (N small:
        the whole [N, V] is made at once, unlike the chunked loss)."""
        norm, weight, bias = self._head_parts(params, lm_weight)
        logits = F.linear(norm.fn(hidden, norm.params), weight, bias)        # [N, V] compute dtype
        return self.transforms.logits.apply(logits.to(torch.promote_types(logits.dtype, torch.float32)))

    def _head_parts(self, params: dict[str, torch.Tensor], lm_weight: torch.Tensor | None
                    ) -> tuple[RowNorm, torch.Tensor, torch.Tensor | None]:
        """(the final norm, the output weight [V, d], its bias or None) of the head's parameters. The
        norm runs inside the head's chunks (ops/cross_entropy.py: nothing N-sized kept but the input
        gradient); each row is normed on its own, so the values are the module's."""
        norm_params = {k[len("norm."):]: v for k, v in params.items() if k.startswith("norm.")}
        weight = lm_weight if self.tied else params["lm_head.weight"]
        bias = None if self.tied else params.get("lm_head.bias")
        return RowNorm(self._final_norm, norm_params), weight, bias

    def _final_norm(self, x: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """The model's final norm on the given parameters: [..., d] -> [..., d]."""
        return functional_call(self.norm_module, params, (x,))


def run_layer(module: nn.Module, params: dict[str, torch.Tensor], hidden: torch.Tensor, kwargs: dict,
              buffers: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """One decoder layer on the given parameters and constant buffers (functional_call):
    [B, S, d] -> [B, S, d]. The buffers are merged here, so `params` stays what a backward
    differentiates."""
    out = functional_call(module, {**params, **buffers} if buffers else params, (hidden,), kwargs)
    return out[0] if isinstance(out, tuple) else out
