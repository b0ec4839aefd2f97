// tvm-ffi entry point of the fused kernel: thin shape/dtype plumbing over gated_resnorm.cuh.
// The Python layer (flux2_fused/ops/gated_resnorm/) validates every input and decides when the
// kernel may run; the checks here only stop a misuse from touching the wrong memory. What a call
// leaves out (the update, update2 and gate of a plain segment, the second update of a one-term
// segment, the second segment and its own modulation, residual_out) arrives as None: the arguments
// say what the kernel does, there are no flag bits to keep in step with them. With q_scale, out is
// the quantizing form's e4m3fn bytes and q_scale its scale a row.
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

// Streams are [B, T, D] or [T, D] (one batch) with unit inner stride, any batch and row strides.
// Modulation rows are [D], [R, D] or [B|1, R, D] with R one (broadcast over tokens) or the tokens
// of the rows they modulate (per token): eager aligns a 2-D modulation with the stream's last two
// axes, so its rows are tokens, never batches. FLUX.2's modulation chunks are strided [B, 1, D]
// views, FLUX.3's strided [B, T, D] ones.
template <typename T>
Rows<T> stream_rows(const TensorView& t, int64_t batch, int64_t tokens, int64_t dim, const char* name) {
  TVM_FFI_ICHECK((t.ndim() == 2 || t.ndim() == 3) && t.stride(-1) == 1 && t.size(-1) == dim &&
                 t.size(-2) == tokens && (t.ndim() == 2 ? batch == 1 : t.size(0) == batch))
      << name << " must be a [B, T, D] or [T, D] view of the launch's rows with unit inner stride";
  const int64_t batch_stride = (t.ndim() == 2 || t.size(0) == 1) ? 0 : t.stride(0);
  return {data<const T>(t), batch_stride, t.stride(-2)};
}

template <typename T>
Rows<T> modulation_rows(const TensorView& t, int64_t batch, int64_t tokens, int64_t dim, const char* name) {
  TVM_FFI_ICHECK(t.ndim() >= 1 && t.ndim() <= 3 && t.size(-1) == dim && t.stride(-1) == 1)
      << name << " must be [D], [R, D] or [B, R, D] with unit inner stride";
  const int64_t rows = t.ndim() == 3 ? t.size(0) : 1;
  const int64_t per_token = t.ndim() >= 2 ? t.size(-2) : 1;
  TVM_FFI_ICHECK((rows == 1 || rows == batch) && (per_token == 1 || per_token == tokens))
      << name << " must have one row or one a batch, and one row or one a token";
  return {data<const T>(t), rows == 1 ? 0 : t.stride(0), per_token == 1 ? 0 : t.stride(-2)};
}

// The segment's rows; update and gate are both given (a gated segment) or both None, and update2
// only with them.
template <typename T>
Segment<T> make_segment(const TensorView& r, const Optional<TensorView>& u, const Optional<TensorView>& u2,
                        const Optional<TensorView>& g, int64_t batch, int64_t tokens, int64_t dim, int terms) {
  TVM_FFI_ICHECK(u.has_value() == (terms > 0) && g.has_value() == (terms > 0) && u2.has_value() == (terms == 2))
      << "both segments need update and gate, or neither, and update2 in both or neither";
  Segment<T> s{};
  s.residual = stream_rows<T>(r, batch, tokens, dim, "residual");
  if (terms > 0) {
    s.update = stream_rows<T>(*u, batch, tokens, dim, "update");
    s.gate = modulation_rows<T>(*g, batch, tokens, dim, "gate");
  }
  if (terms == 2) s.update2 = stream_rows<T>(*u2, batch, tokens, dim, "update2");
  return s;
}

// A uniform_rows word (one int32 on the launch's device) as the kernel reads it, or nullptr.
inline const int* word_of(const Optional<TensorView>& w, DLDevice dev) {
  if (!w.has_value()) return nullptr;
  const TensorView t = *w;
  TVM_FFI_ICHECK(t.numel() == 1 && t.dtype().code == kDLInt && t.dtype().bits == 32) << "a word is one int32";
  check_device(t, dev);
  return data<const int>(t);
}

template <typename T, int kVecs, int kTerms, bool kRowMod, bool kAddcmul = false>
void launch_kernel(const Params<T>& p, cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>(p.rows);
  if (p.dim == 4 * kThreads * kVecs) {
    gated_resnorm_kernel<T, kVecs, kTerms, kRowMod, true, kAddcmul><<<grid, kThreads, 0, stream>>>(p);
  } else {
    gated_resnorm_kernel<T, kVecs, kTerms, kRowMod, false, kAddcmul><<<grid, kThreads, 0, stream>>>(p);
  }
}

// ComfyUI's modulation rounding: one modulation row a batch, one-term updates (or none), D <= 6144
// (ComfyUI's FLUX.2 sizes: 3072, 4096, 6144); the Python guards decline everything else first.
template <typename T, int kVecs>
void launch_addcmul_terms(const Params<T>& p, int terms, cudaStream_t stream) {
  if (terms == 0) return launch_kernel<T, kVecs, 0, false, true>(p, stream);
  return launch_kernel<T, kVecs, 1, false, true>(p, stream);
}

template <typename T>
void launch_addcmul(const Params<T>& p, int terms, bool row_mod, cudaStream_t stream) {
  const int64_t need = (p.dim / 4 + kThreads - 1) / kThreads;
  TVM_FFI_ICHECK(!row_mod && terms < 2 && need <= 12)
      << "addcmul modulation takes one modulation row a batch, one update and D <= 6144";
  if (need <= 1) return launch_addcmul_terms<T, 1>(p, terms, stream);
  if (need <= 2) return launch_addcmul_terms<T, 2>(p, terms, stream);
  if (need <= 4) return launch_addcmul_terms<T, 4>(p, terms, stream);
  if (need <= 6) return launch_addcmul_terms<T, 6>(p, terms, stream);
  if (need <= 8) return launch_addcmul_terms<T, 8>(p, terms, stream);
  return launch_addcmul_terms<T, 12>(p, terms, stream);
}

template <typename T, int kVecs, bool kRowMod>
void launch_terms(const Params<T>& p, int terms, cudaStream_t stream) {
  if (terms == 0) return launch_kernel<T, kVecs, 0, kRowMod>(p, stream);
  if (terms == 1) return launch_kernel<T, kVecs, 1, kRowMod>(p, stream);
  return launch_kernel<T, kVecs, 2, kRowMod>(p, stream);
}

// Per-token and per-segment modulation (kRowMod) is built for D up to 6144 (FLUX.3's 3072 and the
// widths of its larger siblings), where FLUX.1/FLUX.2's rows go up to 16384: the wider instantiations
// would be the largest kernels of the module, for no model.
constexpr int kRowModMaxVecs = 12;

template <typename T, int kVecs>
void launch_vecs(const Params<T>& p, int terms, bool row_mod, cudaStream_t stream) {
  if (!row_mod) return launch_terms<T, kVecs, false>(p, terms, stream);
  if constexpr (kVecs <= kRowModMaxVecs) {
    launch_terms<T, kVecs, true>(p, terms, stream);
  } else {
    TVM_FFI_THROW(ValueError) << "modulation rows per token or per segment take D up to " << 4 * kThreads * kRowModMaxVecs;
  }
}

// The quantizing form: diffusers' rounding, D = 512 kVecs (3072, 4096, 6144), and the update forms of
// the sites that use it: one modulation row a batch with no update or one (FLUX.1's, FLUX.2's,
// Qwen-Image's), per-token or per-segment rows with no update or a two-term one (FLUX.3's); the
// Python guards decline everything else first.
template <typename T, int kVecs>
void launch_quantized_vecs(const Params<T>& p, int terms, bool row_mod, cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>(p.rows);
  TVM_FFI_ICHECK(terms == 0 || terms == (row_mod ? 2 : 1))
      << "the quantizing form takes one update with one modulation row a batch, or two with rows per token";
  if (row_mod) {
    if (terms == 0) return gated_resnorm_kernel_quantized<T, kVecs, 0, true><<<grid, kThreads, 0, stream>>>(p);
    return gated_resnorm_kernel_quantized<T, kVecs, 2, true><<<grid, kThreads, 0, stream>>>(p);
  }
  if (terms == 0) return gated_resnorm_kernel_quantized<T, kVecs, 0, false><<<grid, kThreads, 0, stream>>>(p);
  return gated_resnorm_kernel_quantized<T, kVecs, 1, false><<<grid, kThreads, 0, stream>>>(p);
}

template <typename T>
void launch_quantized(const Params<T>& p, int terms, bool row_mod, bool addcmul, cudaStream_t stream) {
  TVM_FFI_ICHECK(!addcmul) << "the quantizing form takes diffusers' modulation rounding";
  if (p.dim == 3072) return launch_quantized_vecs<T, 6>(p, terms, row_mod, stream);
  if (p.dim == 4096) return launch_quantized_vecs<T, 8>(p, terms, row_mod, stream);
  if (p.dim == 6144) return launch_quantized_vecs<T, 12>(p, terms, row_mod, stream);
  TVM_FFI_THROW(ValueError) << "the quantizing form takes D of 3072, 4096 or 6144, got " << p.dim;
}

// Smallest instantiated per-thread vector count that covers D / 4 vectors over 128 threads.
template <typename T>
void launch(const Params<T>& p, int terms, bool row_mod, cudaStream_t stream) {
  const int64_t need = (p.dim / 4 + kThreads - 1) / kThreads;
  if (need <= 1) return launch_vecs<T, 1>(p, terms, row_mod, stream);
  if (need <= 2) return launch_vecs<T, 2>(p, terms, row_mod, stream);
  if (need <= 3) return launch_vecs<T, 3>(p, terms, row_mod, stream);
  if (need <= 4) return launch_vecs<T, 4>(p, terms, row_mod, stream);
  if (need <= 6) return launch_vecs<T, 6>(p, terms, row_mod, stream);
  if (need <= 8) return launch_vecs<T, 8>(p, terms, row_mod, stream);
  if (need <= 12) return launch_vecs<T, 12>(p, terms, row_mod, stream);
  if (need <= 16) return launch_vecs<T, 16>(p, terms, row_mod, stream);
  if (need <= 24) return launch_vecs<T, 24>(p, terms, row_mod, stream);
  if (need <= 32) return launch_vecs<T, 32>(p, terms, row_mod, stream);
  TVM_FFI_THROW(ValueError) << "hidden size " << p.dim << " exceeds the kernel's maximum of 16384";
}

// The launch's arguments: the outputs, then the modulation (scale and shift of the first segment, or
// of every row; scale1 and shift1 the second segment's own, None where it shares the first's), then
// each segment's residual, update, update2 and gate (None where absent), then eps and whether the
// modulation is aten's addcmul (ComfyUI's) rather than diffusers' two roundings, then each segment's
// uniform_rows words for its gate and for its scale and shift (None where its rows are not proven;
// the second segment's scale word None where it shares the first's scale).
template <typename T>
void run(TensorView out, Optional<TensorView> q_scale, Optional<TensorView> residual_out, TensorView scale,
         TensorView shift,
         Optional<TensorView> scale1, Optional<TensorView> shift1, TensorView r0, Optional<TensorView> u0,
         Optional<TensorView> v0, Optional<TensorView> g0, Optional<TensorView> r1, Optional<TensorView> u1,
         Optional<TensorView> v1, Optional<TensorView> g1, double eps, bool addcmul, Optional<TensorView> gw0,
         Optional<TensorView> mw0, Optional<TensorView> gw1, Optional<TensorView> mw1) {
  const int terms = u0.has_value() ? (v0.has_value() ? 2 : 1) : 0;
  TVM_FFI_ICHECK(out.ndim() == 2 || out.ndim() == 3) << "out must be [B, T, D] or [T, D]";
  const int64_t dim = out.size(-1);
  const int64_t tokens = out.size(-2);
  const int64_t batch = out.ndim() == 3 ? out.size(0) : 1;
  TVM_FFI_ICHECK(dim % 4 == 0 && dim > 0) << "D must be a positive multiple of 4";
  const DLDataType rows_dtype = r0.dtype();
  if (residual_out.has_value()) {  // written densely, a row every D elements of the rows' dtype
    const TensorView& ro = *residual_out;
    const DLDataType d = ro.dtype();
    TVM_FFI_ICHECK((ro.ndim() == 2 || ro.ndim() == 3) && ro.size(-1) == dim && ro.size(-2) == tokens &&
                   (ro.ndim() == 2 || ro.size(0) == batch) && ro.IsContiguous() && d.code == rows_dtype.code &&
                   d.bits == rows_dtype.bits && d.lanes == rows_dtype.lanes)
        << "residual_out must be contiguous, with out's rows and the rows' dtype";
  }
  TVM_FFI_ICHECK(scale1.has_value() == shift1.has_value() && (r1.has_value() || !scale1.has_value()))
      << "the second segment's scale and shift come together, and only with a second segment";
  const int64_t split = r1.has_value() ? r0.size(-2) : tokens;

  Params<T> p{};
  const DLDevice dev = out.device();
  p.seg[0] = make_segment<T>(r0, u0, v0, g0, batch, split, dim, terms);
  p.seg[0].gate_differs = word_of(gw0, dev);
  p.seg[0].mod_differs = word_of(mw0, dev);
  if (r1.has_value()) {
    p.seg[1] = make_segment<T>(*r1, u1, v1, g1, batch, tokens - split, dim, terms);
    p.seg[1].gate_differs = word_of(gw1, dev);
    p.seg[1].mod_differs = scale1.has_value() ? word_of(mw1, dev) : p.seg[0].mod_differs;
  } else {
    TVM_FFI_ICHECK(!u1.has_value() && !v1.has_value() && !g1.has_value() && !gw1.has_value() && !mw1.has_value())
        << "no second segment's residual";
    p.seg[1] = p.seg[0];
  }
  if (scale1.has_value()) {  // per-segment modulation: each indexed by its segment's tokens
    p.seg[0].scale = modulation_rows<T>(scale, batch, split, dim, "scale");
    p.seg[0].shift = modulation_rows<T>(shift, batch, split, dim, "shift");
    p.seg[1].scale = modulation_rows<T>(*scale1, batch, tokens - split, dim, "scale1");
    p.seg[1].shift = modulation_rows<T>(*shift1, batch, tokens - split, dim, "shift1");
  } else {  // one modulation for the launch's rows: the second segment's start `split` rows in
    p.seg[0].scale = p.seg[1].scale = modulation_rows<T>(scale, batch, tokens, dim, "scale");
    p.seg[0].shift = p.seg[1].shift = modulation_rows<T>(shift, batch, tokens, dim, "shift");
    if (r1.has_value()) {
      p.seg[1].scale.data += split * p.seg[1].scale.row_stride;
      p.seg[1].shift.data += split * p.seg[1].shift.row_stride;
    }
  }
  // Modulation rows that differ within a batch (per token anywhere, or each segment its own scale and
  // shift): streamed loads, and addresses from each row's segment and token.
  bool row_mod = scale1.has_value();
  for (const Segment<T>& s : p.seg) {
    row_mod = row_mod || s.gate.row_stride != 0 || s.scale.row_stride != 0 || s.shift.row_stride != 0;
  }
  p.split = split;
  p.rows_per_batch = tokens;
  if (q_scale.has_value()) {
    const TensorView qs = *q_scale;
    const DLDataType o = out.dtype();
    TVM_FFI_ICHECK(o.code == kDLFloat8_e4m3fn && o.bits == 8 && o.lanes == 1 && out.IsContiguous() &&
                   qs.dtype().code == kDLFloat && qs.dtype().bits == 32 && qs.IsContiguous() &&
                   qs.numel() == batch * tokens)
        << "the quantizing form's out must be contiguous float8_e4m3fn and q_scale a float32 a row";
    p.q = data<uint8_t>(out);
    p.q_scale = data<float>(qs);
  } else {
    const DLDataType o = out.dtype();
    TVM_FFI_ICHECK(o.code == rows_dtype.code && o.bits == rows_dtype.bits && o.lanes == rows_dtype.lanes &&
                   out.IsContiguous())
        << "out must be contiguous, in the rows' dtype";
    p.out = data<T>(out);
  }
  p.residual_out = residual_out.has_value() ? data<T>(*residual_out) : nullptr;
  p.dim = static_cast<int32_t>(dim);
  p.eps = static_cast<float>(eps);

  p.rows = batch * tokens;
  if (p.rows == 0) return;
  TVM_FFI_ICHECK(p.rows < (int64_t{1} << 31)) << "too many rows for one launch";
  // Launch on the tensors' device, whichever device is current, on that device's current stream.
  for (const Optional<TensorView>& t : {Optional<TensorView>(scale), Optional<TensorView>(shift), scale1, shift1,
                                          Optional<TensorView>(r0), residual_out, q_scale, u0, v0, g0, r1, u1, v1,
                                          g1}) {
    if (t.has_value()) check_device(*t, dev);
  }
  tvm::ffi::CUDADeviceGuard device_guard(dev.device_id);
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(dev.device_type, dev.device_id));
  if (q_scale.has_value()) {
    launch_quantized<T>(p, terms, row_mod, addcmul, stream);
  } else if (addcmul) {
    launch_addcmul<T>(p, terms, row_mod, stream);
  } else {
    launch<T>(p, terms, row_mod, stream);
  }
  const cudaError_t err = cudaGetLastError();
  TVM_FFI_ICHECK(err == cudaSuccess) << "gated_resnorm launch failed: " << cudaGetErrorString(err);
}

void gated_resnorm(TensorView out, Optional<TensorView> q_scale, Optional<TensorView> residual_out, TensorView scale,
                   TensorView shift, Optional<TensorView> scale1, Optional<TensorView> shift1, TensorView r0,
                   Optional<TensorView> u0, Optional<TensorView> v0, Optional<TensorView> g0,
                   Optional<TensorView> r1, Optional<TensorView> u1, Optional<TensorView> v1,
                   Optional<TensorView> g1, double eps, bool addcmul, Optional<TensorView> gw0,
                   Optional<TensorView> mw0, Optional<TensorView> gw1, Optional<TensorView> mw1) {
  const DLDataType dt = r0.dtype();  // out's, or (the quantizing form) the value's out quantizes
  if (dt.code == kDLBfloat && dt.bits == 16) {
    run<__nv_bfloat16>(out, q_scale, residual_out, scale, shift, scale1, shift1, r0, u0, v0, g0, r1, u1, v1, g1,
                       eps, addcmul, gw0, mw0, gw1, mw1);
  } else if (dt.code == kDLFloat && dt.bits == 16) {
    run<__half>(out, q_scale, residual_out, scale, shift, scale1, shift1, r0, u0, v0, g0, r1, u1, v1, g1, eps,
                addcmul, gw0, mw0, gw1, mw1);
  } else {
    TVM_FFI_THROW(TypeError) << "gated_resnorm supports bfloat16 and float16 only";
  }
}

}  // namespace
}  // namespace flux2_fused

TVM_FFI_DLL_EXPORT_TYPED_FUNC(gated_resnorm, flux2_fused::gated_resnorm);
