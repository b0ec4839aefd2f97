// GELU with the tanh approximation, gelu(x, approximate="tanh"), bit-exact to PyTorch eager.
//
// Eager (FLUX.1: diffusers' GELU(approximate="tanh") in the double block's feed-forward,
// nn.GELU(approximate="tanh") in the single block) runs one aten kernel, GeluCUDAKernelImpl
// (ActivationGeluKernel.cu), in fp32 opmath:
//   kBeta  = float(M_SQRT2 * M_2_SQRTPI * 0.5)        the double product rounded once: 0x3F4C422A
//   kKappa = float(0.044715)                          0x3D372713
//   cube   = RN(RN(x * x) * x)
//   inner  = RN(kBeta * fma(kKappa, cube, x))         aten's x + kKappa * cube, contracted (inner_arg)
//   out    = T(RN(RN(0.5 * x) * RN(1 + tanhf(inner))))
// (docs/numerics.md). Every step is written with an explicit-rounding intrinsic, so nvcc contracts
// nothing but what inner_arg says. No --use_fast_math: tanhf must be the accurate one aten calls
// (c10::cuda::compat::tanh is ::tanhf), not tanh.approx.
//
// The row walk is every row-wise kernel's (rowwise.cuh): one block of 256 threads a row, x's row
// holding one operand. In FLUX.1's single block the activation is written straight into the second
// half of the buffer the output projection reads, so the eager cat disappears too.
#pragma once

#include "rowwise.cuh"

namespace flux2_fused {
namespace gelu_tanh {

// aten's constants: a double expression (math.h's M_SQRT2 and M_2_SQRTPI literals) narrowed once
// to float, and a double literal narrowed to float.
constexpr float kBeta = 1.41421356237309504880 * 1.12837916709551257390 * 0.5f;
constexpr float kKappa = 0.044715;
static_assert(kBeta == 0x1.988454p-1f, "kBeta must be aten's float(M_SQRT2 * M_2_SQRTPI * 0.5), 0x3F4C422A");
static_assert(kKappa == 0x1.6e4e26p-5f, "kKappa must be aten's float(0.044715), 0x3D372713");

// aten's `x + kKappa * x_cube`, the formula's one product feeding an add. aten is built with nvcc's
// default --fmad=true, which contracts it to one FMA, so the kernel writes the FMA; the alternative
// (no contraction) is __fadd_rn(x, __fmul_rn(kKappa, cube)). The exhaustive self-check (every 16-bit
// input) proves the choice on each device.
__device__ __forceinline__ float inner_arg(float x, float cube) { return __fmaf_rn(kKappa, cube, x); }

// gelu(x, approximate="tanh") for one element before its final rounding to T.
__device__ __forceinline__ float gelu(float x) {
  const float cube = __fmul_rn(__fmul_rn(x, x), x);
  const float inner = __fmul_rn(kBeta, inner_arg(x, cube));
  return __fmul_rn(__fmul_rn(0.5f, x), __fadd_rn(1.0f, tanhf(inner)));
}

template <typename T>
__global__ void __launch_bounds__(rowwise::kThreads) gelu_tanh_kernel(const rowwise::Params<T> p) {
  rowwise::map_row<T, 1, false>(p, [](float x) { return gelu(x); });
}

// The same values after a prefix's, the joint row with its amax word (rowwise::map_row's joint form):
// what a whole-tensor float8 scale is reduced from.
template <typename T>
__global__ void __launch_bounds__(rowwise::kThreads) gelu_tanh_kernel_joint(const rowwise::Params<T> p) {
  rowwise::map_row<T, 1, true>(p, [](float x) { return gelu(x); });
}

// The same values, the row [prefix | gelu] quantized for the next Linear (rowwise::quantize_row),
// the row staged in shared memory, kVec elements a load.
template <typename T, int kVec>
__global__ void __launch_bounds__(rowwise::kThreads) gelu_tanh_kernel_quantized(const rowwise::Params<T> p) {
  rowwise::quantize_row<T, 1, kVec, rowwise::kUnroll>(p, [](float x) { return gelu(x); });
}

// Its narrow form: 16-byte loads, rows up to rowwise::kNarrowWidth, six rows an SM.
template <typename T>
__global__ void __launch_bounds__(rowwise::kThreads, rowwise::kNarrowBlocks)
    gelu_tanh_kernel_quantized_narrow(const rowwise::Params<T> p) {
  rowwise::quantize_row<T, 1, 8, rowwise::kNarrowUnroll>(p, [](float x) { return gelu(x); });
}

// Its 8-byte, 16-byte and narrow forms (rowwise::launch_quantized picks one).
template <typename T>
rowwise::QuantizedKernels<T> quantized_kernels() {
  return {gelu_tanh_kernel_quantized<T, 4>, gelu_tanh_kernel_quantized<T, 8>, gelu_tanh_kernel_quantized_narrow<T>};
}

}  // namespace gelu_tanh
}  // namespace flux2_fused
