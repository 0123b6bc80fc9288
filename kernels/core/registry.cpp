// SPDX-License-Identifier: Apache-2.0
// THE list of codecs. A new family adds its factory to the declaration and one table line.
#include "registry.hpp"

namespace gradcomp::detail {

FactoryFn make_cast, make_topk; // defined in kernels/core/codecs/<family>.cpp

const std::vector<RegistryEntry>& registry() {
  static const std::vector<RegistryEntry> table = {
      {"none", CodecId::none, {}, make_cast, {"none"}, "the input dtype as is (dense; PyTorch's allreduce_hook)"},
      {"fp16", CodecId::fp16, {}, make_cast, {"fp16"},
       "round-to-nearest-even cast to float16 (PyTorch's fp16_compress_hook)"},
      {"bf16", CodecId::bf16, {}, make_cast, {"bf16"},
       "round-to-nearest-even cast to bfloat16 (PyTorch's bf16_compress_hook)"},
      {"topk", CodecId::topk, {"ratio", "k", "index", "value_dtype"}, make_topk,
       {"topk:ratio=0.01", "topk:ratio=1", "topk:k=0", "topk:k=3,index=u64,value_dtype=bfloat16",
        "topk:ratio=0.3,value_dtype=float16"},
       "exact top-k by magnitude (Aji & Heafield, EMNLP 2017; Lin et al., ICLR 2018)"},
  };
  return table;
}

} // namespace gradcomp::detail
