// Chunked O_DIRECT reads for the fault tables (see chunked_read.h).
#include "chunked_read.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
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

void check_chunk(uint64_t bytes, const std::string& what) {
  if (bytes != 0 && (bytes % kChunkAlign != 0 || bytes > kMaxChunk)) {
    throw std::invalid_argument(what + ": expected 0 (whole records) or a multiple of " + std::to_string(kChunkAlign) +
                                " bytes up to " + std::to_string(kMaxChunk) + ", got " + std::to_string(bytes));
  }
}

// ASYNCSIDE_FAULT_READ_CHUNK's value; throws on a bad one when `strict`, else falls back to the default.
uint64_t chunk_from_env(bool strict) {
  const char* env = std::getenv(kEnv);
  if (env == nullptr) return kDefaultChunk;
  char* end = nullptr;
  errno = 0;
  const unsigned long long n = std::strtoull(env, &end, 10);
  const bool number = end != env && *end == '\0' && errno == 0 && env[0] != '-';
  if (!number || (n != 0 && (n % kChunkAlign != 0 || n > kMaxChunk))) {
    if (!strict) return kDefaultChunk;
    throw std::invalid_argument(std::string(kEnv) + ": expected 0 (whole records) or a multiple of " +
                                std::to_string(kChunkAlign) + " bytes up to " + std::to_string(kMaxChunk) +
                                ", got '" + env + "'");
  }
  return n;
}

std::atomic<uint64_t>& chunk_setting() {
  static std::atomic<uint64_t> chunk{chunk_from_env(false)};
  return chunk;
}

std::atomic<bool> g_uring_on{true};

#if defined(__linux__)
using namespace asyncside::uring;

// Ops one thread keeps in flight at most (the ring's size): a record at the smallest chunk is
// many more ops than the disk has queue for.
constexpr unsigned kRingEntries = 32;

// One file range of the read, as one request at a time (a short read resumes).
struct Piece {
  std::vector<iovec> iov;
  uint64_t off = 0;
  uint64_t left = 0;
};

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
    std::vector<size_t> ready;  // pieces to (re)submit
    ready.reserve(pieces.size());
    for (size_t i = pieces.size(); i-- > 0;) ready.push_back(i);  // popped from the back: file order
    size_t inflight = 0;
    unsigned unsubmitted = 0;
    int err = 0;
    int fatal = 0;  // io_uring_enter failures other than a retry
    while (inflight > 0 || (err == 0 && !ready.empty())) {
      while (err == 0 && !ready.empty() && inflight < sq_entries_) {
        const size_t i = ready.back();
        ready.pop_back();
        Piece& pc = pieces[i];
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
        global_counters().chunk_ops.fetch_add(1, std::memory_order_relaxed);
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
        Piece& pc = pieces[static_cast<size_t>(c.user_data)];
        if (c.res < 0) {
          if (c.res == -EINTR || c.res == -EAGAIN) {
            ready.push_back(static_cast<size_t>(c.user_data));
          } else if (err == 0) {
            err = -c.res;
          }
          continue;
        }
        if (c.res == 0) {
          if (err == 0) err = ENODATA;
          continue;
        }
        auto n = static_cast<uint64_t>(c.res);
        if (n >= pc.left) {
          pc.left = 0;
          continue;
        }
        // Short: O_DIRECT stops short only at the end of the file; resume where it stopped while
        // that is block aligned (an unaligned end is the file's: the record is cut).
        pc.left -= n;
        pc.off += n;
        if (pc.off % kChunkAlign != 0) {
          if (err == 0) err = ENODATA;
          continue;
        }
        size_t k = 0;
        while (n >= pc.iov[k].iov_len) n -= pc.iov[k++].iov_len;
        pc.iov.erase(pc.iov.begin(), pc.iov.begin() + static_cast<std::ptrdiff_t>(k));
        pc.iov[0].iov_base = static_cast<uint8_t*>(pc.iov[0].iov_base) + n;
        pc.iov[0].iov_len -= n;
        ready.push_back(static_cast<size_t>(c.user_data));
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
