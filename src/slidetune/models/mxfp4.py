"""MXFP4 experts (the published gpt-oss checkpoints), dequantized on the host at load.

gpt-oss's `config.json` carries `quantization_config: {quant_method: "mxfp4", ...}` and its
safetensors store each expert matrix `X` (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) as

    X_blocks  uint8 [E, R, G, 16]   two FP4 (e2m1) codes a byte, low nibble first: 32 values a block
    X_scales  uint8 [E, R, G]       the block's power-of-two scale, e8m0 (exponent + 127)

with R the matrix's output rows and G * 32 its input width; the model's tensor is the decoded
[E, R, G * 32] transposed to [E, G * 32, R] (gate_up_proj [E, H, 2I], down_proj [E, I, H]). The
rest of the checkpoint (attention, routers, the experts' biases, embeddings) is plain BF16.

slidetune trains every weight in FP32 masters, so each packed matrix is decoded when its unit is
built, with transformers' own `convert_moe_packed_tensors` (integrations/mxfp4.py: a lookup table
and `ldexp`, plain PyTorch, no Triton; tests/test_mxfp4.py checks it against transformers'
from_pretrained of the same directory). The decoded values are exact in BF16 (an FP4 value has two
significant bits) and so in the FP32 masters. final/ is written in BF16 (save_dtype auto) and in
the unquantized layout transformers' save_pretrained writes for gpt-oss (`X` whole, no
`quantization_config`): training moves the weights off the MXFP4 grid, so re-packing would lose
the fine-tune. Any other quantization method is refused by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig

QUANT_METHOD = "mxfp4"
_ROWS_PER_CHUNK = 1 << 20      # blocks decoded at a time: the code indices take 4 B x 16 per block


@dataclass(frozen=True)
class PackedTensor:
    """A model tensor the checkpoint holds as MXFP4 blocks and scales."""
    target: str      # the model's name, e.g. "model.layers.0.mlp.experts.gate_up_proj"
    blocks: str      # its checkpoint keys: target + "_blocks" / "_scales"
    scales: str


def quant_method(config: PretrainedConfig) -> str | None:
    """The checkpoint's quantization method (config.json's quantization_config), or None."""
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    return str(getattr(method, "value", method))


def accept_quantization(config: PretrainedConfig, directory: Path) -> str | None:
    """For a directory's config: None when unquantized; for MXFP4, drop the quantization from the
    config (the model is trained and saved unquantized, in BF16) and return the note to print at
    load; any other method refused, naming the file and the method."""
    method = quant_method(config)
    if method is None:
        return None
    if method != QUANT_METHOD:
        raise ValueError(f"{directory / 'config.json'}: quantization_config has quant_method {method!r}; slidetune "
                         f"loads unquantized safetensors and MXFP4 experts (gpt-oss) only. Dequantize the "
                         f"checkpoint first (transformers: from_pretrained(..., dtype=torch.bfloat16) and "
                         f"save_pretrained)")
    del config.quantization_config
    config.dtype = torch.bfloat16          # what the unquantized tensors are; save_dtype auto follows it
    return (f"note: {directory}: the experts are stored in MXFP4 ({QUANT_METHOD}); they are dequantized on the "
            f"host at load (exact in the FP32 masters), and final/ is written in BF16, unquantized")


def find_packed(name: str, weight_map: dict[str, str]) -> PackedTensor | None:
    """`name`'s MXFP4 pair in the checkpoint's keys, or None."""
    blocks, scales = f"{name}_blocks", f"{name}_scales"
    if blocks in weight_map and scales in weight_map:
        return PackedTensor(name, blocks, scales)
    return None


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, key: str,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks uint8 [E, R, G, 16], scales uint8 [E, R, G] -> the model's tensor [E, G * 32, R]."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{key}: MXFP4 blocks and scales are uint8, not {blocks.dtype} / {scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"{key}: MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair "
                         f"(blocks [E, R, G, 16], scales [E, R, G])")
    return convert_moe_packed_tensors(blocks, scales, dtype=dtype, rows_per_chunk=_ROWS_PER_CHUNK)
