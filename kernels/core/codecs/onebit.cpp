// SPDX-License-Identifier: Apache-2.0
#include "onebit.hpp"

#include "../../common/reduce.hpp"
#include "../family.hpp"
#include "../registry.hpp"

namespace gradcomp::detail {
namespace {

constexpr int64_t kMaxChunk = int64_t(1) << 40;

class OnebitCodec final : public FamilyCodec<OnebitPlan> {
 public:
  explicit OnebitCodec(const ParsedSpec& s) {
    if (auto it = s.options.find("scale"); it != s.options.end()) {
      if (it->second == "l2") l2_ = true;
      else if (it->second == "mean_abs") l2_ = false;
      else
        throw InvalidArgument(concat("codec spec '", s.text, "': scale='", display(it->second, 60),
                                     "' is not accepted; accepted: l2, mean_abs"));
    }
    if (auto it = s.options.find("chunk"); it != s.options.end()) {
      chunk_ = parse_int(s, "chunk", it->second, "0 (the whole tensor) or a multiple of 8 in [8, 2^40]");
      GRADCOMP_CHECK(chunk_ >= 0 && chunk_ <= kMaxChunk && chunk_ % 8 == 0, InvalidArgument, "codec spec '", s.text,
                     "': chunk=", display(it->second, 60),
                     " is not accepted; accepted: 0 (the whole tensor) or a multiple of 8 in [8, 2^40] (each chunk "
                     "starts on a byte of the bit section)");
    }
    CanonicalSpec c("onebit");
    if (chunk_ != 0) c.add("chunk", chunk_);
    if (!l2_) c.add("scale", "mean_abs");
    set_spec(c.str());
  }
  CodecProperties base_properties() const noexcept override {
    CodecProperties p;
    p.linear = false;
    p.unbiased = false;
    p.deterministic = true;
    p.exact_residual = false;  // x' - s rounds
    return p;
  }
  int64_t main_param(int64_t n) const override {
    check_numel_dtype(n, DType::float32, "main_param");
    return chunk_;
  }

 protected:
  OnebitPlan make_plan(int64_t n, DType in, Device) const override {
    OnebitPlan p;
    p.input = in;
    p.l2 = l2_;
    p.numel = n;
    p.chunk = chunk_ == 0 ? std::max<int64_t>(n, 1) : chunk_;
    p.nchunks = (n + p.chunk - 1) / p.chunk;
    p.tiles = (p.chunk + common::kSumTile - 1) / common::kSumTile;
    p.threads = cpu_threads_for(n);
    LayoutBuilder b(*this, n, in);
    b.wire(DType::uint1).main_param(chunk_);
    b.section("bits", n, DType::uint1);
    b.section("scales", p.nchunks, DType::float32);
    p.layout = b.build();
    return p;
  }
  Backends<OnebitPlan> backends() const override { return {&cpu::onebit, GRADCOMP_CUDA_KERNELS(cuda::onebit)}; }

 private:
  bool l2_ = true;
  int64_t chunk_ = 0;
};

} // namespace

std::unique_ptr<Codec> make_onebit(const ParsedSpec& s) { return std::make_unique<OnebitCodec>(s); }

} // namespace gradcomp::detail
