// io_uring backend, set up through the kernel's syscall interface (no liburing).
//
// Submission: any thread (the loop thread in submit/reap, scatter workers when a staging slot
// frees) fills SQEs under sq_mu_ and calls io_uring_enter; the caller has released the GIL.
// Reads at least async_threshold long carry IOSQE_ASYNC: a buffered page-cache hit is then copied
// by an io-wq worker, not inside io_uring_enter on the submitting (loop) thread, and an O_DIRECT
// read's page pinning and bio setup happen there too (without it, submitting a batch of large
// fills holds the loop thread inside io_uring_enter: BENCHMARKS.md, read path).
// Completion: the ring's registered eventfd (shared with the completion list) wakes the loop,
// which reaps the CQ in Reader::reap(): short reads and EAGAIN resubmit, staged chunks go to the
// scatter workers, finished fills are posted to the completion list.
#if defined(__linux__)

#include "io_internal.h"
#include "io_uring_abi.h"

#include <cerrno>
#include <cstring>
#include <stdexcept>

#include <unistd.h>

namespace asyncside::io {

namespace {

using namespace asyncside::uring;

int sys_setup(unsigned entries, Params* p) { return static_cast<int>(syscall(kSysSetup, entries, p)); }
int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
  return static_cast<int>(syscall(kSysEnter, fd, to_submit, min_complete, flags, nullptr, 0));
}
int sys_register(int fd, unsigned op, const void* arg, unsigned n) {
  return static_cast<int>(syscall(kSysRegister, fd, op, arg, n));
}

template <typename T>
T load_acquire(const T* p) {
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
template <typename T>
void store_release(T* p, T v) {
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
}

unsigned next_pow2(unsigned x) {
  unsigned p = 1;
  while (p < x) p <<= 1;
  return p;
}

constexpr unsigned kFixedFiles = 256;

class UringReader final : public Reader, private RingMap {
 public:
  explicit UringReader(const ReaderOptions& opts) : Reader(opts) {
    const unsigned entries = std::min(4096u, std::max(8u, next_pow2(static_cast<unsigned>(opts_.queue_depth))));
    Params p;
    std::memset(&p, 0, sizeof p);
    p.flags = kSetupCqSize | kSetupClamp;
    p.cq_entries = entries * 4;
    ring_fd_ = sys_setup(entries, &p);
    if (ring_fd_ < 0) throw std::runtime_error(std::string("io_uring_setup failed: ") + std::strerror(errno));
    if (!(p.features & kFeatSingleMmap) || !(p.features & kFeatNoDrop)) {
      ::close(ring_fd_);
      throw std::runtime_error("io_uring: kernel lacks IORING_FEAT_SINGLE_MMAP/NODROP (needs Linux >= 5.5)");
    }
    sq_entries_ = p.sq_entries;
    cq_entries_ = p.cq_entries;
    if (int e = map_ring(ring_fd_, p)) {
      ::close(ring_fd_);
      throw std::runtime_error(std::string("io_uring: mmap of the rings failed: ") + std::strerror(e));
    }
    // Never more ops in the kernel than CQ entries: the CQ cannot overflow.
    max_in_ring_ = cq_entries_;

    const int32_t efd = notify_read_fd_;
    if (sys_register(ring_fd_, kRegisterEventfd, &efd, 1) != 0) {
      int e = errno;
      teardown();
      throw std::runtime_error(std::string("io_uring: IORING_REGISTER_EVENTFD failed: ") + std::strerror(e));
    }
    if (opts_.register_files) {
      std::vector<int32_t> fds(kFixedFiles, -1);  // sparse table, filled per layout
      files_registered_ = sys_register(ring_fd_, kRegisterFiles, fds.data(), kFixedFiles) == 0;
    }
    if (opts_.register_buffers && slab_ != nullptr) {
      std::vector<iovec> v;
      for (int i = 0; i < n_slots_; ++i) v.push_back({slot_ptr(i), opts_.slot_bytes});
      buffers_registered_ = sys_register(ring_fd_, kRegisterBuffers, v.data(), static_cast<unsigned>(v.size())) == 0;
    }
    if (opts_.iowq_max_workers > 0) {
      // Buffered reads punted with IOSQE_ASYNC are bounded io-wq work: more copy threads than
      // CPUs only thrash (measured: see BENCHMARKS.md). Linux >= 5.15; ignored where refused.
      uint32_t vals[2] = {static_cast<uint32_t>(opts_.iowq_max_workers), 0};
      if (sys_register(ring_fd_, kRegisterIowqMaxWorkers, vals, 2) == 0) {
        counters_.iowq_max_workers = static_cast<uint64_t>(opts_.iowq_max_workers);
      }
    }
    copy_ = std::make_unique<ChunkWorkers>(
        opts_.workers,
        [this](Chunk* c) {
          if (c->read_by_worker) {
            read_chunk_sync(c);
          } else {
            finish_chunk(c);
          }
        },
        opts_.worker_nice);
  }

  ~UringReader() override { close(); }

 protected:
  void on_layout_added(Layout& L) override {
    if (!files_registered_) return;
    auto update = [&](int fd, unsigned idx) -> int {
      if (fd < 0 || idx >= kFixedFiles) return -1;
      int32_t f = fd;
      FilesUpdate u{idx, 0, reinterpret_cast<uint64_t>(&f)};
      return sys_register(ring_fd_, kRegisterFilesUpdate, &u, 1) == 1 ? static_cast<int>(idx) : -1;
    };
    const unsigned idx = static_cast<unsigned>(layouts_.size()) * 2;
    L.fixed = update(L.fd, idx);
    L.fixed_direct = update(L.fd_direct, idx + 1);
  }

  void start_reads(std::vector<Chunk*>& chunks) override {
    std::vector<std::pair<Chunk*, int>> injected;
    std::vector<Chunk*> to_workers;
    {
      std::lock_guard<std::mutex> lk(sq_mu_);
      for (Chunk* c : chunks) {
        if (!c->direct && !c->fill->part_crc.empty()) {
          // A buffered read of a verified layout: mostly a page-cache copy. Done by a copy worker
          // rather than an io-wq thread: from the blob's mapping in one pass that copies and
          // checksums (mapped_reads, pages resident), else with preadv in windows that the same
          // CPU checksums while they are in its cache; after an io-wq copy they are only in L3
          // or DRAM by the time a worker can checksum them (BENCHMARKS.md has the cost).
          // O_DIRECT keeps the ring.
          c->read_by_worker = true;
          to_workers.push_back(c);
          continue;
        }
        if (ops_in_ring_ >= max_in_ring_) {
          overflow_.push_back(c);
          continue;
        }
        const uint64_t len = build_window(c);
        counters_.ops_submitted++;
        if (int e = injected_fault(c, len)) {
          injected.emplace_back(c, -e);
          continue;
        }
        if (*sq_tail_ - load_acquire(sq_head_) >= sq_entries_) flush_locked();
        const uint32_t tail = *sq_tail_;
        Sqe* sqe = &sqes_[tail & sq_mask_];
        std::memset(sqe, 0, sizeof *sqe);
        const Layout& L = *c->fill->layout;
        const int fixed = c->direct ? L.fixed_direct : L.fixed;
        if (fixed >= 0) {
          sqe->fd = fixed;
          sqe->flags |= kSqeFixedFile;
          counters_.ops_fixed_file++;
        } else {
          sqe->fd = c->direct ? L.fd_direct : L.fd;
        }
        if (c->staged && buffers_registered_) {
          sqe->opcode = kOpReadFixed;
          sqe->addr = reinterpret_cast<uint64_t>(c->cur[0].iov_base);
          sqe->len = static_cast<uint32_t>(c->cur[0].iov_len);
          sqe->buf_index = static_cast<uint16_t>(c->slot);
          counters_.ops_fixed_buffer++;
        } else {
          sqe->opcode = kOpReadv;
          sqe->addr = reinterpret_cast<uint64_t>(c->cur.data());
          sqe->len = static_cast<uint32_t>(c->cur.size());
        }
        sqe->off = c->file_off + c->done;
        sqe->user_data = reinterpret_cast<uint64_t>(c);
        if (len >= opts_.async_threshold) {
          sqe->flags |= kSqeAsync;  // the work runs in io-wq, never inside io_uring_enter
          counters_.ops_async++;
        }
        store_release(sq_tail_, tail + 1);
        ++unsubmitted_;
        ++ops_in_ring_;
      }
      flush_locked();
    }
    copy_->push_many(to_workers);
    // Injected faults complete here, as the kernel would have reported them.
    std::vector<Chunk*> again;
    for (auto& [c, res] : injected) {
      int final = 0;
      if (after_op(c, res, &final) == Step::Continue) {
        again.push_back(c);
      } else {
        chunk_read_finished(c, final);
      }
    }
    if (!again.empty()) start_reads(again);
  }

  void reap_backend() override {
    std::lock_guard<std::mutex> lk(cq_mu_);
    {
      std::lock_guard<std::mutex> sl(sq_mu_);
      if (unsubmitted_) flush_locked();  // an earlier enter was refused (EBUSY/EAGAIN)
    }
    for (int round = 0; round < 64; ++round) {
      std::vector<Chunk*> again;
      std::vector<std::pair<Chunk*, int>> finished;
      uint32_t head = *cq_head_;
      const uint32_t tail = load_acquire(cq_tail_);
      if (head == tail) break;
      unsigned n = 0;
      for (; head != tail; ++head, ++n) {
        const Cqe& cqe = cqes_[head & cq_mask_];
        Chunk* c = reinterpret_cast<Chunk*>(cqe.user_data);
        int final = 0;
        if (after_op(c, cqe.res, &final) == Step::Continue) {
          again.push_back(c);
        } else {
          finished.emplace_back(c, final);
        }
      }
      store_release(cq_head_, head);
      {
        std::lock_guard<std::mutex> sl(sq_mu_);
        ops_in_ring_ -= n;
        while (!overflow_.empty()) {
          again.push_back(overflow_.front());
          overflow_.pop_front();
        }
      }
      if (!again.empty()) start_reads(again);
      for (auto& [c, r] : finished) chunk_read_finished(c, r);
    }
  }

  // Reads complete in reap(), on the event loop thread: scatter and checksum run on the copy
  // workers instead.
  void scatter_staged(Chunk* c) override { copy_->push(c); }

  void shutdown_backend() override {
    copy_->stop();
    teardown();
  }

 private:
  // Hands the SQEs filled so far to the kernel. Caller holds sq_mu_.
  void flush_locked() {
    while (unsubmitted_ > 0) {
      counters_.enter_calls++;
      const int r = sys_enter(ring_fd_, unsubmitted_, 0, 0);
      if (r > 0) {
        unsubmitted_ -= static_cast<unsigned>(r);
      } else if (r < 0 && errno == EINTR) {
        continue;
      } else {
        break;  // EAGAIN/EBUSY (or 0): left in the SQ, retried on the next reap
      }
    }
  }

  void teardown() {
    unmap_ring();
    if (ring_fd_ >= 0) ::close(ring_fd_);
    ring_fd_ = -1;
  }

  int ring_fd_ = -1;
  unsigned sq_entries_ = 0, cq_entries_ = 0;

  std::mutex sq_mu_;
  unsigned unsubmitted_ = 0;
  unsigned ops_in_ring_ = 0;
  unsigned max_in_ring_ = 0;
  std::deque<Chunk*> overflow_;
  std::mutex cq_mu_;
  bool files_registered_ = false;
  bool buffers_registered_ = false;
  std::unique_ptr<ChunkWorkers> copy_;
};

}  // namespace

std::unique_ptr<Reader> make_uring_reader(const ReaderOptions& opts) { return std::make_unique<UringReader>(opts); }

bool io_uring_available(std::string* reason) {
  Params p;
  std::memset(&p, 0, sizeof p);
  const int fd = sys_setup(4, &p);
  if (fd < 0) {
    if (reason) {
      *reason = std::string("io_uring_setup: ") + std::strerror(errno);
      if (errno == EPERM) *reason += " (disabled by /proc/sys/kernel/io_uring_disabled or seccomp?)";
      if (errno == ENOSYS) *reason += " (kernel without io_uring)";
    }
    return false;
  }
  ::close(fd);
  if (!(p.features & kFeatSingleMmap) || !(p.features & kFeatNoDrop)) {
    if (reason) *reason = "kernel lacks IORING_FEAT_SINGLE_MMAP/NODROP (needs Linux >= 5.5)";
    return false;
  }
  return true;
}

}  // namespace asyncside::io

#else  // not Linux

#include "io_reader.h"

namespace asyncside::io {
bool io_uring_available(std::string* reason) {
  if (reason) *reason = "io_uring exists only on Linux";
  return false;
}
}  // namespace asyncside::io

#endif
