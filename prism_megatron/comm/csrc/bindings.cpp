// The Python face of the native path (prism_megatron/comm/native.py loads it).
#include "backend.h"
#include "policy.h"
#include "prism.h"

#include <pybind11/chrono.h>
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

namespace prism {

namespace {

std::vector<HoldRow> hold_rows(const py::list& rows) {
  // each row None or (self_s, ((anchor, ghost_s), ...), at_wait, transfer_s or None)
  std::vector<HoldRow> out;
  out.reserve(rows.size());
  for (py::handle item : rows) {
    HoldRow row;
    if (!item.is_none()) {
      auto t = item.cast<py::sequence>();
      TORCH_CHECK_VALUE(t.size() == 4, "a hold row is (self_s, terms, at_wait, transfer_s)");
      row.present = true;
      row.self_s = t[0].cast<double>();
      for (py::handle term : t[1].cast<py::sequence>()) {
        auto pair = term.cast<py::sequence>();
        row.terms.emplace_back(pair[0].cast<int32_t>(), pair[1].cast<double>());
      }
      row.at_wait = t[2].cast<bool>();
      if (!t[3].is_none()) row.transfer_s = t[3].cast<double>();
    }
    out.push_back(std::move(row));
  }
  return out;
}

py::object mark_object(const Mark& m) {
  return m.event >= 0 ? py::object(py::int_(m.event)) : py::object(py::float_(m.t));
}

}  // namespace

}  // namespace prism

using namespace prism;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "prism's native per-operation path: the c10d backend, its trace and holds";
  auto c10d_module = py::module::import("torch._C._distributed_c10d");

  py::class_<Session, std::shared_ptr<Session>>(m, "Session")
      .def(py::init([](int64_t world_size, std::vector<int64_t> sandbox_ranks, int64_t physical_rank, int policy,
                       uint64_t seed) {
             TORCH_CHECK_VALUE(policy >= 0 && policy <= 2, "ghost policy code ", policy, " is not 0, 1 or 2");
             return std::make_shared<Session>(world_size, std::move(sandbox_ranks), physical_rank, Policy(policy), seed);
           }),
           py::arg("world_size"), py::arg("sandbox_ranks"), py::arg("physical_rank"), py::arg("policy"),
           py::arg("seed"))
      .def_property("fresh_gathers", [](Session& s) { return s.fresh_gathers.load(); },
                    [](Session& s, int32_t v) { s.fresh_gathers = v; })
      .def_property("cpu_timed", [](Session& s) { return s.cpu_timed.load(); },
                    [](Session& s, bool v) { s.cpu_timed = v; })
      .def_readwrite("settle_after_wait_s", &Session::settle_after_wait_s)
      .def("set_listeners",
           [](Session& s, py::object on_event, py::object on_issue, py::object on_wait) {
             s.on_event = std::move(on_event);
             s.on_issue = std::move(on_issue);
             s.on_wait = std::move(on_wait);
             s.listening = !s.on_event.is_none();
           })
      .def("set_providers",
           [](Session& s, py::object rows, py::object reduction) {
             s.ghost_rows = std::move(rows);
             s.ghost_reduction = std::move(reduction);
             s.providing_rows = !s.ghost_rows.is_none();
             s.providing_reductions = !s.ghost_reduction.is_none();
           })
      .def("offer_row", [](Session& s, std::optional<at::Tensor> row) { s.offer_row(row ? *row : at::Tensor()); },
           py::arg("row").none(true), py::call_guard<py::gil_scoped_release>())
      .def("set_p2p",
           [](Session& s, const std::string& type, c10::intrusive_ptr<c10d::Backend> backend) { s.p2p[type] = backend; })
      .def("attach_trace", [](Session& s, std::shared_ptr<Trace> trace) { std::atomic_store(&s.trace, trace); },
           py::arg("trace").none(true))
      .def("counts", &Session::counts)
      .def_property_readonly("host_s", [](Session& s) { return double(s.host_ns.load()) * 1e-9; })
      .def_property_readonly("host_cpu_s", [](Session& s) { return double(s.host_cpu_ns.load()) * 1e-9; })
      .def("seed_for", &Session::seed_for)
      .def("physical_of", &Session::physical_of);

  py::class_<Trace, std::shared_ptr<Trace>>(m, "Trace")
      .def(py::init([](const std::string& clock, py::object memory_reader, int64_t memory_offset) {
             TORCH_CHECK_VALUE(clock == "cpu" || clock == "cuda", "a native trace runs on the cpu or cuda clock, not ",
                               clock);
             return std::make_shared<Trace>(clock == "cpu" ? Clock::kCpu : Clock::kCuda, std::move(memory_reader),
                                            memory_offset);
           }),
           py::arg("clock"), py::arg("memory_reader") = py::none(), py::arg("memory_offset") = 0)
      .def("mark", [](Trace& t) { return mark_object(t.mark()); })
      .def("idle", [](Trace& t, int64_t event) { Mark m; m.event = event; return t.idle(m); })
      .def("seconds",
           [](Trace& t, std::vector<int64_t> events, int64_t origin) {
             std::vector<double> s;
             {
               py::gil_scoped_release release;
               s = t.seconds(events, origin);
             }
             return py::array_t<double>(s.size(), s.data());
           })
      .def("begin_iteration", &Trace::begin_iteration, py::arg("labelled"))
      .def("set_holds", [](Trace& t, const py::list& rows) { t.set_holds(hold_rows(rows)); })
      .def("boundary", &Trace::boundary)
      .def("set_memory_reader", &Trace::set_memory_reader, py::arg("reader").none(true), py::arg("offset") = 0)
      .def("take", &Trace::take)
      .def("hold_report", &Trace::hold_report)
      .def_property_readonly("own_device_bytes", &Trace::own_device_bytes)
      .def_property_readonly("events_used", &Trace::events_used)
      .def_property_readonly("epoch", &Trace::epoch);

  py::class_<HoldBook>(m, "HoldBook")
      .def(py::init([](const py::list& rows) { return HoldBook(hold_rows(rows)); }))
      .def("begin", &HoldBook::begin)
      .def("stamp", &HoldBook::stamp)
      .def("plan", &HoldBook::plan)
      .def("goal", &HoldBook::goal)
      .def_readwrite("debt", &HoldBook::debt)
      .def_readonly("start", &HoldBook::start)
      .def_readonly("accrued_s", &HoldBook::accrued_s)
      .def_readonly("absorbed_s", &HoldBook::absorbed_s)
      .def_property_readonly("ends", &HoldBook::planned);

  py::class_<Backend, c10::intrusive_ptr<Backend>>(m, "Backend", c10d_module.attr("Backend"))
      .def(py::init([](std::shared_ptr<Session> session, std::vector<int64_t> members, int group_rank, int32_t index,
                       std::string group_id, std::string device_type, py::object make_inner) {
             return c10::make_intrusive<Backend>(std::move(session), std::move(members), group_rank, index,
                                                 std::move(group_id), std::move(device_type), std::move(make_inner));
           }),
           py::arg("session"), py::arg("members"), py::arg("group_rank"), py::arg("index"), py::arg("group_id"),
           py::arg("device_type"), py::arg("make_inner"))
      .def("connect", &Backend::connect, py::call_guard<py::gil_scoped_release>())
      .def_readwrite("session_object", &Backend::session_object)
      .def_readonly("real", &Backend::real)
      .def_readonly("ghosts", &Backend::ghosts)
      .def_readonly("index", &Backend::index);

  py::class_<Work, c10::intrusive_ptr<Work>>(m, "Work", c10d_module.attr("Work"))
      // its own wait, found before the base class's (which a runtime may have replaced by a Python
      // function: no overload of that, py::sibling(None))
      .def("wait", [](Work& w, std::chrono::milliseconds timeout) { return w.wait(timeout); },
           py::arg("timeout") = ::kNoTimeout, py::call_guard<py::gil_scoped_release>(), py::sibling(py::none()))
      .def_readonly("id", &Work::id);

  // the ghost-data policy's pieces, for their own tests
  m.def("copy_broadcast", [](at::Tensor dst, const at::Tensor& row, int widen) {
    at::NoGradGuard no_grad;
    copy_broadcast(dst, row, widen);
  }, py::arg("dst"), py::arg("row"), py::arg("widen") = -1);
  m.def("mirror_own_piece", [](at::Tensor output, const at::Tensor& local, std::vector<int64_t> rows) {
    at::NoGradGuard no_grad;
    return mirror_own_piece(output, local, rows);
  });
  m.def("finish_reduction", [](std::shared_ptr<Session> s, at::Tensor out, int op, int64_t n, int64_t r, uint64_t seed) {
    at::NoGradGuard no_grad;
    finish_reduction(*s, out, Reduce(op), n, r, GenFn{nullptr, nullptr, out.device(), 0, 0, seed});
  });
  m.def("fill", [](std::shared_ptr<Session> s, at::Tensor dst, std::optional<at::Tensor> source, uint64_t seed) {
    at::NoGradGuard no_grad;
    fill(*s, dst, source ? &*source : nullptr, GenFn{nullptr, nullptr, dst.device(), 0, 0, seed});
  });
  m.def("scalar_type", [](const at::Tensor& t) { return int(t.scalar_type()); });
  m.attr("ENTRY_SIZE") = int(sizeof(Entry));
  m.attr("OP_NAMES") = py::cast(std::vector<std::string>(kOpNames, kOpNames + kOpCount));
#ifdef PRISM_CUDA
  m.attr("CUDA") = true;
#else
  m.attr("CUDA") = false;
#endif
}
