// SPDX-License-Identifier: Apache-2.0
// Codec registry, the built-in codecs' parameters and packet layouts, and the validation that every
// encode/decode goes through before a backend runs.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "backend.hpp"
#include "gradcomp/codec.hpp"
#include "spec.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace gradcomp {

// ------------------------------------------------------------------------------------------------
// dtypes, devices, threads, build info
// ------------------------------------------------------------------------------------------------
std::string_view dtype_name(DType t) noexcept {
  switch (t) {
    case DType::float32: return "float32";
    case DType::float16: return "float16";
    case DType::bfloat16: return "bfloat16";
    case DType::float8_e4m3fn: return "float8_e4m3fn";
    case DType::float8_e5m2: return "float8_e5m2";
    case DType::int8: return "int8";
    case DType::uint8: return "uint8";
    case DType::int32: return "int32";
    case DType::int64: return "int64";
    case DType::uint32: return "uint32";
    case DType::uint64: return "uint64";
    case DType::none: return "none";
  }
  return "unknown";
}

DType dtype_from_name(std::string_view name) {
  for (int i = 0; i <= 10; ++i) {
    auto t = static_cast<DType>(i);
    if (dtype_name(t) == name) return t;
  }
  throw InvalidArgument(detail::concat("unknown dtype '", name,
                                       "'; accepted: float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, int8, "
                                       "uint8, int32, int64, uint32, uint64"));
}

std::string to_string(Device d) {
  return d.kind == DeviceKind::cpu ? std::string("cpu") : "cuda:" + std::to_string(d.index);
}

namespace {
int default_threads() {
  if (const char* env = std::getenv("GRADCOMP_NUM_THREADS")) {
    char* end = nullptr;
    long v = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && v >= 1 && v <= 4096) return static_cast<int>(v);
  }
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}
std::atomic<int>& thread_setting() {
  static std::atomic<int> n{default_threads()};
  return n;
}
} // namespace

void set_num_threads(int n) {
  GRADCOMP_CHECK(n >= 1, InvalidArgument, "set_num_threads(", n, "): the thread count must be >= 1");
  thread_setting().store(n);
}
int get_num_threads() noexcept { return thread_setting().load(); }

BuildInfo build_info() {
  BuildInfo b;
  b.version = GRADCOMP_VERSION;
#if defined(GRADCOMP_WITH_CUDA)
  b.cuda = true;
  b.cuda_architectures = GRADCOMP_CUDA_ARCHS;
  b.cuda_version = detail::cuda::cuda_version();
#endif
#if defined(_OPENMP)
  b.openmp = true;
#endif
  return b;
}

// ------------------------------------------------------------------------------------------------
// Codec base: argument validation and dispatch
// ------------------------------------------------------------------------------------------------
namespace {

void check_tensor_basics(const Tensor& t, const char* what, const char* call) {
  GRADCOMP_CHECK(t.numel >= 0, InvalidArgument, call, ": ", what, " has numel ", t.numel, " < 0");
  GRADCOMP_CHECK(reinterpret_cast<uintptr_t>(t.data) % uintptr_t(std::max<int64_t>(1, dtype_size(t.dtype))) == 0,
                 InvalidArgument, call, ": ", what, " address ", t.data, " is not aligned to its ",
                 dtype_size(t.dtype), "-byte ", dtype_name(t.dtype), " elements");
  GRADCOMP_CHECK(t.numel == 0 || t.data != nullptr, InvalidArgument, call, ": ", what, " has numel ", t.numel,
                 " but a null data pointer");
#if !defined(GRADCOMP_WITH_CUDA)
  GRADCOMP_CHECK(t.device.kind == DeviceKind::cpu, Unsupported, call, ": ", what, " is on ", to_string(t.device),
                 " but this gradcomp build has no CUDA support (build_info().cuda is false)");
#endif
}

void check_same_device(const Tensor& a, const char* an, const Tensor& b, const char* bn, const char* call) {
  GRADCOMP_CHECK(a.device == b.device, InvalidArgument, call, ": ", an, " is on ", to_string(a.device), " but ", bn,
                 " is on ", to_string(b.device));
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Arguments that share bytes would be read after being written (e.g. residual == x, or out inside
// the packet): reject any overlap of two non-empty byte ranges on one device.
void check_disjoint(const Tensor& a, const char* an, const Tensor& b, const char* bn, const char* call) {
  if (a.nbytes() == 0 || b.nbytes() == 0 || !(a.device == b.device)) return;
  const auto a0 = reinterpret_cast<uintptr_t>(a.data), b0 = reinterpret_cast<uintptr_t>(b.data);
  const bool overlap = a0 < b0 + uintptr_t(b.nbytes()) && b0 < a0 + uintptr_t(a.nbytes());
  GRADCOMP_CHECK(!overlap, InvalidArgument, call, ": ", an, " (", a.nbytes(), " bytes at ", a.data, ") and ", bn, " (",
                 b.nbytes(), " bytes at ", b.data, ") overlap; they must be separate buffers");
}

} // namespace

void Codec::encode(const Tensor& x, const Tensor* residual, const Tensor& packet, const Tensor& workspace,
                   Stream stream, float divisor) const {
  const char* call = "encode";
  check_tensor_basics(x, "x", call);
  check_tensor_basics(packet, "packet", call);
  check_tensor_basics(workspace, "workspace", call);
  GRADCOMP_CHECK(is_gradient_dtype(x.dtype), InvalidArgument, call, ": x has dtype ", dtype_name(x.dtype),
                 "; accepted: float32, float16, bfloat16");
  GRADCOMP_CHECK(std::isfinite(divisor) && divisor > 0.0f, InvalidArgument, call, ": divisor ", divisor,
                 " must be a finite number > 0");
  check_same_device(x, "x", packet, "packet", call);
  check_same_device(x, "x", workspace, "workspace", call);
  if (residual) {
    check_tensor_basics(*residual, "residual", call);
    GRADCOMP_CHECK(residual->dtype == DType::float32, InvalidArgument, call, ": residual has dtype ",
                   dtype_name(residual->dtype), "; residuals are float32");
    GRADCOMP_CHECK(residual->numel == x.numel, InvalidArgument, call, ": residual has ", residual->numel,
                   " elements but x has ", x.numel);
    check_same_device(x, "x", *residual, "residual", call);
  }
  const int64_t need = packet_bytes(x.numel, x.dtype);
  GRADCOMP_CHECK(packet.nbytes() >= need, InvalidArgument, call, ": packet holds ", packet.nbytes(),
                 " bytes but codec '", spec(), "' needs packet_bytes(", x.numel, ", ", dtype_name(x.dtype),
                 ") = ", need);
  GRADCOMP_CHECK(aligned16(packet.data), InvalidArgument, call, ": packet address ", packet.data,
                 " is not 16-byte aligned");
  const int64_t ws = workspace_bytes(x.numel, x.dtype, x.device);
  GRADCOMP_CHECK(workspace.nbytes() >= ws, InvalidArgument, call, ": workspace holds ", workspace.nbytes(),
                 " bytes but codec '", spec(), "' needs workspace_bytes(", x.numel, ", ", dtype_name(x.dtype),
                 ") = ", ws);
  GRADCOMP_CHECK(aligned16(workspace.data), InvalidArgument, call, ": workspace address ", workspace.data,
                 " is not 16-byte aligned");
  check_disjoint(x, "x", packet, "packet", call);
  check_disjoint(x, "x", workspace, "workspace", call);
  check_disjoint(packet, "packet", workspace, "workspace", call);
  if (residual) {
    check_disjoint(*residual, "residual", x, "x", call);
    check_disjoint(*residual, "residual", packet, "packet", call);
    check_disjoint(*residual, "residual", workspace, "workspace", call);
  }
  encode_impl(x, residual, packet, workspace, stream, divisor);
}

void Codec::decode(const Tensor& packet, const Tensor& out, const Tensor& workspace, DecodeMode mode, float alpha,
                   Stream stream) const {
  const char* call = "decode";
  check_tensor_basics(packet, "packet", call);
  check_tensor_basics(out, "out", call);
  GRADCOMP_CHECK(is_gradient_dtype(out.dtype), InvalidArgument, call, ": out has dtype ", dtype_name(out.dtype),
                 "; accepted: float32, float16, bfloat16");
  GRADCOMP_CHECK(std::isfinite(alpha), InvalidArgument, call, ": alpha ", alpha, " must be finite");
  check_same_device(out, "out", packet, "packet", call);
  if (workspace.numel > 0 || workspace.data) {
    check_tensor_basics(workspace, "workspace", call);
    check_same_device(out, "out", workspace, "workspace", call);
    GRADCOMP_CHECK(workspace.nbytes() >= kStatusBytes, InvalidArgument, call, ": workspace holds ",
                   workspace.nbytes(), " bytes; decode needs at least ", kStatusBytes, " (the status word)");
    GRADCOMP_CHECK(aligned16(workspace.data), InvalidArgument, call, ": workspace address ", workspace.data,
                   " is not 16-byte aligned");
  } else {
    GRADCOMP_CHECK(out.device.kind == DeviceKind::cpu, InvalidArgument, call,
                   ": decoding on CUDA needs a workspace (the status word lives there)");
  }
  GRADCOMP_CHECK(packet.nbytes() >= kHeaderBytes, CorruptPacket, call, ": packet holds ", packet.nbytes(),
                 " bytes, less than the ", kHeaderBytes, "-byte header");
  GRADCOMP_CHECK(aligned16(packet.data), InvalidArgument, call, ": packet address ", packet.data,
                 " is not 16-byte aligned");
  check_disjoint(packet, "packet", out, "out", call);
  check_disjoint(packet, "packet", workspace, "workspace", call);
  check_disjoint(out, "out", workspace, "workspace", call);
  decode_impl(packet, out, workspace, mode, alpha, stream);
}

uint32_t read_status(const Tensor& workspace, Stream stream, bool clear) {
  GRADCOMP_CHECK(workspace.nbytes() >= kStatusBytes && workspace.data, InvalidArgument, "read_status: workspace holds ",
                 workspace.nbytes(), " bytes; the status word needs ", kStatusBytes);
  if (workspace.device.kind == DeviceKind::cuda) {
#if defined(GRADCOMP_WITH_CUDA)
    return detail::cuda::read_status(static_cast<const uint8_t*>(workspace.data), stream, clear);
#else
    throw Unsupported("read_status: workspace is on CUDA but this build has no CUDA support");
#endif
  }
  auto* w = static_cast<uint32_t*>(workspace.data);
  const uint32_t s = w[0];
  if (clear) w[0] = 0;
  return s;
}

// ------------------------------------------------------------------------------------------------
// Built-in codecs
// ------------------------------------------------------------------------------------------------
namespace {

using detail::CastPlan;
using detail::HeaderExpect;
using detail::TopKPlan;

// Element counts stay below 2^56 so that every byte count fits an int64.
constexpr int64_t kMaxNumel = int64_t(1) << 56;

void check_numel_dtype(int64_t numel, DType dtype, const char* call) {
  GRADCOMP_CHECK(numel >= 0 && numel < kMaxNumel, InvalidArgument, call, ": numel ", numel,
                 " is out of range; accepted: 0 <= numel < 2^56");
  GRADCOMP_CHECK(is_gradient_dtype(dtype), InvalidArgument, call, ": dtype ", dtype_name(dtype),
                 " is not accepted; accepted: float32, float16, bfloat16");
}

PacketHeader make_header(const Codec& c, int64_t numel, DType input, DType wire, DType index, int64_t main) {
  PacketHeader h{};
  h.magic = kPacketMagic;
  h.version = kPacketVersion;
  h.codec_id = static_cast<uint16_t>(c.id());
  h.input_dtype = static_cast<uint8_t>(input);
  h.wire_dtype = static_cast<uint8_t>(wire);
  h.index_dtype = static_cast<uint8_t>(index);
  h.flags = 0;
  h.spec_hash = c.spec_hash();
  h.numel = static_cast<uint64_t>(numel);
  h.main_param = static_cast<uint64_t>(main);
  return h;
}

// Host-side header validation (CPU packets). Returns the header's input dtype.
PacketHeader read_and_check_header(const Codec& c, const Tensor& packet, int64_t numel) {
  PacketHeader h;
  std::memcpy(&h, packet.data, sizeof h);
  const char* call = "decode";
  GRADCOMP_CHECK(h.magic == kPacketMagic, CorruptPacket, call, ": bad magic 0x", std::hex, h.magic, " (expected 0x",
                 kPacketMagic, " 'GCP1')");
  GRADCOMP_CHECK(h.version == kPacketVersion, CorruptPacket, call, ": packet version ", h.version, " (expected ",
                 kPacketVersion, ")");
  GRADCOMP_CHECK(h.codec_id == static_cast<uint16_t>(c.id()), CorruptPacket, call, ": packet codec id ", h.codec_id,
                 " but this codec ('", c.spec(), "') has id ", static_cast<int>(c.id()));
  GRADCOMP_CHECK(h.spec_hash == c.spec_hash(), CorruptPacket, call, ": packet spec hash 0x", std::hex, h.spec_hash,
                 " does not match codec '", c.spec(), "' (hash 0x", c.spec_hash(),
                 "): the packet was made by a codec with other parameters");
  GRADCOMP_CHECK(h.numel == static_cast<uint64_t>(numel), CorruptPacket, call, ": packet numel ", h.numel,
                 " but out has ", numel, " elements");
  const auto in = static_cast<DType>(h.input_dtype);
  GRADCOMP_CHECK(h.input_dtype <= 2 && is_gradient_dtype(in), CorruptPacket, call, ": packet input dtype code ",
                 int(h.input_dtype), " is not float32/float16/bfloat16");
  GRADCOMP_CHECK(h.main_param == static_cast<uint64_t>(c.main_param(numel)), CorruptPacket, call,
                 ": packet main parameter ", h.main_param, " but codec '", c.spec(), "' uses ", c.main_param(numel),
                 " for ", numel, " elements");
  const int64_t need = c.packet_bytes(numel, in);
  GRADCOMP_CHECK(packet.nbytes() >= need, CorruptPacket, call, ": packet buffer holds ", packet.nbytes(),
                 " bytes but its header describes a ", need, "-byte packet");
  return h;
}

uint32_t* status_ptr(const Tensor& ws) { return ws.data ? static_cast<uint32_t*>(ws.data) : nullptr; }

// ---- none / fp16 / bf16 ------------------------------------------------------------------------
class CastCodec final : public Codec {
 public:
  explicit CastCodec(CodecId id) : id_(id) {
    set_spec(id_ == CodecId::none ? "none" : id_ == CodecId::fp16 ? "fp16" : "bf16");
  }
  CodecId id() const noexcept override { return id_; }
  CodecProperties properties() const noexcept override { return {true, id_ == CodecId::none, true}; }
  DType wire(DType in) const { return id_ == CodecId::none ? in : id_ == CodecId::fp16 ? DType::float16 : DType::bfloat16; }
  int64_t packet_bytes(int64_t numel, DType dtype) const override {
    check_numel_dtype(numel, dtype, "packet_bytes");
    return kHeaderBytes + align16((numel + 1) * dtype_size(wire(dtype)));
  }
  int64_t workspace_bytes(int64_t numel, DType dtype, Device) const override {
    check_numel_dtype(numel, dtype, "workspace_bytes");
    return kStatusBytes;
  }
  std::optional<PayloadView> payload(int64_t numel, DType dtype) const override {
    check_numel_dtype(numel, dtype, "payload");
    return PayloadView{kHeaderBytes, numel + 1, wire(dtype)};
  }

 protected:
  void encode_impl(const Tensor& x, const Tensor* residual, const Tensor& packet, const Tensor& ws, Stream stream,
                   float divisor) const override {
    CastPlan p{x.dtype, wire(x.dtype), x.numel};
    const PacketHeader h = make_header(*this, x.numel, x.dtype, p.wire, DType::none, 0);
    float* r = residual ? residual->ptr<float>() : nullptr;
    if (x.device.kind == DeviceKind::cuda) {
#if defined(GRADCOMP_WITH_CUDA)
      detail::cuda::cast_encode(p, x, r, packet.ptr<uint8_t>(), h, divisor, ws.ptr<uint8_t>(), stream);
#endif
      return;
    }
    detail::cpu::cast_encode(p, x, r, packet.ptr<uint8_t>(), h, divisor);
  }
  void decode_impl(const Tensor& packet, const Tensor& out, const Tensor& ws, DecodeMode mode, float alpha,
                   Stream stream) const override {
    if (out.device.kind == DeviceKind::cuda) {
#if defined(GRADCOMP_WITH_CUDA)
      const DType in = id_ == CodecId::none ? DType::none : DType::float32;
      CastPlan p{in, id_ == CodecId::none ? DType::none : wire(DType::float32), out.numel};
      HeaderExpect e{make_header(*this, out.numel, in, p.wire, DType::none, 0), packet.nbytes()};
      detail::cuda::cast_decode(p, packet.ptr<uint8_t>(), out, e, mode, alpha, ws.ptr<uint8_t>(), stream);
#endif
      return;
    }
    const PacketHeader h = read_and_check_header(*this, packet, out.numel);
    const auto in = static_cast<DType>(h.input_dtype);
    GRADCOMP_CHECK(h.wire_dtype == static_cast<uint8_t>(wire(in)), CorruptPacket, "decode: packet wire dtype code ",
                   int(h.wire_dtype), " but codec '", spec(), "' sends ", dtype_name(wire(in)));
    CastPlan p{in, wire(in), out.numel};
    uint32_t* st = status_ptr(ws);
    detail::cpu::cast_decode(p, packet.ptr<uint8_t>(), out, mode, alpha, st);
    (void)stream;
  }

 private:
  CodecId id_;
};

// ---- top-k -------------------------------------------------------------------------------------
enum class IndexMode { automatic, u32, u64 };

class TopKCodec final : public Codec {
 public:
  explicit TopKCodec(const detail::ParsedSpec& s) {
    detail::check_keys(s, {"ratio", "k", "index", "value_dtype"});
    const bool has_ratio = s.options.count("ratio") > 0;
    has_k_ = s.options.count("k") > 0;
    GRADCOMP_CHECK(has_ratio != has_k_, InvalidArgument, "codec spec '", s.text,
                   "': topk needs exactly one of ratio= (in (0, 1]) or k= (an integer >= 0)");
    if (has_ratio) {
      const std::string& v = s.options.find("ratio")->second;
      ratio_ = detail::parse_double(s, "ratio", v, "0 < ratio <= 1");
      GRADCOMP_CHECK(ratio_ > 0.0 && ratio_ <= 1.0, InvalidArgument, "codec spec '", s.text, "': ratio=", v,
                     " is out of range; accepted: 0 < ratio <= 1");
    } else {
      const std::string& v = s.options.find("k")->second;
      k_ = detail::parse_int(s, "k", v, "an integer >= 0");
      GRADCOMP_CHECK(k_ >= 0, InvalidArgument, "codec spec '", s.text, "': k=", v,
                     " is out of range; accepted: an integer >= 0");
    }
    if (auto it = s.options.find("index"); it != s.options.end()) {
      if (it->second == "auto") index_ = IndexMode::automatic;
      else if (it->second == "u32") index_ = IndexMode::u32;
      else if (it->second == "u64") index_ = IndexMode::u64;
      else
        throw InvalidArgument(detail::concat("codec spec '", s.text, "': index='", it->second,
                                             "' is not accepted; accepted: auto, u32, u64"));
    }
    if (auto it = s.options.find("value_dtype"); it != s.options.end()) {
      if (it->second == "auto") value_ = DType::none;
      else if (it->second == "float32" || it->second == "float16" || it->second == "bfloat16")
        value_ = dtype_from_name(it->second);
      else
        throw InvalidArgument(detail::concat("codec spec '", s.text, "': value_dtype='", it->second,
                                             "' is not accepted; accepted: auto, float32, float16, bfloat16"));
    }
    std::string c = has_k_ ? "topk:k=" + std::to_string(k_) : "topk:ratio=" + detail::format_double(ratio_);
    if (index_ == IndexMode::u32) c += ",index=u32";
    if (index_ == IndexMode::u64) c += ",index=u64";
    if (value_ != DType::none) c += ",value_dtype=" + std::string(dtype_name(value_));
    set_spec(std::move(c));
  }
  CodecId id() const noexcept override { return CodecId::topk; }
  CodecProperties properties() const noexcept override { return {false, false, true}; }

  //! k = min(n, max(1, ceil(ratio * n))) in binary64, or min(k=, n).
  int64_t main_param(int64_t n) const override {
    check_numel_dtype(n, DType::float32, "main_param");
    if (has_k_) return std::min(k_, n);
    const double k = std::ceil(ratio_ * static_cast<double>(n));
    return std::min<int64_t>(n, std::max<int64_t>(1, static_cast<int64_t>(k)));
  }
  DType index_dtype(int64_t n) const {
    constexpr int64_t kU32Limit = int64_t(1) << 32;
    if (index_ == IndexMode::u64) return DType::uint64;
    GRADCOMP_CHECK(!(index_ == IndexMode::u32 && n > kU32Limit), InvalidArgument, "topk: ", n,
                   " elements need 64-bit indices but the spec says index=u32 (use index=auto or index=u64)");
    return n > kU32Limit ? DType::uint64 : DType::uint32;
  }
  TopKPlan plan(int64_t n, DType in) const {
    TopKPlan p;
    p.input = in;
    p.numel = n;
    p.k = main_param(n);
    p.index_dtype = index_dtype(n);
    p.value_dtype = value_ == DType::none ? in : value_;
    p.values_offset = kHeaderBytes + align16(p.k * dtype_size(p.index_dtype));
    // AIR-style adaptive candidate buffer: candidates are buffered only while they are few.
    p.candidate_capacity = std::min<int64_t>(n, n / 16 + 4096);
    return p;
  }
  int64_t packet_bytes(int64_t numel, DType dtype) const override {
    check_numel_dtype(numel, dtype, "packet_bytes");
    const TopKPlan p = plan(numel, dtype);
    return p.values_offset + align16(p.k * dtype_size(p.value_dtype));
  }
  int64_t workspace_bytes(int64_t numel, DType dtype, Device device) const override {
    check_numel_dtype(numel, dtype, "workspace_bytes");
    const TopKPlan p = plan(numel, dtype);
    if (device.kind == DeviceKind::cuda) {
#if defined(GRADCOMP_WITH_CUDA)
      return detail::cuda::topk_workspace_bytes(p);
#else
      throw Unsupported("workspace_bytes: device cuda but this build has no CUDA support");
#endif
    }
    return detail::cpu::topk_workspace_bytes(p, get_num_threads());
  }

 protected:
  void encode_impl(const Tensor& x, const Tensor* residual, const Tensor& packet, const Tensor& ws, Stream stream,
                   float divisor) const override {
    const TopKPlan p = plan(x.numel, x.dtype);
    const PacketHeader h = make_header(*this, x.numel, x.dtype, p.value_dtype, p.index_dtype, p.k);
    float* r = residual ? residual->ptr<float>() : nullptr;
    if (x.device.kind == DeviceKind::cuda) {
#if defined(GRADCOMP_WITH_CUDA)
      detail::cuda::topk_encode(p, x, r, packet.ptr<uint8_t>(), h, ws.ptr<uint8_t>(), ws.nbytes(), divisor, stream);
#endif
      return;
    }
    detail::cpu::topk_encode(p, x, r, packet.ptr<uint8_t>(), h, ws.ptr<uint8_t>(), ws.nbytes(), divisor);
  }
  void decode_impl(const Tensor& packet, const Tensor& out, const Tensor& ws, DecodeMode mode, float alpha,
                   Stream stream) const override {
    if (out.device.kind == DeviceKind::cuda) {
#if defined(GRADCOMP_WITH_CUDA)
      TopKPlan p = plan(out.numel, DType::float32);
      p.input = DType::none;
      p.value_dtype = value_;  // none: from the header
      HeaderExpect e{make_header(*this, out.numel, DType::none, value_, p.index_dtype, p.k), packet.nbytes()};
      detail::cuda::topk_decode(p, packet.ptr<uint8_t>(), out, e, mode, alpha, ws.ptr<uint8_t>(), stream);
#endif
      return;
    }
    const PacketHeader h = read_and_check_header(*this, packet, out.numel);
    const auto in = static_cast<DType>(h.input_dtype);
    const TopKPlan p = plan(out.numel, in);
    GRADCOMP_CHECK(h.wire_dtype == static_cast<uint8_t>(p.value_dtype), CorruptPacket,
                   "decode: packet value dtype code ", int(h.wire_dtype), " but codec '", spec(), "' sends ",
                   dtype_name(p.value_dtype));
    GRADCOMP_CHECK(h.index_dtype == static_cast<uint8_t>(p.index_dtype), CorruptPacket,
                   "decode: packet index dtype code ", int(h.index_dtype), " but codec '", spec(), "' uses ",
                   dtype_name(p.index_dtype), " for ", out.numel, " elements");
    uint32_t* st = status_ptr(ws);
    detail::cpu::topk_decode(p, packet.ptr<uint8_t>(), out, mode, alpha, st);  // validates indices first
    (void)stream;
  }

 private:
  bool has_k_ = false;
  double ratio_ = 0;
  int64_t k_ = 0;
  IndexMode index_ = IndexMode::automatic;
  DType value_ = DType::none;
};

} // namespace

std::unique_ptr<Codec> Codec::create(std::string_view spec) {
  const detail::ParsedSpec s = detail::parse_spec(spec);
  if (s.name == "none" || s.name == "fp16" || s.name == "bf16") {
    detail::check_keys(s, {});
    return std::make_unique<CastCodec>(s.name == "none" ? CodecId::none
                                       : s.name == "fp16" ? CodecId::fp16
                                                          : CodecId::bf16);
  }
  if (s.name == "topk") return std::make_unique<TopKCodec>(s);
  throw InvalidArgument(detail::concat("codec spec '", spec, "': unknown codec '", s.name,
                                       "'; accepted codecs: none, fp16, bf16, topk"));
}

} // namespace gradcomp
