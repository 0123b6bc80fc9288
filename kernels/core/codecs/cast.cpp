// SPDX-License-Identifier: Apache-2.0
#include "cast.hpp"

#include "../family.hpp"
#include "../registry.hpp"

namespace gradcomp::detail {
namespace {

class CastCodec final : public FamilyCodec<CastPlan> {
 public:
  explicit CastCodec(const ParsedSpec& s)
      : wire_(s.name == "fp16" ? DType::float16 : s.name == "bf16" ? DType::bfloat16 : DType::none) {
    // `rounding` (bf16 only: the registry accepts no key for none / fp16)
    if (auto it = s.options.find("rounding"); it != s.options.end()) {
      if (it->second == "nearest") stochastic_ = false;
      else if (it->second == "stochastic") stochastic_ = true;
      else
        throw InvalidArgument(concat("codec spec '", s.text, "': rounding='", display(it->second, 60),
                                     "' is not accepted; accepted: nearest (default), stochastic"));
    }
    CanonicalSpec c(s.name);
    if (stochastic_) c.add("rounding", "stochastic");
    set_spec(c.str());
  }
  CodecProperties base_properties() const noexcept override {
    CodecProperties p;
    p.linear = true;
    // stochastic rounding: E[q] = y (kernels/common/sround.hpp); q brackets x' at divisor 1, so
    // x' - q stays exact; the same input and key give the same bytes
    p.unbiased = wire_ == DType::none || stochastic_;
    p.deterministic = true;
    p.exact_residual = true;
    p.keyed = stochastic_;
    return p;
  }

 protected:
  CastPlan make_plan(int64_t numel, DType input, Device) const override {
    CastPlan p;
    p.input = input;
    p.wire = wire_ == DType::none ? input : wire_;
    p.numel = numel;
    p.threads = cpu_threads_for(numel);
    p.stochastic = stochastic_;
    LayoutBuilder b(*this, numel, input);
    b.wire(p.wire);
    b.payload("payload", numel, p.wire);
    if (stochastic_) b.key();
    p.layout = b.build();
    return p;
  }
  Backends<CastPlan> backends() const override { return {&cpu::cast, GRADCOMP_CUDA_KERNELS(cuda::cast)}; }

 private:
  DType wire_; //!< DType::none: the input dtype (codec none)
  bool stochastic_ = false; //!< bf16:rounding=stochastic
};

} // namespace

std::unique_ptr<Codec> make_cast(const ParsedSpec& s) { return std::make_unique<CastCodec>(s); }

} // namespace gradcomp::detail
