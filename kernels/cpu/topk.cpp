// SPDX-License-Identifier: Apache-2.0
// CPU backend of exact top-k by magnitude (docs/contracts.md section 3) with fused error feedback.
//
// Algorithm: a parallel MSD radix select over the 31-bit |y| keys (common::abs_key), digits of
// 11, 11 and 9 bits, in the manner of AIR Top-K (Zhang et al., "Parallel Top-K Algorithms on GPU",
// SC'23, section 4) adapted to threads:
//   * each pass builds per-thread histograms of the current digit over the current candidates
//     (the elements whose higher digits equal the prefix of the k-th key);
//   * the bucket holding the k-th key becomes the new prefix; elements above it are selected for
//     sure, and per-thread counts of both are kept;
//   * candidates (and the sure elements) are filtered into a buffer, in index order, as long as
//     they are few (adaptive buffer, capacity ~n/16); later passes then read only the buffer; with
//     too many candidates the next pass re-reads the input instead;
//   * early stop as soon as the candidates exactly fill k;
//   * ties at the k-th key go to the lowest indices: threads own contiguous index ranges, so a
//     prefix sum over the per-thread tie counts decides which ties each thread keeps, and each
//     thread writes its selection at its prefix-sum offset -- output indices ascend, and the result
//     does not depend on the thread count.
// Sampled prefilter (an addition to AIR, in the spirit of the sampled thresholds of DGC, Lin et
// al., ICLR'18): a lower bound for the k-th key taken from a strided sample lets the first pass
// already buffer every element at or above it; when at least k elements pass, the buffer is closed
// upward and holds the k-th key, so the radix select runs on the buffer alone and the input is read
// once. Otherwise the full radix select runs (2-4 reads). The sample only changes the speed.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "../core/codecs/topk.hpp"
#include "isa.hpp"
#include "parallel.hpp"

namespace GRADCOMP_CPU_NAMESPACE {
namespace {

using common::abs_key;
using common::add_rn;
using common::bits_float;
using common::div_rn;
using common::mul_rn;
using common::sub_rn;
using common::float_bits;
using common::is_finite_bits;
constexpr int kB = common::kRadixBuckets;

inline uint32_t key_of_bits(uint32_t y) { return abs_key(bits_float(y)); }


// Where y comes from: x (converted to float32), plus the residual, divided by the divisor.
template <class In, bool HasRes, bool Div1>
struct Source {
  static constexpr bool has_res = HasRes;
  // y is x itself: float32 input, no residual, divisor 1
  static constexpr bool direct = std::is_same_v<In, F32> && !HasRes && Div1;
  const typename In::storage* x;
  float* r;
  float div;
  // First touch: x' = fl(x + r) is stored into r (it is r_new for every element not sent).
  float first(int64_t i) const {
    float xp = In::load(x[i]);
    if constexpr (HasRes) {
      xp = add_rn(xp, r[i]);
      r[i] = xp;
    }
    return Div1 ? xp : div_rn(xp, div);
  }
  float xprime(int64_t i) const {
    if constexpr (HasRes) return r[i];
    else return In::load(x[i]);
  }
  float again(int64_t i) const { return Div1 ? xprime(i) : div_rn(xprime(i), div); }
  // y without touching the residual (for sampling before the first pass).
  float peek(int64_t i) const {
    float xp = In::load(x[i]);
    if constexpr (HasRes) xp = add_rn(xp, r[i]);
    return Div1 ? xp : div_rn(xp, div);
  }
  // r_new of a sent element whose decoded value is d (x' is in r since the first touch).
  void settle(int64_t i, float d) const {
    if constexpr (HasRes) r[i] = Div1 ? sub_rn(r[i], d) : sub_rn(r[i], mul_rn(div, d));
  }
};

// Workspace layout (after the 16-byte status word): per-thread histograms (u64), per-thread
// counters, then the candidate buffer (y as float32 bits, indices u64).
struct Workspace {
  uint64_t* hist;   // [T][kB]
  int64_t* above;   // [T] selected for sure so far
  int64_t* cls;     // [T] in the current class (prefix bucket)
  int64_t* off;     // [T] buffer segment of each thread: [off, end)
  int64_t* end;     // [T]
  int64_t* count;   // [T] prefilter pass counts
  int64_t* take;    // [T] ties each thread keeps
  int64_t* dst;     // [T] output offset of each thread
  uint32_t* cand_y; // [cap]
  uint64_t* cand_i; // [cap]
  int64_t cap;

  static int64_t bytes(int T, int64_t cap) {
    return kStatusBytes + int64_t(T) * kB * 8 + 8 * int64_t(T) * 8 + align16(cap * 4) + cap * 8;
  }
  Workspace(uint8_t* base, int T, int64_t cap_) : cap(cap_) {
    uint8_t* p = base + kStatusBytes;
    hist = reinterpret_cast<uint64_t*>(p);
    p += int64_t(T) * kB * 8;
    above = reinterpret_cast<int64_t*>(p);
    cls = above + T;
    off = cls + T;
    end = off + T;
    count = end + T;
    take = count + T;
    dst = take + T;
    p += 8 * int64_t(T) * 8;
    cand_y = reinterpret_cast<uint32_t*>(p);
    p += align16(cap * 4);
    cand_i = reinterpret_cast<uint64_t*>(p);
  }
};

// Histogram of digit (key >> shift) & mask over keys with lo <= key <= hi (all keys when
// filtering is off), for i in [b, e). Two interleaved sub-histograms break the dependency chain
// of repeated increments of one bucket (gradients concentrate in few exponents); keys outside
// [lo, hi] count into 16 spare buckets (by index, so that they form no dependency chain either)
// instead of taking an unpredictable branch.
template <bool Filter, class KeyAt>
void histogram(int64_t b, int64_t e, KeyAt key_at, int shift, uint32_t mask, uint32_t lo, uint32_t hi, uint64_t* out) {
  alignas(64) uint32_t h[2][kB + 16];
  auto bucket = [&](uint32_t key, int64_t i) -> uint32_t {
    const uint32_t d = (key >> shift) & mask;
    if constexpr (Filter) {
      const uint32_t spare = uint32_t(kB) + uint32_t(i & 15);
      const uint32_t in = uint32_t(key - lo <= hi - lo);  // lo <= key <= hi, arithmetic only
      return spare + ((d - spare) & (0u - in));
    } else {
      return d;
    }
  };
  for (int64_t blk = b; blk < e; blk += int64_t(1) << 30) {
    const int64_t be = std::min(e, blk + (int64_t(1) << 30));
    std::memset(h, 0, sizeof h);
    int64_t i = blk;
    for (; i + 1 < be; i += 2) {
      ++h[0][bucket(key_at(i), i)];
      ++h[1][bucket(key_at(i + 1), i + 1)];
    }
    if (i < be) ++h[0][bucket(key_at(i), i)];
    for (int d = 0; d < kB; ++d) out[d] += uint64_t(h[0][d]) + h[1][d];
  }
}

// Append (y bits, i) for every i in [b, e) whose key(y) >= lo, starting at slot o0; at most
// o1 - o0 entries are stored. `Touch` selects src.first (stores x' into the residual) or
// src.again. Returns the number of entries that passed (more than o1 - o0 means overflow).
template <bool Touch, class Src>
int64_t filter(const Src& src, int64_t b, int64_t e, uint32_t lo, uint32_t* cy, uint64_t* ci, int64_t o0, int64_t o1) {
  auto y_at = [&](int64_t i) { return Touch ? src.first(i) : src.again(i); };
  int64_t o = o0, passed = 0;
  int64_t i = b;
#if defined(__AVX512F__)
  // 16 elements at a time: y computed by an auto-vectorized loop, keys compared in one mask,
  // hits written with compress stores (about 2% of the vectors hold a hit at k = 1%).
  const __m512i vlo = _mm512_set1_epi32(int(lo));
  const __m512i vabs = _mm512_set1_epi32(0x7FFFFFFF);
  const __m512i iota0 = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i iota1 = _mm512_set_epi64(15, 14, 13, 12, 11, 10, 9, 8);
  // y is computed a block of 256 ahead, so the vector loads below never wait on the stores.
  alignas(64) float yblock[256];
  for (; i + 16 <= e; i += 16) {
    const float* yb;
    // Software prefetch some 4 KiB ahead: on this loop (a mispredicted branch per hit) the
    // hardware prefetcher alone leaves the read well below the copy bandwidth.
    if constexpr (Src::direct) {
      yb = reinterpret_cast<const float*>(src.x) + i;
      _mm_prefetch(reinterpret_cast<const char*>(yb + 1024), _MM_HINT_T0);
    } else {
      const int64_t bo = (i - b) & 255;
      if (bo == 0) {
        const int64_t len = std::min<int64_t>(256, (e - i) / 16 * 16);
        for (int64_t j = 0; j < len; ++j) yblock[j] = y_at(i + j);
      }
      yb = yblock + bo;
      _mm_prefetch(reinterpret_cast<const char*>(src.x + i + 1024), _MM_HINT_T0);
      if constexpr (Src::has_res) _mm_prefetch(reinterpret_cast<const char*>(src.r + i + 1024), _MM_HINT_T0);
    }
    const __m512i yv = _mm512_loadu_si512(yb);
    // |y| bits >= lo is key >= lo: lo never exceeds the NaN key, so mapping NaNs is not needed
    const __mmask16 m = _mm512_cmpge_epu32_mask(_mm512_and_si512(yv, vabs), vlo);
    if (m) {
      const int c = std::popcount(unsigned(m));
      if (o + 16 <= o1) {
        // compress in registers and store whole vectors (the slots past the hits are scratch
        // that later hits overwrite; compress-to-memory is much slower on current x86 cores)
        _mm512_storeu_si512(cy + o, _mm512_maskz_compress_epi32(m, yv));
        const __m512i base = _mm512_set1_epi64(i);
        const __mmask8 m0 = __mmask8(m & 0xFF), m1 = __mmask8(m >> 8);
        _mm512_storeu_si512(ci + o, _mm512_maskz_compress_epi64(m0, _mm512_add_epi64(base, iota0)));
        _mm512_storeu_si512(ci + o + std::popcount(unsigned(m0)), _mm512_maskz_compress_epi64(m1, _mm512_add_epi64(base, iota1)));
        o += c;
      } else {  // near the end of the region: one entry at a time
        for (int j = 0; j < 16; ++j)
          if (((m >> j) & 1) && o < o1) {
            cy[o] = float_bits(yb[j]);
            ci[o] = uint64_t(i + j);
            ++o;
          }
      }
      passed += c;
    }
  }
#endif
  for (; i < e; ++i) {
    const float y = y_at(i);
    if (abs_key(y) >= lo) {
      if (o < o1) {
        cy[o] = float_bits(y);
        ci[o] = uint64_t(i);
        ++o;
      }
      ++passed;
    }
  }
  return passed;
}

struct Selection {
  int level = 0;
  uint32_t prefix = 0; // digits fixed so far
  int64_t k_rem = 0;   // still to take from the current class
  int64_t cls = 0;     // elements in the current class
  uint32_t lo() const { return prefix << common::kRadixShift[level]; }
  uint32_t hi() const {
    const int s = common::kRadixShift[level];
    return s == 0 ? prefix : (((prefix + 1u) << s) - 1u);
  }
};

// Merge per-thread histograms, find the bucket of the k-th key among the current class, and
// advance the selection.
void choose(Selection& s, Workspace& w, int T, int next_level, bool first) {
  uint64_t total[kB];
  for (int d = 0; d < kB; ++d) {
    uint64_t sum = 0;
    for (int t = 0; t < T; ++t) sum += w.hist[int64_t(t) * kB + d];
    total[d] = sum;
  }
  int64_t acc = 0;
  int b = 0;
  for (int d = kB - 1; d >= 0; --d) {
    if (acc + int64_t(total[d]) >= s.k_rem) {
      b = d;
      break;
    }
    acc += int64_t(total[d]);
  }
  for (int t = 0; t < T; ++t) {
    const uint64_t* h = w.hist + int64_t(t) * kB;
    int64_t a = 0;
    for (int d = b + 1; d < kB; ++d) a += int64_t(h[d]);
    w.above[t] = (first ? 0 : w.above[t]) + a;
    w.cls[t] = int64_t(h[b]);
  }
  s.k_rem -= acc;
  s.cls = int64_t(total[b]);
  s.prefix = first ? uint32_t(b) : ((s.prefix << common::kRadixBits[next_level]) | uint32_t(b));
  s.level = next_level;
}

constexpr uint32_t kNoGuess = 0xFFFFFFFFu;

// Lower bound for the k-th key from a strided sample of S = 8192 elements: the sample's key at
// rank ks + 4 sqrt(ks) + 16, where ks = k S / n is the sample's share of k (the count of a sample
// rank fluctuates by about its square root, so the margin is some 4 standard deviations), capped
// at the +inf key (so the buffer holds every non-finite value). kNoGuess below 2^18 elements or
// when the sample predicts more candidates than 80% of a thread's buffer region.
// `scratch` holds S keys (the candidate buffer, unused at that point).
template <class Src>
uint32_t guess_lo(const Src& src, int64_t n, int64_t k, int64_t region, uint32_t* scratch, int T) {
  constexpr int64_t S = 8192;
  if (n < (int64_t(1) << 18)) return kNoGuess;
  uint32_t* keys = scratch;
  const int64_t stride = n / S;
#pragma omp parallel for num_threads(T) schedule(static)
  for (int64_t j = 0; j < S; ++j) keys[j] = abs_key(src.peek(j * stride));
  const double ks = double(k) * double(S) / double(n);
  const int64_t rank = std::min<int64_t>(S, int64_t(std::ceil(ks + 4.0 * std::sqrt(ks) + 16.0)));
  std::nth_element(keys, keys + (rank - 1), keys + S, std::greater<uint32_t>());
  const uint32_t g = std::min(keys[rank - 1], common::kInfKey);
  int64_t at_least = 0;
  for (int64_t j = 0; j < S; ++j) at_least += keys[j] >= g;
  if (double(at_least) * double(n) / double(S) > 0.8 * double(region)) return kNoGuess;
  return g;
}

// The packet's index and value sections with the dtypes as template arguments.
template <class V, class I>
struct TypedEntries {
  I* idx;
  typename V::storage* val;
  // Writes entry o: index i, and y rounded to the value dtype. Returns that value as decoded.
  float put(int64_t o, int64_t i, float y) const {
    const auto c = V::store(y);
    idx[o] = I(i);
    val[o] = c;
    return V::load(c);
  }
};

// The packet's index and value sections with the dtypes as run-time values: topk_run is compiled
// once per source, and only its loops that write entries (visit) per (value, index) dtype pair.
// Compiled whole per pair, topk_run took 70 % of this file's build time, in every CPU variant.
struct Entries {
  uint8_t* idx;
  uint8_t* val;
  bool wide;    // uint64 indices (else uint32)
  DType value;  // float32, float16 or bfloat16 (encode() checks)
  // f(TypedEntries<V, I>{...}) for the packet's dtypes.
  template <class F> void visit(F&& f) const {
    auto with_index = [&](auto v) {
      using V = decltype(v);
      auto* vals = reinterpret_cast<typename V::storage*>(val);
      if (wide) f(TypedEntries<V, uint64_t>{reinterpret_cast<uint64_t*>(idx), vals});
      else f(TypedEntries<V, uint32_t>{reinterpret_cast<uint32_t*>(idx), vals});
    };
    switch (value) {
      case DType::float16: with_index(common::F16{}); break;
      case DType::bfloat16: with_index(common::BF16{}); break;
      default: with_index(common::F32{}); break;
    }
  }
};

// k == 0 (nothing) or k == n (`all`: everything): one pass touches every element (x' into the
// residual) and, for all, writes it. Returns the non-finite flag. (The loops that write entries
// are functions of their own: clang rejects an OpenMP region inside a generic lambda that reads
// the enclosing function's locals.)
template <class E, class Src>
uint32_t select_trivial(const E& entries, const Src& src, int64_t n, bool all, int T) {
  uint32_t flag = 0;
#pragma omp parallel for num_threads(T) schedule(static) reduction(| : flag)
  for (int64_t i = 0; i < n; ++i) {
    const float y = src.first(i);
    flag |= !is_finite_bits(float_bits(y));
    if (all) {
      const float d = entries.put(i, i, y);
      src.settle(i, d);
      flag |= !is_finite_bits(float_bits(d));
    }
  }
  return flag;
}

// The final scan: thread t writes, from entry w.dst[t] on, every key > hi of its part and the
// first w.take[t] keys in [lo, hi], in index order, from the candidate buffer (`buffered`) or the
// input. Returns whether a sent value is non-finite.
template <class E, class Src>
uint32_t emit_selected(const E& entries, const Src& src, const Workspace& w, int64_t n, uint32_t lo, uint32_t hi,
                       bool buffered, int T) {
  uint32_t nonfinite_sent = 0;
#pragma omp parallel num_threads(T) reduction(| : nonfinite_sent)
  for (int t = thread_id(); t < T; t += team_size()) {
    int64_t o = w.dst[t], taken = 0;
    auto emit = [&](int64_t i, float y) {
      const uint32_t key = abs_key(y);
      if (key < lo) return;
      if (key > hi || taken++ < w.take[t]) {
        const float d = entries.put(o++, i, y);
        src.settle(i, d);
        nonfinite_sent |= !is_finite_bits(float_bits(d));
      }
    };
    if (buffered) {
      for (int64_t j = w.off[t]; j < w.end[t]; ++j) emit(int64_t(w.cand_i[j]), bits_float(w.cand_y[j]));
    } else {
      int64_t b, e;
      partition(n, T, t, b, e);
      for (int64_t i = b; i < e; ++i) emit(i, src.again(i));
    }
  }
  return nonfinite_sent;
}

template <class Src>
void topk_run(const TopKPlan& p, const Src& src, uint8_t* packet, const EncodeContext& ctx, uint8_t* ws_base) {
  const int64_t n = p.numel, k = p.k;
  const Entries out{packet + p.layout.sections[0].offset, packet + p.values_offset, p.index_dtype == DType::uint64,
                    p.value_dtype};
  uint32_t flag = 0;
  const int T = p.threads;

  if (k == 0 || k == n) {  // trivial selections: nothing, or everything
    out.visit([&](const auto& entries) { flag = select_trivial(entries, src, n, k == n, T); });
  } else {
    Workspace w(ws_base, T, p.candidate_capacity);
    const int64_t region = w.cap / T;
    Selection s;
    s.k_rem = k;
    bool buffered = false;  // the buffer holds every element that can still be selected
    bool touched = false;   // the first touch (x' into the residual) has happened

    // Sampled prefilter: one read that buffers every key >= guess.
    const uint32_t guess = guess_lo(src, n, k, region, w.cand_y, T);
    if (guess != kNoGuess) {
      int64_t* count = w.count;
      TeamClock clock;
#pragma omp parallel num_threads(T)
      {
        clock.arrive();
        for (int t = thread_id(); t < T; t += team_size()) {
          int64_t b, e;
          partition(n, T, t, b, e);
          count[t] = filter<true>(src, b, e, guess, w.cand_y, w.cand_i, int64_t(t) * region, int64_t(t + 1) * region);
        }
        clock.finish();
      }
      clock.report(T);
      touched = true;
      int64_t total = 0;
      bool fits = true;
      for (int t = 0; t < T; ++t) {
        total += count[t];
        fits = fits && count[t] <= region;
      }
      if (fits && total >= k) {
        buffered = true;
        for (int t = 0; t < T; ++t) {
          w.off[t] = int64_t(t) * region;
          w.end[t] = w.off[t] + count[t];
        }
      }
    }

    // Level 0 histogram: over the buffer, or one full read of the input.
    TeamClock clock0;
#pragma omp parallel num_threads(T)
    {
      clock0.arrive();
      for (int t = thread_id(); t < T; t += team_size()) {
        uint64_t* hist = w.hist + int64_t(t) * kB;
        std::fill(hist, hist + kB, 0);
        if (buffered) {
          const uint32_t* ys = w.cand_y;
          histogram<false>(w.off[t], w.end[t], [&](int64_t j) { return key_of_bits(ys[j]); }, 20, kB - 1, 0, 0, hist);
        } else {
          int64_t b, e;
          partition(n, T, t, b, e);
          if (touched) histogram<false>(b, e, [&](int64_t i) { return abs_key(src.again(i)); }, 20, kB - 1, 0, 0, hist);
          else histogram<false>(b, e, [&](int64_t i) { return abs_key(src.first(i)); }, 20, kB - 1, 0, 0, hist);
        }
      }
      clock0.finish();
    }
    clock0.report(T);
    // Every non-finite key has digit 0x7F8 (and the guess never exceeds the +inf key).
    for (int t = 0; t < T; ++t) flag |= w.hist[int64_t(t) * kB + common::kNonFiniteDigit0] != 0;
    choose(s, w, T, 0, true);

    // Refine until the class exactly fills k_rem (early stop) or the key is fully resolved.
    while (s.cls != s.k_rem && s.level + 1 < common::kRadixLevels) {
      const int nl = s.level + 1;
      const int shift = common::kRadixShift[nl];
      const uint32_t mask = (1u << common::kRadixBits[nl]) - 1u;
      const uint32_t lo = s.lo(), hi = s.hi();
      int64_t above_total = 0;
      for (int t = 0; t < T; ++t) above_total += w.above[t];
      const bool fill = !buffered && above_total + s.cls <= w.cap;
      if (fill) {  // segments sized exactly from the per-thread counts
        int64_t o = 0;
        for (int t = 0; t < T; ++t) {
          w.off[t] = o;
          o += w.above[t] + w.cls[t];
          w.end[t] = o;
        }
      }
#pragma omp parallel num_threads(T)
      for (int t = thread_id(); t < T; t += team_size()) {
        uint64_t* hist = w.hist + int64_t(t) * kB;
        std::fill(hist, hist + kB, 0);
        if (!buffered && fill) {  // filter the input into the buffer
          int64_t b, e;
          partition(n, T, t, b, e);
          filter<false>(src, b, e, lo, w.cand_y, w.cand_i, w.off[t], w.end[t]);
        }
        if (buffered || fill) {  // entries below lo stay in the segment and are skipped
          const uint32_t* ys = w.cand_y;
          histogram<true>(w.off[t], w.end[t], [&](int64_t j) { return key_of_bits(ys[j]); }, shift, mask, lo, hi, hist);
        } else {  // too many candidates to buffer: re-read the input
          int64_t b, e;
          partition(n, T, t, b, e);
          histogram<true>(b, e, [&](int64_t i) { return abs_key(src.again(i)); }, shift, mask, lo, hi, hist);
        }
      }
      buffered = buffered || fill;
      choose(s, w, T, nl, false);
    }

    // Final: select key > hi, and the first k_rem elements (in index order) of the class.
    const uint32_t lo = s.lo(), hi = s.hi();
    int64_t* take = w.take;
    int64_t* dst = w.dst;
    {
      int64_t before = 0, o = 0;
      for (int t = 0; t < T; ++t) {
        take[t] = std::clamp<int64_t>(s.k_rem - before, 0, w.cls[t]);
        before += w.cls[t];
        dst[t] = o;
        o += w.above[t] + take[t];
      }
    }
    uint32_t nonfinite_sent = 0;
    out.visit([&](const auto& entries) { nonfinite_sent = emit_selected(entries, src, w, n, lo, hi, buffered, T); });
    flag |= nonfinite_sent;
  }
  finish_packet(packet, p.layout, flag ? kFlagNonFinite : 0, ctx);
}

int64_t workspace_bytes(const TopKPlan& p) {
  return Workspace::bytes(std::max({1, p.threads, p.workspace_threads}), p.candidate_capacity);
}

void encode(const TopKPlan& p, const EncodeArgs& a) {
  dispatch_float(p.input, [&](auto in) {
    using In = decltype(in);
    dispatch_float(p.value_dtype, [](auto) {}, "topk: value");  // raises for any other dtype (Entries)
    auto go = [&](auto src) { topk_run(p, src, a.packet, a.ctx, a.workspace); };
    const auto* xs = a.x.ptr<const typename In::storage>();
    const bool div1 = a.divisor == 1.0f;
    if (a.residual) {
      if (div1) go(Source<In, true, true>{xs, a.residual, a.divisor});
      else go(Source<In, true, false>{xs, a.residual, a.divisor});
    } else {
      if (div1) go(Source<In, false, true>{xs, nullptr, a.divisor});
      else go(Source<In, false, false>{xs, nullptr, a.divisor});
    }
  }, "topk: input");
}

template <class I, class V, class O>
void topk_decode_t(const TopKPlan& p, const uint8_t* packet, const Tensor& out, DecodeMode mode, float alpha,
                   uint32_t* status) {
  const int64_t n = p.numel, k = p.k;
  const auto* idx = reinterpret_cast<const I*>(packet + p.layout.sections[0].offset);
  const auto* val = reinterpret_cast<const typename V::storage*>(packet + p.values_offset);
  // Validate every index before writing anything. The CPU reports a corrupt packet by raising (as
  // for a bad header), not through the status word, which stays for CUDA's skipped entries.
  for (int64_t j = 0; j < k; ++j) {
    const uint64_t i = idx[j];
    if (i >= uint64_t(n)) {
      throw_corrupt_packet("decode: top-k packet entry %lld has index %llu >= numel %lld", (long long)j,
                           (unsigned long long)i, (long long)n);
    }
    if (j > 0 && i <= uint64_t(idx[j - 1])) {
      throw_corrupt_packet(i == uint64_t(idx[j - 1])
                               ? "decode: top-k packet indices must ascend strictly; entry %lld has index %llu after "
                                 "%llu (repeated)"
                               : "decode: top-k packet indices must ascend strictly; entry %lld has index %llu after "
                                 "%llu (out of order)",
                           (long long)j, (unsigned long long)i, (unsigned long long)idx[j - 1]);
    }
  }
  auto* o = out.ptr<typename O::storage>();
  if (mode == DecodeMode::assign) {
    const typename O::storage zero = O::store(0.0f);
    const int T = p.threads;
#pragma omp parallel for num_threads(T) schedule(static)
    for (int64_t i = 0; i < n; ++i) o[i] = zero;
    for (int64_t j = 0; j < k; ++j) o[idx[j]] = O::store(mul_rn(V::load(val[j]), alpha));
  } else {
    for (int64_t j = 0; j < k; ++j) o[idx[j]] = O::store(add_rn(O::load(o[idx[j]]), mul_rn(V::load(val[j]), alpha)));
  }
  PacketHeader h;
  std::memcpy(&h, packet, sizeof h);
  if (h.flags & kFlagNonFinite) {
    if (status) *status |= kStatusNonFinite;
    if (n > 0) o[0] = O::store(std::numeric_limits<float>::quiet_NaN());
  }
}
void decode(const TopKPlan& p, const DecodeArgs& a) {
  auto* status = reinterpret_cast<uint32_t*>(a.workspace);
  dispatch_float(p.value_dtype, [&](auto v) {
    dispatch_float(a.out.dtype, [&](auto o) {
      if (p.index_dtype == DType::uint64)
        topk_decode_t<uint64_t, decltype(v), decltype(o)>(p, a.packet, a.out, a.mode, a.alpha, status);
      else
        topk_decode_t<uint32_t, decltype(v), decltype(o)>(p, a.packet, a.out, a.mode, a.alpha, status);
    }, "decode: out");
  }, "topk: value");
}

} // namespace
} // namespace GRADCOMP_CPU_NAMESPACE

GRADCOMP_CPU_TABLE(TopKPlan, topk, workspace_bytes, encode, decode)
