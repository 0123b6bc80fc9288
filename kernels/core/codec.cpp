// SPDX-License-Identifier: Apache-2.0
// The Codec entry points: the registry lookup of Codec::create and list_codecs(), the argument
// validation every encode/decode goes through before a family's implementation runs, and
// read_status.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "backend.hpp"
#include "gradcomp/codec.hpp"
#include "registry.hpp"
#include "spec.hpp"

namespace gradcomp {

std::unique_ptr<Codec> Codec::create(std::string_view spec) {
  detail::ParsedSpec s = detail::parse_spec(spec);
  for (const detail::RegistryEntry& e : detail::registry()) {
    if (e.name != s.name) continue;
    std::vector<std::string_view> keys = e.keys;
    keys.push_back(detail::kIntegrityKey);
    detail::check_keys(s, keys);
    // integrity=crc32c (every codec, kernels/core/integrity.hpp): taken out before the family parses
    // its own keys, appended last to the canonical spec
    bool crc = false;
    if (auto it = s.options.find(detail::kIntegrityKey); it != s.options.end()) {
      if (it->second == "crc32c") crc = true;
      else if (it->second != "none")
        throw InvalidArgument(detail::concat("codec spec '", s.text, "': integrity='", detail::display(it->second, 60),
                                             "' is not accepted; accepted: none (default), crc32c"));
      s.options.erase(it);
    }
    std::unique_ptr<Codec> c = e.make(s);
    c->id_ = e.id;
    if (crc) {
      c->integrity_ = true;
      c->set_spec(c->spec() + (c->spec().find(':') == std::string::npos ? ":" : ",") + "integrity=crc32c");
    }
    return c;
  }
  std::string names;
  for (const detail::RegistryEntry& e : detail::registry()) names += (names.empty() ? "" : ", ") + std::string(e.name);
  throw InvalidArgument(detail::concat("codec spec '", s.text, "': unknown codec '", detail::display(s.name, 60),
                                       "'; accepted codecs: ", names));
}

namespace detail {
void throw_no_backend(const Codec& c, Device d) {
  if (d.kind == DeviceKind::cuda && cuda_runtime() == nullptr)
    throw Unsupported(concat("codec '", c.spec(), "': tensors on ", to_string(d),
                             " but this gradcomp build has no CUDA support (build_info()['cuda'] is false)"));
  throw Unsupported(concat("codec '", c.spec(), "' has no ", d.kind == DeviceKind::cuda ? "CUDA" : "CPU",
                           " backend (tensors on ", to_string(d), ")"));
}
} // namespace detail

std::vector<CodecInfo> list_codecs() {
  std::vector<CodecInfo> out;
  for (const detail::RegistryEntry& e : detail::registry()) {
    CodecInfo i;
    i.name = std::string(e.name);
    i.id = e.id;
    for (auto k : e.keys) i.keys.emplace_back(k);
    i.keys.emplace_back(detail::kIntegrityKey);
    for (auto x : e.examples) i.examples.emplace_back(x);
    i.properties = Codec::create(e.examples.front())->properties();
    i.summary = std::string(e.summary);
    out.push_back(std::move(i));
  }
  return out;
}

namespace {

void check_tensor_basics(const Tensor& t, const char* what, const char* call) {
  GRADCOMP_CHECK(t.numel >= 0, InvalidArgument, call, ": ", what, " has numel ", t.numel, " < 0");
  GRADCOMP_CHECK(reinterpret_cast<uintptr_t>(t.data) % uintptr_t(std::max<int64_t>(1, dtype_size(t.dtype))) == 0,
                 InvalidArgument, call, ": ", what, " address ", t.data, " is not aligned to its ",
                 dtype_size(t.dtype), "-byte ", dtype_name(t.dtype), " elements");
  GRADCOMP_CHECK(t.numel == 0 || t.data != nullptr, InvalidArgument, call, ": ", what, " has numel ", t.numel,
                 " but a null data pointer");
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
                   float divisor, const EncodeContext& ctx, Stream stream) const {
  const char* call = "encode";
  require_backend(x.device);
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
                   dtype_name(residual->dtype), "; accepted: float32 (residuals are float32)");
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
  encode_impl(x, residual, packet, workspace, divisor, ctx, stream);
}

void Codec::decode(const Tensor& packet, const Tensor& out, const Tensor& workspace, DecodeMode mode, float alpha,
                   Stream stream) const {
  const char* call = "decode";
  require_backend(out.device);
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
    const detail::DeviceRuntime* rt = detail::cuda_runtime();
    GRADCOMP_CHECK(rt != nullptr, Unsupported, "read_status: workspace is on ", to_string(workspace.device),
                   " but this gradcomp build has no CUDA support (build_info()['cuda'] is false)");
    return rt->read_status(workspace, stream, clear);
  }
  auto* w = static_cast<uint32_t*>(workspace.data);
  const uint32_t s = w[0];
  if (clear) w[0] = 0;
  return s;
}

} // namespace gradcomp
