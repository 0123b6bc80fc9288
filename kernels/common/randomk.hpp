// SPDX-License-Identifier: Apache-2.0
// The indices of random-k (codec `randomk`, docs/contracts.md section 3), shared by the CPU and CUDA
// backends so that the same key gives the same indices on every rank and both backends: only the
// values travel. Integer operations only. Stratified random-k: Stich, Cordonnier & Jaggi,
// "Sparsified SGD with memory", NeurIPS 2018 (random-k with error feedback, section 2), one index
// per stratum as in Wangni et al., "Gradient sparsification for communication-efficient
// distributed optimization", NeurIPS 2018 (unbiased rescaling, section 3).
//
// Strata: n elements split into k contiguous strata as numpy.array_split does: with q = n / k and
// rem = n mod k, stratum j (0 <= j < k) starts at lo_j = j * q + min(j, rem) and holds
// size_j = q + (j < rem) elements (>= 1, since k <= n).
//
// The random bits, for EncodeContext {seed, step, bucket, chunk} (arithmetic modulo 2^32 on the
// 32-bit words, philox4x32_10(counter, key) as in philox.hpp):
//   1. once per encode: (m0, m1, m2, m3) = philox4x32_10({step, bucket, chunk, kRandomkTag},
//                                                        {seed mod 2^32, seed >> 32})
//   2. stratum j uses the call of group g = j / 2:
//        (w0, w1, w2, w3) = philox4x32_10({g mod 2^32, g >> 32, m2, m3}, {m0, m1})
//      and the 64-bit uniform U_j = w[2e] | w[2e + 1] << 32 with e = j mod 2;
//   3. its index: i_j = lo_j + floor(U_j * size_j / 2^64) (the high word of the 128-bit product:
//      each element of the stratum with probability 1/size_j up to size_j / 2^64).
// So the indices depend on (seed, step, bucket, chunk, n, k) only: not on the values, the thread
// count, the backend or any global generator; they ascend strictly (one per stratum).
#pragma once

#include <cstdint>

#include "math.hpp"
#include "philox.hpp"

namespace gradcomp::randomk {

//! Counter word 3 of the stream derivation: ASCII "RNDK" read as a big-endian u32.
inline constexpr uint32_t kRandomkTag = 0x524E444Bu;

//! The Philox key and counter words 2-3 of an encode's index stream (step 1 above).
struct Key {
  uint32_t k0, k1;
  uint32_t c2, c3;
};

GRADCOMP_HD Key derive(uint64_t seed, uint32_t step, uint32_t bucket, uint32_t chunk) {
  const philox::Ctr4x32 m =
      philox::philox4x32_10({step, bucket, chunk, kRandomkTag}, {uint32_t(seed), uint32_t(seed >> 32)});
  return Key{m[0], m[1], m[2], m[3]};
}

//! The strata of n elements into k (1 <= k <= n).
struct Strata {
  int64_t q = 0;   //!< n / k
  int64_t rem = 0; //!< n mod k: the first rem strata hold q + 1 elements
  GRADCOMP_HD int64_t lo(int64_t j) const { return j * q + (j < rem ? j : rem); }
  GRADCOMP_HD int64_t size(int64_t j) const { return q + (j < rem ? 1 : 0); }
  //! The stratum holding element i.
  GRADCOMP_HD int64_t of(int64_t i) const {
    const int64_t big = rem * (q + 1);
    return i < big ? i / (q + 1) : rem + (i - big) / q;
  }
};

GRADCOMP_HD Strata strata(int64_t n, int64_t k) { return Strata{n / k, n % k}; }

//! The index of stratum j (steps 2 and 3 above).
GRADCOMP_HD int64_t index_of(const Key& key, const Strata& s, int64_t j) {
  const uint64_t g = uint64_t(j) >> 1;
  const philox::Ctr4x32 w = philox::philox4x32_10({uint32_t(g), uint32_t(g >> 32), key.c2, key.c3}, {key.k0, key.k1});
  const uint64_t u = (j & 1) ? (uint64_t(w[2]) | uint64_t(w[3]) << 32) : (uint64_t(w[0]) | uint64_t(w[1]) << 32);
  return s.lo(j) + int64_t(philox::mulhi64(u, uint64_t(s.size(j))));
}

} // namespace gradcomp::randomk
