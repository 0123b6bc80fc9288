// SPDX-License-Identifier: Apache-2.0
// gradcomp._C: the thin pybind11 layer. It turns DLPack tensors into gradcomp::Tensor views and
// calls the core with the GIL released; policy (allocation, workspace caching, schemes) lives in
// the Python package.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "dlpack_bridge.hpp"

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
              intptr_t stream, const std::string& x_dtype_override, uint64_t seed, uint32_t step, uint32_t bucket) {
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
    c->encode(tx, has_r ? &tr : nullptr, tp, tw, Stream{reinterpret_cast<void*>(stream)}, divisor,
              EncodeContext{seed, step, bucket});
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
    d["dlpack_version"] = DLPACK_VERSION;
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
           py::arg("step") = 0, py::arg("bucket") = 0)
      .def("decode", &PyCodec::decode, py::arg("packet"), py::arg("out"), py::arg("workspace"),
           py::arg("accumulate") = false, py::arg("alpha") = 1.0f, py::arg("stream") = 0, py::arg("out_dtype") = "");
}
