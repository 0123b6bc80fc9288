// SPDX-License-Identifier: Apache-2.0
// Reference helpers for the gtest suite (docs/contracts.md section 7). Everything here is written
// independently of kernels/common/math.hpp and kernels/cpu: the float -> float16 / bfloat16
// conversions are a nearest-value search over the sorted table of all finite 16-bit values (exact
// midpoints computed in binary64, ties to the even bit pattern), the 16-bit -> float conversions
// use std::ldexp, top-k uses std::stable_sort over explicit keys. Nothing here calls the library
// except to allocate through its public API (packet_bytes, workspace_bytes, encode, decode).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gradcomp/gradcomp.hpp"
#include "seed.hpp"

namespace ref {

using gradcomp::DType;

inline uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---- 16-bit formats ---------------------------------------------------------------------------
// Magnitude of a positive 16-bit pattern as a binary64 value, computed with ldexp. The exponent
// field of all-ones is treated like any other exponent, so the first pattern past the largest
// finite value (0x7C00 / 0x7F80) gets the value 2^16 / 2^128: that is where values round to
// infinity (ties to the even pattern 0x7C00 / 0x7F80, i.e. at 65520 for float16).
inline double half_mag(uint32_t b) {
  const int e = int(b >> 10), m = int(b & 0x3FF);
  return e == 0 ? std::ldexp(double(m), -24) : std::ldexp(double(1024 + m), e - 25);
}
inline double bf16_mag(uint32_t b) {
  const int e = int(b >> 7), m = int(b & 0x7F);
  return e == 0 ? std::ldexp(double(m), -133) : std::ldexp(double(128 + m), e - 134);
}

struct Table16 {
  std::vector<double> v; // v[b] for b in [0, top]; strictly increasing
  uint16_t top;          // the infinity pattern
  uint16_t nan;          // canonical quiet NaN (positive)
};
inline const Table16& half_table() {
  static const Table16 t = [] {
    Table16 t;
    t.top = 0x7C00;
    t.nan = 0x7E00;
    for (uint32_t b = 0; b <= t.top; ++b) t.v.push_back(half_mag(b));
    return t;
  }();
  return t;
}
inline const Table16& bf16_table() {
  static const Table16 t = [] {
    Table16 t;
    t.top = 0x7F80;
    t.nan = 0x7FC0;
    for (uint32_t b = 0; b <= t.top; ++b) t.v.push_back(bf16_mag(b));
    return t;
  }();
  return t;
}

// Nearest entry of the table to f, ties to the even pattern; NaN -> canonical quiet NaN with the
// sign kept; results at or past the top pattern are infinity.
inline uint16_t round16(const Table16& t, float f) {
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (std::isnan(f)) return sign | t.nan;
  const double a = std::fabs(double(f));
  if (a >= t.v[t.top]) return sign | t.top;
  // first entry > a; a >= v[0] = 0 so the index is >= 1
  const size_t hi = size_t(std::upper_bound(t.v.begin(), t.v.end(), a) - t.v.begin());
  const size_t lo = hi - 1;
  if (t.v[lo] == a) return uint16_t(sign | lo);
  const double mid = (t.v[lo] + t.v[hi]) / 2; // exact: both have few significant bits
  size_t r;
  if (a < mid) r = lo;
  else if (a > mid) r = hi;
  else r = (lo & 1) ? hi : lo;
  return uint16_t(sign | r);
}
inline uint16_t f32_to_f16(float f) { return round16(half_table(), f); }
inline uint16_t f32_to_bf16(float f) { return round16(bf16_table(), f); }

// 16-bit -> float32 (exact). NaNs come back as a quiet NaN with the sign (payloads unspecified).
inline float f16_to_f32(uint16_t h) {
  const bool neg = h & 0x8000;
  const uint32_t a = h & 0x7FFF;
  if (a > 0x7C00) return neg ? -std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::quiet_NaN();
  if (a == 0x7C00) return neg ? -INFINITY : INFINITY;
  const float v = float(half_mag(a));
  return neg ? -v : v;
}
inline float bf16_to_f32(uint16_t h) {
  const bool neg = h & 0x8000;
  const uint32_t a = h & 0x7FFF;
  if (a > 0x7F80) return neg ? -std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::quiet_NaN();
  if (a == 0x7F80) return neg ? -INFINITY : INFINITY;
  const float v = float(bf16_mag(a));
  return neg ? -v : v;
}

// Round a float32 into `dt` and back; returns the stored bits (u32 for float32, u16 otherwise).
inline uint32_t to_dtype_bits(DType dt, float f) {
  switch (dt) {
    case DType::float16: return f32_to_f16(f);
    case DType::bfloat16: return f32_to_bf16(f);
    default: return bits(f);
  }
}
inline float from_dtype_bits(DType dt, uint32_t b) {
  switch (dt) {
    case DType::float16: return f16_to_f32(uint16_t(b));
    case DType::bfloat16: return bf16_to_f32(uint16_t(b));
    default: return from_bits(b);
  }
}
inline int64_t esize(DType dt) { return dt == DType::float32 ? 4 : 2; }

//! Equal bit patterns, or both NaN with the same sign (payloads are not specified for float32).
inline bool same_f32(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b) && std::signbit(a) == std::signbit(b);
  return bits(a) == bits(b);
}

// ---- memory ---------------------------------------------------------------------------------
struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
//! 64-byte aligned zero-initialised bytes.
struct Bytes {
  std::unique_ptr<uint8_t[], FreeDeleter> p;
  int64_t n = 0;
  explicit Bytes(int64_t bytes = 0) : n(bytes) {
    const size_t sz = size_t((bytes + 64) / 64 * 64);
    p.reset(static_cast<uint8_t*>(std::aligned_alloc(64, sz)));
    std::memset(p.get(), 0, sz);
  }
  uint8_t* data() const { return p.get(); }
  gradcomp::Tensor tensor() const { return {p.get(), DType::uint8, n, {}}; }
};

//! A flat input of dtype float32/float16/bfloat16, stored as raw bits.
struct Input {
  DType dt = DType::float32;
  std::vector<float> f;     // float32 storage
  std::vector<uint16_t> h;  // float16/bfloat16 storage
  int64_t n() const { return dt == DType::float32 ? int64_t(f.size()) : int64_t(h.size()); }
  float at(int64_t i) const { return dt == DType::float32 ? f[i] : from_dtype_bits(dt, h[i]); }
  const void* data() const { return dt == DType::float32 ? static_cast<const void*>(f.data()) : h.data(); }
  gradcomp::Tensor tensor() const { return {const_cast<void*>(data()), dt, n(), {}}; }
  //! Build from float32 values, rounding each into dt with the reference conversion.
  static Input from_floats(DType dt, const std::vector<float>& v) {
    Input in;
    in.dt = dt;
    if (dt == DType::float32) in.f = v;
    else
      for (float x : v) in.h.push_back(uint16_t(to_dtype_bits(dt, x)));
    return in;
  }
};

inline gradcomp::Tensor f32_tensor(std::vector<float>& v) { return {v.data(), DType::float32, int64_t(v.size()), {}}; }

// ---- random inputs ------------------------------------------------------------------------------
// The tests seed every generator they pass to these helpers from test_seed() (seed.hpp: fixed
// by default, GRADCOMP_TEST_SEED overrides it, printed once).

enum class Dist { normal, ties, constant, zeros, wide, outlier, specials };
inline const char* dist_name(Dist d) {
  switch (d) {
    case Dist::normal: return "normal";
    case Dist::ties: return "ties";
    case Dist::constant: return "constant";
    case Dist::zeros: return "zeros";
    case Dist::wide: return "wide";
    case Dist::outlier: return "outlier";
    case Dist::specials: return "specials";
  }
  return "?";
}

//! n float32 values of a distribution. `wide`: random signs and exponents over the whole float32
//! range including subnormals; `specials`: normal values salted with +-inf, NaNs of both signs,
//! -0.0, subnormals.
inline std::vector<float> make_values(Dist d, int64_t n, std::mt19937_64& g) {
  std::vector<float> v(static_cast<size_t>(n));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> small(-3, 3);
  switch (d) {
    case Dist::normal:
      for (auto& x : v) x = nd(g);
      break;
    case Dist::ties:
      for (auto& x : v) x = 0.5f * float(small(g));
      break;
    case Dist::constant:
      for (auto& x : v) x = -1.25f;
      break;
    case Dist::zeros:
      for (auto& x : v) x = (g() & 1) ? -0.0f : 0.0f;
      break;
    case Dist::wide: {
      for (auto& x : v) {
        uint32_t u = uint32_t(g());
        if ((u & 0x7F800000u) == 0x7F800000u) u &= 0xBFFFFFFFu; // keep it finite
        x = from_bits(u);
      }
      break;
    }
    case Dist::outlier:
      for (auto& x : v) x = 1e-3f * nd(g);
      if (n) v[size_t(g() % uint64_t(n))] = -3e30f;
      break;
    case Dist::specials: {
      const float sp[] = {INFINITY, -INFINITY, std::numeric_limits<float>::quiet_NaN(),
                          -std::numeric_limits<float>::quiet_NaN(), from_bits(0x7F800001u), from_bits(0xFFC12345u),
                          -0.0f, 0.0f, from_bits(1), from_bits(0x807FFFFFu), 65504.0f, -65520.0f};
      for (auto& x : v) x = (g() % 8 == 0) ? sp[g() % 12] : nd(g);
      break;
    }
  }
  return v;
}

// ---- top-k reference -------------------------------------------------------------------------
struct TopKRef {
  std::vector<uint64_t> idx;    // ascending
  std::vector<uint32_t> vals;   // value bits in the value dtype
  std::vector<float> r_new;     // when a residual was given
  bool nonfinite = false;
};

//! Reference top-k: y = fl(fl(x + r) / divisor); sort indices by (|y| desc with every NaN above
//! +inf and all NaNs tied, index asc) with std::stable_sort; take k; sort ascending.
inline TopKRef topk_ref(const Input& x, const std::vector<float>* r, float divisor, int64_t k, DType vdt) {
  const int64_t n = x.n();
  std::vector<float> xp(static_cast<size_t>(n)), y(static_cast<size_t>(n));
  TopKRef out;
  for (int64_t i = 0; i < n; ++i) {
    float v = x.at(i);
    if (r) v = v + (*r)[size_t(i)];
    xp[size_t(i)] = v;
    y[size_t(i)] = divisor == 1.0f ? v : v / divisor;
    if (!std::isfinite(y[size_t(i)])) out.nonfinite = true;
  }
  std::vector<uint8_t> isnan_(static_cast<size_t>(n));
  std::vector<float> mag(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    isnan_[size_t(i)] = std::isnan(y[size_t(i)]);
    mag[size_t(i)] = isnan_[size_t(i)] ? 0.0f : std::fabs(y[size_t(i)]);
  }
  std::vector<uint64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[size_t(i)] = uint64_t(i);
  std::stable_sort(order.begin(), order.end(), [&](uint64_t a, uint64_t b) {
    if (isnan_[a] != isnan_[b]) return isnan_[a] > isnan_[b];
    if (isnan_[a]) return false;
    return mag[a] > mag[b];
  });
  order.resize(size_t(std::min(k, n)));
  std::sort(order.begin(), order.end());
  out.idx = order;
  if (r) out.r_new = xp;
  for (uint64_t i : order) {
    const uint32_t b = to_dtype_bits(vdt, y[i]);
    const float d = from_dtype_bits(vdt, b);
    if (!std::isfinite(d)) out.nonfinite = true;
    out.vals.push_back(b);
    if (r) out.r_new[i] = divisor == 1.0f ? xp[i] - d : xp[i] - divisor * d;
  }
  return out;
}

// ---- packets ------------------------------------------------------------------------------------
inline gradcomp::PacketHeader header_of(const uint8_t* p) {
  gradcomp::PacketHeader h;
  std::memcpy(&h, p, sizeof h);
  return h;
}
inline uint64_t load_index(const uint8_t* p, DType idt, int64_t j) {
  if (idt == DType::uint64) {
    uint64_t v;
    std::memcpy(&v, p + 8 * j, 8);
    return v;
  }
  uint32_t v;
  std::memcpy(&v, p + 4 * j, 4);
  return v;
}
inline uint32_t load_value_bits(const uint8_t* p, DType vdt, int64_t j) {
  if (vdt == DType::float32) {
    uint32_t v;
    std::memcpy(&v, p + 4 * j, 4);
    return v;
  }
  uint16_t v;
  std::memcpy(&v, p + 2 * j, 2);
  return v;
}
inline int64_t align16(int64_t b) { return (b + 15) / 16 * 16; }

//! Result of one encode through the public API.
struct Encoded {
  Bytes packet;
  std::vector<float> residual;
  int64_t packet_bytes = 0;
};

//! Encode with a fresh workspace sized for the current thread count; the packet buffer is
//! pre-filled with 0xCD so that unwritten padding shows.
inline Encoded encode(const gradcomp::Codec& c, const Input& x, const std::vector<float>* r, float divisor = 1.0f) {
  // Packet and workspace get 256 guard bytes past their end that must stay untouched.
  constexpr int64_t kGuard = 256;
  Encoded e;
  e.packet_bytes = c.packet_bytes(x.n(), x.dt);
  e.packet = Bytes(e.packet_bytes + kGuard);
  e.packet.n = e.packet_bytes;
  std::memset(e.packet.data(), 0xCD, size_t(e.packet_bytes + kGuard));
  const int64_t wb = c.workspace_bytes(x.n(), x.dt, {});
  Bytes ws(wb + kGuard);
  ws.n = wb;
  std::memset(ws.data(), 0xEE, size_t(wb + kGuard));
  std::memset(ws.data(), 0, 16);
  gradcomp::Tensor rt;
  if (r) {
    e.residual = *r;
    rt = f32_tensor(e.residual);
  }
  c.encode(x.tensor(), r ? &rt : nullptr, e.packet.tensor(), ws.tensor(), divisor);
  for (int64_t i = 0; i < kGuard; ++i) {
    if (e.packet.data()[e.packet_bytes + i] != 0xCD) {
      ADD_FAILURE() << "encode wrote past the packet end (byte " << e.packet_bytes + i << ")";
      break;
    }
    if (ws.data()[wb + i] != 0xEE) {
      ADD_FAILURE() << "encode wrote past the workspace end (byte " << wb + i << ")";
      break;
    }
  }
  return e;
}

//! Decode into a fresh float32 vector (assign, alpha 1).
inline std::vector<float> decode_f32(const gradcomp::Codec& c, const Bytes& packet, int64_t n, uint32_t* status = nullptr) {
  std::vector<float> out(size_t(n), 123.0f);
  Bytes ws(16);
  c.decode(packet.tensor(), f32_tensor(out), ws.tensor());
  if (status) *status = gradcomp::read_status(ws.tensor());
  return out;
}

//! Scoped thread count.
struct Threads {
  int old;
  explicit Threads(int n) : old(gradcomp::get_num_threads()) { gradcomp::set_num_threads(n); }
  ~Threads() { gradcomp::set_num_threads(old); }
};

} // namespace ref
