// tvm-ffi entry points of the GELU (tanh) kernel: the row-wise launch (rowwise.cuh) of gelu_tanh.cuh's
// kernel, x's rows holding one operand, into rows of T or (with a prefix's rows first where given)
// quantized for the next float8 Linear, or as joint rows with
// their amax words. The Python layer (flux2_fused/ops/gelu_tanh/) validates every
// input and decides when the kernel may run.
#include <tvm/ffi/function.h>

#include "gelu_tanh.cuh"

namespace flux2_fused {
namespace gelu_tanh {
namespace {

void gelu_tanh(tvm::ffi::TensorView out, tvm::ffi::TensorView x) {
  rowwise::dispatch(out, x, tvm::ffi::Optional<tvm::ffi::TensorView>(), /*operands=*/1, "gelu_tanh",
                    gelu_tanh_kernel<__nv_bfloat16>, gelu_tanh_kernel<__half>);
}

// The rows [prefix | gelu_tanh(x)] as torchao's per-row float8: q bytes and a scale a row.
void gelu_tanh_quantized(tvm::ffi::TensorView q, tvm::ffi::TensorView scale,
                         tvm::ffi::Optional<tvm::ffi::TensorView> prefix, tvm::ffi::TensorView x) {
  rowwise::dispatch_quantized(q, scale, prefix, x, tvm::ffi::Optional<tvm::ffi::TensorView>(), /*operands=*/1,
                              "gelu_tanh", quantized_kernels<__nv_bfloat16>(), quantized_kernels<__half>());
}

// The rows [prefix | gelu_tanh(x)] into joint, and each one's amax word (a whole-tensor float8 scale's).
void gelu_tanh_joint(tvm::ffi::TensorView joint, tvm::ffi::TensorView amax,
                     tvm::ffi::Optional<tvm::ffi::TensorView> prefix, tvm::ffi::TensorView x) {
  rowwise::dispatch_joint(joint, amax, prefix, x, tvm::ffi::Optional<tvm::ffi::TensorView>(), /*operands=*/1,
                          "gelu_tanh", gelu_tanh_kernel_joint<__nv_bfloat16>, gelu_tanh_kernel_joint<__half>);
}

}  // namespace
}  // namespace gelu_tanh
}  // namespace flux2_fused

TVM_FFI_DLL_EXPORT_TYPED_FUNC(gelu_tanh, flux2_fused::gelu_tanh::gelu_tanh);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(gelu_tanh_quantized, flux2_fused::gelu_tanh::gelu_tanh_quantized);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(gelu_tanh_joint, flux2_fused::gelu_tanh::gelu_tanh_joint);
