// The one Python <-> native boundary. Every class and function Python sees is declared here;
// the work lives in the plain C++ files beside it, which know nothing of Python.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <mlx/array.h>

#include "io_reader.h"
#include "version.h"

namespace nb = nanobind;

// ---- read path (issue 3, h2): Reader, original-design baseline, memcpy limit --------------------
namespace {

namespace io = asyncside::io;
namespace mx = mlx::core;

// Python's handle on a native Reader. Arguments are converted to plain C++ before the GIL is
// released; native threads never see a Python object.
class PyReader {
 public:
  PyReader(const std::string& backend, int queue_depth, int workers, uint64_t chunk_bytes,
           uint64_t async_threshold, bool direct, uint64_t staging_bytes, uint64_t slot_bytes,
           bool register_files, bool register_buffers) {
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
    o.async_threshold = async_threshold;
    o.direct = direct;
    o.staging_bytes = staging_bytes;
    o.slot_bytes = slot_bytes;
    o.register_files = register_files;
    o.register_buffers = register_buffers;
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
  nb::class_<PyReader>(m, "Reader",
                       "A native reader (io_uring or preadv thread pool) completing whole fills onto one "
                       "completion list + eventfd.")
      .def(nb::init<const std::string&, int, int, uint64_t, uint64_t, bool, uint64_t, uint64_t, bool, bool>(),
           nb::arg("backend"), nb::arg("queue_depth") = 64, nb::arg("workers") = 4,
           nb::arg("chunk_bytes") = 1ull << 20, nb::arg("async_threshold") = 64ull << 10,
           nb::arg("direct") = false, nb::arg("staging_bytes") = 64ull << 20, nb::arg("slot_bytes") = 4ull << 20,
           nb::arg("register_files") = true, nb::arg("register_buffers") = true)
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
      .def("counters", [](PyReader& p) { return p.r().counters(); });

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

NB_MODULE(_native, m) {
  m.doc() = "asyncside native core: readers, scatter, completion bridge";
  m.def("build_info", [] { return std::string(asyncside::build_info()); },
        "Which optional native paths (io_uring, CUDA, Metal) this build compiled in.");
  bind_read_path(m);  // read path (h2)
}
