// SPDX-License-Identifier: Apache-2.0
// The low-rank (PowerSGD) entry points of include/gradcomp/lowrank.hpp: argument validation, then
// dispatch to the CPU backend (kernels/cpu/lowrank.cpp) or the CUDA one (kernels/cuda/lowrank.cu)
// through the table of kernels/core/lowrank_backend.hpp. Low rank is not a codec family (no Plan,
// no Backends<Plan>), so its table is chosen here: the CUDA table exists only in a CUDA build
// (the one `#if GRADCOMP_WITH_CUDA` of this file, the counterpart of GRADCOMP_CUDA_KERNELS in
// backend.hpp); a CUDA tensor in a CPU-only build raises Unsupported, never a silent no-op.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "backend.hpp"
#include "lowrank_backend.hpp"

namespace gradcomp::lowrank {

Resources::Resources() : impl_(std::make_unique<Impl>()) {}
Resources::~Resources() = default;

Resources& default_resources() {
  // Created on first use and never destroyed: its cuBLAS handles must not be released by a static
  // destructor that may run after the CUDA runtime has shut down at process exit.
  static Resources* const r = new Resources();
  return *r;
}

namespace {

using gradcomp::detail::concat;

//! A backend's five entry points (validated arguments; lowrank_backend.hpp).
struct Table {
  void (*project)(const MatrixBatch&, const Tensor&, const Tensor&, int64_t, Stream, Resources::Impl&);
  void (*back_project)(const MatrixBatch&, const Tensor&, const Tensor&, int64_t, Stream, Resources::Impl&);
  void (*orthogonalize)(const Tensor&, int64_t, int64_t, int64_t, float, const Redraw*, Stream, Resources::Impl&);
  void (*reconstruct)(const MatrixBatch&, const Tensor&, const Tensor&, int64_t, const Tensor&, float*, uint32_t*,
                      Stream, Resources::Impl&);
  void (*random_normal)(const Tensor&, uint64_t, uint64_t, Stream, Resources::Impl&);
};

const Table kCpu = {
    [](const MatrixBatch& m, const Tensor& q, const Tensor& p, int64_t r, Stream, Resources::Impl&) {
      detail::cpu_project(m, q, p, r);
    },
    [](const MatrixBatch& m, const Tensor& p, const Tensor& q, int64_t r, Stream, Resources::Impl&) {
      detail::cpu_back_project(m, p, q, r);
    },
    [](const Tensor& x, int64_t c, int64_t rows, int64_t r, float eps, const Redraw* rd, Stream, Resources::Impl&) {
      detail::cpu_orthogonalize(x, c, rows, r, eps, rd);
    },
    [](const MatrixBatch& m, const Tensor& p, const Tensor& q, int64_t r, const Tensor& out, float* e, uint32_t* s,
       Stream, Resources::Impl&) { detail::cpu_reconstruct(m, p, q, r, out, e, s); },
    [](const Tensor& x, uint64_t seed, uint64_t sid, Stream, Resources::Impl&) {
      detail::cpu_random_normal(x, seed, sid);
    },
};

#if defined(GRADCOMP_WITH_CUDA)
const Table kCuda = {&detail::cuda_project, &detail::cuda_back_project, &detail::cuda_orthogonalize,
                     &detail::cuda_reconstruct, &detail::cuda_random_normal};
const Table* cuda_table() { return &kCuda; }
#else
const Table* cuda_table() { return nullptr; }
#endif

//! The table for `d`; Unsupported naming the call and the device when the build has none.
const Table& select(Device d, const char* call) {
  if (d.kind == DeviceKind::cpu) return kCpu;
  if (d.kind == DeviceKind::cuda) {
    if (const Table* t = cuda_table()) return *t;
    throw Unsupported(concat(call, ": tensors on ", to_string(d),
                             " but this gradcomp build has no CUDA support (build_info()['cuda'] is false)"));
  }
  throw Unsupported(concat(call, ": tensors on an unknown device kind ", int(d.kind), "; accepted: cpu, cuda"));
}

//! Elements above which a size is refused (every byte count then fits an int64).
constexpr int64_t kMaxElems = int64_t(1) << 56;

//! a * b, or -1 when it reaches kMaxElems (a, b >= 0).
int64_t mul_or_neg(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r) || r >= kMaxElems) return -1;
  return r;
}

void check_basics(const Tensor& t, const char* what, const char* call) {
  GRADCOMP_CHECK(t.numel >= 0, InvalidArgument, call, ": ", what, " has numel ", t.numel, " < 0");
  GRADCOMP_CHECK(t.numel == 0 || t.data != nullptr, InvalidArgument, call, ": ", what, " has numel ", t.numel,
                 " but a null data pointer");
  const int64_t es = std::max<int64_t>(1, dtype_size(t.dtype));
  GRADCOMP_CHECK(reinterpret_cast<uintptr_t>(t.data) % uintptr_t(es) == 0, InvalidArgument, call, ": ", what,
                 " address ", t.data, " is not aligned to its ", es, "-byte ", dtype_name(t.dtype), " elements");
}

void check_f32(const Tensor& t, const char* what, const char* call) {
  check_basics(t, what, call);
  GRADCOMP_CHECK(t.dtype == DType::float32, InvalidArgument, call, ": ", what, " has dtype ", dtype_name(t.dtype),
                 "; accepted: float32");
}

void check_same_device(const Tensor& a, const char* an, const Tensor& b, const char* bn, const char* call) {
  GRADCOMP_CHECK(a.device == b.device, InvalidArgument, call, ": ", an, " is on ", to_string(a.device), " but ", bn,
                 " is on ", to_string(b.device), "; all tensors of one call must be on the same device");
}

//! Byte ranges [p, p + bytes) of two buffers on one device must not share a byte.
void check_disjoint_bytes(const void* a, int64_t abytes, const char* an, const void* b, int64_t bbytes, const char* bn,
                          const char* call) {
  if (abytes <= 0 || bbytes <= 0) return;
  const auto a0 = reinterpret_cast<uintptr_t>(a), b0 = reinterpret_cast<uintptr_t>(b);
  const bool overlap = a0 < b0 + uintptr_t(bbytes) && b0 < a0 + uintptr_t(abytes);
  GRADCOMP_CHECK(!overlap, InvalidArgument, call, ": ", an, " (", abytes, " bytes at ", a, ") and ", bn, " (", bbytes,
                 " bytes at ", b, ") overlap; they must be separate buffers");
}
void check_disjoint(const Tensor& a, const char* an, const Tensor& b, const char* bn, const char* call) {
  check_disjoint_bytes(a.data, a.nbytes(), an, b.data, b.nbytes(), bn, call);
}

//! count, rows, cols, rank and the offsets of `m` against a buffer of `limit` elements (named
//! `limit_name`). rank_limit_cols: whether rank is bounded by min(rows, cols) (always here).
void check_batch(const MatrixBatch& m, int64_t rank, int64_t limit, const char* limit_name, const char* call) {
  GRADCOMP_CHECK(m.count >= 0 && m.count < kMaxElems, InvalidArgument, call, ": count ", m.count,
                 " is out of range; accepted: 0 <= count < 2^56");
  GRADCOMP_CHECK(m.rows >= 1 && m.rows < kMaxElems, InvalidArgument, call, ": rows ", m.rows,
                 " is out of range; accepted: 1 <= rows < 2^56");
  GRADCOMP_CHECK(m.cols >= 1 && m.cols < kMaxElems, InvalidArgument, call, ": cols ", m.cols,
                 " is out of range; accepted: 1 <= cols < 2^56");
  const int64_t mn = std::min(m.rows, m.cols);
  GRADCOMP_CHECK(rank >= 1 && rank <= mn, InvalidArgument, call, ": rank ", rank,
                 " is outside [1, min(rows, cols)] = [1, ", mn, "] for matrices of shape [", m.rows, ", ", m.cols, "]");
  const int64_t mat = mul_or_neg(m.rows, m.cols);
  GRADCOMP_CHECK(mat >= 0, InvalidArgument, call, ": matrices of shape [", m.rows, ", ", m.cols,
                 "] have 2^56 elements or more; accepted: rows * cols < 2^56");
  GRADCOMP_CHECK(m.count == 0 || m.offsets != nullptr, InvalidArgument, call, ": count is ", m.count,
                 " but offsets is null");
  for (int64_t b = 0; b < m.count; ++b) {
    const int64_t o = m.offsets[b];
    GRADCOMP_CHECK(o >= 0 && o <= limit && mat <= limit - o, InvalidArgument, call, ": matrix ", b, " at offset ", o,
                   " with rows * cols = ", m.rows, " * ", m.cols, " = ", mat, " elements reaches past the end of ",
                   limit_name, " (", limit, " elements); accepted: 0 <= offset and offset + rows * cols <= ", limit);
  }
  if (m.count > 1) {  // the matrices must not overlap (sorted offsets at least rows * cols apart)
    std::vector<std::pair<int64_t, int64_t>> s(size_t(m.count));
    for (int64_t b = 0; b < m.count; ++b) s[size_t(b)] = {m.offsets[b], b};
    std::sort(s.begin(), s.end());
    for (size_t i = 1; i < s.size(); ++i)
      GRADCOMP_CHECK(s[i].first - s[i - 1].first >= mat, InvalidArgument, call, ": matrices ", s[i - 1].second,
                     " (offset ", s[i - 1].first, ") and ", s[i].second, " (offset ", s[i].first,
                     ") overlap: offsets must be at least rows * cols = ", mat, " elements apart");
  }
}

//! A factor tensor (p or q): float32, exactly count * n * rank elements ([count, n, rank]).
void check_factor(const Tensor& t, const char* what, int64_t count, int64_t n, const char* n_name, int64_t rank,
                  const char* call) {
  check_f32(t, what, call);
  const int64_t nr = mul_or_neg(n, rank);
  const int64_t need = nr < 0 ? -1 : mul_or_neg(count, nr);
  GRADCOMP_CHECK(need >= 0, InvalidArgument, call, ": ", what, " of shape [", count, ", ", n, ", ", rank,
                 "] has 2^56 elements or more");
  GRADCOMP_CHECK(t.numel == need, InvalidArgument, call, ": ", what, " has ", t.numel, " elements but [count, ", n_name,
                 ", rank] = [", count, ", ", n, ", ", rank, "] needs ", need);
}

} // namespace

void project(const MatrixBatch& m, const Tensor& q, const Tensor& p, int64_t rank, Stream stream, Resources& res) {
  const char* call = "lowrank::project";
  const Table& t = select(m.base.device, call);
  check_f32(m.base, "m.base", call);
  check_same_device(m.base, "m.base", q, "q", call);
  check_same_device(m.base, "m.base", p, "p", call);
  check_batch(m, rank, m.base.numel, "m.base", call);
  check_factor(q, "q", m.count, m.cols, "cols", rank, call);
  check_factor(p, "p", m.count, m.rows, "rows", rank, call);
  check_disjoint(p, "p", m.base, "m.base", call);
  check_disjoint(p, "p", q, "q", call);
  if (m.count == 0) return;
  t.project(m, q, p, rank, stream, res.impl());
}

void back_project(const MatrixBatch& m, const Tensor& p, const Tensor& q, int64_t rank, Stream stream,
                  Resources& res) {
  const char* call = "lowrank::back_project";
  const Table& t = select(m.base.device, call);
  check_f32(m.base, "m.base", call);
  check_same_device(m.base, "m.base", p, "p", call);
  check_same_device(m.base, "m.base", q, "q", call);
  check_batch(m, rank, m.base.numel, "m.base", call);
  check_factor(p, "p", m.count, m.rows, "rows", rank, call);
  check_factor(q, "q", m.count, m.cols, "cols", rank, call);
  check_disjoint(q, "q", m.base, "m.base", call);
  check_disjoint(q, "q", p, "p", call);
  if (m.count == 0) return;
  t.back_project(m, p, q, rank, stream, res.impl());
}

void orthogonalize(const Tensor& x, int64_t count, int64_t rows, int64_t rank, float epsilon, const Redraw* redraw,
                   Stream stream, Resources& res) {
  const char* call = "lowrank::orthogonalize";
  const Table& t = select(x.device, call);
  check_f32(x, "x", call);
  GRADCOMP_CHECK(count >= 0 && count < kMaxElems, InvalidArgument, call, ": count ", count,
                 " is out of range; accepted: 0 <= count < 2^56");
  GRADCOMP_CHECK(rows >= 1 && rows < kMaxElems, InvalidArgument, call, ": rows ", rows,
                 " is out of range; accepted: 1 <= rows < 2^56");
  GRADCOMP_CHECK(rank >= 1 && rank <= rows, InvalidArgument, call, ": rank ", rank, " is outside [1, rows] = [1, ",
                 rows, "] (the columns of a [", rows, ", rank] matrix can be orthonormal only for rank <= rows)");
  GRADCOMP_CHECK(std::isfinite(epsilon) && epsilon >= 0.0f, InvalidArgument, call, ": epsilon ", epsilon,
                 " is not accepted; accepted: a finite epsilon >= 0");
  check_factor(x, "x", count, rows, "rows", rank, call);
  if (count == 0) return;
  t.orthogonalize(x, count, rows, rank, epsilon, redraw, stream, res.impl());
}

void reconstruct(const MatrixBatch& m, const Tensor& p, const Tensor& q, int64_t rank, const Tensor& out,
                 float* residual, uint32_t* status, Stream stream, Resources& res) {
  const char* call = "lowrank::reconstruct";
  const Table& t = select(out.device, call);
  check_basics(out, "out", call);
  GRADCOMP_CHECK(is_gradient_dtype(out.dtype), InvalidArgument, call, ": out has dtype ", dtype_name(out.dtype),
                 "; accepted: float32, float16, bfloat16");
  check_same_device(out, "out", p, "p", call);
  check_same_device(out, "out", q, "q", call);
  check_batch(m, rank, out.numel, "out", call);
  check_factor(p, "p", m.count, m.rows, "rows", rank, call);
  check_factor(q, "q", m.count, m.cols, "cols", rank, call);
  check_disjoint(out, "out", p, "p", call);
  check_disjoint(out, "out", q, "q", call);
  GRADCOMP_CHECK(reinterpret_cast<uintptr_t>(residual) % alignof(float) == 0, InvalidArgument, call,
                 ": residual address ", static_cast<void*>(residual), " is not aligned to its 4-byte float32 elements");
  GRADCOMP_CHECK(reinterpret_cast<uintptr_t>(status) % alignof(uint32_t) == 0, InvalidArgument, call,
                 ": status address ", static_cast<void*>(status), " is not aligned to 4 bytes");
  if (residual != nullptr) {
    // The residual's length is the caller's (a raw pointer); it spans at least out's extent here.
    int64_t extent = 0;
    for (int64_t b = 0; b < m.count; ++b) extent = std::max(extent, m.offsets[b] + m.rows * m.cols);
    check_disjoint_bytes(residual, extent * 4, "residual", out.data, out.nbytes(), "out", call);
    check_disjoint_bytes(residual, extent * 4, "residual", p.data, p.nbytes(), "p", call);
    check_disjoint_bytes(residual, extent * 4, "residual", q.data, q.nbytes(), "q", call);
  }
  if (m.count == 0) return;
  MatrixBatch mo = m;
  mo.base = out;
  t.reconstruct(mo, p, q, rank, out, residual, status, stream, res.impl());
}

void random_normal(const Tensor& x, uint64_t seed, uint64_t stream_id, Stream stream, Resources& res) {
  const char* call = "lowrank::random_normal";
  const Table& t = select(x.device, call);
  check_f32(x, "x", call);
  GRADCOMP_CHECK(x.numel < kMaxElems, InvalidArgument, call, ": x has ", x.numel,
                 " elements; accepted: numel < 2^56");
  if (x.numel == 0) return;
  t.random_normal(x, seed, stream_id, stream, res.impl());
}

} // namespace gradcomp::lowrank
