// tvm-ffi entry point of the fused kernel: thin shape/dtype plumbing over gated_resnorm.cuh.
// The Python layer (flux2_fused/ops/gated_resnorm/) validates every input and decides when the
// kernel may run; the checks here only stop a misuse from touching the wrong memory. What a call
// leaves out (the update and gate of a plain segment, the second segment, residual_out) arrives as
// None: the arguments say what the kernel does, there are no flag bits to keep in step with them.
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/extra/cuda/device_guard.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>

#include <cuda_runtime.h>

#include "entry.cuh"
#include "gated_resnorm.cuh"

namespace flux2_fused {
namespace {

using tvm::ffi::Optional;
using tvm::ffi::TensorView;

// Streams are [B, T, D] or [T, D] (one batch); modulation rows are [D], [1, D] or [B|1, 1, D],
// broadcast over tokens. A 2-D modulation is one row: eager broadcasts a [B, D] one per token, not
// per batch. Any batch and row strides, unit inner stride: FLUX.2's modulation chunks are strided views.
struct RowLayout {
  int64_t batch_stride, row_stride;
};

RowLayout stream_layout(const TensorView& t, const char* name) {
  TVM_FFI_ICHECK((t.ndim() == 2 || t.ndim() == 3) && t.stride(-1) == 1)
      << name << " must be a [B, T, D] or [T, D] view with unit inner stride";
  if (t.ndim() == 2) return {0, t.stride(0)};
  return {t.size(0) == 1 ? 0 : t.stride(0), t.stride(1)};
}

int64_t modulation_batch_stride(const TensorView& t, int64_t dim, const char* name) {
  TVM_FFI_ICHECK(t.ndim() >= 1 && t.ndim() <= 3 && t.size(-1) == dim && t.stride(-1) == 1 &&
                 (t.ndim() != 2 || t.size(0) == 1) && (t.ndim() != 3 || t.size(1) == 1))
      << name << " must be [D], [1, D] or [B, 1, D] with unit inner stride";
  return (t.ndim() == 1 || t.size(0) == 1) ? 0 : t.stride(0);
}

// The segment's rows; update and gate are both given (a gated segment) or both None.
template <typename T>
Segment<T> make_segment(const TensorView& r, const Optional<TensorView>& u, const Optional<TensorView>& g,
                        int64_t dim, bool gated) {
  TVM_FFI_ICHECK(u.has_value() == gated && g.has_value() == gated)
      << "both segments need update and gate, or neither";
  Segment<T> s{};
  const RowLayout rl = stream_layout(r, "residual");
  s.residual = data<const T>(r);
  s.residual_batch_stride = rl.batch_stride;
  s.residual_row_stride = rl.row_stride;
  if (gated) {
    const RowLayout ul = stream_layout(*u, "update");
    s.update = data<const T>(*u);
    s.update_batch_stride = ul.batch_stride;
    s.update_row_stride = ul.row_stride;
    s.gate = data<const T>(*g);
    s.gate_batch_stride = modulation_batch_stride(*g, dim, "gate");
  }
  return s;
}

template <typename T, int kVecs, bool kGated>
void launch_gated(const Params<T>& p, cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>(p.rows);
  if (p.dim == 4 * kThreads * kVecs) {
    gated_resnorm_kernel<T, kVecs, kGated, true><<<grid, kThreads, 0, stream>>>(p);
  } else {
    gated_resnorm_kernel<T, kVecs, kGated, false><<<grid, kThreads, 0, stream>>>(p);
  }
}

template <typename T, int kVecs>
void launch_vecs(const Params<T>& p, bool gated, cudaStream_t stream) {
  if (gated) {
    launch_gated<T, kVecs, true>(p, stream);
  } else {
    launch_gated<T, kVecs, false>(p, stream);
  }
}

// Smallest instantiated per-thread vector count that covers D / 4 vectors over 128 threads.
template <typename T>
void launch(const Params<T>& p, bool gated, cudaStream_t stream) {
  const int64_t need = (p.dim / 4 + kThreads - 1) / kThreads;
  if (need <= 1) return launch_vecs<T, 1>(p, gated, stream);
  if (need <= 2) return launch_vecs<T, 2>(p, gated, stream);
  if (need <= 3) return launch_vecs<T, 3>(p, gated, stream);
  if (need <= 4) return launch_vecs<T, 4>(p, gated, stream);
  if (need <= 6) return launch_vecs<T, 6>(p, gated, stream);
  if (need <= 8) return launch_vecs<T, 8>(p, gated, stream);
  if (need <= 12) return launch_vecs<T, 12>(p, gated, stream);
  if (need <= 16) return launch_vecs<T, 16>(p, gated, stream);
  if (need <= 24) return launch_vecs<T, 24>(p, gated, stream);
  if (need <= 32) return launch_vecs<T, 32>(p, gated, stream);
  TVM_FFI_THROW(ValueError) << "hidden size " << p.dim << " exceeds the kernel's maximum of 16384";
}

template <typename T>
void run(TensorView out, Optional<TensorView> residual_out, TensorView scale, TensorView shift,
         TensorView r0, Optional<TensorView> u0, Optional<TensorView> g0, Optional<TensorView> r1,
         Optional<TensorView> u1, Optional<TensorView> g1, double eps) {
  const bool gated = u0.has_value();
  TVM_FFI_ICHECK(out.ndim() == 2 || out.ndim() == 3) << "out must be [B, T, D] or [T, D]";
  const int64_t dim = out.size(-1);
  const int64_t tokens = out.size(-2);
  const int64_t batch = out.ndim() == 3 ? out.size(0) : 1;
  TVM_FFI_ICHECK(dim % 4 == 0 && dim > 0) << "D must be a positive multiple of 4";

  Params<T> p{};
  p.seg[0] = make_segment<T>(r0, u0, g0, dim, gated);
  p.seg[1] = r1.has_value() ? make_segment<T>(*r1, u1, g1, dim, gated) : p.seg[0];
  p.split = r1.has_value() ? r0.size(-2) : tokens;
  p.rows_per_batch = tokens;
  p.out = data<T>(out);
  p.residual_out = residual_out.has_value() ? data<T>(*residual_out) : nullptr;
  p.scale = data<const T>(scale);
  p.shift = data<const T>(shift);
  p.scale_batch_stride = modulation_batch_stride(scale, dim, "scale");
  p.shift_batch_stride = modulation_batch_stride(shift, dim, "shift");
  p.dim = static_cast<int32_t>(dim);
  p.eps = static_cast<float>(eps);

  p.rows = batch * tokens;
  if (p.rows == 0) return;
  TVM_FFI_ICHECK(p.rows < (int64_t{1} << 31)) << "too many rows for one launch";
  // Launch on the tensors' device, whichever device is current, on that device's current stream.
  const DLDevice dev = out.device();
  for (const Optional<TensorView>& t : {Optional<TensorView>(scale), Optional<TensorView>(shift),
                                          Optional<TensorView>(r0), residual_out, u0, g0, r1, u1, g1}) {
    if (t.has_value()) check_device(*t, dev);
  }
  tvm::ffi::CUDADeviceGuard device_guard(dev.device_id);
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(dev.device_type, dev.device_id));
  launch<T>(p, gated, stream);
  const cudaError_t err = cudaGetLastError();
  TVM_FFI_ICHECK(err == cudaSuccess) << "gated_resnorm launch failed: " << cudaGetErrorString(err);
}

void gated_resnorm(TensorView out, Optional<TensorView> residual_out, TensorView scale, TensorView shift,
                   TensorView r0, Optional<TensorView> u0, Optional<TensorView> g0,
                   Optional<TensorView> r1, Optional<TensorView> u1, Optional<TensorView> g1,
                   double eps) {
  const DLDataType dt = out.dtype();
  if (dt.code == kDLBfloat && dt.bits == 16) {
    run<__nv_bfloat16>(out, residual_out, scale, shift, r0, u0, g0, r1, u1, g1, eps);
  } else if (dt.code == kDLFloat && dt.bits == 16) {
    run<__half>(out, residual_out, scale, shift, r0, u0, g0, r1, u1, g1, eps);
  } else {
    TVM_FFI_THROW(TypeError) << "gated_resnorm supports bfloat16 and float16 only";
  }
}

}  // namespace
}  // namespace flux2_fused

TVM_FFI_DLL_EXPORT_TYPED_FUNC(gated_resnorm, flux2_fused::gated_resnorm);
