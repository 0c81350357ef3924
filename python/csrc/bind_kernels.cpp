// Bindings for kernels/ops: optimizer steps on flat tensors (fp32 master and state; fp32, bf16 or
// fp16 gradients for Adam; optional 16-bit parameter copy), gradient statistics, and the CPU
// ISA / thread controls. All steps release the GIL.
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <stdexcept>
#include <string>

#include "kernels/cpu_isa.h"
#include "kernels/ops.h"
#include "python/csrc/bindings.h"

namespace py = pybind11;

namespace zeroshard::python {

namespace {
at::Tensor opt(const std::optional<at::Tensor>& t) { return t.has_value() ? *t : at::Tensor(); }
}  // namespace

void bind_kernels(py::module_& m) {
  namespace k = zeroshard::kernels;
  auto km = m.def_submodule("kernels", "optimizer kernels on flat tensors");
  km.def("adam_step",
         [](at::Tensor p, at::Tensor g, at::Tensor m1, at::Tensor m2, float lr, float beta1,
            float beta2, float eps, float wd, bool adamw, bool bias_correction, int64_t step,
            std::optional<at::Tensor> param16, float grad_scale) {
           k::AdamParams hp{lr, beta1, beta2, eps, wd, adamw, bias_correction, step, grad_scale};
           ops::adam_step(p, g, m1, m2, hp, opt(param16));
         },
         py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("lr"),
         py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
         py::arg("adamw_mode"), py::arg("bias_correction"), py::arg("step"), py::kw_only(),
         py::arg("param16") = py::none(), py::arg("grad_scale") = 1.0f,
         py::call_guard<py::gil_scoped_release>(),
         "Adam/AdamW in place. grad may be bf16/fp16 (the fused offload step); grad_scale "
         "multiplies it first (1/loss_scale * clip coefficient); param16 receives the updated "
         "parameters in bf16/fp16.");
  km.def("sgd_step",
         [](at::Tensor p, at::Tensor g, std::optional<at::Tensor> buf, float lr, float momentum,
            float dampening, float wd, bool nesterov, bool first_step,
            std::optional<at::Tensor> param16) {
           ops::sgd_step(p, g, opt(buf), {lr, momentum, dampening, wd, nesterov, first_step}, opt(param16));
         },
         py::arg("param"), py::arg("grad"), py::arg("momentum_buffer"), py::arg("lr"),
         py::arg("momentum"), py::arg("dampening"), py::arg("weight_decay"), py::arg("nesterov"),
         py::arg("first_step"), py::kw_only(), py::arg("param16") = py::none(),
         py::call_guard<py::gil_scoped_release>());
  km.def("adagrad_step",
         [](at::Tensor p, at::Tensor g, at::Tensor sum, float lr, float lr_decay, float eps,
            float wd, int64_t step, std::optional<at::Tensor> param16) {
           ops::adagrad_step(p, g, sum, {lr, lr_decay, eps, wd, step}, opt(param16));
         },
         py::arg("param"), py::arg("grad"), py::arg("sum"), py::arg("lr"), py::arg("lr_decay"),
         py::arg("eps"), py::arg("weight_decay"), py::arg("step"), py::kw_only(),
         py::arg("param16") = py::none(), py::call_guard<py::gil_scoped_release>());
  km.def("lion_step",
         [](at::Tensor p, at::Tensor g, at::Tensor m1, float lr, float beta1, float beta2, float wd,
            std::optional<at::Tensor> param16) {
           ops::lion_step(p, g, m1, {lr, beta1, beta2, wd}, opt(param16));
         },
         py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("lr"), py::arg("beta1"),
         py::arg("beta2"), py::arg("weight_decay"), py::kw_only(), py::arg("param16") = py::none(),
         py::call_guard<py::gil_scoped_release>());
  km.def("grad_stats",
         [](at::Tensor g) {
           const k::GradStats st = ops::grad_stats(g);
           return std::make_pair(st.sum_sq, st.finite);
         },
         py::arg("grad"), py::call_guard<py::gil_scoped_release>(),
         "(sum of squares as a float, all elements finite) in one read of grad");
  km.def("cpu_isa", [] { return std::string(k::isa_name(k::cpu_isa())); },
         "the ISA the CPU kernels use now: 'avx512', 'avx2' or 'scalar'");
  km.def("best_cpu_isa", [] { return std::string(k::isa_name(k::best_cpu_isa())); });
  km.def("cpu_isa_supported",
         [](const std::string& name) {
           k::Isa isa;
           return k::parse_isa(name.c_str(), &isa) && k::cpu_isa_supported(isa);
         },
         py::arg("name"));
  km.def("set_cpu_isa",
         [](const std::string& name) {
           k::Isa isa;
           if (!k::parse_isa(name.c_str(), &isa))
             throw std::invalid_argument("set_cpu_isa: got '" + name + "', expected one of scalar, avx2, avx512");
           if (k::set_cpu_isa(isa) != k::Status::ok)
             throw std::invalid_argument("set_cpu_isa: this CPU does not support '" + name +
                                         "'; best available is " + k::isa_name(k::best_cpu_isa()));
         },
         py::arg("name"));
  km.def("cpu_threads", &k::cpu_threads);
  km.def("set_cpu_threads", &k::set_cpu_threads, py::arg("n"),
         "threads per CPU kernel call; 0 restores ZEROSHARD_CPU_THREADS / OMP_NUM_THREADS");
}

}  // namespace zeroshard::python
