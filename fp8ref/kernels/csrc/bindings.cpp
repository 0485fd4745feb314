// The Python module of fp8ref's CPU extension (fp8ref.kernels.native loads it). torch/python.h
// (pybind11 and its tensor conversions) rather than torch/extension.h, which adds the whole C++
// frontend and doubles this file's compile time; the kernels include light ATen headers only.
#include <torch/python.h>

#include "fp8ref_cpu.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  fp8ref::amx_status();  // on a CPU with AMX: ask the OS for tile permission once, at load
  m.doc() =
      "fp8ref's CPU kernels: cpu-fp8's and cpu-fp8-amx's E4M3FN GEMMs, the fused quantizer, the scale epilogue, "
      "the warm linear calls";
  // isa (the code path; tests force one) defaults to -1, the best this CPU runs.
  m.def("fp8_e4m3_gemm", &fp8ref::fp8_e4m3_gemm, pybind11::arg("a"), pybind11::arg("b"), pybind11::arg("sa"),
        pybind11::arg("sb"), pybind11::arg("bias"), pybind11::arg("has_bias"), pybind11::arg("isa") = -1);
  m.def("gemm_isa", &fp8ref::gemm_isa);
  m.def("fp8_e4m3_gemm_packed", &fp8ref::fp8_e4m3_gemm_packed);
  m.def("has_bf16_dot", &fp8ref::has_bf16_dot);
  m.def("has_nan_e4m3", &fp8ref::has_nan_e4m3);
  m.def("amx_status", &fp8ref::amx_status);
  m.def("fp8_e4m3_gemm_amx", &fp8ref::fp8_e4m3_gemm_amx, pybind11::arg("a"), pybind11::arg("pb"),
        pybind11::arg("special"), pybind11::arg("N"), pybind11::arg("sa"), pybind11::arg("sb"), pybind11::arg("bias"),
        pybind11::arg("has_bias"), pybind11::arg("emulate"), pybind11::arg("out_bf16") = false);
  m.def("amx_emu_tdpbf16ps", &fp8ref::amx_emu_tdpbf16ps);
  m.def("cpu_isa", &fp8ref::cpu_isa);
  m.def("quant_blocks", &fp8ref::quant_blocks);
  m.def("fp8_linear", &fp8ref::fp8_linear, pybind11::arg("x"), pybind11::arg("per_tensor"), pybind11::arg("qmax"),
        pybind11::arg("floor"), pybind11::arg("mant"), pybind11::arg("emin"), pybind11::arg("ebias"),
        pybind11::arg("negzero"), pybind11::arg("pow2"), pybind11::arg("codes"), pybind11::arg("pb"),
        pybind11::arg("special"), pybind11::arg("sb"), pybind11::arg("bias"), pybind11::arg("has_bias"),
        pybind11::arg("isa"), pybind11::arg("rows"), pybind11::arg("out_code"));
  pybind11::class_<fp8ref::WeightWatch>(m, "WeightWatch")
      .def(pybind11::init<at::Tensor, std::vector<at::Tensor>, std::vector<int64_t>, at::Tensor, at::Tensor,
                          at::Tensor>())
      .def("current", &fp8ref::WeightWatch::current2, pybind11::arg("weight"), pybind11::arg("scale"));
  pybind11::class_<fp8ref::BoundLinear>(m, "BoundLinear")
      .def(pybind11::init<bool, double, double, int64_t, int64_t, int64_t, bool, bool, at::Tensor, at::Tensor,
                          at::Tensor, at::Tensor, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          at::Tensor, std::vector<at::Tensor>, std::vector<int64_t>, at::Tensor, at::Tensor,
                          at::Tensor>())
      .def("__call__", &fp8ref::BoundLinear::call, pybind11::arg("x"), pybind11::arg("bias"), pybind11::arg("weight"),
           pybind11::arg("scale"))
      .def("current", &fp8ref::BoundLinear::current);
  m.def("wide_linear", &fp8ref::wide_linear, pybind11::arg("x"), pybind11::arg("qmax"), pybind11::arg("floor"),
        pybind11::arg("mant"), pybind11::arg("emin"), pybind11::arg("ebias"), pybind11::arg("negzero"),
        pybind11::arg("weight"), pybind11::arg("packed"), pybind11::arg("sb"), pybind11::arg("bias"),
        pybind11::arg("has_bias"), pybind11::arg("mode"), pybind11::arg("out_bf16"));
  pybind11::class_<fp8ref::BoundWideLinear>(m, "BoundWideLinear")
      .def(pybind11::init<double, double, int64_t, int64_t, int64_t, bool, at::Tensor, bool, at::Tensor, int64_t, bool,
                          int64_t, int64_t, int64_t, at::Tensor, std::vector<at::Tensor>, std::vector<int64_t>,
                          at::Tensor, at::Tensor, at::Tensor>())
      .def("__call__", &fp8ref::BoundWideLinear::call, pybind11::arg("x"), pybind11::arg("bias"),
           pybind11::arg("weight"), pybind11::arg("scale"));
  m.def("scale_epilogue", &fp8ref::scale_epilogue, pybind11::arg("y"), pybind11::arg("sa"), pybind11::arg("sb"),
        pybind11::arg("bias"), pybind11::arg("has_bias"), pybind11::arg("out_bf16"), pybind11::arg("isa") = -1);
}
