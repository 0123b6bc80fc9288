// SPDX-License-Identifier: Apache-2.0
#include "terngrad.hpp"

#include <cmath>

#include "../../common/reduce.hpp"
#include "../family.hpp"
#include "../registry.hpp"

namespace gradcomp::detail {
namespace {

class TernGradCodec final : public FamilyCodec<TernGradPlan> {
 public:
  explicit TernGradCodec(const ParsedSpec& s) {
    if (auto it = s.options.find("clip"); it != s.options.end()) {
      clip_ = parse_double(s, "clip", it->second, "0 (no clipping) or a number in (0, 1000]");
      GRADCOMP_CHECK(clip_ >= 0.0 && clip_ <= 1000.0, InvalidArgument, "codec spec '", s.text, "': clip=",
                     display(it->second, 60), " is out of range; accepted: 0 (no clipping) or a number in (0, 1000]");
    }
    CanonicalSpec c("terngrad");
    if (clip_ != 2.5) c.add("clip", clip_);
    set_spec(c.str());
  }
  CodecProperties base_properties() const noexcept override {
    CodecProperties p;
    p.linear = false;
    p.unbiased = clip_ == 0.0;  // E[D] = the clipped y
    p.deterministic = true;
    p.exact_residual = false;
    p.keyed = true;
    return p;
  }

 protected:
  TernGradPlan make_plan(int64_t n, DType in, Device) const override {
    TernGradPlan p;
    p.input = in;
    p.numel = n;
    p.clip_c = clip_;
    p.ntiles = (n + common::kSumTile - 1) / common::kSumTile;
    p.threads = cpu_threads_for(n);
    LayoutBuilder b(*this, n, in);
    b.wire(DType::uint8);
    b.section("codes", (n + 3) / 4, DType::uint8);
    b.section("scale", 1, DType::float32);
    b.key();
    p.layout = b.build();
    return p;
  }
  Backends<TernGradPlan> backends() const override {
    return {&cpu::terngrad, GRADCOMP_CUDA_KERNELS(cuda::terngrad)};
  }

 private:
  double clip_ = 2.5;
};

} // namespace

std::unique_ptr<Codec> make_terngrad(const ParsedSpec& s) { return std::make_unique<TernGradCodec>(s); }

} // namespace gradcomp::detail
