// SPDX-License-Identifier: Apache-2.0
// gradcomp._C: the thin pybind11 layer. It turns DLPack tensors into gradcomp::Tensor views and
// calls the core with the GIL released; policy (allocation, workspace caching, schemes) lives in
// the Python package.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "dlpack_bridge.hpp"
#include "gradcomp/lowrank.hpp"

namespace py = pybind11;
using namespace gradcomp;
using gradcomp::python::DLOwner;
using gradcomp::python::from_dlpack;

namespace {

DType parse_dtype(const std::string& name) { return dtype_from_name(name); }

struct PyCodec {
  std::shared_ptr<Codec> c;
  explicit PyCodec(const std::string& spec) : c(Codec::create(spec)) {}

  void encode(py::handle x, py::handle residual, py::handle packet, py::handle workspace, float divisor,
              intptr_t stream, const std::string& x_dtype_override, uint64_t seed, uint32_t step, uint32_t bucket,
              uint32_t chunk) {
    DLOwner ox, or_, op, ow;
    const DType xo = x_dtype_override.empty() ? DType::none : parse_dtype(x_dtype_override);
    Tensor tx = from_dlpack(x, ox, "encode: x", stream, xo);
    Tensor tr;
    const bool has_r = !residual.is_none();
    if (has_r) tr = from_dlpack(residual, or_, "encode: residual", stream);
    Tensor tp = from_dlpack(packet, op, "encode: packet", stream);
    Tensor tw = from_dlpack(workspace, ow, "encode: workspace", stream);
    // byte buffers may come in any dtype; the codec checks byte sizes
    py::gil_scoped_release nogil;
    c->encode(tx, has_r ? &tr : nullptr, tp, tw, divisor, EncodeContext{seed, step, bucket, chunk},
              Stream{reinterpret_cast<void*>(stream)});
  }

  void decode(py::handle packet, py::handle out, py::handle workspace, bool accumulate, float alpha, intptr_t stream,
              const std::string& out_dtype_override) {
    DLOwner op, oo, ow;
    const DType oo_t = out_dtype_override.empty() ? DType::none : parse_dtype(out_dtype_override);
    Tensor tp = from_dlpack(packet, op, "decode: packet", stream);
    Tensor to = from_dlpack(out, oo, "decode: out", stream, oo_t);
    Tensor tw;
    if (!workspace.is_none()) tw = from_dlpack(workspace, ow, "decode: workspace", stream);
    py::gil_scoped_release nogil;
    c->decode(tp, to, tw, accumulate ? DecodeMode::accumulate : DecodeMode::assign, alpha,
              Stream{reinterpret_cast<void*>(stream)});
  }
};

py::dict properties_dict(const CodecProperties& p) {
  py::dict d;
  d["linear"] = p.linear;
  d["unbiased"] = p.unbiased;
  d["deterministic"] = p.deterministic;
  d["exact_residual"] = p.exact_residual;
  d["keyed"] = p.keyed;
  d["sparse"] = p.sparse;
  return d;
}

py::dict layout_dict(const PacketLayout& l) {
  py::list sections;
  for (int i = 0; i < l.nsections; ++i) {
    const PacketSection& s = l.sections[i];
    sections.append(py::make_tuple(std::string(s.name), s.offset, s.count, std::string(dtype_name(s.dtype))));
  }
  py::dict d;
  d["bytes"] = l.bytes;
  d["sections"] = sections;
  d["key_section"] = l.key_section;
  d["payload_section"] = l.payload_section;
  d["main_param"] = l.header.main_param;
  d["main_kind"] = l.main_kind == MainParamKind::exact ? "exact" : "maximum";
  d["wire_dtype"] = std::string(dtype_name(DType(l.header.wire_dtype)));
  d["index_dtype"] = std::string(dtype_name(DType(l.header.index_dtype)));
  return d;
}

// ---- low rank (include/gradcomp/lowrank.hpp) --------------------------------------------------
// Tensors through DLPack, offsets as a list of ints, the GIL released during the call. The
// residual and status of reconstruct are raw pointers in the C++ API: their dtype, device and
// size are checked here.
namespace lr = gradcomp::lowrank;

lr::MatrixBatch make_batch(const Tensor& base, const std::vector<int64_t>& offsets, int64_t rows, int64_t cols) {
  lr::MatrixBatch b;
  b.base = base;
  b.offsets = offsets.data();
  b.count = int64_t(offsets.size());
  b.rows = rows;
  b.cols = cols;
  return b;
}
Stream as_stream(intptr_t s) { return Stream{reinterpret_cast<void*>(s)}; }

void lowrank_project(py::handle base, const std::vector<int64_t>& offsets, int64_t rows, int64_t cols, py::handle q,
                     py::handle p, int64_t rank, intptr_t stream) {
  DLOwner ob, oq, op;
  const Tensor tb = from_dlpack(base, ob, "lowrank_project: m", stream);
  const Tensor tq = from_dlpack(q, oq, "lowrank_project: q", stream);
  const Tensor tp = from_dlpack(p, op, "lowrank_project: p", stream);
  py::gil_scoped_release nogil;
  lr::project(make_batch(tb, offsets, rows, cols), tq, tp, rank, as_stream(stream));
}

void lowrank_back_project(py::handle base, const std::vector<int64_t>& offsets, int64_t rows, int64_t cols,
                          py::handle p, py::handle q, int64_t rank, intptr_t stream) {
  DLOwner ob, op, oq;
  const Tensor tb = from_dlpack(base, ob, "lowrank_back_project: m", stream);
  const Tensor tp = from_dlpack(p, op, "lowrank_back_project: p", stream);
  const Tensor tq = from_dlpack(q, oq, "lowrank_back_project: q", stream);
  py::gil_scoped_release nogil;
  lr::back_project(make_batch(tb, offsets, rows, cols), tp, tq, rank, as_stream(stream));
}

void lowrank_orthogonalize(py::handle x, int64_t count, int64_t rows, int64_t rank, float epsilon,
                           std::optional<uint64_t> redraw_seed, uint64_t redraw_stream, intptr_t stream) {
  DLOwner ox;
  const Tensor tx = from_dlpack(x, ox, "lowrank_orthogonalize: x", stream);
  lr::Redraw rd{redraw_seed.value_or(0), redraw_stream};
  py::gil_scoped_release nogil;
  lr::orthogonalize(tx, count, rows, rank, epsilon, redraw_seed ? &rd : nullptr, as_stream(stream));
}

void lowrank_reconstruct(py::handle out, const std::vector<int64_t>& offsets, int64_t rows, int64_t cols, py::handle p,
                         py::handle q, int64_t rank, py::handle residual, py::handle status, intptr_t stream) {
  const char* call = "lowrank_reconstruct";
  DLOwner oo, op, oq, orr, os;
  const Tensor to = from_dlpack(out, oo, "lowrank_reconstruct: out", stream);
  const Tensor tp = from_dlpack(p, op, "lowrank_reconstruct: p", stream);
  const Tensor tq = from_dlpack(q, oq, "lowrank_reconstruct: q", stream);
  float* e = nullptr;
  if (!residual.is_none()) {
    const Tensor tr = from_dlpack(residual, orr, "lowrank_reconstruct: residual", stream);
    GRADCOMP_CHECK(tr.dtype == DType::float32, InvalidArgument, call, ": residual has dtype ", dtype_name(tr.dtype),
                   "; accepted: float32 (residuals are float32)");
    GRADCOMP_CHECK(tr.device == to.device, InvalidArgument, call, ": residual is on ", to_string(tr.device),
                   " but out is on ", to_string(to.device), "; all tensors of one call must be on the same device");
    // the matrices must lie inside the residual as they do inside out (offsets are checked
    // against out by the core; here against the residual's length)
    for (size_t b = 0; b < offsets.size(); ++b) {
      const int64_t o = offsets[b];
      if (o < 0 || rows < 1 || cols < 1) continue;  // the core names these
      GRADCOMP_CHECK(cols <= (INT64_MAX - o) / rows && o + rows * cols <= tr.numel,
                     InvalidArgument, call, ": matrix ", b, " at offset ", o, " with rows * cols = ", rows, " * ",
                     cols, " reaches past the end of residual (", tr.numel,
                     " elements); accepted: offset + rows * cols <= residual.numel");
    }
    e = tr.ptr<float>();
  }
  uint32_t* st = nullptr;
  if (!status.is_none()) {
    const Tensor ts = from_dlpack(status, os, "lowrank_reconstruct: status", stream);
    GRADCOMP_CHECK((ts.dtype == DType::int32 || ts.dtype == DType::uint32) && ts.numel == 1, InvalidArgument, call,
                   ": status has dtype ", dtype_name(ts.dtype), " and ", ts.numel,
                   " elements; accepted: one int32 (or uint32) element");
    GRADCOMP_CHECK(ts.device == to.device, InvalidArgument, call, ": status is on ", to_string(ts.device),
                   " but out is on ", to_string(to.device), "; all tensors of one call must be on the same device");
    st = ts.ptr<uint32_t>();
  }
  py::gil_scoped_release nogil;
  lr::reconstruct(make_batch(to, offsets, rows, cols), tp, tq, rank, to, e, st, as_stream(stream));
}

void lowrank_random_normal(py::handle x, uint64_t seed, uint64_t stream_id, intptr_t stream) {
  DLOwner ox;
  const Tensor tx = from_dlpack(x, ox, "lowrank_random_normal: x", stream);
  py::gil_scoped_release nogil;
  lr::random_normal(tx, seed, stream_id, as_stream(stream));
}

} // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "gradcomp native core (pybind11). Use the gradcomp package, not this module directly.";

  // gradcomp.Error is the common base (`except gradcomp.Error` catches every gradcomp error); each
  // subclass also derives from its builtin: InvalidArgumentError/CorruptPacketError are ValueErrors,
  // UnsupportedError/CudaError RuntimeErrors (so `except RuntimeError` never swallows bad arguments).
  auto& base = py::register_exception<Error>(m, "Error", PyExc_Exception);
  py::register_exception<InvalidArgument>(m, "InvalidArgumentError", py::make_tuple(base, py::handle(PyExc_ValueError)));
  py::register_exception<CorruptPacket>(m, "CorruptPacketError", py::make_tuple(base, py::handle(PyExc_ValueError)));
  py::register_exception<Unsupported>(m, "UnsupportedError", py::make_tuple(base, py::handle(PyExc_RuntimeError)));
  py::register_exception<CudaError>(m, "CudaError", py::make_tuple(base, py::handle(PyExc_RuntimeError)));

  m.def("cpu_isas_supported", &cpu_isas_supported,
        "The CPU kernel variants of this build this processor runs, best first.");
  m.def("set_cpu_isa", [](const std::string& name) { set_cpu_isa(name); }, py::arg("name"),
        "Use CPU kernel variant `name` (one of cpu_isas_supported()); raises InvalidArgumentError otherwise.");
  m.def("set_num_threads", &set_num_threads, py::arg("n"),
        "Threads used by the CPU backend (OpenMP). Raises InvalidArgumentError for n < 1.");
  m.def("get_num_threads", &get_num_threads);
  m.def("set_adaptive_threads", &set_adaptive_threads, py::arg("on"),
        "Adaptive CPU threads (default on): fewer threads while another process holds a core.");
  m.def("cpu_threads_state", &cpu_threads_state, "'contended' or 'idle' (adaptive CPU threads).");
  m.def("build_info", []() {
    BuildInfo b = build_info();
    py::dict d;
    d["version"] = b.version;
    d["cuda"] = b.cuda;
    d["cuda_architectures"] = b.cuda_architectures;
    d["cuda_version"] = b.cuda_version;
    d["openmp"] = b.openmp;
    d["cpu_isa"] = b.cpu_isa;
    d["cpu_variants"] = b.cpu_variants;
    d["blas"] = b.blas;
    d["dlpack_version"] = gradcomp::python::dlpack::kDLPackVersion;
    return d;
  });
  m.def(
      "read_status",
      [](py::handle workspace, intptr_t stream, bool clear) {
        DLOwner ow;
        Tensor tw = from_dlpack(workspace, ow, "check: workspace", stream);
        py::gil_scoped_release nogil;
        return read_status(tw, Stream{reinterpret_cast<void*>(stream)}, clear);
      },
      py::arg("workspace"), py::arg("stream") = 0, py::arg("clear") = true);
  m.attr("STATUS_NONFINITE") = kStatusNonFinite;
  m.attr("STATUS_CORRUPT") = kStatusCorrupt;
  m.attr("HEADER_BYTES") = kHeaderBytes;
  m.attr("KEY_BYTES") = kKeyBytes;
  m.attr("MAX_THREADS") = kMaxThreads;
  m.def("list_codecs", []() {
    py::list out;
    for (const CodecInfo& i : list_codecs()) {
      py::dict d;
      d["name"] = i.name;
      d["id"] = static_cast<int>(i.id);
      d["keys"] = i.keys;
      d["properties"] = properties_dict(i.properties);
      d["examples"] = i.examples;
      d["summary"] = i.summary;
      out.append(d);
    }
    return out;
  });

  // Low rank (PowerSGD; Vogels et al., NeurIPS 2019, algorithm 1): the steps of
  // include/gradcomp/lowrank.hpp. Use gradcomp.lowrank, not these directly.
  m.def("lowrank_project", &lowrank_project, py::arg("base"), py::arg("offsets"), py::arg("rows"), py::arg("cols"),
        py::arg("q"), py::arg("p"), py::arg("rank"), py::arg("stream") = 0,
        "P[b] = M_b Q[b]: base float32 flat, q float32 [count, cols, rank], p float32 [count, rows, rank] (written).");
  m.def("lowrank_back_project", &lowrank_back_project, py::arg("base"), py::arg("offsets"), py::arg("rows"),
        py::arg("cols"), py::arg("p"), py::arg("q"), py::arg("rank"), py::arg("stream") = 0,
        "Q[b] = M_b^T P[b]: base float32 flat, p float32 [count, rows, rank], q float32 [count, cols, rank] "
        "(written).");
  m.def("lowrank_orthogonalize", &lowrank_orthogonalize, py::arg("x"), py::arg("count"), py::arg("rows"),
        py::arg("rank"), py::arg("epsilon"), py::arg("redraw_seed") = py::none(), py::arg("redraw_stream") = 0,
        py::arg("stream") = 0,
        "Orthonormalize the columns of each [rows, rank] matrix of x (float32 [count, rows, rank]) in place.");
  m.def("lowrank_reconstruct", &lowrank_reconstruct, py::arg("out"), py::arg("offsets"), py::arg("rows"),
        py::arg("cols"), py::arg("p"), py::arg("q"), py::arg("rank"), py::arg("residual") = py::none(),
        py::arg("status") = py::none(), py::arg("stream") = 0,
        "out_b = P[b] Q[b]^T at offsets of out (float32/float16/bfloat16); residual -= P Q^T; status |= 1 on "
        "non-finite output.");
  m.def("lowrank_random_normal", &lowrank_random_normal, py::arg("x"), py::arg("seed"), py::arg("stream_id"),
        py::arg("stream") = 0, "Fill float32 x with Philox4x64-10 / Box-Muller standard normals.");

  py::class_<PyCodec>(m, "Codec")
      .def(py::init<const std::string&>(), py::arg("spec"))
      .def_property_readonly("spec", [](const PyCodec& s) { return s.c->spec(); })
      .def_property_readonly("codec_id", [](const PyCodec& s) { return static_cast<int>(s.c->id()); })
      .def_property_readonly("spec_hash", [](const PyCodec& s) { return s.c->spec_hash(); })
      .def_property_readonly("properties", [](const PyCodec& s) { return properties_dict(s.c->properties()); })
      .def("layout",
           [](const PyCodec& s, int64_t numel, const std::string& dtype) {
             return layout_dict(s.c->layout(numel, parse_dtype(dtype)));
           },
           py::arg("numel"), py::arg("dtype"))
      .def("packet_bytes",
           [](const PyCodec& s, int64_t numel, const std::string& dtype) {
             return s.c->packet_bytes(numel, parse_dtype(dtype));
           },
           py::arg("numel"), py::arg("dtype"))
      .def("workspace_bytes",
           [](const PyCodec& s, int64_t numel, const std::string& dtype, bool cuda) {
             return s.c->workspace_bytes(numel, parse_dtype(dtype), Device{cuda ? DeviceKind::cuda : DeviceKind::cpu, 0});
           },
           py::arg("numel"), py::arg("dtype"), py::arg("cuda") = false)
      .def("payload",
           [](const PyCodec& s, int64_t numel, const std::string& dtype) -> py::object {
             auto p = s.c->payload(numel, parse_dtype(dtype));
             if (!p) return py::none();
             return py::make_tuple(p->byte_offset, p->count, std::string(dtype_name(p->dtype)));
           },
           py::arg("numel"), py::arg("dtype"))
      .def("main_param", [](const PyCodec& s, int64_t numel) { return s.c->main_param(numel); }, py::arg("numel"))
      .def("encode", &PyCodec::encode, py::arg("x"), py::arg("residual"), py::arg("packet"), py::arg("workspace"),
           py::arg("divisor") = 1.0f, py::arg("stream") = 0, py::arg("x_dtype") = "", py::arg("seed") = 0,
           py::arg("step") = 0, py::arg("bucket") = 0, py::arg("chunk") = 0)
      .def("decode", &PyCodec::decode, py::arg("packet"), py::arg("out"), py::arg("workspace"),
           py::arg("accumulate") = false, py::arg("alpha") = 1.0f, py::arg("stream") = 0, py::arg("out_dtype") = "");
}
