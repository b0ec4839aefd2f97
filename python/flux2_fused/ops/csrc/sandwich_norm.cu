// tvm-ffi entry point of the sandwich-norm kernel: thin shape/dtype plumbing over sandwich_norm.cuh.
// The Python layer (flux2_fused/ops/sandwich_norm/) validates every input and decides when the kernel
// may run; the checks here only stop a misuse from touching the wrong memory. `stream` and `update`
// come together (the gated update of the stream), `out` and `weight` together (the next norm); the
// gate and the scale are optional rows, one a batch element or one for all. With q_scale, out is the
// quantizing form's e4m3fn bytes and q_scale its scale a row.
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/extra/cuda/device_guard.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>

#include <cuda_runtime.h>

#include "entry.cuh"
#include "sandwich_norm.cuh"

namespace flux2_fused {
namespace sandwich_norm {
namespace {

using tvm::ffi::Optional;
using tvm::ffi::TensorView;

void check_like(const TensorView& t, const TensorView& x, DLDevice dev) {
  TVM_FFI_ICHECK(t.ndim() == x.ndim() && t.IsContiguous() && t.dtype() == x.dtype())
      << "rows must be contiguous tensors of x's shape and dtype";
  for (int i = 0; i < x.ndim(); ++i) TVM_FFI_ICHECK(t.size(i) == x.size(i)) << "rows must have x's shape";
  check_device(t, dev);
}

template <typename T>
const T* vector_data(const Optional<TensorView>& opt, int64_t hidden, DLDataType dtype, DLDevice dev) {
  if (!opt.has_value()) return nullptr;
  const TensorView t = *opt;
  TVM_FFI_ICHECK(t.ndim() == 1 && t.size(0) == hidden && t.stride(0) == 1 && t.dtype() == dtype)
      << "weights must be dense [D] vectors of x's dtype";
  check_device(t, dev);
  return data<const T>(t);
}

// A gate or scale: [B or 1, 1, D] contiguous rows; its batch stride (0 for one row).
template <typename T>
const T* batch_rows(const Optional<TensorView>& opt, int64_t batch, int64_t hidden, DLDataType dtype,
                    DLDevice dev, int64_t* stride) {
  *stride = 0;
  if (!opt.has_value()) return nullptr;
  const TensorView t = *opt;
  TVM_FFI_ICHECK(t.ndim() == 3 && (t.size(0) == batch || t.size(0) == 1) && t.size(1) == 1 &&
                 t.size(2) == hidden && t.IsContiguous() && t.dtype() == dtype)
      << "gate and scale must be contiguous [B or 1, 1, D] rows of x's dtype";
  check_device(t, dev);
  *stride = t.size(0) == 1 ? 0 : hidden;
  return data<const T>(t);
}

template <typename T>
void run(Optional<TensorView> out, Optional<TensorView> q_scale, Optional<TensorView> stream, TensorView x,
         Optional<TensorView> update,
         Optional<TensorView> weight, Optional<TensorView> update_weight, Optional<TensorView> gate,
         Optional<TensorView> scale, double eps, double factor) {
  const DLDevice dev = x.device();
  TVM_FFI_ICHECK(x.ndim() == 3 && x.IsContiguous()) << "x must be a contiguous [B, S, D] tensor";
  const int64_t batch = x.size(0), tokens = x.size(1), hidden = x.size(2);
  TVM_FFI_ICHECK(hidden % 128 == 0 && hidden > 128 && hidden / 128 <= kMaxVecs)
      << "D must be a multiple of 128 in (128, 4096)";
  TVM_FFI_ICHECK(update.has_value() == stream.has_value() && update.has_value() == update_weight.has_value())
      << "an update needs its stream output and its norm's weight";
  TVM_FFI_ICHECK(out.has_value() == weight.has_value() && (out.has_value() || update.has_value()))
      << "the next norm needs its output and its weight; a call needs an update or a norm";
  TVM_FFI_ICHECK(!gate.has_value() || update.has_value()) << "a gate needs an update";
  TVM_FFI_ICHECK(!scale.has_value() || out.has_value()) << "a scale needs the next norm";
  const DLDataType dtype = x.dtype();
  check_device(x, dev);
  Params<T> p{};
  p.x = data<const T>(x);
  if (update.has_value()) {
    check_like(*update, x, dev);
    check_like(*stream, x, dev);
    p.update = data<const T>(*update);
    p.stream = data<T>(*stream);
  }
  if (q_scale.has_value()) {  // the quantizing form: out as e4m3fn bytes, a float32 scale a row
    TVM_FFI_ICHECK(out.has_value()) << "the quantizing form needs its out";
    const TensorView& o = *out;
    const TensorView& qs = *q_scale;
    TVM_FFI_ICHECK(o.ndim() == 3 && o.IsContiguous() && o.dtype().code == kDLFloat8_e4m3fn && o.dtype().bits == 8 &&
                   o.dtype().lanes == 1 && o.size(0) == batch && o.size(1) == tokens && o.size(2) == hidden &&
                   qs.IsContiguous() && qs.dtype().code == kDLFloat && qs.dtype().bits == 32 &&
                   qs.numel() == batch * tokens)
        << "the quantizing form's out must be contiguous float8_e4m3fn of x's shape and q_scale a float32 a row";
    check_device(o, dev);
    check_device(qs, dev);
    p.q = data<uint8_t>(o);
    p.q_scale = data<float>(qs);
  } else if (out.has_value()) {
    check_like(*out, x, dev);
    p.out = data<T>(*out);
  }
  p.weight = vector_data<T>(weight, hidden, dtype, dev);
  p.update_weight = vector_data<T>(update_weight, hidden, dtype, dev);
  p.gate = batch_rows<T>(gate, batch, hidden, dtype, dev, &p.gate_batch);
  p.scale = batch_rows<T>(scale, batch, hidden, dtype, dev, &p.scale_batch);
  p.rows = batch * tokens;
  p.tokens = tokens;
  p.hidden = static_cast<int32_t>(hidden);
  p.vecs = static_cast<int32_t>(hidden / 128);
  p.eps = static_cast<float>(eps);
  p.factor = static_cast<float>(factor);
  if (p.rows == 0) return;
  const int64_t blocks = p.rows;  // a block a row
  TVM_FFI_ICHECK(blocks < (int64_t{1} << 31)) << "too many rows for one launch";
  tvm::ffi::CUDADeviceGuard device_guard(dev.device_id);
  auto stream_ = static_cast<cudaStream_t>(TVMFFIEnvGetStream(dev.device_type, dev.device_id));
  if (q_scale.has_value()) {
    sandwich_norm_kernel<T, true><<<static_cast<unsigned>(blocks), kWarps * 32, 0, stream_>>>(p);
  } else {
    sandwich_norm_kernel<T, false><<<static_cast<unsigned>(blocks), kWarps * 32, 0, stream_>>>(p);
  }
  const cudaError_t err = cudaGetLastError();
  TVM_FFI_ICHECK(err == cudaSuccess) << "sandwich_norm launch failed: " << cudaGetErrorString(err);
}

// Outputs first (out absent without a next norm, q_scale without the quantizing form, stream without
// an update), then x, the update, the next norm's weight, the update's norm's weight, the gate, the
// scale, eps and the mean's factor.
void sandwich_norm(Optional<TensorView> out, Optional<TensorView> q_scale, Optional<TensorView> stream,
                   TensorView x, Optional<TensorView> update, Optional<TensorView> weight,
                   Optional<TensorView> update_weight, Optional<TensorView> gate, Optional<TensorView> scale,
                   double eps, double factor) {
  const DLDataType dt = x.dtype();
  if (dt.code == kDLBfloat && dt.bits == 16) {
    run<__nv_bfloat16>(out, q_scale, stream, x, update, weight, update_weight, gate, scale, eps, factor);
  } else if (dt.code == kDLFloat && dt.bits == 16) {
    run<__half>(out, q_scale, stream, x, update, weight, update_weight, gate, scale, eps, factor);
  } else {
    TVM_FFI_THROW(TypeError) << "sandwich_norm supports bfloat16 and float16 only";
  }
}

}  // namespace
}  // namespace sandwich_norm
}  // namespace flux2_fused

TVM_FFI_DLL_EXPORT_TYPED_FUNC(sandwich_norm, flux2_fused::sandwich_norm::sandwich_norm);
