// SPDX-License-Identifier: Apache-2.0
// FamilyCodec<Plan>: the Codec implementation every codec family shares. A family provides
//   * make_plan(numel, input, device): its Plan for one call (the packet layout in `plan.layout`,
//     the CPU thread count in `plan.threads`, resolved once here), and
//   * backends(): its Kernels<Plan> tables ({&cpu::table, GRADCOMP_CUDA_KERNELS(cuda::table)}),
// and this class derives packet_bytes, layout, payload, workspace_bytes, the plan-dependent checks,
// host header validation and dispatch from them. One plan per call: the workspace is checked and
// the kernel runs with the same thread count.
#pragma once

#include <algorithm>
#include <cstring>

#include "backend.hpp"
#include "integrity.hpp"
#include "layout.hpp"

namespace gradcomp::detail {

//! Element counts stay below 2^56 so that every byte count fits an int64.
inline constexpr int64_t kMaxNumel = int64_t(1) << 56;

//! Throws InvalidArgument for numel outside [0, 2^56) or a dtype that is not float32/float16/bfloat16.
void check_numel_dtype(int64_t numel, DType dtype, const char* call);

//! Threads a CPU kernel over n elements uses: 1 below 64 Ki elements, else get_num_threads(), or 1
//! for a while after a team found a core contended (runtime.cpp). Throws InvalidArgument for a bad
//! GRADCOMP_NUM_THREADS.
int cpu_threads_for(int64_t n);
//! The most threads such a call may use (what workspaces are sized for): 1 below 64 Ki elements,
//! else get_num_threads().
int cpu_threads_max(int64_t n);

template <class Plan> class FamilyCodec : public Codec {
 public:
  int64_t packet_bytes(int64_t numel, DType dtype) const final {
    check_numel_dtype(numel, dtype, "packet_bytes");
    return plan(numel, dtype, Device{}).layout.bytes;
  }
  PacketLayout layout(int64_t numel, DType dtype) const final {
    check_numel_dtype(numel, dtype, "layout");
    return plan(numel, dtype, Device{}).layout;
  }
  std::optional<PayloadView> payload(int64_t numel, DType dtype) const final {
    check_numel_dtype(numel, dtype, "payload");
    const PacketLayout l = plan(numel, dtype, Device{}).layout;
    if (l.payload_section < 0) return std::nullopt;
    const PacketSection& s = l.sections[l.payload_section];
    return PayloadView{s.offset, s.count, s.dtype};
  }
  int64_t workspace_bytes(int64_t numel, DType dtype, Device device) const final {
    check_numel_dtype(numel, dtype, "workspace_bytes");
    const Plan p = plan(numel, dtype, device);
    return need(select(backends(), device, *this), p, device);
  }

 protected:
  //! Workspace bytes of a call: the family's (at least the status word), then on CUDA the checksum
  //! kernels' partial sums (integrity=crc32c).
  int64_t need(const Kernels<Plan>& k, const Plan& p, Device device) const {
    int64_t n = std::max<int64_t>(kStatusBytes, k.workspace_bytes(p));
    if (integrity() && device.kind == DeviceKind::cuda)
      n = align16(n) + checksum_runtime()->workspace_bytes(p.layout.sections[p.layout.checksum_section].offset);
    return n;
  }
  virtual Plan make_plan(int64_t numel, DType input, Device device) const = 0;
  //! make_plan, with the integrity=crc32c checksum section appended to the layout.
  Plan plan(int64_t numel, DType input, Device device) const {
    Plan p = make_plan(numel, input, device);
    if (integrity()) append_checksum(p.layout);
    return p;
  }
  virtual Backends<Plan> backends() const = 0;
  void require_backend(Device device) const final { (void)select(backends(), device, *this); }

  void encode_impl(const Tensor& x, const Tensor* residual, const Tensor& packet, const Tensor& ws, float divisor,
                   const EncodeContext& ctx, Stream stream) const final {
    const Plan p = plan(x.numel, x.dtype, x.device);
    const Kernels<Plan>& k = select(backends(), x.device, *this);
    const int64_t need = this->need(k, p, x.device);
    GRADCOMP_CHECK(ws.nbytes() >= need, InvalidArgument, "encode: workspace holds ", ws.nbytes(), " bytes but codec '",
                   spec(), "' needs workspace_bytes(", x.numel, ", ", dtype_name(x.dtype), ") = ", need,
                   " (at ", p.threads, " CPU threads)");
    EncodeArgs a;
    a.x = x;
    a.residual = residual ? residual->ptr<float>() : nullptr;
    a.packet = packet.ptr<uint8_t>();
    a.workspace = ws.ptr<uint8_t>();
    a.workspace_bytes = ws.nbytes();
    a.divisor = divisor;
    a.ctx = ctx;
    a.stream = stream;
    k.encode(p, a);
    if (integrity()) {
      if (x.device.kind == DeviceKind::cpu) write_checksum_host(a.packet, p.layout);
      else checksum_runtime()->write(a.packet, p.layout, a.workspace + align16(std::max<int64_t>(kStatusBytes, k.workspace_bytes(p))),
                                     x.device.index, stream);
    }
  }

  void decode_impl(const Tensor& packet, const Tensor& out, const Tensor& ws, DecodeMode mode, float alpha,
                   Stream stream) const final {
    const Kernels<Plan>& k = select(backends(), out.device, *this);
    const HeaderExpect e = make_expect(packet.nbytes(), [&](DType in) { return plan(out.numel, in, out.device).layout; });
    DecodeArgs a;
    a.packet = packet.ptr<uint8_t>();
    a.packet_capacity = packet.nbytes();
    a.out = out;
    a.workspace = ws.data ? ws.ptr<uint8_t>() : nullptr;
    a.workspace_bytes = ws.data ? ws.nbytes() : 0;
    a.mode = mode;
    a.alpha = alpha;
    a.stream = stream;
    if (out.device.kind == DeviceKind::cpu) {
      PacketHeader h;
      std::memcpy(&h, packet.data, sizeof h);
      a.input = validate_header(h, e, *this);
      const Plan p = plan(out.numel, a.input, out.device);
      if (integrity()) check_checksum_host(a.packet, p.layout, *this);
      validate_key(a.packet, p.layout, *this);
      k.decode(p, a);
    } else if (integrity()) {
      // a checksum kernel vetoes the decode kernels (their prologue reads the veto word)
      const Plan p = plan(out.numel, DType::float32, out.device);
      const int64_t need = this->need(k, p, out.device);
      GRADCOMP_CHECK(ws.nbytes() >= need, InvalidArgument, "decode: workspace holds ", ws.nbytes(), " bytes but codec '",
                     spec(), "' on CUDA needs workspace_bytes(", out.numel, ", float32, cuda) = ", need,
                     " (the checksum's partial sums)");
      HeaderExpect ev = e;
      ev.veto = reinterpret_cast<const uint32_t*>(a.workspace + kChecksumVetoOffset);
      checksum_runtime()->verify(a.packet, ev, a.workspace, align16(std::max<int64_t>(kStatusBytes, k.workspace_bytes(p))),
                                 out.device.index, stream);
      a.expect = &ev;
      k.decode(plan(out.numel, DType::float32, out.device), a);
    } else {
      a.expect = &e;
      k.decode(plan(out.numel, DType::float32, out.device), a);
    }
  }
};

} // namespace gradcomp::detail
