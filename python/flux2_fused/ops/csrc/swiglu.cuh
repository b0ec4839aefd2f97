// SwiGLU, silu(a) * b for x = [a, b] split in halves of the last dim, or for a and b two tensors,
// bit-exact to PyTorch eager.
//
// Eager (diffusers' Flux2SwiGLU on the halves of one projection, Z-Image's FeedForward on two
// projections) runs two aten kernels:
//   s   = T(a / (1 + expf(-a)))         silu: fp32 math, accurate expf, IEEE division, one rounding
//   out = T(float(s) * b)               mul: fp32 product of two T values (exact), one rounding
// (docs/numerics.md). This kernel reads the projection's rows in place (no slicing copies) and
// writes the activation straight into its destination, which may be the second half of the buffer
// the single block's output projection reads, so the eager cat disappears too. No --use_fast_math:
// expf must be the accurate one aten calls, and the division IEEE.
//
// The row walk is every row-wise kernel's (rowwise.cuh): one block of 256 threads a row, x's row
// holding the two operands a and b, or a with b in a tensor of its own.
#pragma once

#include "rowwise.cuh"

namespace flux2_fused {
namespace swiglu {

// silu(a) * b for one element before its final rounding to T: silu rounded to T, then the product.
template <typename T>
__device__ __forceinline__ float silu_mul(float a, float b) {
  const float silu = __fdiv_rn(a, __fadd_rn(1.0f, expf(-a)));
  return __fmul_rn(Elem<T>::round(silu), b);
}

template <typename T>
__global__ void __launch_bounds__(rowwise::kThreads) swiglu_kernel(const rowwise::Params<T> p) {
  rowwise::map_row<T, 2, false>(p, [](float a, float b) { return silu_mul<T>(a, b); });
}

// The same values after a prefix's, the joint row with its amax word (rowwise::map_row's joint form):
// what a whole-tensor float8 scale is reduced from.
template <typename T>
__global__ void __launch_bounds__(rowwise::kThreads) swiglu_kernel_joint(const rowwise::Params<T> p) {
  rowwise::map_row<T, 2, true>(p, [](float a, float b) { return silu_mul<T>(a, b); });
}

// The same values, the row [prefix | swiglu] quantized for the next Linear (rowwise::quantize_row),
// the row staged in shared memory, kVec elements a load.
template <typename T, int kVec>
__global__ void __launch_bounds__(rowwise::kThreads) swiglu_kernel_quantized(const rowwise::Params<T> p) {
  rowwise::quantize_row<T, 2, kVec, rowwise::kUnroll>(p, [](float a, float b) { return silu_mul<T>(a, b); });
}

// Its narrow form: 16-byte loads, rows up to rowwise::kNarrowWidth, six rows an SM.
template <typename T>
__global__ void __launch_bounds__(rowwise::kThreads, rowwise::kNarrowBlocks)
    swiglu_kernel_quantized_narrow(const rowwise::Params<T> p) {
  rowwise::quantize_row<T, 2, 8, rowwise::kNarrowUnroll>(p, [](float a, float b) { return silu_mul<T>(a, b); });
}

// Its 8-byte, 16-byte and narrow forms (rowwise::launch_quantized picks one).
template <typename T>
rowwise::QuantizedKernels<T> quantized_kernels() {
  return {swiglu_kernel_quantized<T, 4>, swiglu_kernel_quantized<T, 8>, swiglu_kernel_quantized_narrow<T>};
}

}  // namespace swiglu
}  // namespace flux2_fused
