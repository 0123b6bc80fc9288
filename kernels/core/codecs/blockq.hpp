// SPDX-License-Identifier: Apache-2.0
// The block-quantizer family: codecs fp8, int8 and int4 (docs/contracts.md section 3), error feedback fused.
//
// y = x' / divisor (x' = x + r) is cut into blocks of `block` elements (0: the whole tensor as one
// block), the last one shorter. Per block a float32 decode scale d (or, scale=e8m0, a power of two
// stored as a float8_e8m0fnu byte) from the block's finite amax (common/quant.hpp), then one code
// per element:
//   fp8   (format=e4m3 | e5m2; TransformerEngine / torchao style delayed-free "current" scaling):
//         code = RNE(fl(y / d)) to float8_e4m3fn / float8_e5m2 exactly as ml_dtypes converts it;
//         a non-finite y takes ml_dtypes' pattern (e4m3fn NaN 0x7F|sign for NaN and +-inf; e5m2
//         NaN 0x7E|sign, +-inf 0x7C|sign); scale=e8m0 (OCP Microscaling, block 32): d = 2^ceil(log2
//         fl(amax / max_finite)), never 0 (an all-zero block has d = 1, byte 127);
//   int8 / int4 (symmetric; ZeRO++ qwZ/qgZ-like blocks, Wang et al. 2023): d = fl(amax / 127) (/ 7),
//         code = RNE(fl(y / d)) clamped to [-127, 127] ([-7, 7]); int4 packs two codes per byte, low
//         nibble first; a block holding a non-finite value gets d = NaN and all-zero codes;
//         rounding=stochastic (keyed): code = floor(q) + (u < q - floor(q)) clamped, u from
//         Philox4x32-10 words of the EncodeContext (common/keyed.hpp, common::int_code_sr).
// Decode: D = fl(float(code) * d). The residual keeps r_new = fl(x' - D) (fl(x' - fl(divisor * D))).
// The header's non-finite flag is set exactly when some r_new is not finite (x', D or divisor * D
// non-finite: a non-finite input, or a block near FLT_MAX whose decoded values overflow).
// Packet: header (main parameter: the block; wire dtype: the code dtype), section "codes" (numel
// codes), section "scales" (one per block: float32, or float8_e8m0fnu bytes).
#pragma once

#include "../backend.hpp"

namespace gradcomp::detail {

enum class QuantKind : uint8_t { e4m3 = 0, e5m2 = 1, int8 = 2, int4 = 3 };

struct BlockQPlan {
  DType input = DType::float32;
  QuantKind kind = QuantKind::e4m3;
  bool e8m0 = false;        //!< power-of-two scales stored as float8_e8m0fnu bytes
  bool stochastic = false;  //!< int8 / int4 rounding=stochastic: codes from common::int_code_sr with
                            //!< the uniforms of kernels/common/keyed.hpp (tag kIntSrTag); a key section
  int64_t numel = 0;
  int64_t block = 0;        //!< elements per block, numel for block=0 (the whole tensor)
  int64_t nblocks = 0;      //!< ceil(numel / block)
  int threads = 1;          //!< CPU threads of this call
  PacketLayout layout;      //!< section 0: codes, section 1: scales
};

//! Counter word 3 of the int8 / int4 stochastic rounding's stream: ASCII "INTR" read big-endian.
inline constexpr uint32_t kIntSrTag = 0x494E5452u;

//! The largest finite code magnitude of `k` (448, 57344, 127, 7).
inline float quant_max(QuantKind k) {
  return k == QuantKind::e4m3 ? 448.0f : k == QuantKind::e5m2 ? 57344.0f : k == QuantKind::int8 ? 127.0f : 7.0f;
}

namespace cpu {
extern const Kernels<BlockQPlan> blockq;
} // namespace cpu
namespace cuda {
extern const Kernels<BlockQPlan> blockq;
} // namespace cuda

} // namespace gradcomp::detail
