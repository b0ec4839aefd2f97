// SwiGLU, silu(a) * b for x = [a, b] split in halves of the last dim, bit-exact to PyTorch eager.
//
// Eager (diffusers' Flux2SwiGLU) runs two aten kernels on the halves of the projection:
//   s   = T(a / (1 + expf(-a)))         silu: fp32 math, accurate expf, IEEE division, one rounding
//   out = T(float(s) * b)               mul: fp32 product of two T values (exact), one rounding
// (docs/numerics.md). This kernel reads the projection's rows in place (no slicing copies) and
// writes the activation straight into its destination, which may be the second half of the buffer
// the single block's output projection reads, so the eager cat disappears too. No --use_fast_math:
// expf must be the accurate one aten calls, and the division IEEE.
//
// One block of 256 threads handles one row; thread t owns the 4-element vectors t, t + 256, ... of
// the row's H outputs, with up to kUnroll of them in flight.
#pragma once

#include "common.cuh"

namespace flux2_fused {
namespace swiglu {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

template <typename T>
using Quad = Packed<T, 2>;  // four elements, 8 bytes

template <typename T>
struct Params {
  const T* x;               // [rows, 2H] rows: a = x[:, :H], b = x[:, H:]
  T* out;                   // [rows, H] rows
  int64_t x_batch_stride, x_row_stride;
  int64_t out_batch_stride, out_row_stride;
  int64_t rows_per_batch;
  int32_t hidden;           // H, a multiple of 4
};

// silu(a) * b for one element before its final rounding to T: silu rounded to T, then the product.
template <typename T>
__device__ __forceinline__ float silu_mul(float a, float b) {
  const float silu = __fdiv_rn(a, __fadd_rn(1.0f, expf(-a)));
  return __fmul_rn(Elem<T>::round(silu), b);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) swiglu_kernel(const Params<T> p) {
  const int64_t row = blockIdx.x;
  const int64_t batch = row / p.rows_per_batch;
  const int64_t r = row - batch * p.rows_per_batch;
  const T* a_row = p.x + batch * p.x_batch_stride + r * p.x_row_stride;
  const T* b_row = a_row + p.hidden;
  T* out_row = p.out + batch * p.out_batch_stride + r * p.out_row_stride;
  const int vectors = p.hidden / 4;
  for (int v0 = threadIdx.x; v0 < vectors; v0 += kThreads * kUnroll) {
    Quad<T> a[kUnroll], b[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int v = v0 + u * kThreads;
      if (v < vectors) {
        const uint2 ra = __ldcs(reinterpret_cast<const uint2*>(a_row) + v);
        const uint2 rb = __ldcs(reinterpret_cast<const uint2*>(b_row) + v);
        a[u] = *reinterpret_cast<const Quad<T>*>(&ra);
        b[u] = *reinterpret_cast<const Quad<T>*>(&rb);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int v = v0 + u * kThreads;
      if (v < vectors) {
        Quad<T> o;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          o.p[h] = Elem<T>::pack(silu_mul<T>(a[u].get(2 * h), b[u].get(2 * h)),
                                 silu_mul<T>(a[u].get(2 * h + 1), b[u].get(2 * h + 1)));
        }
        reinterpret_cast<uint2*>(out_row)[v] = *reinterpret_cast<const uint2*>(&o);
      }
    }
  }
}

}  // namespace swiglu
}  // namespace flux2_fused
