// SPDX-License-Identifier: Apache-2.0
//! @file codec.hpp
//! The Codec interface. A codec compresses a flat gradient x of `numel`
//! float32 / float16 / bfloat16 elements into a fixed-size packet, optionally with error feedback
//! fused into the same pass, and decodes packets back (assign or accumulate, scaled by alpha).
//!
//! Fixed floating-point expressions, all in binary32 round-to-nearest, never contracted into FMA:
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
#include <vector>

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
  bool deterministic = true;  //!< same input (and key), same packet bytes
  //! x + r_old == D + r_new holds exactly at divisor 1 (D the decoded packet): the decoded values
  //! are roundings of x' (casts, top-k), so the error-feedback subtraction is exact (Sterbenz).
  bool exact_residual = false;
  //! The codec draws random numbers: its packets carry the EncodeContext in a 32-byte key section.
  bool keyed = false;
  //! The packet holds a subset of the elements (indices and values: top-k): schemes that re-encode
  //! a sum (two_phase) do not fit it; the `auto` scheme sends it with `gather`.
  bool sparse = false;
};

//! The key of codecs that draw random numbers (Philox keyed by values every rank shares: the
//! same key gives the same packet on every rank and backend). It travels in a 32-byte packet
//! section (u64 seed, u32 step, u32 bucket, u32 chunk, little-endian, then 12 reserved zero bytes
//! that decode checks), so decode needs no side channel. `chunk` tells apart the pieces of one
//! bucket that are encoded separately (two_phase's chunks); 0 for a whole bucket. Codecs without
//! randomness ignore it. docs/contracts.md section 3.
struct EncodeContext {
  uint64_t seed = 0;
  uint32_t step = 0;
  uint32_t bucket = 0;
  uint32_t chunk = 0;
  friend bool operator==(const EncodeContext&, const EncodeContext&) = default;
};

enum class DecodeMode : uint8_t { assign = 0, accumulate = 1 };

//! One section of a packet: `count` elements of `dtype` (packed for int4 / uint1) at byte
//! `offset` (a multiple of 16). `name` says what it holds ("payload", "indices", "values",
//! "scales", "key", ...).
struct PacketSection {
  const char* name = "";
  int64_t offset = 0;
  int64_t count = 0;
  DType dtype = DType::none;
};

enum class MainParamKind : uint8_t {
  exact = 0,   //!< header bytes 24-31 must equal the codec's value for numel (k, block)
  maximum = 1, //!< a count up to a capacity (dgc): decode clamps it to the capacity
};

//! The declarative layout of a packet for (codec, numel, input dtype): the header it carries (flags
//! zero), the sections after it, and the total size. packet_bytes, the header, host validation,
//! zeroed padding and the CUDA kernels' header check all derive from it.
inline constexpr int kMaxSections = 5;
struct PacketLayout {
  PacketHeader header{};               //!< expected header, flags 0
  MainParamKind main_kind = MainParamKind::exact;
  uint8_t flags_defined = kFlagNonFinite; //!< the flag bits this codec's packets may carry
  int32_t nsections = 0;
  int32_t key_section = -1;            //!< index of the 32-byte EncodeContext section, -1: none
  int32_t payload_section = -1;        //!< linear codecs: the section an allreduce may sum
  int32_t checksum_section = -1;       //!< integrity=crc32c: the 16-byte CRC-32C section (last), -1: none
  PacketSection sections[kMaxSections];
  int64_t bytes = 0;                   //!< total packet bytes, a multiple of 16
};

//! What the registry says of one codec name (gradcomp.codecs() in Python).
struct CodecInfo {
  std::string name;                    //!< e.g. "topk"
  CodecId id;                          //!< header bytes 6-7
  std::vector<std::string> keys;       //!< accepted spec keys
  CodecProperties properties;          //!< of the first example spec
  std::vector<std::string> examples;   //!< canonical example specs (the contract suite runs them)
  std::string summary;                 //!< one line: what the codec does, and its source
};
//! Every registered codec, in registry order (kernels/core/registry.cpp).
std::vector<CodecInfo> list_codecs();

class Codec {
 public:
  virtual ~Codec() = default;

  //! Parse `name[:key=value,...]` (e.g. "topk:ratio=0.01"). Throws InvalidArgument for an unknown
  //! name or key, a malformed or out-of-range value, listing what is accepted.
  static std::unique_ptr<Codec> create(std::string_view spec);

  //! Canonical spec: the name, then the non-default keys in a fixed order, numbers in their
  //! shortest round-trip form. create(spec()) yields an equal codec.
  const std::string& spec() const noexcept { return spec_; }
  //! Header bytes 6-7, from the registry line of the codec's name.
  CodecId id() const noexcept { return id_; }
  //! FNV-1a of spec(), written into every packet header.
  uint32_t spec_hash() const noexcept { return spec_hash_; }
  //! The family's properties; with integrity=crc32c not linear (a checksum does not survive a sum).
  CodecProperties properties() const noexcept {
    CodecProperties p = base_properties();
    if (integrity_) p.linear = false;
    return p;
  }
  //! Whether packets carry the integrity=crc32c checksum section.
  bool integrity() const noexcept { return integrity_; }

  //! Exact packet size in bytes for `numel` elements of `dtype`: a multiple of 16, the same on
  //! every rank. Throws InvalidArgument for numel outside [0, 2^56) or a dtype that is not a
  //! gradient dtype.
  virtual int64_t packet_bytes(int64_t numel, DType dtype) const = 0;
  //! The packet's layout for `numel` elements of `dtype` (same errors as packet_bytes).
  virtual PacketLayout layout(int64_t numel, DType dtype) const = 0;
  //! Scratch bytes encode/decode need on `device` (>= 16: the status word). On the CPU it depends
  //! on the thread count at the time of the call (gradcomp::get_num_threads()). Throws Unsupported
  //! when the codec has no backend for `device` in this build.
  virtual int64_t workspace_bytes(int64_t numel, DType dtype, Device device) const = 0;
  //! The summable part of the packet for linear codecs; std::nullopt for the others.
  virtual std::optional<PayloadView> payload(int64_t numel, DType dtype) const { return std::nullopt; }
  //! The codec's main parameter for `numel` elements (k for top-k, 0 for casts): header bytes 24-31.
  virtual int64_t main_param(int64_t numel) const { return 0; }

  //! Compress x (numel elements, float32/float16/bfloat16, C-contiguous) into `packet` (byte size
  //! >= packet_bytes, 16-byte aligned). With `residual` (float32, numel elements, same device) the
  //! same pass computes x' = x + residual and overwrites residual with r_new (see file comment).
  //! `workspace` holds >= workspace_bytes(...) bytes on x's device. x is not modified. `ctx` keys
  //! codecs that draw random numbers (ignored by the others; a keyed codec writes it into the
  //! packet's key section, and the same x, residual, divisor and ctx give the same bytes).
  //! Throws InvalidArgument for mismatched sizes/dtypes/devices/alignment or arguments whose bytes
  //! overlap, Unsupported for a device the codec has no backend for in this build.
  //! The stream goes last, as in decode: encode(x, residual, packet, workspace, divisor, ctx, stream).
  void encode(const Tensor& x, const Tensor* residual, const Tensor& packet, const Tensor& workspace,
              float divisor = 1.0f, const EncodeContext& ctx = {}, Stream stream = {}) const;

  //! out (=| +=) alpha * D(packet); out has numel elements (float32/float16/bfloat16); numel is
  //! taken from out. A packet whose magic, version, codec id, spec hash, numel, dtypes, main
  //! parameter or flags do not match, whose key section (keyed codecs) has a non-zero reserved
  //! byte, or that carries an index out of range, out of order or repeated, raises CorruptPacket on the CPU before anything is written; on CUDA kernels skip
  //! invalid entries and set the status word in `workspace`. A packet flagged non-finite sets
  //! kStatusNonFinite (when a workspace is given; on CUDA one always is) on every backend. Top-k,
  //! whose packet may have dropped the non-finite value, also writes NaN into out[0] (numel > 0,
  //! assign and accumulate); the casts, the block quantizers and onebit write nothing more (out
  //! holds what their packet decodes to: NaN / inf codes and NaN scales travel in the packet).
  void decode(const Tensor& packet, const Tensor& out, const Tensor& workspace, DecodeMode mode = DecodeMode::assign,
              float alpha = 1.0f, Stream stream = {}) const;

 protected:
  //! Each codec's constructor sets its canonical spec once (spec() and the header hash read it).
  void set_spec(std::string canonical) {
    spec_ = std::move(canonical);
    spec_hash_ = fnv1a32(spec_);
  }
  virtual CodecProperties base_properties() const noexcept = 0;
  // Backend entry points; arguments are already validated by encode()/decode() (sizes that depend
  // on the plan, such as the workspace, are checked by the implementation).
  virtual void encode_impl(const Tensor& x, const Tensor* residual, const Tensor& packet, const Tensor& workspace,
                           float divisor, const EncodeContext& ctx, Stream stream) const = 0;
  virtual void decode_impl(const Tensor& packet, const Tensor& out, const Tensor& workspace, DecodeMode mode,
                           float alpha, Stream stream) const = 0;
  //! Throws Unsupported when the codec has no backend for `device` in this build.
  virtual void require_backend(Device device) const = 0;

 private:
  std::string spec_;
  uint32_t spec_hash_ = 0;
  CodecId id_{};
  bool integrity_ = false;
};

//! Read the status word from a workspace (CPU memory directly; CUDA: a synchronizing copy on
//! `stream`, on the workspace's device) and clear it. Returns the kStatus* bits.
uint32_t read_status(const Tensor& workspace, Stream stream = {}, bool clear = true);

} // namespace gradcomp
