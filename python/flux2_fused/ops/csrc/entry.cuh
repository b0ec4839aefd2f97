// Host-side helpers every tvm-ffi entry shares: typed data pointers and the same-device check.
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>

namespace flux2_fused {

// The tensor's first element, typed (byte_offset included).
template <typename T>
T* data(const tvm::ffi::TensorView& t) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data_ptr()) + t.byte_offset());
}

// A tensor on another device than the launch's would be read or written through a foreign pointer.
inline void check_device(const tvm::ffi::TensorView& t, DLDevice dev) {
  TVM_FFI_ICHECK(t.device().device_type == dev.device_type && t.device().device_id == dev.device_id)
      << "every tensor must be on the output's device";
}

}  // namespace flux2_fused
