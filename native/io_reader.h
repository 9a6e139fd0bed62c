// The read path: expert records from a layer blob into pool rows, behind one Reader interface
// with two native backends (io_uring on Linux, a preadv thread pool everywhere). Both complete
// whole fills onto one native completion list and one eventfd (a pipe off Linux) that the Python
// event loop watches, so the scheduler above does not care which backend runs.
//
// Plain C++: nothing here knows Python. Native threads touch only state owned here.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <sys/uio.h>

#include <mlx/array.h>

#include "checksum.h"

namespace asyncside::io {

namespace mx = mlx::core;

// O_DIRECT buffers, lengths and offsets are kept multiples of this (the safe block size).
constexpr uint64_t kDirectAlign = 4096;

enum class Backend { IoUring, Threads };

// Reader tuning. Python binds this struct itself (asyncside._native.ReaderOptions, the fields named
// in ASYNCSIDE_READER_OPTION_FIELDS below), so these initialisers are the only defaults there are.
// Two defaults depend on the machine and the backend and are resolved when a Reader is built (see
// resolve_defaults); Reader::options() returns the resolved values.
struct ReaderOptions {
  Backend backend = Backend::Threads;  // chosen by the reader's name, not an option
  int queue_depth = 64;
  int workers = 0;
  uint64_t chunk_bytes = 1ull << 20;
  uint64_t buffered_chunk_bytes = 16ull << 20;
  uint64_t async_threshold = 64ull << 10;
  bool direct = false;
  uint64_t staging_bytes = 64ull << 20;
  uint64_t slot_bytes = 4ull << 20;
  bool register_files = true;
  bool register_buffers = true;
  int iowq_max_workers = -1;
  int worker_nice = 0;
  bool direct_rows = true;
  bool verify = true;
  bool mapped_reads = true;
};

// Every ReaderOptions field Python reads and writes, with what it means: X(name, doc).
#define ASYNCSIDE_READER_OPTION_FIELDS(X)                                                              \
  X(queue_depth, "Fills in flight at the reader (the rest wait in the scheduler's backlog); sizes "     \
                 "the io_uring ring.")                                                                  \
  X(workers, "Native worker threads: preadv workers (threads backend) or scatter workers (io_uring). " \
             "0: min(4, 2 x CPUs) for threads, the CPU count for io_uring.")                          \
  X(chunk_bytes, "Largest O_DIRECT read op: more ops in flight keep the disk busy. Rounded up to "      \
                 "4096.")                                                                               \
  X(buffered_chunk_bytes, "Largest buffered read op: whole records keep readahead sequential (cold) "   \
                          "and per-op overhead low (warm).")                                            \
  X(async_threshold, "io_uring: reads at least this long carry IOSQE_ASYNC, so the page-cache copy "    \
                     "runs in an io-wq worker instead of inside io_uring_enter on the loop thread.")   \
  X(direct, "O_DIRECT reads (into block-aligned rows, else through staging slots and a native "         \
            "scatter).")                                                                                \
  X(staging_bytes, "Bounded O_DIRECT staging slab: when it is full, chunks wait for a slot.")           \
  X(slot_bytes, "One staging slot: the largest staged read op.")                                        \
  X(register_files, "io_uring: IORING_REGISTER_FILES (fixed files).")                                   \
  X(register_buffers, "io_uring: staging slots as fixed buffers.")                                      \
  X(iowq_max_workers, "io_uring: cap on io-wq workers copying for IOSQE_ASYNC reads; more copy "        \
                      "threads than CPUs only thrash. -1: the CPU count; 0: the kernel's default.")    \
  X(worker_nice, "Native worker threads run this much nicer than the thread that built the reader "     \
                 "(Linux), so memcpy-bound workers never delay the event loop.")                        \
  X(direct_rows, "O_DIRECT straight into rows whose pieces are all block aligned; false: always "       \
                 "through staging.")                                                                    \
  X(verify, "Check each record's checksum (when the store has them) before its fill completes; a "      \
            "mismatch fails the fill.")                                                               \
  X(mapped_reads, "Buffered reads whose bytes are all in the page cache copy them from a read-only "   \
                  "mapping of the blob on a native worker, in one pass that also folds the checksum, "  \
                  "instead of preadv's kernel copy plus a checksum pass (the threads backend, and "    \
                  "io_uring's verified reads). false: always preadv.")

// The options with the machine-dependent defaults filled in: workers 0 and iowq_max_workers -1
// become numbers for this backend and this machine's CPU count.
ReaderOptions resolve_defaults(ReaderOptions opts);

// Test hooks, off by default, checked once per read op (a branch on a flag when off).
struct Faults {
  std::string path;          // reads of this file ...
  uint64_t lo = 0, hi = 0;   // ... touching file bytes [lo, hi) ...
  int err = 0;               // ... fail with this errno (0: no fault)
  uint64_t max_read_bytes = 0;   // cap every read op at this many bytes (forces short reads)
  uint64_t transient_every = 0;  // every Nth read op first returns -transient_err (then retried)
  int transient_err = 0;         // EAGAIN or EINTR
  bool map_unchecked = false;    // mapped reads skip the page-cache residency check (so a test can
                                 // make a mapped copy touch pages past a truncated end: SIGBUS)
};

// Whether an O_DIRECT read may land straight in host memory at `p`: false for CUDA managed memory
// (every array of an MLX CUDA build, its CPU arrays too), which the driver may migrate while the
// disk writes into it. Decodes that read in place into such rows failed their checksums where
// reads through a buffer never did (BENCHMARKS.md, "O_DIRECT into CUDA managed memory"). Always
// true without CUDA (defined in expert_faults_cuda.cpp).
bool direct_reads_land_in(const void* p) noexcept;

// Where the segments of a record land. A host-addressable destination gives the address of a
// segment's row; a device destination (CUDA, later) would return nullptr and be fed from staging
// through a copy hook instead.
class Destination {
 public:
  virtual ~Destination() = default;
  virtual int64_t rows() const = 0;
  virtual uint8_t* host_row(size_t segment, int64_t row) = 0;
  // Whether O_DIRECT reads may land straight in the rows (direct_reads_land_in); where not, every
  // reader (the Reader's fills, the fault tables) reads them through a buffer and copies.
  virtual bool takes_direct_reads() const { return true; }
};

// Pools that are evaluated, row-contiguous MLX CPU arrays, one per segment. Holding the arrays
// (shared references) keeps their buffers alive for as long as any read into them is in flight.
class MlxPoolDestination final : public Destination {
 public:
  // Throws std::invalid_argument naming the pool and what was expected.
  MlxPoolDestination(std::vector<mx::array> pools, const std::vector<uint64_t>& segment_nbytes);
  int64_t rows() const override { return rows_; }
  uint8_t* host_row(size_t segment, int64_t row) override {
    return base_[segment] + static_cast<uint64_t>(row) * row_nbytes_[segment];
  }
  bool takes_direct_reads() const override { return takes_direct_; }

 private:
  std::vector<mx::array> pools_;
  bool takes_direct_ = true;  // every pool's memory takes O_DIRECT reads (asked once, at construction)
  std::vector<uint8_t*> base_;
  std::vector<uint64_t> row_nbytes_;
  int64_t rows_ = 0;
};

// A blob could not be opened for reading (missing, unreadable, not a regular file, O_DIRECT
// refused). Carries the errno and the path apart from the message so that the binding raises the
// matching OSError (FileNotFoundError, PermissionError, ...).
class OpenError : public std::runtime_error {
 public:
  OpenError(int err, std::string path, const std::string& what)
      : std::runtime_error(what), err_(err), path_(std::move(path)) {}
  int err() const noexcept { return err_; }
  const std::string& path() const noexcept { return path_; }

 private:
  int err_;
  std::string path_;
};

struct SegmentSpan {
  uint64_t offset;  // inside the record
  uint64_t nbytes;
};

struct FillRequest {
  uint64_t token;
  int64_t expert;
  int64_t row;
};

struct Completion {
  uint64_t token;
  int result;  // 0, or -errno (-ENODATA: the file ended before the record did; -EBADMSG: the
               // bytes landed but do not match the record's checksum, see take_mismatch)
};

// A fill whose bytes did not match its record's checksum.
struct Mismatch {
  uint32_t expected;
  uint32_t got;
};

struct Layout;
struct Fill;
struct Chunk;

// Monotonic counters. Balanced after close(): ops_submitted == ops_completed,
// fills_submitted == fills_completed, staging_acquired == staging_released, slab allocs == frees.
struct Counters {
  std::atomic<uint64_t> fills_submitted{0}, fills_completed{0}, fills_failed{0};
  std::atomic<uint64_t> fills_direct_rows{0}, fills_staged{0};
  std::atomic<uint64_t> ops_submitted{0}, ops_completed{0}, ops_async{0}, ops_fixed_file{0}, ops_fixed_buffer{0};
  std::atomic<uint64_t> chunks_created{0}, chunks_destroyed{0};
  std::atomic<uint64_t> short_reads{0}, retries{0}, faults_injected{0};
  std::atomic<uint64_t> bytes_read{0}, bytes_scattered{0};
  std::atomic<uint64_t> staging_acquired{0}, staging_released{0}, staging_waits{0};
  std::atomic<uint64_t> slab_allocs{0}, slab_frees{0};
  std::atomic<uint64_t> enter_calls{0}, wakeups_written{0};
  std::atomic<uint64_t> iowq_max_workers{0};  // what the kernel accepted (0: default/unsupported)
  std::atomic<uint64_t> submit_ns_max{0}, reap_ns_max{0};  // longest submit()/reap() call (loop thread time)
  std::atomic<uint64_t> checksums_verified{0}, checksum_mismatches{0}, checksum_bytes{0}, checksum_ns{0};
  // Mapped reads (mapped_reads): blob mappings made / unmapped (balanced after close), chunks and
  // bytes copied from a mapping, chunks that were not all resident (read with preadv instead),
  // and mapped copies that hit SIGBUS (the file shrank under the mapping, or an I/O error).
  std::atomic<uint64_t> maps_created{0}, maps_released{0};
  std::atomic<uint64_t> mapped_chunks{0}, mapped_bytes{0}, map_fallbacks{0}, map_errors{0};
  std::map<std::string, uint64_t> snapshot() const;
};

// A fixed set of threads draining a FIFO of chunks through one function.
class ChunkWorkers {
 public:
  // nice: added to each worker thread's nice value (Linux; 0 leaves it alone).
  ChunkWorkers(int n, std::function<void(Chunk*)> fn, int nice = 0);
  ~ChunkWorkers();
  void push(Chunk* c);
  // One lock and one wakeup round for many chunks: a submit of several fills wakes the workers
  // once, not once per chunk (each wakeup can preempt the submitting event loop thread).
  void push_many(const std::vector<Chunk*>& cs);
  void stop();  // joins; pending chunks must have been drained by the caller's protocol

 private:
  void loop();
  std::function<void(Chunk*)> fn_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Chunk*> q_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

class Reader {
 public:
  // Builds the backend; throws std::runtime_error (io_uring unavailable, bad options).
  static std::unique_ptr<Reader> create(const ReaderOptions& opts);
  virtual ~Reader();

  const char* backend_name() const;
  const ReaderOptions& options() const { return opts_; }
  int event_fd() const { return notify_read_fd_; }

  // Opens the blob (and its O_DIRECT twin when direct) once; throws std::invalid_argument naming
  // the path and field on bad input, OpenError when the file cannot be opened for reading or is
  // not a regular file. The open happens outside the API lock and with O_NONBLOCK (a FIFO never
  // blocks it), so call it from a worker thread: an open on a stale mount can still block.
  uint32_t add_layout(const std::string& path, uint64_t stride, int64_t n_experts,
                      std::vector<SegmentSpan> segments, std::shared_ptr<Destination> dest);
  // Verify every later fill of `layout`: its segments' bytes, in table order, must checksum (kind)
  // to values[expert] before the fill completes (0); otherwise it completes with -EBADMSG and
  // take_mismatch(token) tells expected and got. ChecksumKind::None turns verification off.
  // Throws std::invalid_argument unless values has one entry per expert.
  void set_checksums(uint32_t layout, ChecksumKind kind, std::vector<uint32_t> values);
  // The mismatch recorded for a fill completed with -EBADMSG (once), if any.
  bool take_mismatch(uint64_t token, Mismatch* out);
  // Starts every fill now (never blocks on I/O; staging exhaustion queues natively). Validates all
  // requests before starting any; throws std::out_of_range naming the bad value.
  void submit(uint32_t layout, const std::vector<FillRequest>& fills);
  // Resets the eventfd, advances the backend (io_uring: drains the ring), returns finished fills.
  std::vector<Completion> reap();
  // Blocks up to timeout_ms for the eventfd; true when readable. For synchronous callers only.
  bool wait(int timeout_ms);
  // Waits for every in-flight fill, stops threads, frees staging, files and the wakeup
  // descriptor(s) (event_fd() is -1 afterwards). Idempotent.
  void close();
  void set_faults(const Faults& f);
  uint64_t in_flight() const { return in_flight_.load(); }
  std::map<std::string, uint64_t> counters() const;

 protected:
  explicit Reader(const ReaderOptions& opts);

  // Issue one read op for each chunk (its next window). Called from any thread.
  virtual void start_reads(std::vector<Chunk*>& chunks) = 0;
  // Backend work that must happen on reap (io_uring: drain the ring's CQ).
  virtual void reap_backend() {}
  virtual void shutdown_backend() {}
  virtual void on_layout_added(Layout& layout) {}
  // A chunk whose bytes landed and that needs work before it is done (a staged chunk's scatter,
  // a verified layout's checksum): run finish_chunk(c) on a worker (io_uring: the copy workers,
  // never the event loop thread that reaps) or right here (threads: already on a worker).
  virtual void scatter_staged(Chunk* c) = 0;
  // Scatter (staged) or checksum (rows) a chunk whose bytes landed, then chunk_done(c, 0).
  void finish_chunk(Chunk* c);
  // Reads a chunk on the calling (worker) thread with preadv (short reads continue, EINTR/EAGAIN
  // retry), then finishes it right there: a checksum then reads bytes still in this CPU's cache.
  void read_chunk_sync(Chunk* c);
  // A chunk whose bytes are all in the page cache, read from the layout's mapping: copies every
  // row piece in one pass that folds the checksum on the way (verified layouts), then finishes the
  // chunk. Returns false (nothing done) when the chunk cannot take this path; then read it with
  // preadv.
  bool read_mapped(Chunk* c);

  // Shared per-op logic.
  enum class Step { Continue, Done };
  // Fills c->cur with the next window (the rest of the chunk, at most `cap` bytes when cap > 0,
  // trimmed by the max_read_bytes hook); returns the bytes handed to the kernel.
  uint64_t build_window(Chunk* c, uint64_t cap = 0);
  // 0, or the errno an injected fault gives this op (counts the injection).
  int injected_fault(const Chunk* c, uint64_t len);
  // Accounts one op result; Done sets *final to 0 or -errno.
  Step after_op(Chunk* c, int64_t res, int* final_result);
  // The chunk's bytes have landed (or failed): scatter if staged, else finish.
  void chunk_read_finished(Chunk* c, int result);
  // Copies a staged chunk's pieces into rows, checksumming them on the way when the layout is
  // verified (any thread, no locks held).
  void do_scatter(Chunk* c);
  // Checksums the rows-mode chunk's segment bytes (not the padding sink) that landed since the
  // last call, continuing the chunk's running checksum.
  void checksum_landed(Chunk* c);
  // Checksums what is left of a rows-mode chunk and stores the result as its fill's part.
  void checksum_rows(Chunk* c);
  // Returns the staging slot, settles the fill, frees the chunk.
  void chunk_done(Chunk* c, int result);
  // Every chunk of f is done: combine its parts' checksums and compare (verified layouts), post
  // the completion, free f.
  void fill_done(Fill* f);
  void post_completion(uint64_t token, int result);
  void notify();

  ReaderOptions opts_;
  Counters counters_;
  std::mutex api_mu_;  // serialises add_layout / submit / reap / close

  // Layouts live until close.
  std::vector<std::unique_ptr<Layout>> layouts_;

  // Staging slab (O_DIRECT): fixed slots, bounded; chunks wait for a slot FIFO.
  uint8_t* slab_ = nullptr;
  uint64_t slab_bytes_ = 0;
  int n_slots_ = 0;
  uint8_t* junk_ = nullptr;  // aligned sink for padding between segments
  std::mutex slot_mu_;
  std::vector<int> free_slots_;
  std::deque<Chunk*> slot_waiters_;
  uint8_t* slot_ptr(int slot) const { return slab_ + static_cast<uint64_t>(slot) * opts_.slot_bytes; }
  void dispatch(std::vector<Chunk*>& chunks);  // acquires slots, then start_reads

  // Completions.
  std::mutex done_mu_;
  std::vector<Completion> done_;
  std::map<uint64_t, Mismatch> mismatches_;  // under done_mu_
  int notify_read_fd_ = -1, notify_write_fd_ = -1;  // same fd for eventfd
  std::atomic<uint64_t> in_flight_{0};
  bool closed_ = false;

  // Faults (copied under a mutex; the hot path reads an atomic flag first).
  std::atomic<bool> faults_on_{false};
  std::atomic<bool> map_unchecked_{false};
  std::mutex faults_mu_;
  Faults faults_;
  std::atomic<uint64_t> op_seq_{0};
};

// The side-region design's read, for the benchmark baseline: one thread, one pread of the whole
// record into a temp buffer, then one memcpy per segment into its row. Returns bytes read; throws
// on error.
uint64_t side_region_read(const std::string& path, uint64_t stride, const std::vector<SegmentSpan>& segments,
                          Destination& dest, const std::vector<int64_t>& experts, const std::vector<int64_t>& rows);

// memcpy throughput limit: copies `total_bytes` in `block_bytes` blocks from a buffer of
// `working_bytes` to another, on `threads` threads. Returns seconds.
double memcpy_seconds(uint64_t total_bytes, uint64_t block_bytes, uint64_t working_bytes, int threads);

// Page-cache read limit: `threads` threads pread whole records (`experts`, split round-robin) into
// prefaulted private buffers, no second copy. Returns seconds; throws on error.
double pread_seconds(const std::string& path, uint64_t stride, const std::vector<int64_t>& experts, int threads);

// Whether io_uring can be set up here; reason filled when not.
bool io_uring_available(std::string* reason);

}  // namespace asyncside::io
