// The one Python <-> native boundary. Every class and function Python sees is declared here;
// the work lives in the plain C++ files beside it, which know nothing of Python.
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
// ---- read path (issue 3, h2): Reader, original-design baseline, memcpy limit --------------------
namespace {

namespace io = asyncside::io;
namespace mx = mlx::core;

// Python's handle on a native Reader. Arguments are converted to plain C++ before the GIL is
// released; native threads never see a Python object.
class PyReader {
 public:
  PyReader(const std::string& backend, int queue_depth, int workers, uint64_t chunk_bytes, uint64_t buffered_chunk_bytes,
           uint64_t async_threshold, bool direct, uint64_t staging_bytes, uint64_t slot_bytes,
           bool register_files, bool register_buffers, int iowq_max_workers, int worker_nice, bool direct_rows) {
    io::ReaderOptions o;
    if (backend == "io_uring") {
      o.backend = io::Backend::IoUring;
    } else if (backend == "threads") {
      o.backend = io::Backend::Threads;
    } else {
      throw std::invalid_argument("backend: expected 'io_uring' or 'threads', got '" + backend + "'");
    }
    o.queue_depth = queue_depth;
    o.workers = workers;
    o.chunk_bytes = chunk_bytes;
    o.buffered_chunk_bytes = buffered_chunk_bytes;
    o.async_threshold = async_threshold;
    o.direct = direct;
    o.staging_bytes = staging_bytes;
    o.slot_bytes = slot_bytes;
    o.register_files = register_files;
    o.register_buffers = register_buffers;
    o.iowq_max_workers = iowq_max_workers;
    o.worker_nice = worker_nice;
    o.direct_rows = direct_rows;
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
          [](PyReader* self, const std::string& backend, int queue_depth, int workers, uint64_t chunk_bytes,
             uint64_t buffered_chunk_bytes,
             uint64_t async_threshold, bool direct, uint64_t staging_bytes, uint64_t slot_bytes, bool register_files,
             bool register_buffers, int iowq_max_workers, int worker_nice, bool direct_rows) {
            // Ring setup, staging allocation and buffer registration take milliseconds: GIL released.
            nb::gil_scoped_release g;
            new (self) PyReader(backend, queue_depth, workers, chunk_bytes, buffered_chunk_bytes, async_threshold, direct, staging_bytes,
                                slot_bytes, register_files, register_buffers, iowq_max_workers, worker_nice,
                                direct_rows);
          },
           nb::arg("backend"), nb::arg("queue_depth") = 64, nb::arg("workers") = 4,
           nb::arg("chunk_bytes") = 1ull << 20, nb::arg("buffered_chunk_bytes") = 16ull << 20,
           nb::arg("async_threshold") = 64ull << 10,
           nb::arg("direct") = false, nb::arg("staging_bytes") = 64ull << 20, nb::arg("slot_bytes") = 4ull << 20,
           nb::arg("register_files") = true, nb::arg("register_buffers") = true, nb::arg("iowq_max_workers") = 0,
           nb::arg("worker_nice") = 0, nb::arg("direct_rows") = true)
      .def_prop_ro("backend", [](PyReader& p) { return std::string(p.r().backend_name()); })
      .def_prop_ro("event_fd", [](PyReader& p) { return p.r().event_fd(); },
                   "Readable when completions are waiting: watch it, then call reap().")
      .def_prop_ro("direct", [](PyReader& p) { return p.r().options().direct; })
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
             uint64_t transient_every, int transient_err) {
            io::Faults f;
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
          "Test hooks: fail reads of `path` touching [lo, hi) with errno `err`; cap every read op at "
          "max_read_bytes; make every Nth op fail once with EAGAIN/EINTR.")
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
      "io_uring_available",
      [] {
        std::string why;
        bool ok = io::io_uring_available(&why);
        return std::make_pair(ok, why);
      },
      "(True, '') when io_uring rings can be set up here, else (False, reason).");

  m.def(
      "original_design_read",
      [](const std::string& path, uint64_t stride, const std::vector<uint64_t>& offsets,
         const std::vector<uint64_t>& nbytes, std::vector<mx::array> pools, const std::vector<int64_t>& experts,
         const std::vector<int64_t>& rows) {
        io::MlxPoolDestination dest(std::move(pools), nbytes);
        auto s = spans(offsets, nbytes);
        nb::gil_scoped_release g;
        return io::original_design_read(path, stride, s, dest, experts, rows);
      },
      nb::arg("path"), nb::arg("stride"), nb::arg("offsets"), nb::arg("nbytes"), nb::arg("pools"),
      nb::arg("experts"), nb::arg("rows"),
      "Benchmark baseline: one thread, pread each whole record into a temp buffer, memcpy each segment.");

  m.def(
      "pread_seconds",
      [](const std::string& path, uint64_t stride, const std::vector<int64_t>& experts, int threads) {
        nb::gil_scoped_release g;
        return io::pread_seconds(path, stride, experts, threads);
      },
      nb::arg("path"), nb::arg("stride"), nb::arg("experts"), nb::arg("threads") = 1,
      "Seconds for `threads` threads to pread the given whole records into private buffers (page-cache limit).");

  m.def(
      "memcpy_seconds",
      [](uint64_t total_bytes, uint64_t block_bytes, uint64_t working_bytes, int threads) {
        nb::gil_scoped_release g;
        return io::memcpy_seconds(total_bytes, block_bytes, working_bytes, threads);
      },
      nb::arg("total_bytes"), nb::arg("block_bytes"), nb::arg("working_bytes"), nb::arg("threads") = 1,
      "Seconds to memcpy total_bytes in block_bytes blocks within a working_bytes buffer (the warm limit).");
}

}  // namespace
// ---- end read path --------------------------------------------------------------------------------

// ===== device pools (issue 7): host mirror, mirror reads, uploads to device pools ===============
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
  m.def("cuda_h2d_bandwidth", &asyncside::cuda::h2d_bandwidth, nb::arg("nbytes"), nb::arg("iters"),
        nb::call_guard<nb::gil_scoped_release>(), "Pinned host->device cudaMemcpy bytes/s (the copy limit).");
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

}  // namespace
// ===== end device pools ===========================================================================

NB_MODULE(_native, m) {
  m.doc() = "asyncside native core: readers, scatter, completion bridge";
  m.def("build_info", [] { return std::string(asyncside::build_info()); },
        "Which optional native paths (io_uring, CUDA, Metal) this build compiled in.");
  bind_bridge(m);
  bind_read_path(m);  // read path (h2)
  bind_device_pools(m);
}
