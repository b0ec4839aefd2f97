// tvm-ffi entry point of the attention-prologue kernel: thin shape/dtype plumbing over qk_norm_rope.cuh.
// The Python layer (flux2_fused/ops/qk_norm_rope/) validates every input and decides when the kernel
// may run; the checks here only stop a misuse from touching the wrong memory. A single-segment call
// passes None for the second segment, a call without v (the single block's) None for v; `upcast`
// picks FLUX.3's mode (float32 weights, the norm's output kept in fp32) over FLUX.2's (weights of x's
// dtype), `rotation` the host's RoPE arithmetic (0 aten, 1 addcmul, 2 kitchen, 3 complex) and `norm`
// its q/k norm (0 aten's fused RMSNorm, 1 diffusers' pow/mean module), one instantiation of the kernel
// for each mode: FLUX.2's norm with the first three rotations, the upcast mode with aten's, diffusers'
// norm with the complex rotation (Qwen-Image's, Z-Image's). The RoPE tables are [S, 128] or one a
// batch, [B, S, 128].
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/extra/cuda/device_guard.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>

#include <cuda_runtime.h>

#include "entry.cuh"
#include "qk_norm_rope.cuh"

namespace flux2_fused {
namespace qk_norm_rope {
namespace {

using tvm::ffi::Optional;
using tvm::ffi::TensorView;

bool same_dtype(DLDataType a, DLDataType b) { return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes; }

template <typename T>
Rows<T> make_rows(const TensorView& x, int64_t batch, int64_t heads, DLDevice dev, DLDataType dtype) {
  TVM_FFI_ICHECK(x.ndim() == 4 && x.size(0) == batch && x.size(2) == heads && x.size(3) == kHeadDim &&
                 x.stride(3) == 1 && (heads == 1 || x.stride(2) == kHeadDim))
      << "inputs must be [B, S, H, 128] with dense heads";
  TVM_FFI_ICHECK(same_dtype(x.dtype(), dtype)) << "inputs must have the outputs' dtype";
  check_device(x, dev);
  return Rows<T>{data<const T>(x), batch == 1 ? 0 : x.stride(0), x.stride(1)};
}

// A [128] weight of W: the outputs' dtype, or float32 in the upcast mode (read 32 bytes a lane).
template <typename W>
const W* weight_data(const TensorView& weight, DLDevice dev, DLDataType dtype) {
  TVM_FFI_ICHECK(weight.ndim() == 1 && weight.size(0) == kHeadDim && weight.stride(0) == 1)
      << "weights must be dense [128] vectors";
  TVM_FFI_ICHECK(same_dtype(weight.dtype(), dtype))
      << "weights must be float32 in the upcast mode, of the outputs' dtype otherwise";
  check_device(weight, dev);
  return data<const W>(weight);
}

// An output: contiguous [B, S, H, 128] on the launch's device (the kernel writes it densely).
void check_out(const TensorView& out, const TensorView& like, DLDevice dev) {
  TVM_FFI_ICHECK(out.ndim() == 4 && out.size(3) == kHeadDim) << "outputs must be [B, S, H, 128]";
  for (int i = 0; i < 4; ++i) TVM_FFI_ICHECK(out.size(i) == like.size(i)) << "outputs must have one shape";
  TVM_FFI_ICHECK(out.stride(3) == 1 && out.stride(2) == kHeadDim && out.stride(1) == out.size(2) * kHeadDim &&
                 (out.size(0) == 1 || out.stride(0) == out.size(1) * out.stride(1)))
      << "outputs must be contiguous";
  TVM_FFI_ICHECK(out.dtype() == like.dtype()) << "outputs must have one dtype";
  check_device(out, dev);
}

template <typename T, bool kUpcast, int kRotation, int kNorm>
void run(TensorView q_out, TensorView k_out, Optional<TensorView> v_out, TensorView q0, TensorView k0,
         Optional<TensorView> v0, TensorView wq0, TensorView wk0, Optional<TensorView> q1,
         Optional<TensorView> k1, Optional<TensorView> v1, Optional<TensorView> wq1, Optional<TensorView> wk1,
         TensorView cos, TensorView sin, double eps, int64_t parts) {
  const DLDevice dev = q_out.device();
  check_out(q_out, q_out, dev);
  check_out(k_out, q_out, dev);
  if (v_out.has_value()) check_out(*v_out, q_out, dev);
  const int64_t batch = q_out.size(0), tokens = q_out.size(1), heads = q_out.size(2);
  const bool two = q1.has_value();
  TVM_FFI_ICHECK(k1.has_value() == two && wq1.has_value() == two && wk1.has_value() == two)
      << "a second segment needs q, k and both weights";
  TVM_FFI_ICHECK(v0.has_value() == v_out.has_value() && (!v0.has_value() || v1.has_value() == two))
      << "v needs its output and one input a segment";
  using W = Weight<T, kUpcast>;
  const DLDataType dtype = q_out.dtype();
  const DLDataType wtype = kUpcast ? DLDataType{kDLFloat, 32, 1} : dtype;
  Params<T, kUpcast> p{};
  p.in[0][0] = make_rows<T>(q0, batch, heads, dev, dtype);
  p.in[1][0] = make_rows<T>(k0, batch, heads, dev, dtype);
  p.in[kV][0] = v0.has_value() ? make_rows<T>(*v0, batch, heads, dev, dtype) : p.in[0][0];
  p.weight[0][0] = weight_data<W>(wq0, dev, wtype);
  p.weight[1][0] = weight_data<W>(wk0, dev, wtype);
  p.split = two ? q0.size(1) : tokens;
  TVM_FFI_ICHECK(k0.size(1) == p.split && (!v0.has_value() || (*v0).size(1) == p.split))
      << "q, k and v segments must have equal rows";
  if (two) {
    p.in[0][1] = make_rows<T>(*q1, batch, heads, dev, dtype);
    p.in[1][1] = make_rows<T>(*k1, batch, heads, dev, dtype);
    p.in[kV][1] = v1.has_value() ? make_rows<T>(*v1, batch, heads, dev, dtype) : p.in[0][1];
    p.weight[0][1] = weight_data<W>(*wq1, dev, wtype);
    p.weight[1][1] = weight_data<W>(*wk1, dev, wtype);
    TVM_FFI_ICHECK(p.split + (*q1).size(1) == tokens && (*k1).size(1) == (*q1).size(1) &&
                   (!v1.has_value() || (*v1).size(1) == (*q1).size(1)))
        << "segment rows must sum to S, equal for q, k and v";
  } else {
    for (int t = 0; t < kTensors; ++t) p.in[t][1] = p.in[t][0];
    p.weight[0][1] = p.weight[0][0];
    p.weight[1][1] = p.weight[1][0];
    TVM_FFI_ICHECK(p.split == tokens) << "segment rows must sum to S";
  }
  const int table_dims = cos.ndim();
  const int64_t table_batches = table_dims == 3 ? cos.size(0) : 1;
  for (const TensorView* t : {&cos, &sin}) {
    const int d = t->ndim();
    TVM_FFI_ICHECK((d == 2 || (d == 3 && (t->size(0) == 1 || t->size(0) == batch))) && d == table_dims &&
                   (d == 2 || t->size(0) == table_batches) && t->size(d - 2) == tokens &&
                   t->size(d - 1) == kHeadDim && t->stride(d - 1) == 1 && t->stride(d - 2) == kHeadDim &&
                   (d == 2 || t->size(0) == 1 || t->stride(0) == tokens * kHeadDim) &&
                   t->dtype().code == kDLFloat && t->dtype().bits == 32)
        << "cos and sin must be contiguous float32 [S, 128] or [B, S, 128] tables of one shape";
    check_device(*t, dev);
  }
  p.out[0] = data<T>(q_out);
  p.out[1] = data<T>(k_out);
  p.out[kV] = v_out.has_value() ? data<T>(*v_out) : p.out[0];
  p.tensors = v_out.has_value() ? 3 : 2;
  p.cos = data<const float>(cos);
  p.sin = data<const float>(sin);
  p.table_batch = table_batches > 1 ? tokens * kHeadDim : 0;
  p.tokens = tokens;
  p.heads = static_cast<int32_t>(heads);
  p.eps = static_cast<float>(eps);
  TVM_FFI_ICHECK(parts >= 0 && parts <= kMaxParts) << "parts must be 0 (chosen here) to " << kMaxParts;
  const int64_t blocks = batch * tokens;
  if (blocks == 0 || heads == 0) return;
  TVM_FFI_ICHECK(blocks < (int64_t{1} << 31)) << "too many tokens for one launch";
  tvm::ffi::CUDADeviceGuard device_guard(dev.device_id);
  if (parts == 0) {
    int sms = 0;
    const cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev.device_id);
    TVM_FFI_ICHECK(err == cudaSuccess) << "qk_norm_rope: " << cudaGetErrorString(err);
    parts = parts_for(blocks, units_of(p.tensors, p.heads), sms * kMinBlocks);
  }
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(dev.device_type, dev.device_id));
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(parts));
  qk_norm_rope_kernel<T, kUpcast, kRotation, kNorm><<<grid, kThreads, 0, stream>>>(p);
  const cudaError_t err = cudaGetLastError();
  TVM_FFI_ICHECK(err == cudaSuccess) << "qk_norm_rope launch failed: " << cudaGetErrorString(err);
}

template <typename T>
void run_mode(TensorView q_out, TensorView k_out, Optional<TensorView> v_out, TensorView q0, TensorView k0,
              Optional<TensorView> v0, TensorView wq0, TensorView wk0, Optional<TensorView> q1,
              Optional<TensorView> k1, Optional<TensorView> v1, Optional<TensorView> wq1,
              Optional<TensorView> wk1, TensorView cos, TensorView sin, double eps, bool upcast,
              int64_t rotation, int64_t norm, int64_t parts) {
  TVM_FFI_ICHECK(rotation >= kAten && rotation <= kComplex && (norm == kFusedNorm || norm == kMeanNorm) &&
                 (!upcast || (rotation == kAten && norm == kFusedNorm)) &&
                 ((norm == kMeanNorm) == (rotation == kComplex)))
      << "the modes are: rotation 0, 1 or 2 with norm 0; the upcast mode with rotation 0 and norm 0; "
         "rotation 3 with norm 1";
  if (upcast) {
    run<T, true, kAten, kFusedNorm>(q_out, k_out, v_out, q0, k0, v0, wq0, wk0, q1, k1, v1, wq1, wk1, cos, sin,
                                    eps, parts);
  } else if (rotation == kAten) {
    run<T, false, kAten, kFusedNorm>(q_out, k_out, v_out, q0, k0, v0, wq0, wk0, q1, k1, v1, wq1, wk1, cos, sin,
                                     eps, parts);
  } else if (rotation == kAddcmul) {
    run<T, false, kAddcmul, kFusedNorm>(q_out, k_out, v_out, q0, k0, v0, wq0, wk0, q1, k1, v1, wq1, wk1, cos,
                                        sin, eps, parts);
  } else if (rotation == kKitchen) {
    run<T, false, kKitchen, kFusedNorm>(q_out, k_out, v_out, q0, k0, v0, wq0, wk0, q1, k1, v1, wq1, wk1, cos,
                                        sin, eps, parts);
  } else {
    run<T, false, kComplex, kMeanNorm>(q_out, k_out, v_out, q0, k0, v0, wq0, wk0, q1, k1, v1, wq1, wk1, cos,
                                       sin, eps, parts);
  }
}

// Outputs first (v's absent in a single block), then segment 0's q, k, v and weights, segment 1's
// (absent with one segment), the tables, eps, the mode, the rotation, the norm, and the blocks a token
// (0: chosen here from the grid's size and the device's SMs).
void qk_norm_rope(TensorView q_out, TensorView k_out, Optional<TensorView> v_out, TensorView q0, TensorView k0,
                  Optional<TensorView> v0, TensorView wq0, TensorView wk0, Optional<TensorView> q1,
                  Optional<TensorView> k1, Optional<TensorView> v1, Optional<TensorView> wq1,
                  Optional<TensorView> wk1, TensorView cos, TensorView sin, double eps, bool upcast,
                  int64_t rotation, int64_t norm, int64_t parts) {
  const DLDataType dt = q_out.dtype();
  if (dt.code == kDLBfloat && dt.bits == 16) {
    run_mode<__nv_bfloat16>(q_out, k_out, v_out, q0, k0, v0, wq0, wk0, q1, k1, v1, wq1, wk1, cos, sin, eps,
                            upcast, rotation, norm, parts);
  } else if (dt.code == kDLFloat && dt.bits == 16) {
    run_mode<__half>(q_out, k_out, v_out, q0, k0, v0, wq0, wk0, q1, k1, v1, wq1, wk1, cos, sin, eps, upcast,
                     rotation, norm, parts);
  } else {
    TVM_FFI_THROW(TypeError) << "qk_norm_rope supports bfloat16 and float16 only";
  }
}

}  // namespace
}  // namespace qk_norm_rope
}  // namespace flux2_fused

TVM_FFI_DLL_EXPORT_TYPED_FUNC(qk_norm_rope, flux2_fused::qk_norm_rope::qk_norm_rope);
