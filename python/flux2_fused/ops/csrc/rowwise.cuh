// What the row-wise elementwise kernels (swiglu, gelu_tanh) share: the row walk on the device and the
// launch on the host.
//
// Such a kernel maps each row of x ([B, S, C] or [S, C] rows with unit inner stride, rows and batch
// possibly strided: a view of a wider projection) to the same row of out ([..., H], possibly half of
// a wider buffer), element by element: x's row holds kOperands H-wide operands side by side
// (swiglu's a and b, gelu_tanh's x), or x holds the first and a second tensor of x's shape the other
// (Z-Image's silu(w1(x)) * w3(x): two projections), and output element j is
// f(operand 0 [j], ..., operand k-1 [j]) rounded once to T (round to nearest even, as aten's stores).
//
// One block of 256 threads handles one row; thread t owns the 4-element (8-byte) vectors t, t + 256,
// ... of the row's H outputs, with up to kUnroll of them in flight. Every input is read once, so the
// loads are streaming (__ldcs). The Python layer (flux2_fused/ops/rowwise.py) validates every input
// and decides when a kernel may run; the host checks here only stop a misuse from touching the
// wrong memory.
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/extra/cuda/device_guard.h>
#include <tvm/ffi/optional.h>

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "common.cuh"
#include "entry.cuh"

namespace flux2_fused {
namespace rowwise {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int kMaxOperands = 2;

template <typename T>
using Quad = Packed<T, 2>;  // four elements, 8 bytes

template <typename T>
struct Params {
  // Operand i's first row and its strides: x[:, i * H : (i + 1) * H] for operands side by side in x,
  // or a tensor of its own.
  const T* in[kMaxOperands];
  int64_t in_batch_stride[kMaxOperands], in_row_stride[kMaxOperands];
  T* out;                   // [rows, H] rows
  int64_t out_batch_stride, out_row_stride;
  int64_t rows_per_batch;
  int32_t hidden;           // H, a multiple of 4
};

// f of element j of each operand's vector.
template <typename T, int kOperands, typename F, std::size_t... I>
__device__ __forceinline__ float element(F f, const Quad<T> (&in)[kOperands], int j, std::index_sequence<I...>) {
  return f(in[I].get(j)...);
}

// The body of a row-wise kernel: this block's row of x, through f (fp32 operands in, the fp32 value
// before the final rounding out), into its row of out.
template <typename T, int kOperands, typename F>
__device__ __forceinline__ void map_row(const Params<T>& p, F f) {
  using Operands = std::make_index_sequence<kOperands>;
  const int64_t row = blockIdx.x;
  const int64_t batch = row / p.rows_per_batch;
  const int64_t r = row - batch * p.rows_per_batch;
  const T* in_row[kOperands];
#pragma unroll
  for (int i = 0; i < kOperands; ++i) in_row[i] = p.in[i] + batch * p.in_batch_stride[i] + r * p.in_row_stride[i];
  T* out_row = p.out + batch * p.out_batch_stride + r * p.out_row_stride;
  const int vectors = p.hidden / 4;
  for (int v0 = threadIdx.x; v0 < vectors; v0 += kThreads * kUnroll) {
    Quad<T> in[kUnroll][kOperands];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int v = v0 + u * kThreads;
      if (v < vectors) {
#pragma unroll
        for (int i = 0; i < kOperands; ++i) {
          const uint2 raw = __ldcs(reinterpret_cast<const uint2*>(in_row[i]) + v);
          in[u][i] = *reinterpret_cast<const Quad<T>*>(&raw);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int v = v0 + u * kThreads;
      if (v < vectors) {
        Quad<T> o;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          o.p[h] = Elem<T>::pack(element<T, kOperands>(f, in[u], 2 * h, Operands{}),
                                 element<T, kOperands>(f, in[u], 2 * h + 1, Operands{}));
        }
        reinterpret_cast<uint2*>(out_row)[v] = *reinterpret_cast<const uint2*>(&o);
      }
    }
  }
}

using tvm::ffi::Optional;
using tvm::ffi::TensorView;

// kernel over x's rows (and other's, which holds the last operand where given) into out's, on the
// current stream of out's device.
template <typename T>
void launch(void (*kernel)(Params<T>), TensorView out, TensorView x, const Optional<TensorView>& other,
            int operands, const char* name) {
  const int in_x = other.has_value() ? operands - 1 : operands;  // operands side by side in x
  TVM_FFI_ICHECK(operands <= kMaxOperands && in_x >= 1) << name << ": too many operands";
  TVM_FFI_ICHECK(out.ndim() == x.ndim() && out.size(-1) * in_x == x.size(-1))
      << name << ": out's rows must be 1/" << in_x << " of x's width";
  for (int d = 0; d + 1 < x.ndim(); ++d) TVM_FFI_ICHECK(out.size(d) == x.size(d)) << "out and x rows differ";
  TVM_FFI_ICHECK(out.size(-1) % 4 == 0) << "H must be a multiple of 4";
  const DLDevice dev = out.device();
  check_device(x, dev);
  Params<T> p{};
  const int64_t hidden = out.size(-1);
  for (int i = 0; i < in_x; ++i) {
    p.in[i] = data<const T>(x) + i * hidden;
    row_layout(x, &p.in_batch_stride[i], &p.in_row_stride[i]);
  }
  if (other.has_value()) {
    const TensorView t = *other;
    TVM_FFI_ICHECK(t.ndim() == out.ndim() && t.dtype() == x.dtype()) << name << ": other must be rows like out";
    for (int d = 0; d < t.ndim(); ++d) TVM_FFI_ICHECK(t.size(d) == out.size(d)) << "out and other rows differ";
    check_device(t, dev);
    p.in[in_x] = data<const T>(t);
    row_layout(t, &p.in_batch_stride[in_x], &p.in_row_stride[in_x]);
  }
  p.out = data<T>(out);
  row_layout(out, &p.out_batch_stride, &p.out_row_stride);
  p.rows_per_batch = x.size(-2);
  p.hidden = static_cast<int32_t>(hidden);
  const int64_t rows = (x.ndim() == 3 ? x.size(0) : 1) * x.size(-2);
  if (rows == 0 || p.hidden == 0) return;
  TVM_FFI_ICHECK(rows < (int64_t{1} << 31)) << "too many rows for one launch";
  tvm::ffi::CUDADeviceGuard device_guard(dev.device_id);
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(dev.device_type, dev.device_id));
  kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(p);
  const cudaError_t err = cudaGetLastError();
  TVM_FFI_ICHECK(err == cudaSuccess) << name << " launch failed: " << cudaGetErrorString(err);
}

// The op's entry: out's dtype picks the bf16 or the fp16 kernel.
inline void dispatch(TensorView out, TensorView x, const Optional<TensorView>& other, int operands,
                     const char* name, void (*bf16_kernel)(Params<__nv_bfloat16>),
                     void (*fp16_kernel)(Params<__half>)) {
  const DLDataType dt = out.dtype();
  TVM_FFI_ICHECK(x.dtype().code == dt.code && x.dtype().bits == dt.bits) << "x and out dtypes differ";
  if (dt.code == kDLBfloat && dt.bits == 16) {
    launch(bf16_kernel, out, x, other, operands, name);
  } else if (dt.code == kDLFloat && dt.bits == 16) {
    launch(fp16_kernel, out, x, other, operands, name);
  } else {
    TVM_FFI_THROW(TypeError) << name << " supports bfloat16 and float16 only";
  }
}

}  // namespace rowwise
}  // namespace flux2_fused
