// SPDX-License-Identifier: Apache-2.0
// The QSGD family: codec `qsgd:levels=s,block=B` (docs/contracts.md section 3; Alistarh et al.,
// NeurIPS 2017, section 3.1, with GRACE's defaults s = 127, B = 128). Keyed: the stochastic
// rounding draws Philox4x32-10 words from the EncodeContext (kernels/common/qsgd.hpp says exactly
// how), so the same input and key give the same packet on every rank and on CPU and CUDA.
//
// y = x' / W (x' = x + r) in blocks of B elements (1 <= B <= 4096, the last block shorter); per
// block a float32 L2 norm (binary64 sum of y^2 in the fixed lane order of common/reduce.hpp,
// rounded once) and per element an int8 code sign(y) * level, level in [0, s] rounded up with
// probability q - floor(q), q = fl(fl(s / norm) * |y|). Decode: D = fl(fl(norm / s) * code). A block
// holding a non-finite y gets norm NaN and zero codes (D = NaN: the bucket stays non-finite) and
// sets the header flag. Residual: r = fl(x' - D) (fl(x' - fl(W * D))).
// Packet (coding=dense): header (main parameter: the block; wire dtype int8), "codes": n int8,
// "norms": one float32 per block, then the 32-byte key section.
// Packet (coding=elias; QSGD section 3.2): header (main parameter: the stream's bit count, a maximum
// of 8 n; wire dtype uint8), "stream": n bytes holding the Elias-delta stream of the same codes
// (kernels/common/elias.hpp), "norms", "ends": the stream bit at which each block's part ends
// (uint32; block b spans [ends[b-1], ends[b]), ends[-1] = 0; so numel < 2^28: at most 13 bits per
// element), then the key section.
// When the stream would pass its n-byte capacity the packet carries the dense int8 codes in "stream"
// instead, main parameter 0, ends 0, and sets header flag bit 1 (kFlagFallback). Either way the
// decoded values (and so the residual) are those of coding=dense.
#pragma once

#include "../backend.hpp"

namespace gradcomp::detail {

struct QsgdPlan {
  DType input = DType::float32;
  int64_t numel = 0;
  int64_t block = 128;
  int64_t nblocks = 0; //!< ceil(numel / block)
  int levels = 127;
  int threads = 1;     //!< CPU threads of this call
  bool elias = false;  //!< coding=elias
  PacketLayout layout; //!< section 0: codes (elias: stream); 1: norms; elias: 2: ends; then the key
};

namespace cpu {
extern const Kernels<QsgdPlan> qsgd;
} // namespace cpu
namespace cuda {
extern const Kernels<QsgdPlan> qsgd;
} // namespace cuda

} // namespace gradcomp::detail
