// torchao's dynamic float8 activation quantization (Float8DynamicActivationFloat8WeightConfig, the
// torch path: PerRow and PerTensor, e4m3fn), bit-exact to torchao 0.18 running eager PyTorch:
//   amax  = max |x| over the row (or the tensor), in T: exact, NaN if any element is NaN
//   scale = float(T(RN(float(amax) * RN(1 / 448))))    aten divides by the Python scalar 448 as a
//                                                      product with its float reciprocal, rounded to T
//   q     = e4m3fn(clamp(RN(float(x) / scale), -448, 448))   IEEE division; clamp keeps NaN; c10's
//                                                      round-to-nearest-even conversion
// (docs/numerics.md, 15). kWarpsPerRow warps hold a row in registers (one warp up to K = 3072, more for
// wider rows, at most 12 vectors of 8 elements a thread), so a block of 8 warps works on 8, 4, 2 or 1
// rows at once with all of their loads in flight: the amax of the row, then its elements quantized.
// For a whole-tensor scale, a first launch reduces |x| into one word with an atomic max (the order of
// a max does not matter), and the row launch reads the scale from it.
//
// The amax is taken on the magnitude bits of T (sign cleared): they order as |x| does, with every NaN
// above +Inf, so an integer max is NaN-propagating as aten's amax is.
#pragma once

#include <cstdint>

#include "common.cuh"

namespace flux2_fused {
namespace float8_quant {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxVecs = 12;  // 8-element vectors a thread holds: K up to 256 x 12 x 8 = 24576
constexpr float kE4m3Max = 448.0f;

template <typename T>
using Oct = Packed<T, 4>;  // eight elements, 16 bytes

template <typename T>
struct Params {
  const T* x;                // [rows, K] contiguous
  uint8_t* q;                // [rows, K] e4m3fn bytes
  float* scale;              // [rows] (a row's scale), or [1] (the tensor's)
  unsigned int* amax;        // the tensor's |x| bits (null: a scale a row)
  int64_t rows;
  int32_t cols;              // K, a multiple of 8
};

// A T's magnitude bits: its bits with the sign cleared, an integer ordered as |x| with NaN on top.
template <typename T>
__device__ __forceinline__ unsigned int magnitude(typename Elem<T>::Pair p, int half) {
  const unsigned int bits = *reinterpret_cast<const unsigned int*>(&p);
  return (half ? bits >> 16 : bits) & 0x7fffu;
}

// The largest magnitude of a vector's eight elements.
template <typename T>
__device__ __forceinline__ unsigned int vector_max(const Oct<T>& v) {
  unsigned int m = 0;
#pragma unroll
  for (int h = 0; h < 4; ++h) m = max(m, max(magnitude<T>(v.p[h], 0), magnitude<T>(v.p[h], 1)));
  return m;
}

// The block's max of each thread's m (every thread gets it).
__device__ __forceinline__ unsigned int block_max(unsigned int m) {
  __shared__ unsigned int warp_max[kThreads / 32];
  __shared__ unsigned int result;
  m = __reduce_max_sync(0xffffffffu, m);
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    unsigned int w = threadIdx.x < kThreads / 32 ? warp_max[threadIdx.x] : 0u;
    w = __reduce_max_sync(0xffffffffu, w);
    if (threadIdx.x == 0) result = w;
  }
  __syncthreads();
  return result;
}

// The scale of an amax (T magnitude bits): aten's `amax / 448` in T, as float.
template <typename T>
__device__ __forceinline__ float scale_of(unsigned int amax_bits) {
  typename Elem<T>::Pair p;
  *reinterpret_cast<unsigned int*>(&p) = amax_bits;
  return Elem<T>::round(__fmul_rn(Elem<T>::lo(p), 1.0f / kE4m3Max));
}

// c10's float -> e4m3fn conversion (fp8e4m3fn_from_fp32_value): round to nearest even, magnitudes
// from 480 up (and NaN) to 0x7f, the sign or-ed in.
__device__ __forceinline__ uint8_t to_e4m3fn(float f) {
  constexpr unsigned int kFp8Max = 1087u << 20;     // 480.0f
  constexpr unsigned int kDenormMask = 141u << 23;  // 2^14
  unsigned int bits = __float_as_uint(f);
  const unsigned int sign = bits & 0x80000000u;
  bits ^= sign;
  uint8_t result;
  if (bits >= kFp8Max) {
    result = 0x7f;
  } else if (bits < (121u << 23)) {  // below e4m3's smallest normal (2^-6): a denormal or zero
    bits = __float_as_uint(__fadd_rn(__uint_as_float(bits), __uint_as_float(kDenormMask)));
    result = static_cast<uint8_t>(bits - kDenormMask);
  } else {
    const unsigned int mant_odd = (bits >> 20) & 1u;
    bits += ((unsigned int)(7 - 127) << 23) + 0x7ffffu;
    bits += mant_odd;
    result = static_cast<uint8_t>(bits >> 20);
  }
  return result | static_cast<uint8_t>(sign >> 24);
}

// One element: RN(x / scale), clamped to +-448 (NaN stays NaN), to e4m3fn.
__device__ __forceinline__ uint8_t quantize(float x, float scale) {
  float v = __fdiv_rn(x, scale);
  if (!isnan(v)) v = fminf(fmaxf(v, -kE4m3Max), kE4m3Max);
  return to_e4m3fn(v);
}

// The tensor's amax into p.amax (zeroed before): a grid-stride max over 8-element vectors.
template <typename T>
__global__ void __launch_bounds__(kThreads) float8_quant_kernel_amax(const Params<T> p) {
  const int64_t vectors = p.rows * (p.cols / 8);
  unsigned int m = 0;
  for (int64_t v = int64_t(blockIdx.x) * kThreads + threadIdx.x; v < vectors; v += int64_t(gridDim.x) * kThreads) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p.x) + v);
    m = max(m, vector_max<T>(*reinterpret_cast<const Oct<T>*>(&raw)));
  }
  m = block_max(m);
  if (threadIdx.x == 0) atomicMax(p.amax, m);
}

// kWarpsPerRow warps a row, 8 / kWarpsPerRow rows a block: each row's amax (or the tensor's), its
// scale, its elements quantized.
template <typename T, int kWarpsPerRow>
__global__ void __launch_bounds__(kThreads) float8_quant_kernel(const Params<T> p) {
  constexpr int kRowThreads = 32 * kWarpsPerRow;
  __shared__ unsigned int warp_max[kWarps];
  const int warp = threadIdx.x >> 5;
  const int group = warp / kWarpsPerRow;            // the block's row this thread works on
  const int t = threadIdx.x - group * kRowThreads;  // its thread within the row
  const int64_t row = int64_t(blockIdx.x) * (kWarps / kWarpsPerRow) + group;
  const bool live = row < p.rows;  // a block's last rows may be past the end: no loads, no stores
  const int vectors = p.cols / 8;
  const uint4* x = reinterpret_cast<const uint4*>(p.x + row * p.cols);
  Oct<T> v[kMaxVecs];
  unsigned int m = 0;
#pragma unroll
  for (int j = 0; j < kMaxVecs; ++j) {
    const int i = t + j * kRowThreads;
    if (live && i < vectors) {
      const uint4 raw = __ldcs(x + i);
      v[j] = *reinterpret_cast<const Oct<T>*>(&raw);
      m = max(m, vector_max<T>(v[j]));
    }
  }
  m = __reduce_max_sync(0xffffffffu, m);
  if constexpr (kWarpsPerRow > 1) {
    if ((threadIdx.x & 31) == 0) warp_max[warp] = m;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kWarpsPerRow; ++w) m = max(m, warp_max[group * kWarpsPerRow + w]);
  }
  if (!live) return;
  const unsigned int amax = p.amax != nullptr ? *p.amax : m;
  const float scale = scale_of<T>(amax);
  if (t == 0 && (p.amax == nullptr || row == 0)) p.scale[p.amax == nullptr ? row : 0] = scale;
  uint2* q = reinterpret_cast<uint2*>(p.q + row * p.cols);
#pragma unroll
  for (int j = 0; j < kMaxVecs; ++j) {
    const int i = t + j * kRowThreads;
    if (i < vectors) {
      uint2 packed = make_uint2(0u, 0u);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        packed.x |= static_cast<unsigned int>(quantize(v[j].get(e), scale)) << (8 * e);
        packed.y |= static_cast<unsigned int>(quantize(v[j].get(e + 4), scale)) << (8 * e);
      }
      __stcs(q + i, packed);
    }
  }
}

// The warps a row takes: the fewest (1, 2, 4, 8) whose threads hold its K / 8 vectors in kMaxVecs each.
inline int warps_per_row(int64_t cols) {
  int warps = 1;
  while (warps < kWarps && cols / 8 > int64_t{32} * warps * kMaxVecs) warps *= 2;
  return warps;
}

}  // namespace float8_quant
}  // namespace flux2_fused
