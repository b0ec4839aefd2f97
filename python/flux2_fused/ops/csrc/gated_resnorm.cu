// tvm-ffi entry point of the fused kernel: thin shape/dtype plumbing over gated_resnorm.cuh.
// The Python layer (flux2_fused/ops/gated_resnorm.py) validates every input and decides when the
// kernel may run; the checks here only stop a misuse from touching the wrong memory.
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <cuda_runtime.h>

#include "gated_resnorm.cuh"

namespace flux2_fused {
namespace {

using tvm::ffi::TensorView;

constexpr int64_t kFlagGated = 1;         // y = residual + gate * update (else y = residual)
constexpr int64_t kFlagResidualOut = 2;   // write y to residual_out
constexpr int64_t kFlagTwoSegments = 4;   // rows >= split come from (r1, u1, g1)

template <typename T>
const T* ptr(const TensorView& t) {
  return reinterpret_cast<const T*>(static_cast<const char*>(t.data_ptr()) + t.byte_offset());
}

template <typename T>
Segment<T> make_segment(const TensorView& r, const TensorView& u, const TensorView& g, bool gated) {
  TVM_FFI_ICHECK(r.ndim() == 3 && r.stride(2) == 1) << "residual must be a [B, T, D] view with unit stride";
  Segment<T> s{};
  s.residual = ptr<T>(r);
  s.residual_batch_stride = r.stride(0);
  s.residual_row_stride = r.stride(1);
  if (gated) {
    TVM_FFI_ICHECK(u.ndim() == 3 && u.stride(2) == 1) << "update must be a [B, T, D] view with unit stride";
    TVM_FFI_ICHECK(g.ndim() == 2 && g.stride(1) == 1) << "gate must be a [B or 1, D] view with unit stride";
    s.update = ptr<T>(u);
    s.update_batch_stride = u.stride(0);
    s.update_row_stride = u.stride(1);
    s.gate = ptr<T>(g);
    s.gate_batch_stride = g.size(0) == 1 ? 0 : g.stride(0);
  }
  return s;
}

template <typename T, int kVecs>
void launch_vecs(const Params<T>& p, int64_t rows, bool gated, cudaStream_t stream) {
  if (gated) {
    gated_resnorm_kernel<T, kVecs, true><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(p);
  } else {
    gated_resnorm_kernel<T, kVecs, false><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(p);
  }
}

// Smallest instantiated per-thread vector count that covers D / 4 vectors over 128 threads.
template <typename T>
void launch(const Params<T>& p, int64_t rows, bool gated, cudaStream_t stream) {
  const int64_t need = (p.dim / 4 + kThreads - 1) / kThreads;
  if (need <= 1) return launch_vecs<T, 1>(p, rows, gated, stream);
  if (need <= 2) return launch_vecs<T, 2>(p, rows, gated, stream);
  if (need <= 3) return launch_vecs<T, 3>(p, rows, gated, stream);
  if (need <= 4) return launch_vecs<T, 4>(p, rows, gated, stream);
  if (need <= 6) return launch_vecs<T, 6>(p, rows, gated, stream);
  if (need <= 8) return launch_vecs<T, 8>(p, rows, gated, stream);
  if (need <= 12) return launch_vecs<T, 12>(p, rows, gated, stream);
  if (need <= 16) return launch_vecs<T, 16>(p, rows, gated, stream);
  if (need <= 24) return launch_vecs<T, 24>(p, rows, gated, stream);
  if (need <= 32) return launch_vecs<T, 32>(p, rows, gated, stream);
  TVM_FFI_THROW(ValueError) << "hidden size " << p.dim << " exceeds the kernel's maximum of 16384";
}

template <typename T>
void run(TensorView out, TensorView residual_out, TensorView scale, TensorView shift, TensorView r0,
         TensorView u0, TensorView g0, TensorView r1, TensorView u1, TensorView g1, int64_t split,
         int64_t flags, double eps) {
  const bool gated = flags & kFlagGated;
  TVM_FFI_ICHECK(out.ndim() == 3) << "out must be [B, T, D]";
  const int64_t batch = out.size(0), tokens = out.size(1), dim = out.size(2);
  TVM_FFI_ICHECK(dim % 4 == 0 && dim > 0) << "D must be a positive multiple of 4";
  TVM_FFI_ICHECK(scale.ndim() == 2 && shift.ndim() == 2 && scale.size(1) == dim && shift.size(1) == dim)
      << "scale and shift must be [B or 1, D]";

  Params<T> p{};
  p.seg[0] = make_segment<T>(r0, u0, g0, gated);
  p.seg[1] = (flags & kFlagTwoSegments) ? make_segment<T>(r1, u1, g1, gated) : p.seg[0];
  p.split = (flags & kFlagTwoSegments) ? split : tokens;
  p.rows_per_batch = tokens;
  p.out = static_cast<T*>(const_cast<void*>(static_cast<const void*>(ptr<T>(out))));
  p.residual_out = (flags & kFlagResidualOut)
                       ? static_cast<T*>(const_cast<void*>(static_cast<const void*>(ptr<T>(residual_out))))
                       : nullptr;
  p.scale = ptr<T>(scale);
  p.shift = ptr<T>(shift);
  p.scale_batch_stride = scale.size(0) == 1 ? 0 : scale.stride(0);
  p.shift_batch_stride = shift.size(0) == 1 ? 0 : shift.stride(0);
  p.dim = static_cast<int32_t>(dim);
  p.eps = static_cast<float>(eps);

  const int64_t rows = batch * tokens;
  if (rows == 0) return;
  TVM_FFI_ICHECK(rows < (int64_t{1} << 31)) << "too many rows for one launch";
  const DLDevice dev = out.device();
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(dev.device_type, dev.device_id));
  launch<T>(p, rows, gated, stream);
  const cudaError_t err = cudaGetLastError();
  TVM_FFI_ICHECK(err == cudaSuccess) << "gated_resnorm launch failed: " << cudaGetErrorString(err);
}

void gated_resnorm(TensorView out, TensorView residual_out, TensorView scale, TensorView shift,
                   TensorView r0, TensorView u0, TensorView g0, TensorView r1, TensorView u1,
                   TensorView g1, int64_t split, int64_t flags, double eps) {
  const DLDataType dt = out.dtype();
  if (dt.code == kDLBfloat && dt.bits == 16) {
    run<__nv_bfloat16>(out, residual_out, scale, shift, r0, u0, g0, r1, u1, g1, split, flags, eps);
  } else if (dt.code == kDLFloat && dt.bits == 16) {
    run<__half>(out, residual_out, scale, shift, r0, u0, g0, r1, u1, g1, split, flags, eps);
  } else {
    TVM_FFI_THROW(TypeError) << "gated_resnorm supports bfloat16 and float16 only";
  }
}

}  // namespace
}  // namespace flux2_fused

TVM_FFI_DLL_EXPORT_TYPED_FUNC(gated_resnorm, flux2_fused::gated_resnorm);
