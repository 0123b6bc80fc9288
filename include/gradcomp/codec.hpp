// SPDX-License-Identifier: Apache-2.0
//! @file codec.hpp
//! The Codec interface (DESIGN.md section 3). A codec compresses a flat gradient x of `numel`
//! float32 / float16 / bfloat16 elements into a fixed-size packet, optionally with error feedback
//! fused into the same pass, and decodes packets back (assign or accumulate, scaled by alpha).
//!
//! Fixed floating-point expressions (DESIGN.md section 2), all in binary32 round-to-nearest:
//!   x' = fl(x + r)            (x' = x without a residual)
//!   y  = fl(x' / divisor)     (y = x' when divisor == 1)
//!   D  = fl(float(code) * d)  (the decoded value; d = 1 for casts and top-k)
//!   r_new = fl(x' - D)        (divisor == 1)   or   fl(x' - fl(divisor * D))  (divisor != 1)
//!   v = fl(D * alpha); accumulate: out = fl(out + v); assign: out = v.
//!
//! Entry points never allocate: outputs and scratch space are passed in; workspace_bytes() says how
//! much scratch space encode/decode need (at least 16 bytes: the status word lives there).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "gradcomp/error.hpp"
#include "gradcomp/packet.hpp"
#include "gradcomp/types.hpp"

namespace gradcomp {

//! The part of a packet an allreduce may sum (linear codecs): `count` elements of `dtype`
//! starting at byte `byte_offset`. The header never travels in the `sum` scheme.
struct PayloadView {
  int64_t byte_offset = 0;
  int64_t count = 0;
  DType dtype = DType::float32;
};

struct CodecProperties {
  bool linear = false;        //!< decode(a) + decode(b) == decode(a + b) on the payload
  bool unbiased = false;      //!< E[decode(encode(x))] == x
  bool deterministic = true;  //!< same input, same packet bytes
};

enum class DecodeMode : uint8_t { assign = 0, accumulate = 1 };

class Codec {
 public:
  virtual ~Codec() = default;

  //! Parse `name[:key=value,...]` (e.g. "topk:ratio=0.01"). Throws InvalidArgument for an unknown
  //! name or key, a malformed or out-of-range value, listing what is accepted.
  static std::unique_ptr<Codec> create(std::string_view spec);

  //! Canonical spec: the name, then the non-default keys in a fixed order, numbers in their
  //! shortest round-trip form. create(spec()) yields an equal codec.
  const std::string& spec() const noexcept { return spec_; }
  virtual CodecId id() const noexcept = 0;
  //! FNV-1a of spec(), written into every packet header.
  uint32_t spec_hash() const noexcept { return spec_hash_; }
  virtual CodecProperties properties() const noexcept = 0;

  //! Exact packet size in bytes for `numel` elements of `dtype`: a multiple of 16, the same on
  //! every rank. Throws InvalidArgument for numel outside [0, 2^56) or a dtype that is not a
  //! gradient dtype.
  virtual int64_t packet_bytes(int64_t numel, DType dtype) const = 0;
  //! Scratch bytes encode/decode need on `device` (>= 16: the status word).
  virtual int64_t workspace_bytes(int64_t numel, DType dtype, Device device) const = 0;
  //! The summable part of the packet for linear codecs; std::nullopt for the others.
  virtual std::optional<PayloadView> payload(int64_t numel, DType dtype) const { return std::nullopt; }
  //! The codec's main parameter for `numel` elements (k for top-k, 0 for casts): header bytes 24-31.
  virtual int64_t main_param(int64_t numel) const { return 0; }

  //! Compress x (numel elements, float32/float16/bfloat16, C-contiguous) into `packet` (byte size
  //! >= packet_bytes, 16-byte aligned). With `residual` (float32, numel elements, same device) the
  //! same pass computes x' = x + residual and overwrites residual with r_new (see file comment).
  //! `workspace` holds >= workspace_bytes(...) bytes on x's device. x is not modified.
  //! Throws InvalidArgument for mismatched sizes/dtypes/devices/alignment or arguments whose bytes
  //! overlap, Unsupported for a CUDA tensor in a CPU-only build.
  void encode(const Tensor& x, const Tensor* residual, const Tensor& packet, const Tensor& workspace,
              Stream stream = {}, float divisor = 1.0f) const;

  //! out (=| +=) alpha * D(packet); out has numel elements (float32/float16/bfloat16); numel is
  //! taken from out. A packet whose magic, version, codec id, spec hash, numel or dtypes do not
  //! match, or that carries an index out of range, out of order or repeated, raises CorruptPacket
  //! on the CPU before anything is written; on CUDA kernels skip invalid entries and set the status
  //! word in `workspace`. A packet flagged non-finite sets kStatusNonFinite (when a workspace is
  //! given) and writes NaN into out[0].
  void decode(const Tensor& packet, const Tensor& out, const Tensor& workspace, DecodeMode mode = DecodeMode::assign,
              float alpha = 1.0f, Stream stream = {}) const;

 protected:
  //! Each codec's constructor sets its canonical spec once (spec() and the header hash read it).
  void set_spec(std::string canonical) {
    spec_ = std::move(canonical);
    spec_hash_ = fnv1a32(spec_);
  }
  // Backend entry points; arguments are already validated by encode()/decode().
  virtual void encode_impl(const Tensor& x, const Tensor* residual, const Tensor& packet, const Tensor& workspace,
                           Stream stream, float divisor) const = 0;
  virtual void decode_impl(const Tensor& packet, const Tensor& out, const Tensor& workspace, DecodeMode mode,
                           float alpha, Stream stream) const = 0;

 private:
  std::string spec_;
  uint32_t spec_hash_ = 0;
};

//! Read the status word from a workspace (CPU memory directly; CUDA: a synchronizing copy on
//! `stream`) and clear it. Returns the kStatus* bits.
uint32_t read_status(const Tensor& workspace, Stream stream = {}, bool clear = true);

} // namespace gradcomp
