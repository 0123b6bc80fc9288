// SPDX-License-Identifier: Apache-2.0
#include "qsgd.hpp"

#include "../../common/qsgd.hpp"
#include "../family.hpp"
#include "../registry.hpp"

namespace gradcomp::detail {
namespace {

class QsgdCodec final : public FamilyCodec<QsgdPlan> {
 public:
  explicit QsgdCodec(const ParsedSpec& s) {
    if (auto it = s.options.find("levels"); it != s.options.end()) {
      const int64_t v = parse_int(s, "levels", it->second, "an integer in [1, 127]");
      GRADCOMP_CHECK(v >= 1 && v <= qsgd::kMaxLevels, InvalidArgument, "codec spec '", s.text, "': levels=",
                     display(it->second, 60), " is out of range; accepted: an integer in [1, 127] (int8 codes)");
      levels_ = int(v);
    }
    if (auto it = s.options.find("block"); it != s.options.end()) {
      const int64_t v = parse_int(s, "block", it->second, "an integer in [1, 4096]");
      GRADCOMP_CHECK(v >= 1 && v <= qsgd::kMaxBlock, InvalidArgument, "codec spec '", s.text, "': block=",
                     display(it->second, 60), " is out of range; accepted: an integer in [1, 4096]");
      block_ = v;
    }
    CanonicalSpec c("qsgd");
    if (levels_ != 127) c.add("levels", int64_t(levels_));
    if (block_ != 128) c.add("block", block_);
    set_spec(c.str());
  }
  CodecProperties properties() const noexcept override {
    CodecProperties p;
    p.linear = false;
    p.unbiased = true;  // E[level] = q (kernels/common/qsgd.hpp), up to float32 roundings
    p.deterministic = true;
    p.exact_residual = false;
    p.keyed = true;
    return p;
  }
  int64_t main_param(int64_t) const override { return block_; }

 protected:
  QsgdPlan make_plan(int64_t n, DType in, Device) const override {
    QsgdPlan p;
    p.input = in;
    p.numel = n;
    p.block = block_;
    p.nblocks = (n + block_ - 1) / block_;
    p.levels = levels_;
    p.threads = cpu_threads_for(n);
    LayoutBuilder b(*this, n, in);
    b.wire(DType::int8).main_param(block_);
    b.section("codes", n, DType::int8);
    b.section("norms", p.nblocks, DType::float32);
    b.key();
    p.layout = b.build();
    return p;
  }
  Backends<QsgdPlan> backends() const override { return {&cpu::qsgd, GRADCOMP_CUDA_KERNELS(cuda::qsgd)}; }

 private:
  int levels_ = 127;
  int64_t block_ = 128;
};

} // namespace

std::unique_ptr<Codec> make_qsgd(const ParsedSpec& s) { return std::make_unique<QsgdCodec>(s); }

} // namespace gradcomp::detail
