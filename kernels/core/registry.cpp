// SPDX-License-Identifier: Apache-2.0
// THE list of codecs. A new family adds its factory to the declaration and one table line.
#include "registry.hpp"

namespace gradcomp::detail {

FactoryFn make_cast, make_topk, make_blockq, make_onebit, make_randomk, make_qsgd, make_terngrad; // defined in kernels/core/codecs/<family>.cpp

const std::vector<RegistryEntry>& registry() {
  static const std::vector<RegistryEntry> table = {
      {"none", CodecId::none, {}, make_cast, {"none"}, "the input dtype as is (dense; PyTorch's allreduce_hook)"},
      {"fp16", CodecId::fp16, {}, make_cast, {"fp16"},
       "round-to-nearest-even cast to float16 (PyTorch's fp16_compress_hook)"},
      {"bf16", CodecId::bf16, {"rounding"}, make_cast, {"bf16", "bf16:rounding=stochastic"},
       "cast to bfloat16: round to nearest even (PyTorch's bf16_compress_hook) or, keyed, stochastic rounding "
       "from Philox4x32-10 (Gupta et al., ICML 2015)"},
      {"topk", CodecId::topk, {"ratio", "k", "index", "value_dtype"}, make_topk,
       {"topk:ratio=0.01", "topk:ratio=1", "topk:k=0", "topk:k=3,index=u64,value_dtype=bfloat16",
        "topk:ratio=0.3,value_dtype=float16", "topk:ratio=0.3,integrity=crc32c"},
       "exact top-k by magnitude (Aji & Heafield, EMNLP 2017; Lin et al., ICLR 2018)"},
      {"randomk", CodecId::randomk, {"ratio", "k", "unbiased"}, make_randomk,
       {"randomk:ratio=0.01", "randomk:ratio=1", "randomk:k=0", "randomk:k=3,unbiased=true"},
       "random-k, one index per stratum from the key, values only (Stich et al., NeurIPS 2018; unbiased "
       "rescaling: Wangni et al., NeurIPS 2018)"},
      {"fp8", CodecId::fp8, {"format", "block", "scale"}, make_blockq,
       {"fp8", "fp8:format=e5m2", "fp8:scale=e8m0", "fp8:block=0", "fp8:format=e5m2,block=17"},
       "float8 e4m3fn / e5m2 codes with a float32 (or OCP MX e8m0) scale per block (Micikevicius et al. 2022)"},
      {"int8", CodecId::int8, {"block", "rounding"}, make_blockq,
       {"int8", "int8:block=0", "int8:block=7", "int8:rounding=stochastic", "int8:block=7,integrity=crc32c"},
       "symmetric int8 codes with a float32 scale per block (ZeRO++ qgZ, Wang et al. 2023); rounding=stochastic: "
       "keyed stochastic rounding of the codes"},
      {"int4", CodecId::int4, {"block", "rounding"}, make_blockq,
       {"int4", "int4:block=0", "int4:block=6", "int4:block=1026,rounding=stochastic"},
       "symmetric int4 codes, two per byte, with a float32 scale per block (ZeRO++ qgZ, Wang et al. 2023); "
       "rounding=stochastic: keyed stochastic rounding of the codes"},
      {"qsgd", CodecId::qsgd, {"levels", "block", "coding"}, make_qsgd,
       {"qsgd", "qsgd:levels=16", "qsgd:levels=1,block=7", "qsgd:block=4096", "qsgd:levels=16,coding=elias",
        "qsgd:block=5,coding=elias"},
       "stochastic rounding to s levels of |x| / the block's L2 norm, int8 codes, a float32 norm per block, keyed "
       "(QSGD, Alistarh et al., NeurIPS 2017, section 3.1; GRACE's defaults s = 127, block 128); coding=elias: "
       "the non-zero levels with Elias-delta gaps and levels (section 3.2), dense fallback past the capacity"},
      {"terngrad", CodecId::terngrad, {"clip"}, make_terngrad, {"terngrad", "terngrad:clip=0"},
       "ternary codes sign(x) * Bernoulli(|x| / max|x|) after clipping at c standard deviations, one float32 "
       "scale, keyed (TernGrad, Wen et al., NeurIPS 2017, sections 3 and 3.3)"},
      {"onebit", CodecId::onebit, {"scale", "chunk"}, make_onebit,
       {"onebit", "onebit:scale=mean_abs", "onebit:chunk=8", "onebit:chunk=4104,scale=mean_abs"},
       "1-bit signs with a float32 scale (RMS or mean |x|) per chunk (1-bit Adam, Tang et al. 2021)"},
  };
  return table;
}

} // namespace gradcomp::detail
