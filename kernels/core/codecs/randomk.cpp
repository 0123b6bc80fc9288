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
    count_ = SparseCount::parse(s, "randomk");
    if (auto it = s.options.find("unbiased"); it != s.options.end()) {
      if (it->second == "true") unbiased_ = true;
      else if (it->second == "false") unbiased_ = false;
      else
        throw InvalidArgument(concat("codec spec '", s.text, "': unbiased='", display(it->second, 60),
                                     "' is not accepted; accepted: false (default), true"));
    }
    CanonicalSpec c("randomk");
    count_.add_to(c);
    if (unbiased_) c.add("unbiased", "true");
    set_spec(c.str());
  }
  CodecProperties base_properties() const noexcept override {
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
    return count_.of(n);
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
  SparseCount count_;
  bool unbiased_ = false;
};

} // namespace

std::unique_ptr<Codec> make_randomk(const ParsedSpec& s) { return std::make_unique<RandomKCodec>(s); }

} // namespace gradcomp::detail
