"""telemetry/kernel_classes.py: GPU kernels sorted into classes by their names as torch.profiler
records them on an H100/H200 (cuBLAS, SDPA's flash / efficient / cuDNN kernels, inductor's and
Liger's Triton kernels, aten's elementwise and copy kernels), and a trace's breakdown."""
from __future__ import annotations

import json

import pytest

from slidetune.telemetry.kernel_classes import KERNEL_CLASSES, kernel_breakdown, kernel_class, trace_kernels

NAMES = {
    "gemm": [
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_"
        "kernel__5x_cublas",
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT",
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>("
        "cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8::Params)",
        "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, "
        "false>(cublasLt::cublasSplitKParams<float>, float const*, __nv_bfloat16 const*, __nv_bfloat16*)",
        "triton_tem_fused_mm_0",
    ],
    "attention": [
        "flash_fwd_kernel",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128, "
        "8, 2, 4, 2, false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 8, cutlass::bfloat16_t>>"
        ", true, false, false, false, false, false, false>(pytorch_flash::Flash_bwd_params)",
        "void pytorch_flash::flash_bwd_dot_do_o_kernel<true, Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, "
        "false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 8, cutlass::bfloat16_t>>>"
        "(pytorch_flash::Flash_bwd_params)",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
        "cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0",
        "triton_tem_fused_flex_attention_0",
    ],
    "triton": [
        "triton_poi_fused_mul_0",
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1",
        "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_sum_2",
        "triton_poi_fused__scaled_dot_product_flash_attention_transpose_3",
        "_rms_norm_forward_kernel",
        "_block_rms_norm_backward_kernel",
        "_swiglu_backward_kernel",
        "_triton_rope",
    ],
    "elementwise": [
        "void at::native::vectorized_elementwise_kernel<4, at::native::AUnaryFunctor<float, float, float, "
        "at::native::binary_internal::MulFunctor<float>>, std::array<char*, 2ul>>(int, at::native::AUnaryFunctor<"
        "float, float, float, at::native::binary_internal::MulFunctor<float>>, std::array<char*, 2ul>)",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, "
        "float, float>, unsigned int, float, 4, 4>>(at::native::ReduceOp<float, at::native::MeanOps<float, float, "
        "float, float>, unsigned int, float, 4, 4>)",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
        "at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)",
        "_ZN2at6native13reduce_kernelILi512ELi1EEEvv",          # a name left mangled: not a Triton kernel
    ],
    "copy": [
        "Memcpy DtoH (Device -> Pinned)",
        "Memcpy DtoD (Device -> Device)",
        "Memset (Device)",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
        "::{lambda()#3}::operator()() const::{lambda()#10}::operator()() const::{lambda(c10::BFloat16)#1}, "
        "std::array<char*, 2ul>, 4, TrivialOffsetCalculator<1, unsigned int>, TrivialOffsetCalculator<1, unsigned "
        "int>, at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1>>(int, ...)",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType"
        "<2u>, unsigned int, 4, 64, 64>(at::native::(anonymous namespace)::OpaqueType<2u>*, ...)",
    ],
    "other": [
        "void cub::DeviceRadixSortOnesweepKernel<cub::DeviceRadixSortPolicy<long, long, unsigned int>::Policy800>()",
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
    ],
}


@pytest.mark.parametrize("cls", list(NAMES))
def test_kernel_class_of_real_kernel_names(cls):
    for name in NAMES[cls]:
        assert kernel_class(name) == cls, name


def test_breakdown_of_a_trace(tmp_path):
    """Only the GPU's kernels, copies and memsets count: CPU ops and GPU-side annotations of CPU
    ranges (which span the kernels inside them) do not."""
    gemm, attention, liger = NAMES["gemm"][0], NAMES["attention"][0], NAMES["triton"][4]
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 900.0},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "CompiledFunction", "ts": 0, "dur": 800.0},
        {"ph": "X", "cat": "kernel", "name": gemm, "ts": 10, "dur": 300.0},
        {"ph": "X", "cat": "kernel", "name": gemm, "ts": 320, "dur": 200.0},
        {"ph": "X", "cat": "kernel", "name": attention, "ts": 530, "dur": 150.0},
        {"ph": "X", "cat": "kernel", "name": liger, "ts": 690, "dur": 40.0},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 735, "dur": 2.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 740, "dur": 8.0},
        {"ph": "i", "cat": "kernel", "name": "an instant", "ts": 750},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    kernels = trace_kernels(path)
    assert [n for n, _ in kernels] == [gemm, gemm, attention, liger, "Memset (Device)",
                                       "Memcpy DtoD (Device -> Device)"]
    out = kernel_breakdown(kernels, top=3, name_chars=40)
    assert list(out["classes"]) == list(KERNEL_CLASSES)
    assert out["classes"] == pytest.approx({"gemm": 0.5, "attention": 0.15, "triton": 0.04, "elementwise": 0.0,
                                            "copy": 0.01, "other": 0.0})
    assert out["kernel_ms"] == pytest.approx(0.7)
    assert out["top"] == [{"name": gemm[:40], "class": "gemm", "ms": pytest.approx(0.5), "calls": 2},
                          {"name": attention, "class": "attention", "ms": pytest.approx(0.15), "calls": 1},
                          {"name": liger, "class": "triton", "ms": pytest.approx(0.04), "calls": 1}]
