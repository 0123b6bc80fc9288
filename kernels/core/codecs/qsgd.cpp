// SPDX-License-Identifier: Apache-2.0
#include "qsgd.hpp"

#include "../../common/qsgd.hpp"
#include "../family.hpp"
#include "../registry.hpp"

namespace gradcomp::detail {
namespace {

//! coding=elias keeps stream bit offsets (up to 8 numel) in uint32.
constexpr int64_t kMaxEliasNumel = int64_t(1) << 28;

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
    if (auto it = s.options.find("coding"); it != s.options.end()) {
      if (it->second == "elias") elias_ = true;
      else if (it->second != "dense")
        throw InvalidArgument(concat("codec spec '", s.text, "': coding='", display(it->second, 60),
                                     "' is not accepted; accepted: dense (default), elias"));
    }
    CanonicalSpec c("qsgd");
    if (levels_ != 127) c.add("levels", int64_t(levels_));
    if (block_ != 128) c.add("block", block_);
    if (elias_) c.add("coding", "elias");
    set_spec(c.str());
  }
  CodecProperties base_properties() const noexcept override {
    CodecProperties p;
    p.linear = false;
    p.unbiased = true;  // E[level] = q (kernels/common/qsgd.hpp), up to float32 roundings
    p.deterministic = true;
    p.exact_residual = false;
    p.keyed = true;
    return p;
  }
  int64_t main_param(int64_t n) const override { return elias_ ? 8 * n : block_; }

 protected:
  QsgdPlan make_plan(int64_t n, DType in, Device) const override {
    QsgdPlan p;
    p.input = in;
    p.numel = n;
    p.block = block_;
    p.nblocks = (n + block_ - 1) / block_;
    p.levels = levels_;
    p.threads = cpu_threads_for(n);
    p.elias = elias_;
    GRADCOMP_CHECK(!elias_ || n < kMaxEliasNumel, InvalidArgument, "codec '", spec(), "': numel ", n,
                   " is too large for coding=elias (stream bit offsets are uint32); accepted: numel < 2^28 = ",
                   kMaxEliasNumel, ", or coding=dense");
    LayoutBuilder b(*this, n, in);
    if (elias_) {
      // the stream's capacity is the dense codes' n bytes, so the dense fallback always fits; the
      // header's main parameter is the stream's bit count (at most 8 n), 0 in the fallback
      b.wire(DType::uint8).main_param(8 * n, MainParamKind::maximum).fallback_flag();
      b.section("stream", n, DType::uint8);
      b.section("norms", p.nblocks, DType::float32);
      b.section("ends", p.nblocks, DType::uint32);
    } else {
      b.wire(DType::int8).main_param(block_);
      b.section("codes", n, DType::int8);
      b.section("norms", p.nblocks, DType::float32);
    }
    b.key();
    p.layout = b.build();
    return p;
  }
  Backends<QsgdPlan> backends() const override { return {&cpu::qsgd, GRADCOMP_CUDA_KERNELS(cuda::qsgd)}; }

 private:
  int levels_ = 127;
  int64_t block_ = 128;
  bool elias_ = false;
};

} // namespace

std::unique_ptr<Codec> make_qsgd(const ParsedSpec& s) { return std::make_unique<QsgdCodec>(s); }

} // namespace gradcomp::detail
