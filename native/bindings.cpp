// The one Python <-> native boundary. Every class and function Python sees is declared here;
// the work lives in the plain C++ files beside it, which know nothing of Python.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "version.h"

namespace nb = nanobind;

// ===== completion bridge (h3): asyncside/bridge.py is its only Python user ======================
#include "bridge.h"
#include "mlx/array.h"
#include "mlx/stream.h"

namespace {

namespace br = asyncside::bridge;

// Python holds the queue through this handle, never through a shared_ptr that nanobind ties to a
// Python object: the stream thread's copy of the queue pointer must be pure C++, so dropping it
// there never touches Python.
struct BridgeQueue {
  std::shared_ptr<br::CompletionQueue> q = std::make_shared<br::CompletionQueue>();
};

void bind_bridge(nb::module_& m) {
  nb::class_<BridgeQueue>(m, "CompletionQueue",
                          "Native completion queue: tickets posted by stream threads, a readable "
                          "fd (eventfd) for the event loop. Owned by one event loop thread.")
      .def(nb::init<>())
      .def("fileno", [](const BridgeQueue& h) { return h.q->fd(); },
           "The descriptor that becomes readable when completions are waiting (-1 once closed).")
      .def_prop_ro("closed", [](const BridgeQueue& h) { return h.q->closed(); })
      .def("drain",
           [](BridgeQueue& h) {
             std::vector<std::pair<uint64_t, int64_t>> out;
             for (const auto& c : h.q->drain()) out.emplace_back(c.ticket, c.posted_ns);
             return out;
           },
           "Reset the fd and return [(ticket, posted_monotonic_ns), ...] in post order. "
           "Never blocks.")
      .def("abandon", [](BridgeQueue& h, uint64_t t) { h.q->abandon(t); }, nb::arg("ticket"),
           "Record that issuing this ticket failed and nobody waits for it.")
      .def("close", [](BridgeQueue& h) { h.q->close(); },
           "Close the fd now; completions posted later are dropped (and counted).")
      .def_prop_ro("posted", [](const BridgeQueue& h) { return h.q->posted(); })
      .def_prop_ro("reaped", [](const BridgeQueue& h) { return h.q->reaped(); });

  m.def("signal",
        [](const mlx::core::array& x, BridgeQueue& queue, uint64_t ticket,
           std::optional<mlx::core::Stream> stream) {
          return br::signal(x, queue.q, ticket, stream);
        },
        nb::arg("x"), nb::arg("queue"), nb::arg("ticket"), nb::arg("stream") = nb::none(),
        nb::call_guard<nb::gil_scoped_release>(),
        "Schedule x (if needed) and a completion signal after it on its stream (async_eval, "
        "GIL released); returns the (1,) uint64 signal array, or None when the post was queued "
        "directly on a backlogged CPU stream. When the stream reaches it, `ticket` is posted to "
        "`queue`.");
  m.def("mlx_active_tasks", &br::mlx_active_tasks,
        "MLX's count of CPU task groups in flight (its eval throttle blocks callers above 10).");
  m.def("is_available", &br::is_available, nb::arg("x"),
        "True if x is computed and readable without waiting. Never blocks; raises the MLX error "
        "if x's computation failed.");
  m.def("array_status", &br::status, nb::arg("x"),
        "MLX's status of x: 'unscheduled', 'evaluated' (scheduled, maybe running) or 'available'.");
  m.def("stream_of", &br::stream_of, nb::arg("x"),
        "The stream x is (or was) computed on, or None if MLX no longer records it.");
  m.def("bridge_paths", &br::paths, "Completion paths compiled in: 'cpu', 'cuda', 'metal'.");
  m.def("bridge_counters",
        [] {
          auto& c = br::counters();
          nb::dict d;
          d["queues_created"] = c.queues_created.load();
          d["queues_closed"] = c.queues_closed.load();
          d["queues_destroyed"] = c.queues_destroyed.load();
          d["signals_created"] = c.signals_created.load();
          d["signals_destroyed"] = c.signals_destroyed.load();
          d["signals_dispatched"] = c.signals_dispatched.load();
          d["signals_direct"] = c.signals_direct.load();
          d["tickets_posted"] = c.tickets_posted.load();
          d["tickets_reaped"] = c.tickets_reaped.load();
          d["tickets_dropped"] = c.tickets_dropped.load();
          d["tickets_abandoned"] = c.tickets_abandoned.load();
          d["wakeups_written"] = c.wakeups_written.load();
          return d;
        },
        "Process-wide counters of the native completion bridge.");
  nb::class_<br::TestingGate>(m, "TestingGate",
                              "Test helper: hold(x) blocks x's CPU stream until open().")
      .def(nb::init<double>(), nb::arg("timeout_s") = 60.0)
      .def("hold", &br::TestingGate::hold, nb::arg("x"), nb::arg("stream") = nb::none())
      .def("open", &br::TestingGate::open)
      .def_prop_ro("is_open", &br::TestingGate::is_open);
  m.def("testing_fail", &br::testing_fail, nb::arg("x"), nb::arg("message"),
        nb::arg("stream") = nb::none(),
        "Test helper: an array equal to x whose evaluation raises `message` on the stream.");
  m.def("wakeup_floor_ns", &br::wakeup_floor_ns, nb::arg("n"),
        nb::call_guard<nb::gil_scoped_release>(),
        "Bench helper: n latencies (ns) of a native eventfd wakeup across threads (the floor).");
}

}  // namespace
// ===== end completion bridge =====================================================================

NB_MODULE(_native, m) {
  m.doc() = "asyncside native core: readers, scatter, completion bridge";
  m.def("build_info", [] { return std::string(asyncside::build_info()); },
        "Which optional native paths (io_uring, CUDA, Metal) this build compiled in.");
  bind_bridge(m);
}
