// Backend-independent half of the read path: planning fills into chunks, the per-op short-read /
// retry / EOF logic, staging slots, scatter, completion list + eventfd, and the thread-pool backend.
#include "io_internal.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csetjmp>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/eventfd.h>
#endif

namespace asyncside::io {

namespace {

constexpr uint64_t kJunkBytes = 64ull << 10;  // gaps up to this are read into a sink, not split
#if defined(IOV_MAX)
constexpr size_t kMaxIov = IOV_MAX < 1024 ? IOV_MAX : 1024;
#else
constexpr size_t kMaxIov = 1024;
#endif

uint64_t round_down(uint64_t x, uint64_t a) { return x - x % a; }
uint64_t round_up(uint64_t x, uint64_t a) { return round_down(x + a - 1, a); }

void* aligned_alloc_or_throw(uint64_t bytes, const char* what) {
  void* p = nullptr;
  if (posix_memalign(&p, kDirectAlign, bytes) != 0 || p == nullptr) {
    throw std::runtime_error(std::string("cannot allocate ") + std::to_string(bytes) +
                             " aligned bytes for " + what);
  }
  return p;
}

std::string errno_text(int e) { return std::string(std::strerror(e)) + " (errno " + std::to_string(e) + ")"; }

// Verified preadv reads land in windows this small, each checksummed right after it landed, while
// it is still in the reading CPU's cache (L2 is 0.5-2 MiB per core).
constexpr uint64_t kVerifyWindow = 256ull << 10;

// ---- mapped reads: SIGBUS becomes an error, not a crash ------------------------------------------
//
// A mapped copy touches the blob through a mapping; if the file shrinks under it (or a page cannot
// be read) the access raises SIGBUS instead of returning an error. One process-wide handler,
// installed with the first mapping, turns a SIGBUS inside a guarded copy on this thread, at an
// address inside the mapping being copied, into a jump back to the copy's start, which then fails
// the chunk. Every other SIGBUS goes to the handler that was there before (or the default action).

struct MapGuard {
  sigjmp_buf jb;
  const uint8_t* lo;
  const uint8_t* hi;
};

// initial-exec (ELF): the handler reads it without the lazy TLS allocation a dlopen'ed module's
// TLS otherwise gets on a thread's first access.
#if defined(__linux__)
__attribute__((tls_model("initial-exec")))
#endif
thread_local MapGuard* t_map_guard = nullptr;
struct sigaction g_prev_sigbus {};

void sigbus_handler(int sig, siginfo_t* info, void* ctx) {
  MapGuard* g = t_map_guard;
  if (g != nullptr && info != nullptr) {
    const auto* a = static_cast<const uint8_t*>(info->si_addr);
    if (a >= g->lo && a < g->hi) {
      t_map_guard = nullptr;
      siglongjmp(g->jb, 1);
    }
  }
  // Not ours: what the previous disposition would have done.
  if (g_prev_sigbus.sa_flags & SA_SIGINFO) {
    if (g_prev_sigbus.sa_sigaction != nullptr) {
      g_prev_sigbus.sa_sigaction(sig, info, ctx);
      return;
    }
  } else if (g_prev_sigbus.sa_handler != SIG_DFL && g_prev_sigbus.sa_handler != SIG_IGN &&
             g_prev_sigbus.sa_handler != nullptr) {
    g_prev_sigbus.sa_handler(sig);
    return;
  }
  // Default action (a fault cannot be ignored: returning would fault again forever).
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(SIGBUS, &dfl, nullptr);
  raise(SIGBUS);
}

void install_sigbus_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    sa.sa_sigaction = sigbus_handler;
    sigemptyset(&sa.sa_mask);
    // SA_NODEFER: the jump out of the handler leaves SIGBUS unblocked without sigsetjmp saving
    // and restoring the signal mask (a system call per guarded copy).
    sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigaction(SIGBUS, &sa, &g_prev_sigbus);
  });
}

#if defined(__linux__) && !defined(__NR_cachestat) && (defined(__x86_64__) || defined(__aarch64__))
#define __NR_cachestat 451
#endif

// Whether every page of file bytes [off, off + n) of a mapped blob is in the page cache.
bool mapped_resident(const Layout& L, uint64_t off, uint64_t n) {
  static const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t lo = off - off % page;
  const uint64_t len = off + n - lo;
#if defined(__NR_cachestat)
  // cachestat (Linux 6.5) walks the page cache by folio, where mincore of a range not mapped yet
  // looks up every page, a sizeable share of copying it (BENCHMARKS.md, "Measurements behind code choices").
  static std::atomic<bool> no_cachestat{false};
  if (!no_cachestat.load(std::memory_order_relaxed)) {
    struct {
      uint64_t off, len;
    } range{lo, len};
    struct {
      uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
    } st{};
    if (::syscall(__NR_cachestat, L.fd, &range, &st, 0) == 0) return st.nr_cache >= (len + page - 1) / page;
    if (errno == ENOSYS || errno == EPERM) no_cachestat.store(true, std::memory_order_relaxed);
  }
#endif
  static thread_local std::vector<unsigned char> vec;
  vec.resize((len + page - 1) / page);
#if defined(__APPLE__)
  auto* out = reinterpret_cast<char*>(vec.data());
#else
  auto* out = vec.data();
#endif
  if (::mincore(const_cast<uint8_t*>(L.map) + lo, len, out) != 0) {
    return false;
  }
  for (unsigned char v : vec) {
    if ((v & 1) == 0) return false;
  }
  return true;
}

// Opens a blob for reading without ever blocking on what the path turns out to be: O_NONBLOCK
// makes open() of a FIFO return at once (a FIFO opened for reading otherwise waits for a writer),
// and anything but a regular file is refused. O_NONBLOCK is then cleared: io_uring would
// otherwise report EAGAIN for reads it should punt to its workers.
int open_blob(const std::string& path, int flags, const char* how) {
  int fd;
  do {
    fd = ::open(path.c_str(), flags | O_NONBLOCK);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    const int e = errno;
    std::string why = std::string("cannot open") + how + ": " + errno_text(e);
#if defined(O_DIRECT)
    if (e == EINVAL && (flags & O_DIRECT) != 0) why += " (the filesystem refuses direct I/O; read it buffered)";
#endif
    throw OpenError(e, path, path + ": " + why);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw OpenError(e, path, path + ": cannot stat: " + errno_text(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw OpenError(EINVAL, path, path + ": not a regular file (a FIFO, device or directory cannot be a blob)");
  }
  const int fl = ::fcntl(fd, F_GETFL);
  if (fl < 0 || ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
    const int e = errno;
    ::close(fd);
    throw OpenError(e, path, path + ": cannot clear O_NONBLOCK: " + errno_text(e));
  }
  return fd;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Counters

std::map<std::string, uint64_t> Counters::snapshot() const {
  return {
      {"fills_submitted", fills_submitted.load()},   {"fills_completed", fills_completed.load()},
      {"fills_failed", fills_failed.load()},         {"fills_direct_rows", fills_direct_rows.load()},
      {"fills_staged", fills_staged.load()},         {"ops_submitted", ops_submitted.load()},
      {"ops_completed", ops_completed.load()},       {"ops_async", ops_async.load()},
      {"ops_fixed_file", ops_fixed_file.load()},     {"ops_fixed_buffer", ops_fixed_buffer.load()},
      {"chunks_created", chunks_created.load()},     {"chunks_destroyed", chunks_destroyed.load()},
      {"short_reads", short_reads.load()},           {"retries", retries.load()},
      {"faults_injected", faults_injected.load()},   {"bytes_read", bytes_read.load()},
      {"bytes_scattered", bytes_scattered.load()},   {"staging_acquired", staging_acquired.load()},
      {"staging_released", staging_released.load()}, {"staging_waits", staging_waits.load()},
      {"slab_allocs", slab_allocs.load()},           {"slab_frees", slab_frees.load()},
      {"enter_calls", enter_calls.load()},           {"wakeups_written", wakeups_written.load()},
      {"iowq_max_workers", iowq_max_workers.load()},
      {"submit_ns_max", submit_ns_max.load()},       {"reap_ns_max", reap_ns_max.load()},
      {"checksums_verified", checksums_verified.load()}, {"checksum_mismatches", checksum_mismatches.load()},
      {"checksum_bytes", checksum_bytes.load()},     {"checksum_ns", checksum_ns.load()},
      {"maps_created", maps_created.load()},         {"maps_released", maps_released.load()},
      {"mapped_chunks", mapped_chunks.load()},       {"mapped_bytes", mapped_bytes.load()},
      {"map_fallbacks", map_fallbacks.load()},       {"map_errors", map_errors.load()},
  };
}

// ---------------------------------------------------------------------------------------------
// MlxPoolDestination

MlxPoolDestination::MlxPoolDestination(std::vector<mx::array> pools,
                                       const std::vector<uint64_t>& segment_nbytes)
    : pools_(std::move(pools)) {
  if (pools_.size() != segment_nbytes.size()) {
    throw std::invalid_argument("pools: expected one pool per segment (" +
                                std::to_string(segment_nbytes.size()) + "), got " +
                                std::to_string(pools_.size()));
  }
  for (size_t i = 0; i < pools_.size(); ++i) {
    mx::array& a = pools_[i];
    const std::string who = "pools[" + std::to_string(i) + "]";
    if (a.ndim() < 1) throw std::invalid_argument(who + ": expected at least one axis (rows), got a scalar");
    if (a.status() == mx::array::Status::unscheduled || !a.is_available()) {
      throw std::invalid_argument(who + ": must be evaluated (mx.eval) before reads target it");
    }
    if (!a.flags().row_contiguous) throw std::invalid_argument(who + ": must be row-contiguous");
    const int64_t rows = a.shape(0);
    if (i == 0) rows_ = rows;
    if (rows != rows_) {
      throw std::invalid_argument(who + ": has " + std::to_string(rows) + " rows, pools[0] has " +
                                  std::to_string(rows_));
    }
    if (a.nbytes() != static_cast<size_t>(rows) * segment_nbytes[i]) {
      throw std::invalid_argument(who + ": holds " + std::to_string(a.nbytes()) + " bytes, expected rows (" +
                                  std::to_string(rows) + ") x segment nbytes (" +
                                  std::to_string(segment_nbytes[i]) + ")");
    }
    base_.push_back(a.data<uint8_t>());
    row_nbytes_.push_back(segment_nbytes[i]);
    takes_direct_ = takes_direct_ && direct_reads_land_in(base_.back());
  }
}

// ---------------------------------------------------------------------------------------------
// ChunkWorkers

ChunkWorkers::ChunkWorkers(int n, std::function<void(Chunk*)> fn, int nice) : fn_(std::move(fn)) {
  for (int i = 0; i < std::max(1, n); ++i) {
    threads_.emplace_back([this, nice] {
#if defined(__linux__)
      // Linux nice is per thread: a worker above the loop thread's nice never delays the loop
      // when both want the same CPU (memcpy-bound warm reads keep workers runnable).
      if (nice != 0) setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), getpriority(PRIO_PROCESS, 0) + nice);
#endif
      loop();
    });
  }
}

ChunkWorkers::~ChunkWorkers() { stop(); }

void ChunkWorkers::push(Chunk* c) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    q_.push_back(c);
  }
  cv_.notify_one();
}

void ChunkWorkers::push_many(const std::vector<Chunk*>& cs) {
  if (cs.empty()) return;
  {
    std::lock_guard<std::mutex> lk(mu_);
    q_.insert(q_.end(), cs.begin(), cs.end());
  }
  if (cs.size() == 1) {
    cv_.notify_one();
  } else {
    cv_.notify_all();
  }
}

void ChunkWorkers::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_ && threads_.empty()) return;
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
  threads_.clear();
}

void ChunkWorkers::loop() {
  for (;;) {
    Chunk* c = nullptr;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stopping_ || !q_.empty(); });
      if (q_.empty()) return;  // stopping and drained
      c = q_.front();
      q_.pop_front();
    }
    fn_(c);
  }
}

// ---------------------------------------------------------------------------------------------
// Reader: construction, layouts, submission

ReaderOptions resolve_defaults(ReaderOptions o) {
  const long online = sysconf(_SC_NPROCESSORS_ONLN);
  const int ncpu = online > 0 ? static_cast<int>(online) : 1;
  // threads: up to four preadv workers, at most two per CPU; io_uring: one scatter worker per CPU
  // (they only copy staged O_DIRECT bytes). io-wq copy threads beyond the CPU count only thrash.
  if (o.workers == 0) o.workers = o.backend == Backend::Threads ? std::min(4, 2 * ncpu) : ncpu;
  if (o.iowq_max_workers == -1) o.iowq_max_workers = ncpu;
  return o;
}

Reader::Reader(const ReaderOptions& opts) : opts_(resolve_defaults(opts)) {
  if (opts_.queue_depth < 1) throw std::invalid_argument("queue_depth: expected >= 1, got " + std::to_string(opts_.queue_depth));
  if (opts_.workers < 1) {
    throw std::invalid_argument("workers: expected >= 1 (or 0 for the default), got " + std::to_string(opts_.workers));
  }
  if (opts_.iowq_max_workers < 0) {
    throw std::invalid_argument("iowq_max_workers: expected >= 0 (or -1 for the CPU count), got " +
                                std::to_string(opts_.iowq_max_workers));
  }
  if (opts_.chunk_bytes < kDirectAlign) {
    throw std::invalid_argument("chunk_bytes: expected >= 4096, got " + std::to_string(opts_.chunk_bytes));
  }
  // Direct reads split at chunk boundaries, which must stay block aligned.
  opts_.chunk_bytes = round_up(opts_.chunk_bytes, kDirectAlign);
  if (opts_.buffered_chunk_bytes < 1) throw std::invalid_argument("buffered_chunk_bytes: expected >= 1");
  opts_.slot_bytes = round_up(std::max<uint64_t>(opts_.slot_bytes, kDirectAlign), kDirectAlign);
#if defined(__linux__)
  int efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (efd < 0) throw std::runtime_error("eventfd: " + errno_text(errno));
  notify_read_fd_ = notify_write_fd_ = efd;
#else
  int p[2];
  if (pipe(p) != 0) throw std::runtime_error("pipe: " + errno_text(errno));
  for (int fd : p) {
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    fcntl(fd, F_SETFD, FD_CLOEXEC);
  }
  notify_read_fd_ = p[0];
  notify_write_fd_ = p[1];
#endif
  junk_ = static_cast<uint8_t*>(aligned_alloc_or_throw(kJunkBytes, "the padding sink"));
  if (opts_.direct) {
    n_slots_ = static_cast<int>(std::max<uint64_t>(1, opts_.staging_bytes / opts_.slot_bytes));
    slab_bytes_ = static_cast<uint64_t>(n_slots_) * opts_.slot_bytes;
    slab_ = static_cast<uint8_t*>(aligned_alloc_or_throw(slab_bytes_, "the O_DIRECT staging slab"));
    counters_.slab_allocs++;
    for (int i = n_slots_ - 1; i >= 0; --i) free_slots_.push_back(i);
  }
}

Reader::~Reader() {
  // Subclasses call close() in their destructors (while their backend still exists); this only
  // cleans up after a constructor that threw.
  if (slab_) {
    std::free(slab_);
    counters_.slab_frees++;
  }
  std::free(junk_);
  if (notify_read_fd_ >= 0) ::close(notify_read_fd_);
  if (notify_write_fd_ >= 0 && notify_write_fd_ != notify_read_fd_) ::close(notify_write_fd_);
}

uint32_t Reader::add_layout(const std::string& path, uint64_t stride, int64_t n_experts,
                            std::vector<SegmentSpan> segments, std::shared_ptr<Destination> dest) {
  {
    std::lock_guard<std::mutex> lk(api_mu_);
    if (closed_) throw std::runtime_error("reader is closed");
  }
  if (stride == 0) throw std::invalid_argument(path + ": stride: expected > 0");
  if (n_experts < 1) throw std::invalid_argument(path + ": n_experts: expected >= 1, got " + std::to_string(n_experts));
  if (segments.empty()) throw std::invalid_argument(path + ": segments: expected at least one");
  if (!dest) throw std::invalid_argument(path + ": destination missing");
  auto L = std::make_unique<Layout>();
  L->path = path;
  L->stride = stride;
  L->n_experts = n_experts;
  L->segs = std::move(segments);
  L->dest = std::move(dest);
  L->order.resize(L->segs.size());
  for (uint32_t i = 0; i < L->order.size(); ++i) L->order[i] = i;
  std::sort(L->order.begin(), L->order.end(),
            [&](uint32_t a, uint32_t b) { return L->segs[a].offset < L->segs[b].offset; });
  uint64_t prev_end = 0;
  for (size_t k = 0; k < L->order.size(); ++k) {
    const uint32_t i = L->order[k];
    const SegmentSpan& s = L->segs[i];
    const std::string who = path + ": segments[" + std::to_string(i) + "]";
    if (s.nbytes == 0) throw std::invalid_argument(who + ".nbytes: expected > 0");
    if (s.offset + s.nbytes > stride) {
      throw std::invalid_argument(who + ": ends at " + std::to_string(s.offset + s.nbytes) +
                                  ", past the record stride " + std::to_string(stride));
    }
    if (k > 0 && s.offset < prev_end) {
      throw std::invalid_argument(who + ".offset: " + std::to_string(s.offset) + " overlaps the previous segment (ends at " +
                                  std::to_string(prev_end) + ")");
    }
    prev_end = s.offset + s.nbytes;
  }
  L->span_begin = L->segs[L->order.front()].offset;
  L->span_end = prev_end;

  L->fd = open_blob(path, O_RDONLY | O_CLOEXEC, "");
  if (opts_.direct) {
#if defined(O_DIRECT)
    try {
      L->fd_direct = open_blob(path, O_RDONLY | O_CLOEXEC | O_DIRECT, " with O_DIRECT");
    } catch (...) {
      ::close(L->fd);
      throw;
    }
#else
    L->fd_direct = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (L->fd_direct >= 0) fcntl(L->fd_direct, F_NOCACHE, 1);
#endif
  }
  if (!opts_.direct && opts_.mapped_reads) {
    // The whole blob, read-only and shared with the page cache: a chunk whose pages are resident
    // is copied from here by a worker (see read_mapped). Address space only; nothing is read or
    // populated now. Where the mapping fails, every read goes through preadv.
    struct stat st {};
    if (::fstat(L->fd, &st) == 0 && st.st_size > 0) {
      install_sigbus_handler();
      void* m = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_SHARED, L->fd, 0);
      if (m != MAP_FAILED) {
        L->map = static_cast<const uint8_t*>(m);
        L->map_len = static_cast<uint64_t>(st.st_size);
        counters_.maps_created++;
      }
    }
  }
  std::lock_guard<std::mutex> lk(api_mu_);
  if (closed_) {
    ::close(L->fd);
    if (L->fd_direct >= 0) ::close(L->fd_direct);
    if (L->map != nullptr) {
      ::munmap(const_cast<uint8_t*>(L->map), L->map_len);
      counters_.maps_released++;
    }
    throw std::runtime_error("reader is closed");
  }
  L->id = static_cast<uint32_t>(layouts_.size());
  on_layout_added(*L);
  layouts_.push_back(std::move(L));
  return layouts_.back()->id;
}

namespace {
uint64_t elapsed_ns(std::chrono::steady_clock::time_point t0) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
}
void note_max(std::atomic<uint64_t>& slot, std::chrono::steady_clock::time_point t0) {
  const uint64_t ns = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
  uint64_t cur = slot.load();
  while (ns > cur && !slot.compare_exchange_weak(cur, ns)) {
  }
}
}  // namespace

void Reader::submit(uint32_t layout, const std::vector<FillRequest>& fills) {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<Chunk*> chunks;
  {
    std::lock_guard<std::mutex> lk(api_mu_);
    if (closed_) throw std::runtime_error("reader is closed");
    if (layout >= layouts_.size()) throw std::out_of_range("layout: no layout " + std::to_string(layout));
    Layout& L = *layouts_[layout];
    const int64_t rows = L.dest->rows();
    for (const FillRequest& r : fills) {
      if (r.expert < 0 || r.expert >= L.n_experts) {
        throw std::out_of_range(L.path + ": expert " + std::to_string(r.expert) + " out of range [0, " +
                                std::to_string(L.n_experts) + ")");
      }
      if (r.row < 0 || r.row >= rows) {
        throw std::out_of_range(L.path + ": row " + std::to_string(r.row) + " out of range [0, " + std::to_string(rows) + ")");
      }
    }
    for (const FillRequest& r : fills) {
      Fill* f = new Fill;
      f->token = r.token;
      f->layout = &L;
      f->expert = r.expert;
      f->row = r.row;
      const uint64_t rec = static_cast<uint64_t>(r.expert) * L.stride;
      std::vector<Chunk*> mine;
      const bool direct = opts_.direct && L.fd_direct >= 0;
      const bool verify = L.checksum != ChecksumKind::None;

      // Can the O_DIRECT read land in the rows themselves (every piece block aligned)?
      bool rows_ok = !direct || (opts_.direct_rows && L.dest->takes_direct_reads());
      if (direct && rows_ok) {
        for (size_t i = 0; i < L.segs.size() && rows_ok; ++i) {
          uint8_t* p = L.dest->host_row(i, r.row);
          rows_ok = p != nullptr && reinterpret_cast<uintptr_t>(p) % kDirectAlign == 0 &&
                    L.segs[i].nbytes % kDirectAlign == 0 && (rec + L.segs[i].offset) % kDirectAlign == 0;
        }
      } else {
        for (size_t i = 0; i < L.segs.size() && rows_ok; ++i) rows_ok = L.dest->host_row(i, r.row) != nullptr;
      }

      if (rows_ok) {
        // Rows mode: one vectored read per chunk whose iovecs are the rows themselves (and the
        // junk sink for small gaps); big gaps start a new group.
        struct Group {
          uint64_t off;
          std::vector<iovec> iov;
          uint64_t len = 0;
        };
        std::vector<Group> groups;
        for (uint32_t i : L.order) {
          const SegmentSpan& s = L.segs[i];
          const uint64_t off = rec + s.offset;
          if (!groups.empty()) {
            Group& g = groups.back();
            const uint64_t gap = off - (g.off + g.len);
            if (gap > 0 && gap <= kJunkBytes) {
              g.iov.push_back({junk_, gap});
              g.len += gap;
            } else if (gap > 0) {
              groups.push_back({off, {}, 0});
            }
          } else {
            groups.push_back({off, {}, 0});
          }
          Group& g = groups.back();
          g.iov.push_back({L.dest->host_row(i, r.row), s.nbytes});
          g.len += s.nbytes;
        }
        for (Group& g : groups) {
          // Split into chunks of at most `limit` bytes and kMaxIov iovecs.
          const uint64_t limit = direct ? opts_.chunk_bytes : opts_.buffered_chunk_bytes;
          Chunk* c = nullptr;
          uint64_t pos = 0;
          for (const iovec& v : g.iov) {
            uint64_t vo = 0;
            while (vo < v.iov_len) {
              if (c == nullptr || c->req == limit || c->iov.size() == kMaxIov) {
                c = new Chunk;
                c->fill = f;
                c->direct = direct;
                c->file_off = g.off + pos;
                mine.push_back(c);
              }
              uint64_t take = std::min<uint64_t>(v.iov_len - vo, limit - c->req);
              c->iov.push_back({static_cast<uint8_t*>(v.iov_base) + vo, take});
              c->req += take;
              c->need = c->req;
              vo += take;
              pos += take;
            }
          }
        }
        if (direct) counters_.fills_direct_rows++;
      } else {
        // Staged mode: block-aligned reads of the record's span into staging slots, then scatter.
        const uint64_t a = round_down(rec + L.span_begin, kDirectAlign);
        const uint64_t need_end = rec + L.span_end;
        const uint64_t b = round_up(need_end, kDirectAlign);
        for (uint64_t s = a; s < b; s += opts_.slot_bytes) {
          Chunk* c = new Chunk;
          c->fill = f;
          c->direct = direct;
          c->staged = true;
          c->file_off = s;
          c->req = std::min<uint64_t>(opts_.slot_bytes, b - s);
          c->need = std::min<uint64_t>(s + c->req, need_end) - s;
          for (uint32_t i : L.order) {
            const uint64_t lo = rec + L.segs[i].offset, hi = lo + L.segs[i].nbytes;
            const uint64_t x = std::max(lo, s), y = std::min(hi, s + c->req);
            if (x < y) c->pieces.push_back({x - s, L.dest->host_row(i, r.row) + (x - lo), y - x});
          }
          if (c->pieces.empty()) {  // a slot-sized hole inside the span: nothing to read there
            delete c;
            continue;
          }
          mine.push_back(c);
        }
        counters_.fills_staged++;
      }
      counters_.chunks_created += mine.size();
      if (verify) {
        f->part_crc.assign(mine.size(), 0);
        f->part_len.assign(mine.size(), 0);
        for (size_t k = 0; k < mine.size(); ++k) mine[k]->seq = static_cast<uint32_t>(k);
      }
      f->chunks_left.store(static_cast<int>(mine.size()));
      counters_.fills_submitted++;
      in_flight_++;
      chunks.insert(chunks.end(), mine.begin(), mine.end());
    }
  }
  dispatch(chunks);
  note_max(counters_.submit_ns_max, t0);
}

void Reader::dispatch(std::vector<Chunk*>& chunks) {
  std::vector<Chunk*> go;
  go.reserve(chunks.size());
  {
    std::lock_guard<std::mutex> lk(slot_mu_);
    for (Chunk* c : chunks) {
      if (!c->staged) {
        go.push_back(c);
      } else if (!free_slots_.empty()) {
        c->slot = free_slots_.back();
        free_slots_.pop_back();
        counters_.staging_acquired++;
        go.push_back(c);
      } else {
        counters_.staging_waits++;
        slot_waiters_.push_back(c);  // backpressure: starts when a slot comes back
      }
    }
  }
  if (!go.empty()) start_reads(go);
}

// ---------------------------------------------------------------------------------------------
// Reader: per-op logic shared by the backends

uint64_t Reader::build_window(Chunk* c, uint64_t cap) {
  // The op asks for the rest of the chunk, or `cap` bytes of it (op_len). The max_read_bytes hook
  // then trims what is actually handed to the kernel, so the op returns fewer bytes than it asked
  // for: exactly what a real short read looks like to after_op().
  uint64_t want = c->req - c->done;
  if (cap > 0 && want > cap) want = cap;
  uint64_t give = want;
  if (faults_on_.load(std::memory_order_relaxed)) {
    std::lock_guard<std::mutex> lk(faults_mu_);
    uint64_t cap = faults_.max_read_bytes;
    if (cap && c->direct) cap = std::max(round_down(cap, kDirectAlign), kDirectAlign);
    if (cap && give > cap) give = cap;
  }
  c->cur.clear();
  if (c->staged) {
    c->cur.push_back({slot_ptr(c->slot) + c->done, give});
  } else {
    uint64_t skip = c->done, left = give;
    for (const iovec& v : c->iov) {
      if (left == 0) break;
      if (skip >= v.iov_len) {
        skip -= v.iov_len;
        continue;
      }
      const uint64_t take = std::min<uint64_t>(v.iov_len - skip, left);
      c->cur.push_back({static_cast<uint8_t*>(v.iov_base) + skip, take});
      left -= take;
      skip = 0;
    }
  }
  c->op_len = want;
  return give;
}

int Reader::injected_fault(const Chunk* c, uint64_t len) {
  if (!faults_on_.load(std::memory_order_relaxed)) return 0;
  std::lock_guard<std::mutex> lk(faults_mu_);
  if (faults_.transient_every && faults_.transient_err) {
    if (++op_seq_ % faults_.transient_every == 0) {
      counters_.faults_injected++;
      return faults_.transient_err;
    }
  }
  if (faults_.err && faults_.path == c->fill->layout->path) {
    const uint64_t off = c->file_off + c->done;
    if (off < faults_.hi && off + len > faults_.lo) {
      counters_.faults_injected++;
      return faults_.err;
    }
  }
  return 0;
}

Reader::Step Reader::after_op(Chunk* c, int64_t res, int* final_result) {
  counters_.ops_completed++;
  if (res < 0) {
    if (res == -EAGAIN || res == -EINTR) {
      counters_.retries++;
      return Step::Continue;
    }
    *final_result = static_cast<int>(res);
    return Step::Done;
  }
  if (res == 0) {  // end of file
    *final_result = c->done >= c->need ? 0 : -ENODATA;
    return Step::Done;
  }
  counters_.bytes_read += static_cast<uint64_t>(res);
  c->done += static_cast<uint64_t>(res);
  if (c->done >= c->need) {
    *final_result = 0;
    return Step::Done;
  }
  if (static_cast<uint64_t>(res) < c->op_len) {
    counters_.short_reads++;
    // A short O_DIRECT read ends at end of file; continuing at an unaligned offset cannot work.
    if (c->direct && c->done % kDirectAlign != 0) {
      *final_result = -ENODATA;
      return Step::Done;
    }
  }
  return Step::Continue;
}

void Reader::chunk_read_finished(Chunk* c, int result) {
  if (result == 0 && (c->staged || !c->fill->part_crc.empty())) {
    scatter_staged(c);
  } else {
    chunk_done(c, result);
  }
}

void Reader::read_chunk_sync(Chunk* c) {
  if (read_mapped(c)) return;
  const Layout& L = *c->fill->layout;
  const int fd = c->direct ? L.fd_direct : L.fd;
  const bool verify = !c->fill->part_crc.empty();
  // A verified buffered chunk lands in windows, each checksummed right after it landed: one pass
  // over 16 MiB after the read would find it in DRAM, not in this CPU's cache.
  const bool windows = verify && !c->direct && !c->staged;
  int final = 0;
  for (;;) {
    const uint64_t len = build_window(c, windows ? kVerifyWindow : 0);
    counters_.ops_submitted++;
    int64_t res;
    if (int e = injected_fault(c, len)) {
      res = -e;
    } else {
      res = ::preadv(fd, c->cur.data(), static_cast<int>(c->cur.size()), static_cast<off_t>(c->file_off + c->done));
      if (res < 0) res = -errno;
    }
    const Step step = after_op(c, res, &final);
    if (windows && res > 0) checksum_landed(c);
    if (step == Step::Done) break;
  }
  // On a worker already: scatter / checksum right here, while the bytes are in this CPU's cache.
  if (final == 0 && (c->staged || verify)) {
    finish_chunk(c);
  } else {
    chunk_done(c, final);
  }
}

namespace {
// Copies a mapped chunk's row pieces (not the padding) from `src` (the mapping at the chunk's
// first byte), folding the checksum when `kind` is set. Returns 0, or 1 when the copy hit SIGBUS
// (nothing after the setjmp may rely on locals changed after it: only the return value is used).
__attribute__((noinline)) int copy_guarded(const std::vector<iovec>& iov, const uint8_t* src, const uint8_t* map_lo,
                                           const uint8_t* map_hi, const uint8_t* junk, uint64_t junk_len,
                                           ChecksumKind kind, uint32_t* crc_out, uint64_t* len_out) {
  MapGuard g;
  g.lo = map_lo;
  g.hi = map_hi;
  if (sigsetjmp(g.jb, 0) != 0) {
    std::atomic_signal_fence(std::memory_order_seq_cst);
    return 1;
  }
  t_map_guard = &g;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  uint32_t crc = 0;
  uint64_t pos = 0, len = 0;
  for (const iovec& v : iov) {
    const auto* b = static_cast<const uint8_t*>(v.iov_base);
    if (!(b >= junk && b < junk + junk_len)) {  // padding between segments: not copied, not checksummed
      // Streaming stores: a pool row is written once here and read later by the model, and a
      // record is larger than this CPU's cache.
      crc = checksum_copy(kind, crc, v.iov_base, src + pos, v.iov_len, true);
      len += v.iov_len;
    }
    pos += v.iov_len;
  }
  std::atomic_signal_fence(std::memory_order_seq_cst);
  t_map_guard = nullptr;
  *crc_out = crc;
  *len_out = len;
  return 0;
}

#if defined(__x86_64__)
__attribute__((target("avx"))) void clear_upper_state() {
  // A jump out of the vector copy skipped its vzeroupper (see checksum.cpp).
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx")) __asm__ volatile("vzeroupper");
}
#else
void clear_upper_state() {}
#endif
}  // namespace

bool Reader::read_mapped(Chunk* c) {
  const Layout& L = *c->fill->layout;
  // Test hooks fail or shorten read ops: those chunks keep preadv, where the hooks apply.
  if (L.map == nullptr || c->direct || c->staged || c->done != 0 || faults_on_.load(std::memory_order_relaxed)) {
    return false;
  }
  if (c->file_off + c->req > L.map_len) return false;  // past the mapped end: preadv reports the EOF
  if (!map_unchecked_.load(std::memory_order_relaxed) && !mapped_resident(L, c->file_off, c->req)) {
    // Not all in the page cache: preadv, whose readahead reads the rest in large requests.
    counters_.map_fallbacks++;
    return false;
  }
  Fill* f = c->fill;
  const bool verify = !f->part_crc.empty();
  const auto t0 = std::chrono::steady_clock::now();
  uint32_t crc = 0;
  uint64_t len = 0;
  const int hit = copy_guarded(c->iov, L.map + c->file_off, L.map, L.map + L.map_len, junk_, kJunkBytes,
                               verify ? L.checksum : ChecksumKind::None, &crc, &len);
  if (hit != 0) {
    clear_upper_state();
    counters_.map_errors++;
    // SIGBUS: the file no longer reaches the chunk's end (truncated under the mapping), or the
    // page could not be read.
    struct stat st {};
    const bool short_file = ::fstat(L.fd, &st) == 0 && static_cast<uint64_t>(st.st_size) < c->file_off + c->need;
    chunk_done(c, short_file ? -ENODATA : -EIO);
    return true;
  }
  counters_.mapped_chunks++;
  counters_.mapped_bytes += c->req;
  counters_.bytes_read += c->req;
  c->done = c->req;
  if (verify) {
    c->crc = crc;
    c->crc_len = len;
    c->crc_pos = c->req;
    counters_.checksum_bytes += len;
    counters_.checksum_ns += elapsed_ns(t0);
    checksum_rows(c);  // stores the part
  }
  chunk_done(c, 0);
  return true;
}

void Reader::finish_chunk(Chunk* c) {
  if (c->staged) {
    do_scatter(c);
  } else {
    checksum_rows(c);
  }
  chunk_done(c, 0);
}

namespace {
// Checksum and copy in blocks this small: the block just checksummed is still in the cache when
// it is copied.
constexpr uint64_t kFuseBlock = 64ull << 10;
}  // namespace

void Reader::do_scatter(Chunk* c) {
  const uint8_t* src = slot_ptr(c->slot);
  Fill* f = c->fill;
  const bool verify = !f->part_crc.empty();
  const ChecksumKind kind = f->layout->checksum;
  const auto t0 = std::chrono::steady_clock::now();
  uint32_t crc = 0;
  uint64_t n = 0;
  for (const ScatterPiece& p : c->pieces) {
    if (!verify) {
      std::memcpy(p.dst, src + p.slot_off, p.n);
    } else {
      for (uint64_t o = 0; o < p.n; o += kFuseBlock) {
        const uint64_t b = std::min(kFuseBlock, p.n - o);
        crc = checksum_update(kind, crc, src + p.slot_off + o, b);
        std::memcpy(p.dst + o, src + p.slot_off + o, b);
      }
    }
    n += p.n;
  }
  counters_.bytes_scattered += n;
  if (verify) {
    f->part_crc[c->seq] = crc;
    f->part_len[c->seq] = n;
    counters_.checksum_bytes += n;
    counters_.checksum_ns += elapsed_ns(t0);
  }
}

void Reader::checksum_landed(Chunk* c) {
  const uint64_t end = std::min(c->done, c->req);
  if (c->crc_pos >= end) return;
  const auto t0 = std::chrono::steady_clock::now();
  const ChecksumKind kind = c->fill->layout->checksum;
  uint64_t at = 0, n = 0;  // at: chunk offset of v's first byte
  for (const iovec& v : c->iov) {
    const uint64_t lo = std::max(at, c->crc_pos), hi = std::min(at + v.iov_len, end);
    const auto* b = static_cast<const uint8_t*>(v.iov_base);
    if (lo < hi && !(b >= junk_ && b < junk_ + kJunkBytes)) {  // padding between segments: not checksummed
      c->crc = checksum_update(kind, c->crc, b + (lo - at), hi - lo);
      n += hi - lo;
    }
    at += v.iov_len;
    if (at >= end) break;
  }
  c->crc_pos = end;
  c->crc_len += n;
  counters_.checksum_bytes += n;
  counters_.checksum_ns += elapsed_ns(t0);
}

void Reader::checksum_rows(Chunk* c) {
  Fill* f = c->fill;
  if (f->part_crc.empty()) return;
  checksum_landed(c);
  f->part_crc[c->seq] = c->crc;
  f->part_len[c->seq] = c->crc_len;
}

void Reader::chunk_done(Chunk* c, int result) {
  const int slot = c->slot;
  Fill* f = c->fill;
  delete c;
  counters_.chunks_destroyed++;
  if (slot >= 0) {
    Chunk* next = nullptr;
    {
      std::lock_guard<std::mutex> lk(slot_mu_);
      if (!slot_waiters_.empty()) {
        next = slot_waiters_.front();
        slot_waiters_.pop_front();
        next->slot = slot;
      } else {
        free_slots_.push_back(slot);
      }
    }
    counters_.staging_released++;
    if (next) {
      counters_.staging_acquired++;
      std::vector<Chunk*> v{next};
      start_reads(v);
    }
  }
  if (result < 0) {
    int expected = 0;
    f->result.compare_exchange_strong(expected, result);
  }
  if (f->chunks_left.fetch_sub(1) == 1) fill_done(f);
}

void Reader::fill_done(Fill* f) {
  int r = f->result.load();
  const Layout& L = *f->layout;
  if (r == 0 && !f->part_crc.empty()) {
    uint32_t got = 0;
    for (size_t i = 0; i < f->part_crc.size(); ++i) got = checksum_combine(L.checksum, got, f->part_crc[i], f->part_len[i]);
    const uint32_t want = L.checksums[static_cast<size_t>(f->expert)];
    counters_.checksums_verified++;
    if (got != want) {
      counters_.checksum_mismatches++;
      r = -EBADMSG;
      std::lock_guard<std::mutex> lk(done_mu_);
      mismatches_[f->token] = Mismatch{want, got};
    }
  }
  if (r < 0) counters_.fills_failed++;
  post_completion(f->token, r);
  delete f;
  counters_.fills_completed++;
  in_flight_--;
}

void Reader::set_checksums(uint32_t layout, ChecksumKind kind, std::vector<uint32_t> values) {
  std::lock_guard<std::mutex> lk(api_mu_);
  if (layout >= layouts_.size()) throw std::out_of_range("layout: no layout " + std::to_string(layout));
  Layout& L = *layouts_[layout];
  if (kind != ChecksumKind::None && values.size() != static_cast<size_t>(L.n_experts)) {
    throw std::invalid_argument(L.path + ": checksums: expected one per expert (" + std::to_string(L.n_experts) +
                                "), got " + std::to_string(values.size()));
  }
  for (size_t k = 0; k < L.order.size(); ++k) {
    // Parts are combined in file order, and the checksum runs in segment table order.
    if (L.order[k] != k) {
      throw std::invalid_argument(L.path + ": checksums need the segments in offset order (the store format's order)");
    }
  }
  // Fills already in flight may see either setting; the scheduler sets this before any fill.
  L.checksums = kind == ChecksumKind::None ? std::vector<uint32_t>{} : std::move(values);
  L.checksum = kind;
}

bool Reader::take_mismatch(uint64_t token, Mismatch* out) {
  std::lock_guard<std::mutex> lk(done_mu_);
  auto it = mismatches_.find(token);
  if (it == mismatches_.end()) return false;
  *out = it->second;
  mismatches_.erase(it);
  return true;
}

void Reader::post_completion(uint64_t token, int result) {
  {
    std::lock_guard<std::mutex> lk(done_mu_);
    done_.push_back({token, result});
  }
  notify();
}

void Reader::notify() {
  counters_.wakeups_written++;
#if defined(__linux__)
  const uint64_t one = 1;
  while (::write(notify_write_fd_, &one, sizeof one) < 0 && errno == EINTR) {
  }
#else
  const char b = 1;
  while (::write(notify_write_fd_, &b, 1) < 0 && errno == EINTR) {
  }
#endif
}

// ---------------------------------------------------------------------------------------------
// Reader: reaping, waiting, closing

std::vector<Completion> Reader::reap() {
  const auto t0 = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lk(api_mu_);
  // Reset the wakeup first: anything completing after this re-arms it.
  uint64_t buf[8];
  while (notify_read_fd_ >= 0 && ::read(notify_read_fd_, buf, sizeof buf) > 0) {
  }
  if (!closed_) reap_backend();
  std::vector<Completion> out;
  {
    std::lock_guard<std::mutex> dl(done_mu_);
    out.swap(done_);
  }
  note_max(counters_.reap_ns_max, t0);
  return out;
}

bool Reader::wait(int timeout_ms) {
  if (notify_read_fd_ < 0) return false;  // closed
  pollfd p{notify_read_fd_, POLLIN, 0};
  int r;
  do {
    r = ::poll(&p, 1, timeout_ms);
  } while (r < 0 && errno == EINTR);
  return r > 0;
}

void Reader::close() {
  // Destinations are let go after the lock (declared before it, destroyed after it): the last
  // reference to one may run foreign code (a pool's buffer, a pinned mirror's unpin), which must
  // not run while callers of this reader wait on api_mu_.
  std::vector<std::shared_ptr<Destination>> released;
  std::lock_guard<std::mutex> lk(api_mu_);
  if (closed_) return;
  // Reads in flight write into pool rows and staging: they must finish before anything goes.
  while (in_flight_.load() > 0) {
    reap_backend();
    if (in_flight_.load() == 0) break;
    pollfd p{notify_read_fd_, POLLIN, 0};
    ::poll(&p, 1, 20);
    uint64_t buf[8];
    while (::read(notify_read_fd_, buf, sizeof buf) > 0) {
    }
  }
  shutdown_backend();
  for (auto& L : layouts_) {
    if (L->map != nullptr) {
      ::munmap(const_cast<uint8_t*>(L->map), L->map_len);
      L->map = nullptr;
      counters_.maps_released++;
    }
    if (L->fd >= 0) ::close(L->fd);
    if (L->fd_direct >= 0) ::close(L->fd_direct);
    L->fd = L->fd_direct = -1;
    released.push_back(std::move(L->dest));  // drops the pool references (once unlocked)
  }
  if (slab_) {
    std::free(slab_);
    slab_ = nullptr;
    counters_.slab_frees++;
  }
  std::free(junk_);
  junk_ = nullptr;
  // The ring (which had the eventfd registered) is gone and nothing is in flight: nobody writes
  // the wakeup descriptor any more. Closing it here, not in the destructor, keeps a closed reader
  // from holding a descriptor until garbage collection.
  {
    std::lock_guard<std::mutex> dl(done_mu_);
    if (notify_write_fd_ >= 0 && notify_write_fd_ != notify_read_fd_) ::close(notify_write_fd_);
    if (notify_read_fd_ >= 0) ::close(notify_read_fd_);
    notify_read_fd_ = notify_write_fd_ = -1;
  }
  closed_ = true;
}

void Reader::set_faults(const Faults& f) {
  if (f.transient_every == 1) {
    throw std::invalid_argument("transient_every: 1 would fail every retry too; expected 0 or >= 2");
  }
  if (f.transient_every && f.transient_err != EAGAIN && f.transient_err != EINTR) {
    throw std::invalid_argument("transient_err: expected EAGAIN or EINTR, got " + std::to_string(f.transient_err));
  }
  std::lock_guard<std::mutex> lk(faults_mu_);
  faults_ = f;
  faults_on_.store(f.err != 0 || f.max_read_bytes != 0 || f.transient_every != 0);
  map_unchecked_.store(f.map_unchecked);
}

std::map<std::string, uint64_t> Reader::counters() const {
  auto m = counters_.snapshot();
  m["in_flight"] = in_flight_.load();
  m["staging_slots"] = static_cast<uint64_t>(n_slots_);
  return m;
}

// ---------------------------------------------------------------------------------------------
// Thread-pool backend: N workers each preadv a chunk to completion (short reads continue,
// EINTR/EAGAIN retry), scatter staged chunks themselves, and complete onto the shared list.

namespace {

class ThreadReader final : public Reader {
 public:
  explicit ThreadReader(const ReaderOptions& opts) : Reader(opts) {
    workers_ = std::make_unique<ChunkWorkers>(opts_.workers, [this](Chunk* c) { work(c); }, opts_.worker_nice);
  }
  ~ThreadReader() override { close(); }

 protected:
  void start_reads(std::vector<Chunk*>& chunks) override { workers_->push_many(chunks); }
  void scatter_staged(Chunk* c) override { finish_chunk(c); }  // already on a worker
  void shutdown_backend() override { workers_->stop(); }

 private:
  void work(Chunk* c) { read_chunk_sync(c); }

  std::unique_ptr<ChunkWorkers> workers_;
};

}  // namespace

#if defined(__linux__)
std::unique_ptr<Reader> make_uring_reader(const ReaderOptions& opts);  // io_uring_reader.cpp
#endif

std::unique_ptr<Reader> Reader::create(const ReaderOptions& opts) {
  if (opts.backend == Backend::Threads) return std::make_unique<ThreadReader>(opts);
#if defined(__linux__)
  return make_uring_reader(opts);
#else
  throw std::runtime_error("io_uring: only available on Linux");
#endif
}

const char* Reader::backend_name() const { return opts_.backend == Backend::IoUring ? "io_uring" : "threads"; }

// ---------------------------------------------------------------------------------------------
// Benchmark baselines

uint64_t side_region_read(const std::string& path, uint64_t stride, const std::vector<SegmentSpan>& segments,
                          Destination& dest, const std::vector<int64_t>& experts, const std::vector<int64_t>& rows) {
  if (experts.size() != rows.size()) throw std::invalid_argument("experts and rows: expected equal lengths");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error(path + ": cannot open: " + errno_text(errno));
  std::vector<uint8_t> tmp(stride);
  uint64_t total = 0;
  for (size_t k = 0; k < experts.size(); ++k) {
    uint64_t got = 0;
    const uint64_t off = static_cast<uint64_t>(experts[k]) * stride;
    while (got < stride) {
      ssize_t n = ::pread(fd, tmp.data() + got, stride - got, static_cast<off_t>(off + got));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        int e = n < 0 ? errno : ENODATA;
        ::close(fd);
        throw std::runtime_error(path + ": read of expert " + std::to_string(experts[k]) + " failed: " + errno_text(e));
      }
      got += static_cast<uint64_t>(n);
    }
    for (size_t i = 0; i < segments.size(); ++i) {
      std::memcpy(dest.host_row(i, rows[k]), tmp.data() + segments[i].offset, segments[i].nbytes);
    }
    total += stride;
  }
  ::close(fd);
  return total;
}

double pread_seconds(const std::string& path, uint64_t stride, const std::vector<int64_t>& experts, int threads) {
  if (threads < 1) throw std::invalid_argument("pread_seconds: threads: expected >= 1");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error(path + ": cannot open: " + errno_text(errno));
  // Each thread cycles through its share of at least 128 MiB of destination (more than the
  // last-level cache), like rows of a pool.
  const uint64_t per_thread = std::max<uint64_t>(2, ((128ull << 20) / stride + threads) / threads);
  std::vector<uint8_t*> bufs;
  for (int t = 0; t < threads; ++t) {
    auto* b = static_cast<uint8_t*>(aligned_alloc_or_throw(stride * per_thread, "pread buffer"));
    std::memset(b, 0, stride * per_thread);
    bufs.push_back(b);
  }
  std::atomic<int> failed{0};
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      int k = 0;
      for (size_t i = t; i < experts.size(); i += threads, ++k) {
        uint8_t* dst = bufs[t] + (k % per_thread) * stride;
        uint64_t got = 0;
        while (got < stride) {
          ssize_t n = ::pread(fd, dst + got, stride - got, static_cast<off_t>(experts[i] * stride + got));
          if (n < 0 && errno == EINTR) continue;
          if (n <= 0) {
            failed = 1;
            return;
          }
          got += static_cast<uint64_t>(n);
        }
      }
    });
  }
  for (auto& th : ts) th.join();
  auto t1 = std::chrono::steady_clock::now();
  for (auto* b : bufs) std::free(b);
  ::close(fd);
  if (failed) throw std::runtime_error(path + ": pread_seconds: a read failed or hit end of file");
  return std::chrono::duration<double>(t1 - t0).count();
}

double memcpy_seconds(uint64_t total_bytes, uint64_t block_bytes, uint64_t working_bytes, int threads) {
  if (block_bytes == 0 || working_bytes < block_bytes || threads < 1) {
    throw std::invalid_argument("memcpy_seconds: expected block_bytes > 0, working_bytes >= block_bytes, threads >= 1");
  }
  const uint64_t nblocks = working_bytes / block_bytes;
  uint8_t* src = static_cast<uint8_t*>(aligned_alloc_or_throw(nblocks * block_bytes, "memcpy source"));
  uint8_t* dst = static_cast<uint8_t*>(aligned_alloc_or_throw(nblocks * block_bytes, "memcpy destination"));
  std::memset(src, 1, nblocks * block_bytes);
  std::memset(dst, 0, nblocks * block_bytes);
  const uint64_t copies = std::max<uint64_t>(1, total_bytes / block_bytes);
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([=] {
      for (uint64_t i = t; i < copies; i += threads) {
        const uint64_t b = (i * 7919) % nblocks;  // scattered blocks, like rows of a pool
        std::memcpy(dst + b * block_bytes, src + ((i + 1) % nblocks) * block_bytes, block_bytes);
      }
    });
  }
  for (auto& th : ts) th.join();
  auto t1 = std::chrono::steady_clock::now();
  std::free(src);
  std::free(dst);
  return std::chrono::duration<double>(t1 - t0).count();
}

}  // namespace asyncside::io
