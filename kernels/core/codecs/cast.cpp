// SPDX-License-Identifier: Apache-2.0
#include "cast.hpp"

#include "../family.hpp"
#include "../registry.hpp"

namespace gradcomp::detail {
namespace {

class CastCodec final : public FamilyCodec<CastPlan> {
 public:
  explicit CastCodec(std::string_view name) : wire_(name == "fp16" ? DType::float16 : name == "bf16" ? DType::bfloat16 : DType::none) {
    set_spec(std::string(name));
  }
  CodecProperties properties() const noexcept override {
    CodecProperties p;
    p.linear = true;
    p.unbiased = wire_ == DType::none;
    p.deterministic = true;
    p.exact_residual = true;
    return p;
  }

 protected:
  CastPlan make_plan(int64_t numel, DType input, Device) const override {
    CastPlan p;
    p.input = input;
    p.wire = wire_ == DType::none ? input : wire_;
    p.numel = numel;
    p.threads = cpu_threads_for(numel);
    LayoutBuilder b(*this, numel, input);
    b.wire(p.wire);
    b.payload("payload", numel, p.wire);
    p.layout = b.build();
    return p;
  }
  Backends<CastPlan> backends() const override { return {&cpu::cast, GRADCOMP_CUDA_KERNELS(cuda::cast)}; }

 private:
  DType wire_; //!< DType::none: the input dtype (codec none)
};

} // namespace

std::unique_ptr<Codec> make_cast(const ParsedSpec& s) { return std::make_unique<CastCodec>(s.name); }

} // namespace gradcomp::detail
