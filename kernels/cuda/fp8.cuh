// SPDX-License-Identifier: Apache-2.0
// The device float32 -> float8 conversions of the CUDA fp8 encoder (kernels/cuda/blockq.cu), in
// one place so that tests/cpp/test_cuda_convert_all.cu runs exactly these on the device.
//
// A finite quotient goes through the sm_89+/sm_90 hardware convert (cuda_fp8.h,
// __nv_cvt_float_to_fp8 with __NV_SATFINITE: one cvt.rn.satfinite.e4m3x2.f32 / e5m2x2 instruction
// on sm_90, round to nearest even); a non-finite one takes ml_dtypes' pattern
// (common::float_to_e4m3fn / float_to_e5m2: NaN -> 0x7F|sign for e4m3fn, 0x7E|sign for e5m2,
// +-inf -> NaN for e4m3fn, 0x7C|sign for e5m2). The encoder's quotients are x / scale with
// scale = amax / 448 (57344), so a finite quotient never exceeds the largest finite value by more
// than a rounding: below the overflow thresholds 464 (e4m3fn) and 61440 (e5m2), where satfinite
// and ml_dtypes agree (above them satfinite clamps to +-448 / +-57344 and ml_dtypes gives NaN / inf).
// Input: one float32; output: the code in the low 8 bits.
#pragma once

#include <cuda_fp8.h>

#include "../common/quant.hpp"

namespace gradcomp::detail::cuda {

__device__ __forceinline__ uint32_t fp8_e4m3_code(float q) {
  if (!common::is_finite_bits(__float_as_uint(q))) return common::float_to_e4m3fn(q);  // NaN / inf patterns
  return __nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3);
}
__device__ __forceinline__ uint32_t fp8_e5m2_code(float q) {
  if (!common::is_finite_bits(__float_as_uint(q))) return common::float_to_e5m2(q);
  return __nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E5M2);
}

} // namespace gradcomp::detail::cuda
