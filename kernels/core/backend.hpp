// SPDX-License-Identifier: Apache-2.0
// Internal interface between kernels/core (validation, packet layout) and the backends
// (kernels/cpu, kernels/cuda). Arguments reaching these functions are already validated; the
// backends never include each other.
#pragma once

#include <cstdint>

#include "gradcomp/codec.hpp"

namespace gradcomp::detail {

//! Layout of a cast packet (codecs none / fp16 / bf16): header, then numel + 1 wire elements; the
//! last one is the non-finite sentinel (0, or NaN when a non-finite value was encoded).
struct CastPlan {
  DType input = DType::float32;
  DType wire = DType::float32;
  int64_t numel = 0;
};

//! Layout of a top-k packet: header, k indices (ascending) at offset 32, k values at values_offset.
struct TopKPlan {
  DType input = DType::float32;
  int64_t numel = 0;
  int64_t k = 0;
  DType index_dtype = DType::uint32;
  DType value_dtype = DType::float32;
  int64_t values_offset = 0;
  int64_t candidate_capacity = 0; //!< CPU: entries the candidate buffer holds
};

//! What decode expects in the header; the CPU checks it on the host, CUDA kernels on the device.
struct HeaderExpect {
  PacketHeader header{}; //!< flags ignored; input/wire dtype checked by the codec's rule
  int64_t packet_capacity = 0; //!< bytes available in the packet buffer
};

namespace cpu {
void cast_encode(const CastPlan& p, const Tensor& x, float* residual, uint8_t* packet, const PacketHeader& hdr,
                 float divisor);
void cast_decode(const CastPlan& p, const uint8_t* packet, const Tensor& out, DecodeMode mode, float alpha,
                 uint32_t* status);
int64_t topk_workspace_bytes(const TopKPlan& p, int threads);
void topk_encode(const TopKPlan& p, const Tensor& x, float* residual, uint8_t* packet, const PacketHeader& hdr,
                 uint8_t* workspace, int64_t workspace_bytes, float divisor);
void topk_decode(const TopKPlan& p, const uint8_t* packet, const Tensor& out, DecodeMode mode, float alpha,
                 uint32_t* status);
} // namespace cpu

} // namespace gradcomp::detail

#if defined(GRADCOMP_WITH_CUDA)
namespace gradcomp::detail::cuda {
// Implemented in kernels/cuda/*.cu. No allocation, host synchronization or host read of device
// memory: the header is written by the encode kernel; decode validates the header on the device
// against `expect` and reports through the status word at the start of `workspace`.
// For decode, a CastPlan/TopKPlan whose input dtype is DType::none means "take it from the header".
void cast_encode(const CastPlan& p, const Tensor& x, float* residual, uint8_t* packet, const PacketHeader& hdr,
                 float divisor, uint8_t* workspace, Stream stream);
void cast_decode(const CastPlan& p, const uint8_t* packet, const Tensor& out, const HeaderExpect& expect,
                 DecodeMode mode, float alpha, uint8_t* workspace, Stream stream);
int64_t topk_workspace_bytes(const TopKPlan& p);
void topk_encode(const TopKPlan& p, const Tensor& x, float* residual, uint8_t* packet, const PacketHeader& hdr,
                 uint8_t* workspace, int64_t workspace_bytes, float divisor, Stream stream);
void topk_decode(const TopKPlan& p, const uint8_t* packet, const Tensor& out, const HeaderExpect& expect,
                 DecodeMode mode, float alpha, uint8_t* workspace, Stream stream);
//! Synchronizing copy of the status word (first 4 bytes of the workspace) to the host; clears it.
uint32_t read_status(const uint8_t* workspace, Stream stream, bool clear);
//! Toolkit version and architectures compiled in, for build_info().
const char* cuda_version();
} // namespace gradcomp::detail::cuda
#endif
