// The one Python <-> native boundary. Every class and function Python sees is declared here;
// the work lives in the plain C++ files beside it, which know nothing of Python.
//
// asyncside._native          what the runtime uses: completion bridge, Reader + ReaderOptions,
//                            host mirror and uploads, counters
// asyncside._native.testing  test hooks: a stream gate, a computation that fails on its stream
// asyncside._native.bench    benchmark baselines and limits: the side-region design's read, pread
//                            and memcpy timers, the eventfd wakeup floor, pinned H2D bandwidth
//
// The MLX headers (public and internal) this extension depends on, and the MLX version it is
// pinned to, are listed in mlx_dependency.h.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <mlx/array.h>

#include "checksum.h"
#include "io_reader.h"
#include "host_mirror.h"
#include "mlx_dependency.h"
#include "version.h"

namespace nb = nanobind;

// ===== completion bridge: asyncside/bridge.py is its only Python user =============================
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
           std::optional<mlx::core::Stream> stream, const std::vector<mlx::core::array>& then) {
          auto r = br::signal(x, queue.q, ticket, stream, then);
          return std::make_pair(r.signal, r.then_scheduled);
        },
        nb::arg("x"), nb::arg("queue"), nb::arg("ticket"), nb::arg("stream") = nb::none(),
        nb::arg("then") = std::vector<mlx::core::array>{},
        nb::call_guard<nb::gil_scoped_release>(),
        "Schedule x (if needed) and a completion signal after it on its stream (async_eval, "
        "GIL released). When the stream reaches it, `ticket` is posted to `queue`. Returns "
        "(signal, then_scheduled): the (1,) uint64 signal array, or None when the post was queued "
        "directly on a backlogged CPU stream; and whether `then` was scheduled behind the signal "
        "in the same async_eval (GPU streams only: the caller schedules it otherwise).");
  m.def("schedule_step", &br::schedule_step, nb::arg("roots"),
        nb::call_guard<nb::gil_scoped_release>(),
        "Schedule as much of the unscheduled graph of `roots` as fits under MLX's eval throttle. "
        "Returns (True, None) once all is scheduled, else (False, y): await y, then call again; "
        "(False, None): nothing fits and nothing of the graph is pending: await the roots' stream "
        "(barrier), then call again.");
  m.def("barrier",
        [](BridgeQueue& queue, uint64_t ticket, mlx::core::Stream stream) {
          br::barrier(queue.q, ticket, stream);
        },
        nb::arg("queue"), nb::arg("ticket"), nb::arg("stream"),
        "Post `ticket` to `queue` once the CPU `stream` has run everything queued on it so far "
        "(no array, no eval: never blocked by MLX's throttle).");
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
          d["schedule_whole"] = c.schedule_whole.load();
          d["schedule_chunks"] = c.schedule_chunks.load();
          d["schedule_waits"] = c.schedule_waits.load();
          d["tickets_posted"] = c.tickets_posted.load();
          d["tickets_reaped"] = c.tickets_reaped.load();
          d["tickets_dropped"] = c.tickets_dropped.load();
          d["tickets_abandoned"] = c.tickets_abandoned.load();
          d["wakeups_written"] = c.wakeups_written.load();
          return d;
        },
        "Process-wide counters of the native completion bridge.");
}

// Test hooks over the bridge's stream primitives (asyncside._native.testing).
void bind_bridge_testing(nb::module_& t) {
  nb::class_<br::TestingGate>(t, "StreamGate", "hold(x) blocks x's CPU stream until open().")
      .def(nb::init<double>(), nb::arg("timeout_s") = 60.0)
      .def("hold", &br::TestingGate::hold, nb::arg("x"), nb::arg("stream") = nb::none())
      .def("open", &br::TestingGate::open)
      .def_prop_ro("is_open", &br::TestingGate::is_open);
  t.def("fail_on_stream", &br::testing_fail, nb::arg("x"), nb::arg("message"), nb::arg("stream") = nb::none(),
        "An array equal to x whose evaluation raises `message` on the stream.");
}

void bind_bridge_bench(nb::module_& b) {
  b.def("wakeup_floor_ns", &br::wakeup_floor_ns, nb::arg("n"), nb::call_guard<nb::gil_scoped_release>(),
        "n latencies (ns) of a native eventfd wakeup across threads (the floor under any bridge).");
}

}  // namespace
// ===== end completion bridge =====================================================================
// ===== read path: Reader and its options =========================================================
namespace {

namespace io = asyncside::io;
namespace mx = mlx::core;

// ReaderOptions(**fields): starts from the C++ struct's defaults (the only ones) and sets the named
// fields. Unknown names and values of the wrong type are refused, naming the field.
template <typename T>
void set_option(T& field, const char* name, nb::handle v) {
  // bool is an int in Python: refuse it for number fields (queue_depth=True is a mistake), and
  // refuse numbers for bool fields.
  const bool is_bool = PyBool_Check(v.ptr());
  const char* want = std::is_same_v<T, bool> ? "a bool" : std::is_signed_v<T> ? "an int" : "a non-negative int";
  if (is_bool != std::is_same_v<T, bool> || !nb::try_cast(v, field)) {
    throw nb::type_error((std::string("ReaderOptions.") + name + ": expected " + want + ", got " +
                          nb::cast<std::string>(nb::repr(v)))
                             .c_str());
  }
}

using OptionSetter = void (*)(io::ReaderOptions&, nb::handle);
const std::map<std::string, OptionSetter>& option_setters() {
  static const std::map<std::string, OptionSetter> setters = {
#define ASYNCSIDE_OPTION_SETTER(name, doc) \
  {#name, [](io::ReaderOptions& o, nb::handle v) { set_option(o.name, #name, v); }},
      ASYNCSIDE_READER_OPTION_FIELDS(ASYNCSIDE_OPTION_SETTER)
#undef ASYNCSIDE_OPTION_SETTER
  };
  return setters;
}

std::string options_repr(const io::ReaderOptions& o) {
  std::string r = "ReaderOptions(";
  bool first = true;
  auto add = [&](const char* name, const std::string& value) {
    r += (first ? "" : ", ") + std::string(name) + "=" + value;
    first = false;
  };
  auto text = [](auto v) {
    if constexpr (std::is_same_v<decltype(v), bool>) {
      return std::string(v ? "True" : "False");
    } else {
      return std::to_string(v);
    }
  };
#define ASYNCSIDE_OPTION_REPR(name, doc) add(#name, text(o.name));
  ASYNCSIDE_READER_OPTION_FIELDS(ASYNCSIDE_OPTION_REPR)
#undef ASYNCSIDE_OPTION_REPR
  return r + ")";
}

io::Backend backend_of(const std::string& backend) {
  if (backend == "io_uring") return io::Backend::IoUring;
  if (backend == "threads") return io::Backend::Threads;
  throw std::invalid_argument("backend: expected 'io_uring' or 'threads', got '" + backend + "'");
}

// Python's handle on a native Reader. Options are plain C++ before the GIL is released; native
// threads never see a Python object.
class PyReader {
 public:
  PyReader(io::Backend backend, io::ReaderOptions o) {
    o.backend = backend;
    r_ = io::Reader::create(o);
  }
  ~PyReader() {
    // Last resort (the scheduler closes explicitly): reads in flight must land before the pools go.
    nb::gil_scoped_release g;
    r_->close();
  }
  io::Reader& r() { return *r_; }

 private:
  std::unique_ptr<io::Reader> r_;
};

void bind_reader_options(nb::module_& m) {
  auto cls = nb::class_<io::ReaderOptions>(
      m, "ReaderOptions",
      "Reader tuning, one struct for every layer (Scheduler, Runtime, the native readers). "
      "ReaderOptions(**fields) starts from the defaults and sets the fields named; fields are "
      "read/write attributes.");
  cls.def(
      "__init__",
      [](io::ReaderOptions* self, nb::kwargs fields) {
        io::ReaderOptions o;
        const auto& setters = option_setters();
        for (auto [key, value] : fields) {
          const std::string name = nb::cast<std::string>(key);
          auto it = setters.find(name);
          if (it == setters.end()) {
            std::string known;
            for (const auto& kv : setters) known += (known.empty() ? "" : ", ") + kv.first;
            throw nb::type_error(("ReaderOptions: unknown field '" + name + "'; fields: " + known).c_str());
          }
          it->second(o, value);
        }
        new (self) io::ReaderOptions(o);
      },
      "Defaults from the native struct; keyword arguments set fields by name.");
#define ASYNCSIDE_OPTION_FIELD(name, doc)                                                            \
  cls.def_prop_rw(                                                                                 \
      #name, [](const io::ReaderOptions& o) { return o.name; },                                    \
      [](io::ReaderOptions& o, nb::handle v) { set_option(o.name, #name, v); }, doc);
  ASYNCSIDE_READER_OPTION_FIELDS(ASYNCSIDE_OPTION_FIELD)
#undef ASYNCSIDE_OPTION_FIELD
  cls.def("__repr__", &options_repr);
  cls.def("__eq__", [](const io::ReaderOptions& a, const io::ReaderOptions& b) {
    return options_repr(a) == options_repr(b);
  });
  cls.def("__copy__", [](const io::ReaderOptions& o) { return io::ReaderOptions(o); });
  cls.def(
      "as_dict",
      [](const io::ReaderOptions& o) {
        nb::dict d;
#define ASYNCSIDE_OPTION_ITEM(name, doc) d[#name] = o.name;
        ASYNCSIDE_READER_OPTION_FIELDS(ASYNCSIDE_OPTION_ITEM)
#undef ASYNCSIDE_OPTION_ITEM
        return d;
      },
      "The fields as a dict (for JSON).");
  cls.def_static(
      "field_names",
      [] {
        std::vector<std::string> names;
#define ASYNCSIDE_OPTION_NAME(name, doc) names.push_back(#name);
        ASYNCSIDE_READER_OPTION_FIELDS(ASYNCSIDE_OPTION_NAME)
#undef ASYNCSIDE_OPTION_NAME
        return names;
      },
      "The field names, in declaration order.");
}

io::ChecksumKind checksum_kind(const std::string& name) {
  if (name == "crc32") return io::ChecksumKind::Crc32;
  if (name == "crc32c") return io::ChecksumKind::Crc32c;
  if (name == "none" || name.empty()) return io::ChecksumKind::None;
  throw std::invalid_argument("checksum: expected 'crc32', 'crc32c' or 'none', got '" + name + "'");
}

// checksum_update over any C-contiguous buffer (bytes, memoryview, numpy array), GIL released.
uint32_t checksum_buffer(io::ChecksumKind kind, nb::handle data, uint32_t state, bool portable) {
  Py_buffer view;
  if (PyObject_GetBuffer(data.ptr(), &view, PyBUF_C_CONTIGUOUS) != 0) throw nb::python_error();
  uint32_t r;
  {
    nb::gil_scoped_release g;
    r = portable ? io::checksum_update_portable(kind, state, view.buf, static_cast<size_t>(view.len))
                 : io::checksum_update(kind, state, view.buf, static_cast<size_t>(view.len));
  }
  PyBuffer_Release(&view);
  return r;
}

std::vector<io::SegmentSpan> spans(const std::vector<uint64_t>& offsets, const std::vector<uint64_t>& nbytes) {
  if (offsets.size() != nbytes.size()) {
    throw std::invalid_argument("offsets and nbytes: expected equal lengths, got " + std::to_string(offsets.size()) +
                                " and " + std::to_string(nbytes.size()));
  }
  std::vector<io::SegmentSpan> s;
  for (size_t i = 0; i < offsets.size(); ++i) s.push_back({offsets[i], nbytes[i]});
  return s;
}

void bind_read_path(nb::module_& m) {
  // A blob that cannot be opened surfaces as the matching OSError (FileNotFoundError,
  // PermissionError, ...) with errno and filename set, so callers can tell causes apart.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const io::OpenError& e) {
      std::string msg = e.what();
      const std::string prefix = e.path() + ": ";
      if (msg.rfind(prefix, 0) == 0) msg = msg.substr(prefix.size());
      nb::object exc = nb::handle(PyExc_OSError)(e.err(), msg, e.path());
      PyErr_SetObject(PyExc_OSError, exc.ptr());
    }
  });
  nb::class_<PyReader>(m, "Reader",
                       "A native reader (io_uring or preadv thread pool) completing whole fills onto one "
                       "completion list + eventfd.")
      .def(
          "__init__",
          [](PyReader* self, const std::string& backend, const io::ReaderOptions& options) {
            const io::Backend which = backend_of(backend);
            const io::ReaderOptions o = options;  // a C++ copy: nothing Python crosses the release
            // Ring setup, staging allocation and buffer registration take milliseconds: GIL released.
            nb::gil_scoped_release g;
            new (self) PyReader(which, o);
          },
          nb::arg("backend"), nb::arg("options") = io::ReaderOptions(),
          "backend: 'io_uring' or 'threads'; options: ReaderOptions (defaults when omitted).")
      .def_prop_ro("backend", [](PyReader& p) { return std::string(p.r().backend_name()); })
      .def_prop_ro("event_fd", [](PyReader& p) { return p.r().event_fd(); },
                   "Readable when completions are waiting: watch it, then call reap().")
      .def_prop_ro("direct", [](PyReader& p) { return p.r().options().direct; })
      .def_prop_ro("options", [](PyReader& p) { return p.r().options(); },
                   "The options in force, machine-dependent defaults resolved (a copy).")
      .def_prop_ro("in_flight", [](PyReader& p) { return p.r().in_flight(); })
      .def(
          "add_layout",
          [](PyReader& p, const std::string& path, uint64_t stride, int64_t n_experts,
             const std::vector<uint64_t>& offsets, const std::vector<uint64_t>& nbytes,
             std::vector<mx::array> pools) {
            auto dest = std::make_shared<io::MlxPoolDestination>(std::move(pools), nbytes);
            auto s = spans(offsets, nbytes);
            nb::gil_scoped_release g;
            return p.r().add_layout(path, stride, n_experts, std::move(s), std::move(dest));
          },
          nb::arg("path"), nb::arg("stride"), nb::arg("n_experts"), nb::arg("offsets"), nb::arg("nbytes"),
          nb::arg("pools"),
          "Open a layer blob; pools[i] (evaluated, rows x nbytes[i] bytes) receives segment i. Returns its id.")
      .def(
          "add_layout_mirror",
          [](PyReader& p, const std::string& path, uint64_t stride, int64_t n_experts,
             const std::vector<uint64_t>& offsets, const std::vector<uint64_t>& nbytes,
             std::shared_ptr<io::HostMirror> mirror) {
            if (mirror->segments() != nbytes.size()) {
              throw std::invalid_argument("mirror: expected " + std::to_string(nbytes.size()) +
                                          " segments, got " + std::to_string(mirror->segments()));
            }
            for (size_t i = 0; i < nbytes.size(); ++i) {
              if (mirror->row_nbytes(i) != nbytes[i]) {
                throw std::invalid_argument("mirror segment " + std::to_string(i) + ": rows of " +
                                            std::to_string(mirror->row_nbytes(i)) + " bytes, expected " +
                                            std::to_string(nbytes[i]));
              }
            }
            auto s = spans(offsets, nbytes);
            nb::gil_scoped_release g;
            return p.r().add_layout(path, stride, n_experts, std::move(s), std::move(mirror));
          },
          nb::arg("path"), nb::arg("stride"), nb::arg("n_experts"), nb::arg("offsets"), nb::arg("nbytes"),
          nb::arg("mirror"), "Like add_layout, but reads land in a HostMirror (device pools are fed from it).")
      .def(
          "submit",
          [](PyReader& p, uint32_t layout, const std::vector<uint64_t>& tokens, const std::vector<int64_t>& experts,
             const std::vector<int64_t>& rows) {
            if (tokens.size() != experts.size() || tokens.size() != rows.size()) {
              throw std::invalid_argument("tokens, experts, rows: expected equal lengths");
            }
            std::vector<io::FillRequest> req(tokens.size());
            for (size_t i = 0; i < tokens.size(); ++i) req[i] = {tokens[i], experts[i], rows[i]};
            nb::gil_scoped_release g;
            p.r().submit(layout, req);
          },
          nb::arg("layout"), nb::arg("tokens"), nb::arg("experts"), nb::arg("rows"),
          "Start reading record `experts[i]` into row `rows[i]`; completes as (tokens[i], result).")
      .def(
          "reap",
          [](PyReader& p) {
            std::vector<io::Completion> done;
            {
              nb::gil_scoped_release g;
              done = p.r().reap();
            }
            std::vector<std::pair<uint64_t, int>> out;
            out.reserve(done.size());
            for (auto& c : done) out.emplace_back(c.token, c.result);
            return out;
          },
          "Reset the eventfd, advance the backend, return finished fills as (token, 0 or -errno).")
      .def(
          "wait",
          [](PyReader& p, int timeout_ms) {
            nb::gil_scoped_release g;
            return p.r().wait(timeout_ms);
          },
          nb::arg("timeout_ms"), "Block (GIL released) until the eventfd is readable; for synchronous callers.")
      .def(
          "close",
          [](PyReader& p) {
            nb::gil_scoped_release g;
            p.r().close();
          },
          "Wait for every in-flight read, then release threads, ring, staging and files.")
      .def(
          "set_faults",
          [](PyReader& p, const std::string& path, uint64_t lo, uint64_t hi, int err, uint64_t max_read_bytes,
             uint64_t transient_every, int transient_err, bool map_unchecked) {
            io::Faults f;
            f.map_unchecked = map_unchecked;
            f.path = path;
            f.lo = lo;
            f.hi = hi;
            f.err = err;
            f.max_read_bytes = max_read_bytes;
            f.transient_every = transient_every;
            f.transient_err = transient_err;
            p.r().set_faults(f);
          },
          nb::arg("path") = "", nb::arg("lo") = 0, nb::arg("hi") = 0, nb::arg("err") = 0,
          nb::arg("max_read_bytes") = 0, nb::arg("transient_every") = 0, nb::arg("transient_err") = 0,
          nb::arg("map_unchecked") = false,
          "Test hooks: fail reads of `path` touching [lo, hi) with errno `err`; cap every read op at "
          "max_read_bytes; make every Nth op fail once with EAGAIN/EINTR; map_unchecked: mapped reads "
          "skip the page-cache residency check (a copy past a truncated end then meets SIGBUS).")
      .def(
          "set_checksums",
          [](PyReader& p, uint32_t layout, const std::string& kind, std::vector<uint32_t> values) {
            p.r().set_checksums(layout, checksum_kind(kind), std::move(values));
          },
          nb::arg("layout"), nb::arg("kind"), nb::arg("values"),
          "Verify every later fill of `layout` against values[expert] ('crc32' | 'crc32c'; 'none': off) "
          "before it completes; a mismatch completes it with -EBADMSG (see take_mismatch).")
      .def(
          "take_mismatch",
          [](PyReader& p, uint64_t token) -> std::optional<std::pair<uint32_t, uint32_t>> {
            io::Mismatch m{};
            if (!p.r().take_mismatch(token, &m)) return std::nullopt;
            return std::make_pair(m.expected, m.got);
          },
          nb::arg("token"), "(expected, got) of a fill completed with -EBADMSG, once; else None.")
      .def("counters", [](PyReader& p) { return p.r().counters(); });

  m.def(
      "checksum",
      [](const std::string& kind, nb::handle data, uint32_t state) {
        return checksum_buffer(checksum_kind(kind), data, state, false);
      },
      nb::arg("kind"), nb::arg("data"), nb::arg("state") = 0,
      "CRC of a C-contiguous buffer ('crc32': equals zlib.crc32; 'crc32c'), continuing `state` "
      "(0 to start). The fastest implementation the CPU has; GIL released.");
  m.def(
      "checksum_portable",
      [](const std::string& kind, nb::handle data, uint32_t state) {
        return checksum_buffer(checksum_kind(kind), data, state, true);
      },
      nb::arg("kind"), nb::arg("data"), nb::arg("state") = 0,
      "The same CRC by the portable table implementation (tests compare the fast paths with it).");
  m.def(
      "checksum_combine",
      [](const std::string& kind, uint32_t crc1, uint32_t crc2, uint64_t len2) {
        return io::checksum_combine(checksum_kind(kind), crc1, crc2, len2);
      },
      nb::arg("kind"), nb::arg("crc1"), nb::arg("crc2"), nb::arg("len2"),
      "The checksum of a||b from those of a and b (b's started at 0) and b's length (zlib's crc32_combine).");
  m.def(
      "checksum_implementation",
      [](const std::string& kind) { return std::string(io::checksum_implementation(checksum_kind(kind))); },
      nb::arg("kind"), "Which implementation checksum() uses here: 'vpclmulqdq', 'pclmulqdq', 'sse4.2', "
      "'armv8-crc', 'table' or 'none'.");

  m.def(
      "checksum_leaves_upper_state",
      [](const std::string& kind, size_t nbytes) { return io::checksum_leaves_upper_state(checksum_kind(kind), nbytes); },
      nb::arg("kind"), nb::arg("nbytes"),
      "Checksum nbytes, then whether the AVX upper state was left dirty: 1 dirty, 0 clean, -1 "
      "unknown here (a dirty state slows the SSE code this thread runs next).");
  m.def(
      "io_uring_available",
      [] {
        std::string why;
        bool ok = io::io_uring_available(&why);
        return std::make_pair(ok, why);
      },
      "(True, '') when io_uring rings can be set up here, else (False, reason).");

}

// Benchmark baselines and limits of the read path (asyncside._native.bench).
void bind_read_path_bench(nb::module_& b) {
  b.def(
      "side_region_read",
      [](const std::string& path, uint64_t stride, const std::vector<uint64_t>& offsets,
         const std::vector<uint64_t>& nbytes, std::vector<mx::array> pools, const std::vector<int64_t>& experts,
         const std::vector<int64_t>& rows) {
        io::MlxPoolDestination dest(std::move(pools), nbytes);
        auto s = spans(offsets, nbytes);
        nb::gil_scoped_release g;
        return io::side_region_read(path, stride, s, dest, experts, rows);
      },
      nb::arg("path"), nb::arg("stride"), nb::arg("offsets"), nb::arg("nbytes"), nb::arg("pools"),
      nb::arg("experts"), nb::arg("rows"),
      "The side-region design's read: one thread, pread each whole record into a temp buffer, memcpy "
      "each segment into its row. Returns the bytes read.");

  b.def(
      "pread_seconds",
      [](const std::string& path, uint64_t stride, const std::vector<int64_t>& experts, int threads) {
        nb::gil_scoped_release g;
        return io::pread_seconds(path, stride, experts, threads);
      },
      nb::arg("path"), nb::arg("stride"), nb::arg("experts"), nb::arg("threads") = 1,
      "Seconds for `threads` threads to pread the given whole records into private buffers (page-cache limit).");

  b.def(
      "memcpy_seconds",
      [](uint64_t total_bytes, uint64_t block_bytes, uint64_t working_bytes, int threads) {
        nb::gil_scoped_release g;
        return io::memcpy_seconds(total_bytes, block_bytes, working_bytes, threads);
      },
      nb::arg("total_bytes"), nb::arg("block_bytes"), nb::arg("working_bytes"), nb::arg("threads") = 1,
      "Seconds to memcpy total_bytes in block_bytes blocks within a working_bytes buffer (the warm limit).");
}

}  // namespace
// ===== end read path ==============================================================================

// ===== device pools: host mirror, mirror reads, uploads to device pools ==========================
#include <nanobind/ndarray.h>

#include "cuda_upload.h"
#include "host_mirror.h"

namespace {

void bind_device_pools(nb::module_& m) {
  namespace io = asyncside::io;
  nb::class_<io::HostMirror>(m, "HostMirror",
                             "Page-aligned (pinned on CUDA) host memory laid out like one layer's pools: "
                             "readers fill it, upload_rows copies rows to device pools.")
      .def(nb::new_([](int64_t rows, std::vector<uint64_t> nbytes) {
             // Zeroing and pinning a large mirror takes a while: other Python threads (the event
             // loop, when this runs in a worker thread) go on meanwhile.
             nb::gil_scoped_release release;
             return std::make_shared<io::HostMirror>(rows, std::move(nbytes));
           }),
           nb::arg("rows"), nb::arg("segment_nbytes"))
      .def_prop_ro("rows", &io::HostMirror::rows)
      .def_prop_ro("pinned", &io::HostMirror::pinned)
      .def(
          "row_view",
          [](nb::handle self, size_t segment, int64_t row) {
            auto& m = nb::cast<io::HostMirror&>(self);
            if (segment >= m.segments()) {
              throw std::out_of_range("segment " + std::to_string(segment) + " outside [0, " +
                                      std::to_string(m.segments()) + ")");
            }
            if (row < 0 || row >= m.rows()) {
              throw std::out_of_range("row " + std::to_string(row) + " outside [0, " + std::to_string(m.rows()) + ")");
            }
            size_t shape[1] = {static_cast<size_t>(m.row_nbytes(segment))};
            // A writable numpy view of the row; it keeps the mirror object alive.
            return nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(m.host_row(segment, row), 1, shape, self);
          },
          nb::arg("segment"), nb::arg("row"), "A writable uint8 numpy view of one row of one segment.");
  m.def(
      "upload_rows",
      [](std::shared_ptr<io::HostMirror> mirror, std::vector<mlx::core::array> pools, std::vector<int64_t> rows,
         mlx::core::Stream stream) {
        return asyncside::cuda::upload_rows(std::move(mirror), std::move(pools), std::move(rows), stream);
      },
      nb::arg("mirror"), nb::arg("pools"), nb::arg("rows"), nb::arg("stream"),
      "A lazy array whose evaluation on a GPU stream copies mirror rows into device pool rows.");
  m.def("cuda_upload_available", &asyncside::cuda::available, "True when the CUDA upload path is compiled in.");
  m.def("mirror_counters", [] {
    auto& c = io::mirror_counters();
    return std::map<std::string, uint64_t>{{"created", c.created.load()},
                                           {"destroyed", c.destroyed.load()},
                                           {"bytes_allocated", c.bytes_allocated.load()},
                                           {"bytes_freed", c.bytes_freed.load()},
                                           {"pinned", c.pinned.load()},
                                           {"unpinned", c.unpinned.load()}};
  });
  asyncside::cuda::install_pin_hooks();
}

void bind_device_pools_bench(nb::module_& b) {
  b.def("cuda_h2d_bandwidth", &asyncside::cuda::h2d_bandwidth, nb::arg("nbytes"), nb::arg("iters"),
        nb::call_guard<nb::gil_scoped_release>(), "Pinned host->device cudaMemcpy bytes/s (the copy limit).");
}

}  // namespace
// ===== end device pools ===========================================================================


// ===== expert faults: the fault table and the expert_rows node (queued decode steps) ==============
#include <unistd.h>

#include "chunked_read.h"
#include "expert_faults.h"
#include "fault_server.h"
#include "read_pool.h"
#include "graph_release.h"
#include "step_plan.h"

namespace {

namespace fa = asyncside::faults;

// Python holds the table through this handle (not a shared_ptr nanobind ties to a Python object),
// so the stream thread's copies are pure C++ and dropping them there never touches Python.
struct PyFaultTable {
  std::shared_ptr<fa::FaultTable> t;
};

nb::bytes as_bytes(const void* p, size_t n) { return nb::bytes(static_cast<const char*>(p), n); }

void bind_faults(nb::module_& m) {
  nb::class_<PyFaultTable>(m, "FaultTable",
                           "One MoE layer's expert -> row table for queued steps: the stream maps routed "
                           "experts to pool rows and reads absent ones into rows lent by the ledger.")
      .def(
          "__init__",
          [](PyFaultTable* self, int layer, int64_t n_experts, std::vector<mx::array> pools,
             const std::vector<uint64_t>& offsets, const std::vector<uint64_t>& nbytes, int fd,
             const std::string& path, uint64_t stride) {
            // The table owns fd from here on, also when building it fails.
            try {
              auto dest = std::make_shared<io::MlxPoolDestination>(std::move(pools), nbytes);
              auto sink = std::make_unique<fa::HostRecordSink>(dest, stride, spans(offsets, nbytes));
              new (self) PyFaultTable{std::make_shared<fa::FaultTable>(layer, n_experts, std::move(sink), fd, path, stride)};
            } catch (...) {
              if (fd >= 0) ::close(fd);
              throw;
            }
          },
          nb::arg("layer"), nb::arg("n_experts"), nb::arg("pools"), nb::arg("offsets"), nb::arg("nbytes"),
          nb::arg("fd"), nb::arg("path"), nb::arg("stride"),
          "Host pools (evaluated, pools[i] receives segment i); takes ownership of `fd` (the layer blob).")
      .def_static(
          "for_device",
          [](int layer, int64_t n_experts, std::vector<mx::array> pools, std::shared_ptr<io::HostMirror> mirror,
             const std::vector<uint64_t>& offsets, const std::vector<uint64_t>& nbytes, int fd, const std::string& path,
             uint64_t stride, uint32_t max_pairs, std::shared_ptr<io::HostMirror> tier) {
            try {
              if (tier && tier->rows() != n_experts) {
                throw std::invalid_argument("tier: expected one row per expert (" + std::to_string(n_experts) +
                                            "), got " + std::to_string(tier->rows()));
              }
              const bool by_expert = tier != nullptr;
              auto sink = fa::make_device_sink(by_expert ? std::move(tier) : std::move(mirror), std::move(pools), stride,
                                               spans(offsets, nbytes), max_pairs, by_expert);
              return PyFaultTable{std::make_shared<fa::FaultTable>(layer, n_experts, std::move(sink), fd, path, stride)};
            } catch (...) {
              if (fd >= 0) ::close(fd);
              throw;
            }
          },
          nb::arg("layer"), nb::arg("n_experts"), nb::arg("pools"), nb::arg("mirror"), nb::arg("offsets"),
          nb::arg("nbytes"), nb::arg("fd"), nb::arg("path"), nb::arg("stride"), nb::arg("max_pairs") = 4096,
          nb::arg("tier").none() = nb::none(),
          "Device pools (MLX CUDA): faults read into `mirror` (pinned) and are copied to the pools on "
          "the device; with `tier` (a HostMirror of one row per expert) they read into the tier instead, "
          "where a record stays once verified, so a later fault of it is the device copy alone. Takes "
          "ownership of `fd`.")
      .def_prop_ro("layer", [](PyFaultTable& p) { return p.t->layer(); })
      .def_prop_ro("rows", [](PyFaultTable& p) { return p.t->rows(); })
      .def_prop_ro("can_stage", [](PyFaultTable& p) { return p.t->can_stage(); },
                   "Whether staged resolves can run (device pools, a host tier, staging arrays given).")
      .def(
          "set_staging", [](PyFaultTable& p, std::vector<mx::array> staging) { fa::set_device_staging(*p.t, std::move(staging)); },
          nb::arg("staging"),
          "Device tables with a host tier: the arrays staged resolves fill (one per segment, a row per "
          "expert, evaluated; layers of one shape may share them). Only before any queued step.")
      .def(
          "sync",
          [](PyFaultTable& p, nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> table) {
            std::vector<int32_t> v(table.data(), table.data() + table.shape(0));
            p.t->sync(v);
          },
          nb::arg("table"), "Replace the expert -> row table (int32, -1 absent); nothing may be lent.")
      .def("lend", [](PyFaultTable& p, const std::vector<int64_t>& rows) { p.t->lend(rows); }, nb::arg("rows"),
           "Rows the stream may fill with faulted experts (evicting what they hold).")
      .def("reclaim", [](PyFaultTable& p) { return p.t->reclaim(); },
           "Take back every lent row not used yet; returns them.")
      .def(
          "drain",
          [](PyFaultTable& p, bool positions) {
            fa::Drained d = p.t->drain();
            nb::bytes events = as_bytes(d.events.data(), d.events.size() * sizeof(fa::FaultEvent));
            nb::bytes used = as_bytes(d.used.data(), d.used.size() * sizeof(int32_t));
            nb::bytes sizes = as_bytes(d.used_sizes.data(), d.used_sizes.size() * sizeof(int32_t));
            nb::bytes missed = as_bytes(d.missed.data(), d.missed.size());
            if (!positions) return nb::make_tuple(events, used, sizes, missed);
            return nb::make_tuple(events, used, sizes, missed,
                                  as_bytes(d.event_at.data(), d.event_at.size() * sizeof(int32_t)));
          },
          nb::arg("positions") = false,
          "(events, used, used_sizes, missed) since the last drain, as raw bytes: events are int64 rows of "
          "(row, victim, expert, ns, error, source: 0 read, 1 from the host tier, 2 read in the background, "
          "3 a prefetch's read); used the distinct experts of each resolve (int32), used_sizes how many each "
          "resolve added (int32), and missed one uint8 per entry of used: 1 where that resolve found the "
          "expert absent (a miss), 0 where it was a hit. With positions=True a fifth, event_at: per event "
          "(int32) how many resolves had logged their uses when it was logged, its own included (an event "
          "of resolve r of this log has r + 1; 0: of the last resolve of the log drained before).")
      .def("prefetch", [](PyFaultTable& p, std::vector<int64_t> ids) { p.t->prefetch(std::move(ids)); },
           nb::arg("ids"), nb::call_guard<nb::gil_scoped_release>(),
           "Start reading the predicted experts `ids` this layer lacks into lent rows (what a "
           "prefetch_rows node does on the stream; tests). Waits first for reads still pending.")
      .def("settle", [](PyFaultTable& p) { p.t->settle(); }, nb::call_guard<nb::gil_scoped_release>(),
           "Wait for the reads streamed resolves began and publish them (their events go to the log); "
           "blocks for that I/O: call it off the event loop, once the steps that began them are done.")
      .def_prop_ro("failure", [](PyFaultTable& p) { return p.t->failure(); },
                   "The message of the latest fault node that failed as a whole (error -4 in the log), or ''.")
      .def_prop_ro("pending", [](PyFaultTable& p) { return p.t->pending(); },
                   "Whether streamed reads are begun and not yet published.")
      .def("table", [](PyFaultTable& p) { return p.t->table(); }, "The expert -> row table now (a copy).")
      .def("lent", [](PyFaultTable& p) { return p.t->lent(); }, "Lent rows not used yet, in lend order.")
      .def("counters", [](PyFaultTable& p) { return p.t->counters(); })
      .def("set_fault", [](PyFaultTable& p, uint64_t lo, uint64_t hi, int err) { p.t->set_fault(lo, hi, err); },
           nb::arg("lo"), nb::arg("hi"), nb::arg("err"),
           "Tests: every read of a record touching blob bytes [lo, hi) fails with errno `err` (0: none).")
      .def(
          "set_checksums",
          [](PyFaultTable& p, const std::string& kind, std::vector<uint32_t> expected) {
            p.t->set_checksums(checksum_kind(kind), std::move(expected));
          },
          nb::arg("kind"), nb::arg("expected"),
          "Check every faulted record against its checksum ('crc32' or 'crc32c'; 'none': no check) "
          "before the step uses it; a mismatch fails the step.")
      .def(
          "set_drop_cache", [](PyFaultTable& p, bool on) { p.t->set_drop_cache(on); }, nb::arg("on"),
          "Drop each faulted record from the page cache once read (the plan reads past the page cache).")
      .def(
          "set_direct", [](PyFaultTable& p, bool on) { p.t->set_direct(on); }, nb::arg("on"),
          "The table's descriptor was opened with O_DIRECT: read whole aligned record spans through an "
          "aligned buffer.")
      .def(
          "set_read_window", [](PyFaultTable& p, int pieces) { p.t->set_read_window(pieces); }, nb::arg("pieces"),
          "The window of this table's ordered reads: 0 to 32 pieces in flight, or -1 for the process's "
          "fault_read_window(); ValueError otherwise.")
      .def(
          "set_order",
          [](PyFaultTable& p, const std::string& order, double half_life, const std::vector<double>& kept) {
            fa::VictimOrder o;
            if (order == "lend") {
              o = fa::VictimOrder::LendOrder;
            } else if (order == "recency") {
              o = fa::VictimOrder::Recency;
            } else if (order == "decayed") {
              o = fa::VictimOrder::Decayed;
            } else {
              throw std::invalid_argument("order: expected 'lend', 'recency' or 'decayed', got '" + order + "'");
            }
            p.t->set_order(o, half_life, kept);
          },
          nb::arg("order"), nb::arg("half_life") = 8.0, nb::arg("kept") = std::vector<double>{},
          "Which lent row a fault takes: the first lent ('lend'), the least recently used "
          "('recency'), or the lowest use count decayed by `half_life` steps ('decayed'). Counts are "
          "kept under `half_life` and each of `kept` (a policy's candidate half-lives), so one adopted "
          "later ranks by the counts it would have had all along.");

  m.def(
      "expert_rows",
      [](const mx::array& ids, PyFaultTable& table, std::optional<mx::Stream> stream, bool staged) {
        return fa::expert_rows(ids, table.t, stream ? *stream : mx::default_stream(mx::default_device()), staged);
      },
      nb::arg("ids"), nb::arg("table"), nb::arg("stream") = nb::none(), nb::arg("staged") = false,
      "Lazy uint32 pool rows of `ids` (any integer shape): when the stream reaches it, each routed "
      "expert is looked up in `table`, and one without a row is read into a lent row first. "
      "`staged`: instead copy every routed expert into the table's staging arrays (from its pool row, "
      "or from the host tier) and return the ids themselves, rows of the staging arrays; no pool row "
      "changes.");
  m.def(
      "begin_rows",
      [](const mx::array& ids, PyFaultTable& table, std::optional<mx::Stream> stream) {
        return fa::begin_rows(ids, table.t, stream ? *stream : mx::default_stream(mx::Device::cpu));
      },
      nb::arg("ids"), nb::arg("table"), nb::arg("stream") = nb::none(),
      "The streamed form of expert_rows (CPU stream, host pools): when the stream reaches it, every "
      "routed expert gets its row at once and the absent ones' reads start in the background. Lazy "
      "uint32, the shape of `ids` with the last axis (a token's k slots) doubled: [rows | order], order "
      "being the slots to compute first to last (expert in first, then as their reads were issued). A "
      "gather must read a row only behind finish_rows for its expert.");
  m.def(
      "finish_rows",
      [](const mx::array& ids, const mx::array& rows, PyFaultTable& table, std::optional<mx::Stream> stream) {
        return fa::finish_rows(ids, rows, table.t, stream ? *stream : mx::default_stream(mx::Device::cpu));
      },
      nb::arg("ids"), nb::arg("rows"), nb::arg("table"), nb::arg("stream") = nb::none(),
      "`rows` (begin_rows' rows of the experts `ids`, any part of them) passed through once those "
      "experts' reads finished and were published; a failed read fails the step here.");
  m.def(
      "prefetch_rows",
      [](const mx::array& after, const mx::array& ids, PyFaultTable& table, std::optional<mx::Stream> stream) {
        return fa::prefetch_rows(after, ids, table.t, stream ? *stream : mx::default_stream(mx::Device::cpu));
      },
      nb::arg("after"), nb::arg("ids"), nb::arg("table"), nb::arg("stream") = nb::none(),
      "`after` (integer rows, passed through as uint32) once the stream got there and `table`'s "
      "layer started reading the predicted experts `ids` it lacks into lent rows (a hint: no use "
      "logged, no step failed; its next begin_rows adopts the reads of the experts it routes, "
      "expert_rows settles them first).");
  m.def("fault_background_threads", &fa::background_threads,
        "Threads the streamed resolves' background reads run on.");
  nb::class_<asyncside::plan::StepPlan>(
      m, "StepPlan",
      "One queued step's unscheduled graph, handed to MLX in chunks that fit under its eval throttle.")
      .def(nb::init<const std::vector<mx::array>&>(), nb::arg("roots"), nb::call_guard<nb::gil_scoped_release>())
      .def("advance", &asyncside::plan::StepPlan::advance, nb::arg("budget_ns") = 0, nb::arg("slice_ns") = 0,
           nb::arg("lend") = false, nb::call_guard<nb::gil_scoped_release>(),
           "Schedule the next chunk, letting MLX's throttle block for up to budget_ns more: (True, None) "
           "when all is scheduled, else (False, y): await y, then call again; (False, None) when "
           "slice_ns > 0 of the caller's time ran out first: let other work run, then call again.")
      .def_prop_ro("size", &asyncside::plan::StepPlan::size)
      .def_prop_ro("scheduled", &asyncside::plan::StepPlan::scheduled)
      .def_prop_ro("chunks", &asyncside::plan::StepPlan::chunks);
  m.def("pending_graph_releases", &asyncside::plan::pending_releases,
        "Scheduled step graphs handed to the release thread and not yet dropped.");
  m.def("wait_for_graph_releases", &asyncside::plan::wait_for_releases, nb::call_guard<nb::gil_scoped_release>(),
        "Block until every step graph handed to the release thread so far has been dropped.");
  m.def("stop_graph_releases", &asyncside::plan::stop_releases, nb::call_guard<nb::gil_scoped_release>(),
        "From now on drop step graphs on the caller (registered with atexit: nothing is freed on the "
        "release thread while MLX's statics are destroyed).");
  m.def("fault_errors_total", &fa::fault_errors_total,
        "Failed faults in every fault table of the process so far (a step checks it, not the logs).");
  m.def("fault_read_threads", &fa::read_threads,
        "Worker threads a fault resolve reads its absent records with, beside the stream's own thread.");
  m.def("set_fault_read_threads", &fa::set_read_threads, nb::arg("n"),
        "Set how many worker threads fault resolves read with (0: the stream's thread alone; tests).");
  m.def("device_faults_available", &fa::device_faults_available,
        "True when fault tables for device pools (the CUDA fault path) are compiled in.");
  m.def("device_fault_node_form", [] { return std::string(fa::device_fault_node_form()); },
        "How CUDA fault nodes are encoded in this process: 'device' (the lookup kernel; a miss "
        "asks the fault server), 'host' or 'child' (a host node on every node; "
        "ASYNCSIDE_CUDA_FAULT_NODE), 'none' without the CUDA fault path.");
  m.def("fault_server_counters", [] {
    return std::map<std::string, uint64_t>{{"registered", fa::server_registered()},
                                           {"served", fa::server_served()}};
  }, "The fault server: nodes that may post now, requests answered so far.");
  m.def("fault_counters", [] {
    auto& c = fa::global_counters();
    return std::map<std::string, uint64_t>{{"tables_created", c.tables_created.load()},
                                           {"tables_destroyed", c.tables_destroyed.load()},
                                           {"nodes_created", c.nodes_created.load()},
                                           {"nodes_destroyed", c.nodes_destroyed.load()},
                                           {"fault_errors", c.fault_errors.load()},
                                           {"shared_reads", c.shared_reads.load()},
                                           {"background_reads", c.background_reads.load()},
                                           {"direct_in_place", c.direct_in_place.load()},
                                           {"chunked_reads", c.chunked_reads.load()},
                                           {"chunk_ops", c.chunk_ops.load()},
                                           {"chunk_fallbacks", c.chunk_fallbacks.load()},
                                           {"ordered_reads", c.ordered_reads.load()}};
  });
  // A bad ASYNCSIDE_FAULT_READ_CHUNK fails here, naming the variable, not inside a read.
  fa::check_fault_read_chunk_env();
  fa::check_fault_read_window_env();
  m.def("fault_read_window", &fa::fault_read_window,
        "Pieces a streamed resolve keeps in flight while it reads its records in order (O_DIRECT: "
        "one ring, each record landing before the next); 0: a background job per record, side by "
        "side. Default ASYNCSIDE_FAULT_READ_WINDOW, else 4.");
  m.def("set_fault_read_window", &fa::set_fault_read_window, nb::arg("pieces"),
        "Set the streamed reads' window, process-wide: 0, or 1 to 32 pieces in flight. A window set "
        "here (or by ASYNCSIDE_FAULT_READ_WINDOW) is kept by every runtime instead of the one it "
        "would measure for its disk.");
  m.def("fault_read_window_chosen", &fa::fault_read_window_chosen,
        "Whether the streamed reads' window was chosen for the process (ASYNCSIDE_FAULT_READ_WINDOW "
        "or set_fault_read_window).");
  m.def("ordered_reads_possible", &fa::ordered_reads_possible,
        "Whether streamed resolves read their O_DIRECT records in order here (io_uring present and on).");
  m.def(
      "time_ordered_reads",
      [](int fd, const std::vector<std::pair<uint64_t, uint64_t>>& records, uint64_t piece, unsigned window) {
        if (piece == 0 || piece % fa::kChunkAlign != 0) {
          throw std::invalid_argument("piece: expected a multiple of 4096 bytes, got " + std::to_string(piece));
        }
        if (window == 0 || window > fa::kMaxFaultReadWindow) {
          throw std::invalid_argument("window: expected 1 to " + std::to_string(fa::kMaxFaultReadWindow) +
                                      " pieces in flight, got " + std::to_string(window));
        }
        int64_t ns = 0;
        int err;
        {
          nb::gil_scoped_release release;
          err = fa::time_ordered_reads(fd, records, piece, window, ns);
        }
        return std::make_pair(err, static_cast<double>(ns) * 1e-9);
      },
      nb::arg("fd"), nb::arg("records"), nb::arg("piece"), nb::arg("window"),
      "Read records (offset, bytes) of an O_DIRECT descriptor one after another as a streamed "
      "resolve's ordered read does (pieces of `piece` bytes, `window` in flight, into scratch "
      "buffers), on the calling thread; returns (0 or an errno, seconds). ENOSYS without io_uring.");
  m.def("fault_read_chunk", &fa::fault_read_chunk,
        "Bytes an O_DIRECT fault read of a record is split into, all in flight at once (0: one "
        "request per record). Default ASYNCSIDE_FAULT_READ_CHUNK, else 1 MiB.");
  m.def("set_fault_read_chunk", &fa::set_fault_read_chunk, nb::arg("n"),
        "Set the fault reads' chunk in bytes, process-wide: 0 (whole records) or a multiple of 4096 "
        "up to 1 GiB; ValueError otherwise.");
}

}  // namespace
// ===== end expert faults ==========================================================================

NB_MODULE(_native, m) {
  m.doc() = "asyncside native core: readers, scatter, completion bridge";
  m.def("build_info", [] { return std::string(asyncside::build_info()); },
        "Which optional native paths (io_uring, CUDA, Metal) this build compiled in.");
  bind_bridge(m);
  bind_reader_options(m);
  bind_read_path(m);
  bind_device_pools(m);
  bind_faults(m);
  // Step graphs are dropped on the caller once Python starts exiting (graph_release.h).
  nb::module_::import_("atexit").attr("register")(m.attr("stop_graph_releases"));

  nb::module_ testing = m.def_submodule("testing", "Test hooks; not part of the runtime.");
  bind_bridge_testing(testing);
  testing.def(
      "fail_next_fault_node",
      [](PyFaultTable& table, std::string message) { table.t->testing_fail_next(std::move(message)); },
      nb::arg("table"), nb::arg("message"),
      "The next fault node of `table` to run throws `message` on the stream, once: logged as error -4, its rows 0.");
  testing.def("set_direct_in_place", &asyncside::faults::set_direct_in_place, nb::arg("on"), nb::arg("force") = false,
              "False: every O_DIRECT fault read lands in an aligned buffer and is copied into its rows; "
              "force: straight into rows even where they are CUDA managed memory.");
  testing.def("direct_reads_land_in_pool", [](const mx::array& pool) {
        return asyncside::io::direct_reads_land_in(const_cast<mx::array&>(pool).data<uint8_t>());
      }, nb::arg("pool"), "Whether O_DIRECT fault reads may land straight in this evaluated pool array.");
  testing.def("reset_fault_read_window", &asyncside::faults::reset_fault_read_window,
              "The streamed reads' window back to its default (ASYNCSIDE_FAULT_READ_WINDOW where set, "
              "else 4), not chosen for the process.");
  testing.def("set_fault_read_uring", &asyncside::faults::set_fault_read_uring, nb::arg("on"),
              "False: chunked fault reads take their fallback (one preadv a record), as without io_uring.");

  nb::module_ bench = m.def_submodule("bench", "Benchmark baselines and limits; not part of the runtime.");
  bind_bridge_bench(bench);
  bind_read_path_bench(bench);
  bind_device_pools_bench(bench);
}
