// SPDX-License-Identifier: Apache-2.0
#include "topk.hpp"

#include <algorithm>
#include <cmath>

#include "../family.hpp"
#include "../registry.hpp"

namespace gradcomp::detail {
namespace {

enum class IndexMode { automatic, u32, u64 };

class TopKCodec final : public FamilyCodec<TopKPlan> {
 public:
  explicit TopKCodec(const ParsedSpec& s) {
    count_ = SparseCount::parse(s, "topk");
    if (auto it = s.options.find("index"); it != s.options.end()) {
      if (it->second == "auto") index_ = IndexMode::automatic;
      else if (it->second == "u32") index_ = IndexMode::u32;
      else if (it->second == "u64") index_ = IndexMode::u64;
      else
        throw InvalidArgument(concat("codec spec '", s.text, "': index='", display(it->second, 60),
                                     "' is not accepted; accepted: auto, u32, u64"));
    }
    if (auto it = s.options.find("value_dtype"); it != s.options.end()) {
      if (it->second == "auto") value_ = DType::none;
      else if (it->second == "float32" || it->second == "float16" || it->second == "bfloat16")
        value_ = dtype_from_name(it->second);
      else
        throw InvalidArgument(concat("codec spec '", s.text, "': value_dtype='", display(it->second, 60),
                                     "' is not accepted; accepted: auto, float32, float16, bfloat16"));
    }
    CanonicalSpec c("topk");
    count_.add_to(c);
    if (index_ == IndexMode::u32) c.add("index", "u32");
    if (index_ == IndexMode::u64) c.add("index", "u64");
    if (value_ != DType::none) c.add("value_dtype", dtype_name(value_));
    set_spec(c.str());
  }
  CodecProperties base_properties() const noexcept override {
    CodecProperties p;
    p.linear = false;
    p.unbiased = false;
    p.deterministic = true;
    p.exact_residual = true;
    p.sparse = true;
    return p;
  }

  //! k = min(n, max(1, ceil(ratio * n))) in binary64, or min(k=, n).
  int64_t main_param(int64_t n) const override {
    check_numel_dtype(n, DType::float32, "main_param");
    return count_.of(n);
  }

 protected:
  TopKPlan make_plan(int64_t n, DType in, Device) const override {
    TopKPlan p;
    p.input = in;
    p.numel = n;
    p.k = main_param(n);
    p.index_dtype = index_dtype(n);
    p.value_dtype = value_ == DType::none ? in : value_;
    // AIR-style adaptive candidate buffer: candidates are buffered only while they are few.
    p.candidate_capacity = std::min<int64_t>(n, n / 16 + 4096);
    p.threads = cpu_threads_for(n);
    p.workspace_threads = cpu_threads_max(n);
    LayoutBuilder b(*this, n, in);
    b.wire(p.value_dtype).index(p.index_dtype).main_param(p.k);
    b.section("indices", p.k, p.index_dtype);
    const int v = b.section("values", p.k, p.value_dtype);
    p.layout = b.build();
    p.values_offset = p.layout.sections[v].offset;
    return p;
  }
  Backends<TopKPlan> backends() const override { return {&cpu::topk, GRADCOMP_CUDA_KERNELS(cuda::topk)}; }

 private:
  DType index_dtype(int64_t n) const {
    constexpr int64_t kU32Limit = int64_t(1) << 32;
    if (index_ == IndexMode::u64) return DType::uint64;
    GRADCOMP_CHECK(!(index_ == IndexMode::u32 && n > kU32Limit), InvalidArgument, "topk: ", n,
                   " elements need 64-bit indices but the spec says index=u32 (use index=auto or index=u64)");
    return n > kU32Limit ? DType::uint64 : DType::uint32;
  }

  SparseCount count_;
  IndexMode index_ = IndexMode::automatic;
  DType value_ = DType::none; //!< none: the input dtype
};

} // namespace

std::unique_ptr<Codec> make_topk(const ParsedSpec& s) { return std::make_unique<TopKCodec>(s); }

} // namespace gradcomp::detail
