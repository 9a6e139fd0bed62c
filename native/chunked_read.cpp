// Chunked O_DIRECT reads for the fault tables (see chunked_read.h).
#include "chunked_read.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>

#include <unistd.h>

#include "expert_faults.h"

#if defined(__linux__)
#include "io_uring_abi.h"
#endif

namespace asyncside::faults {

int preadv_full(int fd, std::vector<iovec> iov, uint64_t offset) {
  size_t first = 0;
  while (first < iov.size()) {
    const int cnt = static_cast<int>(std::min<size_t>(iov.size() - first, IOV_MAX));
    ssize_t n = ::preadv(fd, iov.data() + first, cnt, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return errno;
    }
    if (n == 0) return ENODATA;
    offset += static_cast<uint64_t>(n);
    // Advance past what landed (a short read resumes mid-vector).
    uint64_t left = static_cast<uint64_t>(n);
    while (first < iov.size() && left >= iov[first].iov_len) {
      left -= iov[first].iov_len;
      ++first;
    }
    if (left) {
      iov[first].iov_base = static_cast<uint8_t*>(iov[first].iov_base) + left;
      iov[first].iov_len -= left;
    }
  }
  return 0;
}

namespace {

constexpr uint64_t kDefaultChunk = 1ull << 20;
constexpr uint64_t kMaxChunk = 1ull << 30;
constexpr const char* kEnv = "ASYNCSIDE_FAULT_READ_CHUNK";

// The count in environment variable `name`: `fallback` where it is unset, or where it is not a
// count that `accepts` when not `strict`; a bad value when `strict` throws, saying what was
// `expected`.
unsigned long long count_from_env(const char* name, unsigned long long fallback, bool (*accepts)(unsigned long long),
                                  const std::string& expected, bool strict) {
  const char* env = std::getenv(name);
  if (env == nullptr) return fallback;
  char* end = nullptr;
  errno = 0;
  const unsigned long long n = std::strtoull(env, &end, 10);
  const bool number = end != env && *end == '\0' && errno == 0 && env[0] != '-';
  if (number && accepts(n)) return n;
  if (!strict) return fallback;
  throw std::invalid_argument(std::string(name) + ": expected " + expected + ", got '" + env + "'");
}

bool chunk_ok(unsigned long long n) { return n == 0 || (n % kChunkAlign == 0 && n <= kMaxChunk); }

std::string chunk_expected() {
  return "0 (whole records) or a multiple of " + std::to_string(kChunkAlign) + " bytes up to " +
         std::to_string(kMaxChunk);
}

// ASYNCSIDE_FAULT_READ_CHUNK's value; throws on a bad one when `strict`, else falls back to the default.
uint64_t chunk_from_env(bool strict) { return count_from_env(kEnv, kDefaultChunk, chunk_ok, chunk_expected(), strict); }

void check_chunk(uint64_t bytes, const std::string& what) {
  if (!chunk_ok(bytes)) throw std::invalid_argument(what + ": expected " + chunk_expected() + ", got " + std::to_string(bytes));
}

std::atomic<uint64_t>& chunk_setting() {
  static std::atomic<uint64_t> chunk{chunk_from_env(false)};
  return chunk;
}

constexpr unsigned kDefaultWindow = 4;
constexpr unsigned kMaxWindow = kMaxFaultReadWindow;  // the ring's size (kRingEntries)
constexpr const char* kWindowEnv = "ASYNCSIDE_FAULT_READ_WINDOW";

bool window_ok(unsigned long long n) { return n <= kMaxWindow; }

std::string window_expected() {
  return "0 (a background job per record) or 1 to " + std::to_string(kMaxWindow) + " pieces in flight";
}

void check_window(unsigned long long pieces, const std::string& what) {
  if (!window_ok(pieces)) throw std::invalid_argument(what + ": expected " + window_expected() + ", got " + std::to_string(pieces));
}

// ASYNCSIDE_FAULT_READ_WINDOW's value; throws on a bad one when `strict`, else the default.
unsigned window_from_env(bool strict) {
  return static_cast<unsigned>(count_from_env(kWindowEnv, kDefaultWindow, window_ok, window_expected(), strict));
}

std::atomic<unsigned>& window_setting() {
  static std::atomic<unsigned> window{window_from_env(false)};
  return window;
}

std::atomic<bool>& window_chosen() {
  static std::atomic<bool> chosen{std::getenv(kWindowEnv) != nullptr};
  return chosen;
}

std::atomic<bool> g_uring_on{true};

#if defined(__linux__)
using namespace asyncside::uring;

// Ops one thread keeps in flight at most (the ring's size): a record at the smallest chunk is
// many more ops than the disk has queue for.
constexpr unsigned kRingEntries = kMaxFaultReadWindow;

// One file range of the read, as one request at a time (a short read resumes).
using Piece = ReadPiece;

// The calling thread's ring: set up on its first chunked read, closed when the thread ends.
class ThreadRing : private RingMap {
 public:
  ThreadRing() {
    Params p;
    std::memset(&p, 0, sizeof p);
    p.flags = kSetupCqSize;
    p.cq_entries = kRingEntries * 2;
    fd_ = static_cast<int>(syscall(kSysSetup, kRingEntries, &p));
    if (fd_ < 0) return;
    if (!(p.features & kFeatSingleMmap) || map_ring(fd_, p) != 0) {
      teardown();
      return;
    }
    sq_entries_ = p.sq_entries;
    ok_ = true;
  }
  ~ThreadRing() { teardown(); }
  ThreadRing(const ThreadRing&) = delete;
  ThreadRing& operator=(const ThreadRing&) = delete;

  bool ok() const { return ok_; }

  // Every piece read, at most sq_entries_ in flight; 0 or the first error. Returns only once the
  // kernel holds none of them (a failed piece does not leave the others writing into the rows).
  int read(int fd, std::vector<Piece>& pieces) {
    return run(fd, pieces.size(), sq_entries_, [&](size_t i) -> Piece& { return pieces[i]; }, nullptr);
  }

  // read_ordered (chunked_read.h): pieces submitted in index order, at most `window` in flight.
  // `count`: the requests go to fault_counters()["chunk_ops"] (a probe's do not).
  int run(int fd, size_t n, unsigned window, const std::function<Piece&(size_t)>& prepare,
          const std::function<void(size_t, int)>& landed, bool count = true) {
    window = std::max(1u, std::min(window, sq_entries_));
    std::vector<Piece*> at(n, nullptr);
    std::vector<size_t> retry;  // pieces to submit again (interrupted, or short), before new ones
    size_t next = 0;            // the next piece never submitted
    size_t inflight = 0;
    unsigned unsubmitted = 0;
    int err = 0;
    int fatal = 0;  // io_uring_enter failures other than a retry
    auto end = [&](size_t i, int e) {
      if (e != 0 && err == 0) err = e;
      if (landed) landed(i, e);
    };
    while (inflight > 0 || (err == 0 && (!retry.empty() || next < n))) {
      while (err == 0 && (!retry.empty() || next < n) && inflight < window) {
        size_t i;
        if (!retry.empty()) {
          i = retry.back();
          retry.pop_back();
        } else {
          i = next++;
          at[i] = &prepare(i);
        }
        Piece& pc = *at[i];
        const uint32_t tail = *sq_tail_;
        Sqe* sqe = &sqes_[tail & sq_mask_];
        std::memset(sqe, 0, sizeof *sqe);
        sqe->opcode = kOpReadv;
        sqe->fd = fd;
        sqe->off = pc.off;
        sqe->addr = reinterpret_cast<uint64_t>(pc.iov.data());
        sqe->len = static_cast<uint32_t>(pc.iov.size());
        sqe->user_data = i;
        __atomic_store_n(sq_tail_, tail + 1, __ATOMIC_RELEASE);
        ++inflight;
        ++unsubmitted;
        if (count) global_counters().chunk_ops.fetch_add(1, std::memory_order_relaxed);
      }
      const int got = static_cast<int>(syscall(kSysEnter, fd_, unsubmitted, 1u, kEnterGetEvents, nullptr, 0));
      if (got < 0) {
        const int e = errno;
        if (e != EINTR && e != EAGAIN && e != EBUSY) {
          // The kernel took none of the unsubmitted SQEs: take them back, then wait only for
          // what it holds (it writes into the rows until each op completes).
          if (err == 0) err = e;
          *sq_tail_ -= unsubmitted;
          inflight -= unsubmitted;
          unsubmitted = 0;
          if (inflight == 0 || ++fatal > 3) return err;
        }
      } else {
        unsubmitted -= std::min<unsigned>(unsubmitted, static_cast<unsigned>(got));
      }
      uint32_t head = *cq_head_;
      const uint32_t tail = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
      for (; head != tail; ++head) {
        const Cqe& c = cqes_[head & cq_mask_];
        --inflight;
        const auto i = static_cast<size_t>(c.user_data);
        Piece& pc = *at[i];
        if (c.res < 0) {
          if (c.res == -EINTR || c.res == -EAGAIN) {
            retry.push_back(i);
          } else {
            end(i, -c.res);
          }
          continue;
        }
        if (c.res == 0) {
          end(i, ENODATA);
          continue;
        }
        auto done = static_cast<uint64_t>(c.res);
        if (done >= pc.left) {
          pc.left = 0;
          end(i, 0);
          continue;
        }
        // Short: O_DIRECT stops short only at the end of the file; resume where it stopped while
        // that is block aligned (an unaligned end is the file's: the record is cut).
        pc.left -= done;
        pc.off += done;
        if (pc.off % kChunkAlign != 0) {
          end(i, ENODATA);
          continue;
        }
        size_t k = 0;
        while (done >= pc.iov[k].iov_len) done -= pc.iov[k++].iov_len;
        pc.iov.erase(pc.iov.begin(), pc.iov.begin() + static_cast<std::ptrdiff_t>(k));
        pc.iov[0].iov_base = static_cast<uint8_t*>(pc.iov[0].iov_base) + done;
        pc.iov[0].iov_len -= done;
        retry.push_back(i);
      }
      __atomic_store_n(cq_head_, head, __ATOMIC_RELEASE);
    }
    return err;
  }

 private:
  void teardown() {
    ok_ = false;
    unmap_ring();
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  bool ok_ = false;
  int fd_ = -1;
  unsigned sq_entries_ = 0;
};

ThreadRing* thread_ring() {
  thread_local ThreadRing ring;
  return ring.ok() ? &ring : nullptr;
}
#endif

}  // namespace

uint64_t fault_read_chunk() { return chunk_setting().load(std::memory_order_relaxed); }

void set_fault_read_chunk(uint64_t bytes) {
  check_chunk(bytes, "chunk");
  chunk_setting().store(bytes, std::memory_order_relaxed);
}

void check_fault_read_chunk_env() { (void)chunk_from_env(true); }


void set_fault_read_uring(bool on) { g_uring_on.store(on, std::memory_order_relaxed); }

bool ordered_reads_possible() {
  static const bool kernel = io::io_uring_available(nullptr);
  return kernel && g_uring_on.load(std::memory_order_relaxed);
}

bool ordered_reads_ready() {
#if defined(__linux__)
  return g_uring_on.load(std::memory_order_relaxed) && thread_ring() != nullptr;
#else
  return false;
#endif
}

int read_ordered(int fd, size_t n, unsigned window, const std::function<ReadPiece&(size_t)>& prepare,
                 const std::function<void(size_t, int)>& landed) {
#if defined(__linux__)
  if (ThreadRing* ring = thread_ring()) {
    global_counters().ordered_reads.fetch_add(1, std::memory_order_relaxed);
    return ring->run(fd, n, window, prepare, landed);
  }
#endif
  return ENOSYS;  // callers ask ordered_reads_ready() first
}

int time_ordered_reads(int fd, const std::vector<std::pair<uint64_t, uint64_t>>& records, uint64_t piece,
                       unsigned window, int64_t& ns) {
  ns = 0;
  if (piece == 0 || piece % kChunkAlign != 0 || window == 0) return EINVAL;
  if (!ordered_reads_ready()) return ENOSYS;
  std::vector<ReadPiece> pieces;
  for (const auto& [off, bytes] : records) {
    if (off % kChunkAlign != 0) return EINVAL;
    const uint64_t end = off + (bytes + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
    for (uint64_t a = off; a < end; a += piece) pieces.push_back(ReadPiece{{}, a, std::min(piece, end - a)});
  }
  void* raw = nullptr;
  if (::posix_memalign(&raw, kChunkAlign, piece * window) != 0) return ENOMEM;
  std::unique_ptr<uint8_t, decltype(&std::free)> buffers(static_cast<uint8_t*>(raw), &std::free);
  std::vector<unsigned> free_slots;
  for (unsigned b = window; b-- > 0;) free_slots.push_back(b);
  std::vector<unsigned> slot_of(pieces.size(), 0);
  auto prepare = [&](size_t i) -> ReadPiece& {
    slot_of[i] = free_slots.back();
    free_slots.pop_back();
    pieces[i].iov.push_back({buffers.get() + static_cast<uint64_t>(slot_of[i]) * piece, pieces[i].left});
    return pieces[i];
  };
  auto landed = [&](size_t i, int) { free_slots.push_back(slot_of[i]); };
#if defined(__linux__)
  // The ring itself, not read_ordered: a probe is not a streamed resolve's read (its counters).
  const auto t0 = std::chrono::steady_clock::now();
  const int err = thread_ring()->run(fd, pieces.size(), window, prepare, landed, false);
  ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  return err;
#else
  return ENOSYS;
#endif
}

unsigned fault_read_window() { return window_setting().load(std::memory_order_relaxed); }

void set_fault_read_window(unsigned pieces) {
  check_window(pieces, "window");
  window_setting().store(pieces, std::memory_order_relaxed);
  window_chosen().store(true, std::memory_order_relaxed);
}

bool fault_read_window_chosen() { return window_chosen().load(std::memory_order_relaxed); }

void reset_fault_read_window() {
  window_setting().store(window_from_env(false), std::memory_order_relaxed);
  window_chosen().store(std::getenv(kWindowEnv) != nullptr, std::memory_order_relaxed);
}

void check_fault_read_window_env() { (void)window_from_env(true); }

int read_direct_chunked(int fd, const std::vector<iovec>& iov, uint64_t offset) {
  const uint64_t chunk = fault_read_chunk();
  uint64_t total = 0;
  for (const iovec& v : iov) total += v.iov_len;
  if (chunk == 0 || total <= chunk) return preadv_full(fd, iov, offset);
#if defined(__linux__)
  ThreadRing* ring = g_uring_on.load(std::memory_order_relaxed) ? thread_ring() : nullptr;
  if (ring != nullptr) {
    // Split the vector at every multiple of `chunk` from `offset` (block aligned: so is chunk).
    std::vector<Piece> pieces;
    pieces.reserve(static_cast<size_t>((total + chunk - 1) / chunk));
    uint64_t pos = offset;
    for (const iovec& v : iov) {
      auto* base = static_cast<uint8_t*>(v.iov_base);
      uint64_t used = 0;
      while (used < v.iov_len) {
        if (pieces.empty() || pieces.back().left == chunk) pieces.push_back(Piece{{}, pos, 0});
        Piece& pc = pieces.back();
        const uint64_t n = std::min<uint64_t>(v.iov_len - used, chunk - pc.left);
        pc.iov.push_back({base + used, n});
        pc.left += n;
        used += n;
        pos += n;
      }
    }
    global_counters().chunked_reads.fetch_add(1, std::memory_order_relaxed);
    return ring->read(fd, pieces);
  }
#endif
  global_counters().chunk_fallbacks.fetch_add(1, std::memory_order_relaxed);
  return preadv_full(fd, iov, offset);
}

}  // namespace asyncside::faults
