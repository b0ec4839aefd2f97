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
// loads are streaming (__ldcs).
//
// The joint form (map_row with kJoint) writes the row [prefix | f(x)] into out (the prefix's values
// copied) and the largest magnitude of its values into one word a row (T's magnitude bits, as
// float8_quant.cuh orders them): what a whole-tensor float8 scale is reduced from, so the quantizing
// launch after it needs no pass of its own over the row for it.
//
// The quantizing epilogue (`quantize_row`) writes, instead of out, the row that the next Linear reads
// as torchao's per-row float8 (float8_quant.cuh): the joint row [prefix | f(x)] (a single block's
// attention output beside its activation, or f(x) alone), each value rounded to T as eager's buffer
// holds it, then its amax over the row, the scale and the e4m3fn bytes. The row's values are staged
// in shared memory between the amax and the bytes (48 KB for a 24576-wide bf16 row: four rows an SM).
// Where every row of its inputs starts on 16 bytes and holds whole 16-byte vectors (the models'
// widths), it walks the row 8 elements (16 bytes) at a time: 16-byte loads double a thread's bytes
// in flight at the same instruction count. Rows up to kNarrowWidth wide take the narrow form: six
// rows an SM (their staged rows fit its shared memory; a 40-register cap) with two vectors of each
// operand in flight a thread, where the wide form holds four rows an SM with four vectors each. A
// block waits on its row's loads, then computes, then quantizes, so more rows an SM overlap more of
// those phases: on the H200 the narrow form took 6-14% off FLUX.2 klein's and FLUX.1's sites, and
// lost 6% at dev's 24576-wide rows, where shared memory holds four rows an SM either way.
//
// The Python layer (flux2_fused/ops/rowwise.py) validates every input and decides when a kernel may
// run; the host checks here only stop a misuse from touching the wrong memory.
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/extra/cuda/device_guard.h>
#include <tvm/ffi/optional.h>

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <utility>

#include "common.cuh"
#include "entry.cuh"
#include "float8_quant.cuh"

namespace flux2_fused {
namespace rowwise {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
// The quantizing kernel's narrow form (see the header): rows up to this wide, six blocks an SM, two
// vectors of each operand in flight a thread.
constexpr int kNarrowWidth = 18432;
constexpr int kNarrowBlocks = 6;
constexpr int kNarrowUnroll = 2;
constexpr int kMaxOperands = 2;
constexpr int kMaxQuantizedWidth = 24576;  // the widest joint row the quantizing kernel stages

// kVec elements of T (4: 8 bytes, 8: 16 bytes), the unit a thread loads and stores.
template <typename T, int kVec>
using Vec = Packed<T, kVec / 2>;

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
  // The quantizing epilogue's row: `prefix_width` (a multiple of 4, or 0) columns of prefix, then
  // f(x), as e4m3fn bytes into q ([rows, prefix_width + H], contiguous) with a scale a row.
  const T* prefix;
  int64_t prefix_batch_stride, prefix_row_stride;
  int32_t prefix_width;
  uint8_t* q;
  float* scale;
  unsigned int* amax;       // the joint form's word a row
};

// f of element j of each operand's vector.
template <typename T, int kOperands, typename F, int kPairs, std::size_t... I>
__device__ __forceinline__ float element(F f, const Packed<T, kPairs> (&in)[kOperands], int j, std::index_sequence<I...>) {
  return f(in[I].get(j)...);
}

// A block's row: its batch and row within it, and each operand's first element of it.
template <typename T, int kOperands>
struct RowOf {
  int64_t batch, r;
  const T* in[kOperands];
  __device__ __forceinline__ RowOf(const Params<T>& p, int64_t row)
      : batch(row / p.rows_per_batch), r(row - batch * p.rows_per_batch) {
#pragma unroll
    for (int i = 0; i < kOperands; ++i) in[i] = of(p.in[i], p.in_batch_stride[i], p.in_row_stride[i]);
  }
  // The row's first element in a tensor of these strides.
  template <typename U>
  __device__ __forceinline__ U* of(U* base, int64_t batch_stride, int64_t row_stride) const {
    return base + batch * batch_stride + r * row_stride;
  }
};

// Vector v of a row, streamed (read once).
template <typename T, int kVec>
__device__ __forceinline__ Vec<T, kVec> load_vec(const T* row, int v) {
  if constexpr (kVec == 8) {
    const uint4 raw = __ldcs(reinterpret_cast<const uint4*>(row) + v);
    return *reinterpret_cast<const Vec<T, 8>*>(&raw);
  } else {
    static_assert(kVec == 4, "vectors of 4 or 8 elements");
    const uint2 raw = __ldcs(reinterpret_cast<const uint2*>(row) + v);
    return *reinterpret_cast<const Vec<T, 4>*>(&raw);
  }
}

// This block's row of x through f (fp32 operands in, the fp32 value before the final rounding out),
// each value rounded to T, into out_row (global or shared memory), kVec elements a vector, kLoads
// vectors of each operand in flight a thread; with kJoint, the prefix's row first, and the largest
// magnitude bits of the row's values returned (every thread gets them).
template <typename T, int kOperands, bool kJoint, typename F, int kVec = 4, int kLoads = kUnroll>
__device__ __forceinline__ unsigned int map_row_to(const Params<T>& p, F f, T* out_row) {
  using Operands = std::make_index_sequence<kOperands>;
  const RowOf<T, kOperands> at(p, blockIdx.x);
  const T* const* in_row = at.in;
  const T* prefix_row = kJoint ? at.of(p.prefix, p.prefix_batch_stride, p.prefix_row_stride) : nullptr;
  const int prefix_vectors = kJoint ? p.prefix_width / kVec : 0;
  const int vectors = prefix_vectors + p.hidden / kVec;
  unsigned int m = 0;
  for (int v0 = threadIdx.x; v0 < vectors; v0 += kThreads * kLoads) {
    Vec<T, kVec> in[kLoads][kOperands];  // a prefix vector, or the operands
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int v = v0 + u * kThreads - prefix_vectors;  // the operands' vector (< 0: the prefix's)
      if (kJoint && v < 0) {
        in[u][0] = load_vec<T, kVec>(prefix_row, v + prefix_vectors);
      } else if (v + prefix_vectors < vectors) {
#pragma unroll
        for (int i = 0; i < kOperands; ++i) in[u][i] = load_vec<T, kVec>(in_row[i], v);
      }
    }
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int v = v0 + u * kThreads - prefix_vectors;
      if (v + prefix_vectors < vectors) {
        Vec<T, kVec> o;
        if (kJoint && v < 0) {
          o = in[u][0];
        } else {
#pragma unroll
          for (int h = 0; h < kVec / 2; ++h) {
            o.p[h] = Elem<T>::pack(element<T, kOperands>(f, in[u], 2 * h, Operands{}),
                                   element<T, kOperands>(f, in[u], 2 * h + 1, Operands{}));
          }
        }
        if (kJoint) m = max(m, float8_quant::packed_max<T, kVec / 2>(o));
        reinterpret_cast<Vec<T, kVec>*>(out_row)[v + prefix_vectors] = o;
      }
    }
  }
  if constexpr (kJoint) {
    static_assert(kThreads == float8_quant::kThreads, "block_max reduces a block of float8_quant's size");
    m = float8_quant::block_max(m);
  }
  return m;
}

// The body of a row-wise kernel: this block's row into its row of out; with kJoint, the prefix's row
// first and the row's amax word after.
template <typename T, int kOperands, bool kJoint, typename F>
__device__ __forceinline__ void map_row(const Params<T>& p, F f) {
  const RowOf<T, kOperands> at(p, blockIdx.x);
  const unsigned int m = map_row_to<T, kOperands, kJoint>(p, f, at.of(p.out, p.out_batch_stride, p.out_row_stride));
  if (kJoint && threadIdx.x == 0) p.amax[blockIdx.x] = m;
}

// The body of a row-wise kernel with the quantizing epilogue: the joint row [prefix | f(x)] of this
// block, its values rounded to T, as torchao's per-row float8 into q and scale. The row's values wait
// in shared memory (the launch's dynamic shared memory, the row's width in T) between its amax and
// its bytes, so a thread holds only what it has in flight and several rows share an SM. kVec: the
// elements a load (4, or 8 where `octs_aligned`); kLoads: the vectors of each operand a thread has
// in flight.
template <typename T, int kOperands, int kVec, int kLoads, typename F>
__device__ __forceinline__ void quantize_row(const Params<T>& p, F f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
  __trap();  // float8 GEMMs need sm_89: the guards never launch it on an older GPU, and no code is built
#else
  extern __shared__ uint4 staged[];  // the joint row, in T
  const unsigned int m = map_row_to<T, kOperands, true, F, kVec, kLoads>(p, f, reinterpret_cast<T*>(staged));
  // block_max's barrier has made every thread's values visible
  const int64_t row = blockIdx.x;
  const float scale = float8_quant::scale_of<T>(m);
  if (threadIdx.x == 0) p.scale[row] = scale;
  const float8_quant::Divisor d = float8_quant::divisor_of(scale);
  const int octs = (p.prefix_width + p.hidden) / 8;
  uint2* q_row = reinterpret_cast<uint2*>(p.q + row * (int64_t{8} * octs));
  for (int j = threadIdx.x; j < octs; j += kThreads) {
    const uint4 raw = staged[j];
    float8_quant::store_oct(q_row, j, *reinterpret_cast<const float8_quant::Oct<T>*>(&raw), d);
  }
#endif
}

using tvm::ffi::Optional;
using tvm::ffi::TensorView;

// The operands' pointers and strides in p: x's rows holding operands H-wide operands side by side, or
// the first operands - 1 of them with other (rows like x's, H wide) the last.
template <typename T>
void set_operands(Params<T>& p, TensorView x, const Optional<TensorView>& other, int operands, int64_t hidden,
                  DLDevice dev, const char* name) {
  const int in_x = other.has_value() ? operands - 1 : operands;  // operands side by side in x
  TVM_FFI_ICHECK(operands <= kMaxOperands && in_x >= 1) << name << ": too many operands";
  TVM_FFI_ICHECK(hidden % 4 == 0 && hidden * in_x == x.size(-1)) << name << ": H must be a multiple of 4, 1/"
                                                                   << in_x << " of x's width";
  check_device(x, dev);
  for (int i = 0; i < in_x; ++i) {
    p.in[i] = data<const T>(x) + i * hidden;
    row_layout(x, &p.in_batch_stride[i], &p.in_row_stride[i]);
  }
  if (other.has_value()) {
    const TensorView t = *other;
    TVM_FFI_ICHECK(t.ndim() == x.ndim() && t.dtype() == x.dtype()) << name << ": other must be rows like x";
    for (int d = 0; d + 1 < t.ndim(); ++d) TVM_FFI_ICHECK(t.size(d) == x.size(d)) << "x and other rows differ";
    TVM_FFI_ICHECK(t.size(-1) == hidden) << name << ": other must be H wide";
    check_device(t, dev);
    p.in[in_x] = data<const T>(t);
    row_layout(t, &p.in_batch_stride[in_x], &p.in_row_stride[in_x]);
  }
  p.rows_per_batch = x.size(-2);
  p.hidden = static_cast<int32_t>(hidden);
}

// The prefix's rows in p, where given (rows like x's, a multiple of 4 wide).
template <typename T>
void set_prefix(Params<T>& p, const Optional<TensorView>& prefix, TensorView x, DLDevice dev, const char* name) {
  if (!prefix.has_value()) return;
  const TensorView t = *prefix;
  TVM_FFI_ICHECK(t.ndim() == x.ndim() && t.dtype() == x.dtype() && t.size(-1) % 4 == 0) << name << ": prefix must be rows like x";
  for (int d = 0; d + 1 < t.ndim(); ++d) TVM_FFI_ICHECK(t.size(d) == x.size(d)) << "x and prefix rows differ";
  check_device(t, dev);
  p.prefix = data<const T>(t);
  row_layout(t, &p.prefix_batch_stride, &p.prefix_row_stride);
  p.prefix_width = static_cast<int32_t>(t.size(-1));
}

// One block of `threads` a row of x on the current stream of dev.
template <typename T>
void run(void (*kernel)(Params<T>), const Params<T>& p, TensorView x, DLDevice dev, const char* name,
         int shared_bytes = 0) {
  const int64_t rows = (x.ndim() == 3 ? x.size(0) : 1) * x.size(-2);
  if (rows == 0 || p.hidden == 0) return;
  TVM_FFI_ICHECK(rows < (int64_t{1} << 31)) << "too many rows for one launch";
  tvm::ffi::CUDADeviceGuard device_guard(dev.device_id);
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(dev.device_type, dev.device_id));
  if (shared_bytes > 32 * 1024) {  // near the default 48 KB with the static part: the kernel opts in
    const cudaError_t err = cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes);
    TVM_FFI_ICHECK(err == cudaSuccess) << name << ": " << cudaGetErrorString(err);
  }
  kernel<<<static_cast<unsigned>(rows), kThreads, shared_bytes, stream>>>(p);
  const cudaError_t err = cudaGetLastError();
  TVM_FFI_ICHECK(err == cudaSuccess) << name << " launch failed: " << cudaGetErrorString(err);
}

// kernel over x's rows (and other's, which holds the last operand where given) into out's, on the
// current stream of out's device.
template <typename T>
void launch(void (*kernel)(Params<T>), TensorView out, TensorView x, const Optional<TensorView>& other,
            int operands, const char* name) {
  TVM_FFI_ICHECK(out.ndim() == x.ndim()) << name << ": out and x must have the same rank";
  for (int d = 0; d + 1 < x.ndim(); ++d) TVM_FFI_ICHECK(out.size(d) == x.size(d)) << "out and x rows differ";
  const DLDevice dev = out.device();
  Params<T> p{};
  set_operands(p, x, other, operands, out.size(-1), dev, name);
  p.out = data<T>(out);
  row_layout(out, &p.out_batch_stride, &p.out_row_stride);
  run(kernel, p, x, dev, name);
}

// A quantizing kernel's forms: 8-byte vectors (any row a multiple of 4 wide), 16-byte ones, and
// 16-byte ones for rows up to kNarrowWidth (six rows an SM).
template <typename T>
struct QuantizedKernels {
  void (*quads)(Params<T>);
  void (*octs)(Params<T>);
  void (*narrow)(Params<T>);
};

// Whether every row p's walk reads (each operand's, the prefix's) starts on 16 bytes and is whole
// 16-byte vectors wide, so the 16-byte form may run.
template <typename T>
bool octs_aligned(const Params<T>& p, int operands) {
  const auto aligned = [](const T* row, int64_t batch_stride, int64_t row_stride) {
    return reinterpret_cast<std::uintptr_t>(row) % 16 == 0 && batch_stride % 8 == 0 && row_stride % 8 == 0;
  };
  bool ok = p.hidden % 8 == 0 && p.prefix_width % 8 == 0 &&
            (p.prefix_width == 0 || aligned(p.prefix, p.prefix_batch_stride, p.prefix_row_stride));
  for (int i = 0; i < operands; ++i) ok = ok && aligned(p.in[i], p.in_batch_stride[i], p.in_row_stride[i]);
  return ok;
}

// (H, P + H, rows) of the joint rows [prefix | f(x)] over x's rows (other as in `launch`).
struct JointShape {
  int64_t hidden, width, rows;
};
inline JointShape joint_shape(TensorView x, const Optional<TensorView>& other, const Optional<TensorView>& prefix,
                              int operands) {
  const int64_t hidden = x.size(-1) / (other.has_value() ? operands - 1 : operands);
  return {hidden, hidden + (prefix.has_value() ? (*prefix).size(-1) : 0), x.numel() / x.size(-1)};
}

// The quantizing epilogue over x's rows (other as in `launch`), prefix's rows first where given: q
// the joint rows' e4m3fn bytes ([rows, P + H], contiguous), scale one float a row.
template <typename T>
void launch_quantized(const QuantizedKernels<T>& kernels, TensorView q, TensorView scale,
                      const Optional<TensorView>& prefix, TensorView x, const Optional<TensorView>& other,
                      int operands, const char* name) {
  const DLDevice dev = q.device();
  const auto [hidden, width, rows] = joint_shape(x, other, prefix, operands);
  TVM_FFI_ICHECK(q.IsContiguous() && q.dtype().bits == 8 && q.numel() == rows * width) << name << ": q must be the joint rows' bytes";
  TVM_FFI_ICHECK(scale.IsContiguous() && scale.dtype().code == kDLFloat && scale.dtype().bits == 32 && scale.numel() == rows)
      << name << ": scale must be one float a row";
  TVM_FFI_ICHECK(width % 8 == 0 && width <= kMaxQuantizedWidth) << name << ": joint rows must be a multiple of 8 up to 24576 wide";
  check_device(scale, dev);
  Params<T> p{};
  set_operands(p, x, other, operands, hidden, dev, name);
  set_prefix(p, prefix, x, dev, name);
  p.q = data<uint8_t>(q);
  p.scale = data<float>(scale);
  const auto kernel = !octs_aligned(p, operands) ? kernels.quads : (width <= kNarrowWidth ? kernels.narrow : kernels.octs);
  run(kernel, p, x, dev, name, static_cast<int>(width * sizeof(T)));
}

// The joint form over x's rows (other as in `launch`), prefix's rows first where given: joint the
// rows [prefix | f(x)] ([rows, P + H], contiguous), amax their words (at least one a row).
template <typename T>
void launch_joint(void (*kernel)(Params<T>), TensorView joint, TensorView amax, const Optional<TensorView>& prefix,
                  TensorView x, const Optional<TensorView>& other, int operands, const char* name) {
  const DLDevice dev = joint.device();
  const auto [hidden, width, rows] = joint_shape(x, other, prefix, operands);
  TVM_FFI_ICHECK(joint.IsContiguous() && joint.dtype() == x.dtype() && joint.size(-1) == width && joint.numel() == rows * width)
      << name << ": joint must be the joint rows";
  TVM_FFI_ICHECK(amax.IsContiguous() && amax.dtype().bits == 32 && amax.numel() >= rows) << name << ": amax must be a word a row";
  check_device(amax, dev);
  Params<T> p{};
  set_operands(p, x, other, operands, hidden, dev, name);
  set_prefix(p, prefix, x, dev, name);
  p.out = data<T>(joint);
  p.out_row_stride = width;
  p.out_batch_stride = width * x.size(-2);
  p.amax = data<unsigned int>(amax);
  run(kernel, p, x, dev, name);
}

// An entry's launch of the kernel for `dt`: launch(bf16) or launch(fp16), the kernel(s) of each type.
template <typename Bf16, typename Fp16, typename Launch>
void for_dtype(DLDataType dt, const char* name, Bf16 bf16, Fp16 fp16, Launch launch) {
  if (dt.code == kDLBfloat && dt.bits == 16) {
    launch(bf16);
  } else if (dt.code == kDLFloat && dt.bits == 16) {
    launch(fp16);
  } else {
    TVM_FFI_THROW(TypeError) << name << " supports bfloat16 and float16 only";
  }
}

// The op's entry: out's dtype picks the bf16 or the fp16 kernel.
template <typename Bf16, typename Fp16>
void dispatch(TensorView out, TensorView x, const Optional<TensorView>& other, int operands, const char* name,
              Bf16 bf16, Fp16 fp16) {
  const DLDataType dt = out.dtype();
  TVM_FFI_ICHECK(x.dtype().code == dt.code && x.dtype().bits == dt.bits) << "x and out dtypes differ";
  for_dtype(dt, name, bf16, fp16, [&](auto kernel) { launch(kernel, out, x, other, operands, name); });
}

// The quantizing entry: x's dtype picks the bf16 or the fp16 kernels.
template <typename Bf16, typename Fp16>
void dispatch_quantized(TensorView q, TensorView scale, const Optional<TensorView>& prefix, TensorView x,
                        const Optional<TensorView>& other, int operands, const char* name, Bf16 bf16, Fp16 fp16) {
  for_dtype(x.dtype(), name, bf16, fp16,
            [&](auto kernel) { launch_quantized(kernel, q, scale, prefix, x, other, operands, name); });
}

// The joint entry: x's dtype picks the bf16 or the fp16 kernels.
template <typename Bf16, typename Fp16>
void dispatch_joint(TensorView joint, TensorView amax, const Optional<TensorView>& prefix, TensorView x,
                    const Optional<TensorView>& other, int operands, const char* name, Bf16 bf16, Fp16 fp16) {
  for_dtype(x.dtype(), name, bf16, fp16,
            [&](auto kernel) { launch_joint(kernel, joint, amax, prefix, x, other, operands, name); });
}

}  // namespace rowwise
}  // namespace flux2_fused
