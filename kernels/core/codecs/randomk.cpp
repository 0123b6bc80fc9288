// SPDX-License-Identifier: Apache-2.0
#include "randomk.hpp"

#include <algorithm>
#include <cmath>

#include "../family.hpp"
#include "../registry.hpp"

namespace gradcomp::detail {
namespace {

class RandomKCodec final : public FamilyCodec<RandomKPlan> {
 public:
  explicit RandomKCodec(const ParsedSpec& s) {
    const bool has_ratio = s.options.count("ratio") > 0;
    has_k_ = s.options.count("k") > 0;
    GRADCOMP_CHECK(has_ratio != has_k_, InvalidArgument, "codec spec '", s.text,
                   "': randomk needs exactly one of ratio= (in (0, 1]) or k= (an integer >= 0)");
    if (has_ratio) {
      const std::string& v = s.options.find("ratio")->second;
      ratio_ = parse_double(s, "ratio", v, "0 < ratio <= 1");
      GRADCOMP_CHECK(ratio_ > 0.0 && ratio_ <= 1.0, InvalidArgument, "codec spec '", s.text, "': ratio=",
                     display(v, 60), " is out of range; accepted: 0 < ratio <= 1");
    } else {
      const std::string& v = s.options.find("k")->second;
      k_ = parse_int(s, "k", v, "an integer >= 0");
      GRADCOMP_CHECK(k_ >= 0, InvalidArgument, "codec spec '", s.text, "': k=", display(v, 60),
                     " is out of range; accepted: an integer >= 0");
    }
    if (auto it = s.options.find("unbiased"); it != s.options.end()) {
      if (it->second == "true") unbiased_ = true;
      else if (it->second == "false") unbiased_ = false;
      else
        throw InvalidArgument(concat("codec spec '", s.text, "': unbiased='", display(it->second, 60),
                                     "' is not accepted; accepted: false (default), true"));
    }
    CanonicalSpec c("randomk");
    if (has_k_) c.add("k", k_);
    else c.add("ratio", ratio_);
    if (unbiased_) c.add("unbiased", "true");
    set_spec(c.str());
  }
  CodecProperties properties() const noexcept override {
    CodecProperties p;
    p.linear = true;      // the same indices on every rank: the values add
    p.unbiased = unbiased_;
    p.deterministic = true;
    p.exact_residual = !unbiased_; // y itself is sent (rounded to the input dtype, as codec none)
    p.keyed = true;
    p.sparse = true;
    return p;
  }

  //! k = min(n, max(1, ceil(ratio * n))) in binary64, or min(k=, n) (top-k's rule).
  int64_t main_param(int64_t n) const override {
    check_numel_dtype(n, DType::float32, "main_param");
    if (has_k_) return std::min(k_, n);
    const double k = std::ceil(ratio_ * static_cast<double>(n));
    return std::min<int64_t>(n, std::max<int64_t>(1, static_cast<int64_t>(k)));
  }

 protected:
  RandomKPlan make_plan(int64_t n, DType in, Device) const override {
    RandomKPlan p;
    p.input = in;
    p.numel = n;
    p.k = main_param(n);
    p.unbiased = unbiased_;
    p.threads = cpu_threads_for(n);
    LayoutBuilder b(*this, n, in);
    b.wire(in).main_param(p.k);
    b.payload("values", p.k, in);
    b.key();
    p.layout = b.build();
    return p;
  }
  Backends<RandomKPlan> backends() const override {
    return {&cpu::randomk, GRADCOMP_CUDA_KERNELS(cuda::randomk)};
  }

 private:
  bool has_k_ = false;
  double ratio_ = 0;
  int64_t k_ = 0;
  bool unbiased_ = false;
};

} // namespace

std::unique_ptr<Codec> make_randomk(const ParsedSpec& s) { return std::make_unique<RandomKCodec>(s); }

} // namespace gradcomp::detail
