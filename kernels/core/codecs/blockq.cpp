// SPDX-License-Identifier: Apache-2.0
#include "blockq.hpp"

#include "../family.hpp"
#include "../registry.hpp"

namespace gradcomp::detail {
namespace {

constexpr int64_t kMaxBlock = int64_t(1) << 24;

class BlockQCodec final : public FamilyCodec<BlockQPlan> {
 public:
  explicit BlockQCodec(const ParsedSpec& s) {
    const bool fp8 = s.name == "fp8";
    kind_ = s.name == "int8" ? QuantKind::int8 : s.name == "int4" ? QuantKind::int4 : QuantKind::e4m3;
    if (auto it = s.options.find("format"); it != s.options.end()) {
      if (it->second == "e4m3") kind_ = QuantKind::e4m3;
      else if (it->second == "e5m2") kind_ = QuantKind::e5m2;
      else
        throw InvalidArgument(concat("codec spec '", s.text, "': format='", display(it->second, 60),
                                     "' is not accepted; accepted: e4m3, e5m2"));
    }
    if (auto it = s.options.find("scale"); it != s.options.end()) {
      if (it->second == "e8m0") e8m0_ = true;
      else if (it->second != "float32")
        throw InvalidArgument(concat("codec spec '", s.text, "': scale='", display(it->second, 60),
                                     "' is not accepted; accepted: float32, e8m0"));
    }
    if (auto it = s.options.find("rounding"); it != s.options.end()) {  // int8 / int4 only (the registry's keys)
      if (it->second == "stochastic") stochastic_ = true;
      else if (it->second != "nearest")
        throw InvalidArgument(concat("codec spec '", s.text, "': rounding='", display(it->second, 60),
                                     "' is not accepted; accepted: nearest (default), stochastic"));
    }
    const int64_t default_block = e8m0_ ? 32 : 128;
    block_ = default_block;
    if (auto it = s.options.find("block"); it != s.options.end()) {
      block_ = parse_int(s, "block", it->second, "0 (the whole tensor) or 1 <= block <= 2^24");
      GRADCOMP_CHECK(block_ >= 0 && block_ <= kMaxBlock, InvalidArgument, "codec spec '", s.text, "': block=",
                     display(it->second, 60), " is out of range; accepted: 0 (the whole tensor) or 1 <= block <= 2^24");
    }
    GRADCOMP_CHECK(!e8m0_ || block_ == 32, InvalidArgument, "codec spec '", s.text, "': scale=e8m0 needs block=32 "
                   "(OCP MX blocks of 32 elements), got block=", block_);
    GRADCOMP_CHECK(kind_ != QuantKind::int4 || block_ % 2 == 0, InvalidArgument, "codec spec '", s.text,
                   "': int4 packs two codes per byte, so the block must be even (or 0), got block=", block_);
    CanonicalSpec c(s.name);
    if (fp8 && kind_ == QuantKind::e5m2) c.add("format", "e5m2");
    if (block_ != default_block) c.add("block", block_);
    if (e8m0_) c.add("scale", "e8m0");
    if (stochastic_) c.add("rounding", "stochastic");
    set_spec(c.str());
  }
  CodecProperties base_properties() const noexcept override {
    CodecProperties p;
    p.linear = false;
    p.unbiased = stochastic_;  // E[code] = q inside the code range (common::int_code_sr)
    p.deterministic = true;
    // nearest: D is a rounding of x' on the block's grid, x' - D is exact (Sterbenz); stochastic:
    // D may be the far neighbour, and x' - D then need not be exact
    p.exact_residual = !stochastic_;
    p.keyed = stochastic_;
    return p;
  }
  int64_t main_param(int64_t n) const override {
    check_numel_dtype(n, DType::float32, "main_param");
    return block_;
  }

 protected:
  BlockQPlan make_plan(int64_t n, DType in, Device) const override {
    BlockQPlan p;
    p.input = in;
    p.kind = kind_;
    p.e8m0 = e8m0_;
    p.stochastic = stochastic_;
    p.numel = n;
    p.block = block_ == 0 ? std::max<int64_t>(n, 1) : block_;
    p.nblocks = (n + p.block - 1) / p.block;
    p.threads = cpu_threads_for(n);
    const DType code = kind_ == QuantKind::e4m3   ? DType::float8_e4m3fn
                       : kind_ == QuantKind::e5m2 ? DType::float8_e5m2
                       : kind_ == QuantKind::int8 ? DType::int8
                                                  : DType::int4;
    LayoutBuilder b(*this, n, in);
    b.wire(code).main_param(block_);
    b.section("codes", n, code);
    b.section("scales", p.nblocks, e8m0_ ? DType::float8_e8m0fnu : DType::float32);
    if (stochastic_) b.key();
    p.layout = b.build();
    return p;
  }
  Backends<BlockQPlan> backends() const override { return {&cpu::blockq, GRADCOMP_CUDA_KERNELS(cuda::blockq)}; }

 private:
  QuantKind kind_ = QuantKind::e4m3;
  bool e8m0_ = false;
  bool stochastic_ = false; //!< int8 / int4 rounding=stochastic (keyed)
  int64_t block_ = 128;
};

} // namespace

std::unique_ptr<Codec> make_blockq(const ParsedSpec& s) { return std::make_unique<BlockQCodec>(s); }

} // namespace gradcomp::detail
