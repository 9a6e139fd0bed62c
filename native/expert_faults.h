// Expert faults served inside the stream: the one-queued-step decode path.
//
// A decode step is queued whole. Each MoE layer's gather reads its pool rows through an
// `expert_rows(ids, table)` node: when the stream reaches it, the node maps every routed expert
// to its pool row from a per-layer table kept here, and an expert without a row is brought in
// right there, on the stream, into a row the ledger lent for that purpose. The gather after it
// (which depends on the node's output) then reads bytes that are in place. No host round trip
// per layer, no recomputation of the step.
//
// Ownership: the Python ledger owns row state. It *lends* rows to a FaultTable (rows it promises
// not to touch until it takes them back) and *reconciles* afterwards from the table's event log:
// each fault says "row R: expert V evicted, expert E filled" (or failed). A lent row stays lent
// after a fault (a later step may reuse it) until the ledger reclaims it. The table never writes a
// row it was not lent.
//
// Threads: the stream thread runs resolve(); the loop thread runs everything else. A mutex guards
// the state; resolve() drops it while it reads its records (side by side on the read pool when
// there are several, read_pool.h), so the loop thread never waits for I/O.
//
// Streamed resolves (begin() / finish()): a decode step's switch that expects misses maps its
// experts to rows at once and leaves the misses' reads to background threads, then computes its
// slots one by one, each waiting only for its own expert. The reads of a layer overlap that
// layer's expert compute instead of preceding it. The reads still land only in lent rows, and a
// row is published (table, log) only once its read finished and verified.
// Plain C++: nothing here knows Python.
#pragma once

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "checksum.h"
#include "io_reader.h"

namespace asyncside::faults {

namespace io = asyncside::io;

// One fault, as the ledger needs it to reconcile.
struct FaultEvent {
  int64_t row;     // the lent row that was (re)filled
  int64_t victim;  // the expert the row held before (-1: it was free)
  int64_t expert;  // the expert now in the row (on error: the expert that was being read)
  int64_t ns;      // time the fault took on the stream thread (read + checksum)
  int64_t error;   // 0, or errno of the failed read, or one of the codes below (negative)
  int64_t source;  // where the bytes came from: 0 the store (a read on the stream), 1 the sink's host
                   // tier (no read), 2 the store (a streamed resolve's read, in the background),
                   // 3 the store (a prefetch's read, in the background: not a miss)
};

// FaultEvent::error codes that are not a read's errno. Nothing on the stream thread throws: a
// failure thrown there is kept by MLX and raised at the next call that queues work on the stream,
// and when that call is one of the dispatches that count a task, MLX's count of tasks in flight
// goes up and never comes down (its throttle then waits forever). Failures go to the log instead,
// and the step's awaiter raises them.
inline constexpr int kChecksumMismatch = -1;
inline constexpr int kNoLentRow = -2;
inline constexpr int kOutsideExperts = -3;  // a routed id outside [0, n_experts): no read, row 0
inline constexpr int kNodeFailed = -4;      // a fault node failed as a whole (FaultTable::failed)

// Everything recorded since the last drain().
struct Drained {
  std::vector<FaultEvent> events;
  std::vector<int32_t> used;        // each resolve's distinct experts, in call order, concatenated
  std::vector<int32_t> used_sizes;  // how many of `used` each resolve contributed
  // Beside `used`, one per entry: 1 where that resolve found the expert absent (a miss: faulted
  // into a row, staged from the host tier, or failed), 0 where it was a hit (in its row, or a
  // prefetch's fill it adopted and whose read verified). Several resolves of one step's layer (a
  // split switch) each log their own experts; the ledger counts an expert once per step, by its
  // first resolve's entry.
  std::vector<uint8_t> missed;
  // Beside `events`, one per event: how many resolves had logged their uses (used_sizes) when it
  // was logged, its own included. An event of a resolve's fault is logged after that resolve's
  // uses, so it belongs to the event_at-th resolve of this log (none: to the last resolve of the
  // log drained before); the loop thread keys a failed fault to the step that queued that resolve.
  std::vector<int32_t> event_at;
};

class HostRecordSink;

// Where the bytes of a faulted record come from and go to. The host implementation reads the
// record straight into the pool rows (preadv, one vector per record); a device implementation
// stages in host memory and copies to the device (compiled with the GPU backend).
class RecordSink {
 public:
  virtual ~RecordSink() = default;
  virtual int64_t rows() const = 0;
  // Read `expert`'s record (at `offset`) for `row`; returns 0 or an errno (ENODATA: the blob ended
  // early). Called for several rows at once from different threads (never twice for one row, nor
  // for one expert, at once).
  virtual int read(int fd, uint64_t offset, int64_t row, int64_t expert) = 0;
  // `expert`'s bytes were read and verified, or the sink holds them: make them `row`'s (a device
  // sink plans the copy to the device). Called one row at a time, under the table's lock; 0 or an
  // errno.
  virtual int publish(int64_t row, int64_t expert) { return 0; }
  // The checksum of the bytes read for `row` / `expert`, segments in segment order (the store's
  // definition), from the host copy of them.
  virtual uint32_t checksum(io::ChecksumKind kind, int64_t row, int64_t expert) = 0;
  // A host tier: true when the sink already holds `expert`'s verified bytes in host memory it
  // copies from, so a fault of `expert` is publish() alone (no read, no checksum). Asked and
  // told (keep) under the table's lock; keep() follows a read that verified.
  virtual bool holds(int64_t expert) const { return false; }
  virtual void keep(int64_t expert) {}
  // Reads come from a descriptor opened with O_DIRECT: read whole aligned spans into an aligned
  // buffer and copy the segments out (pool rows are not block aligned in general). Either form
  // is read in chunks all in flight at once (chunked_read.h).
  virtual void set_direct(bool on) {}
  // A sink that reads its records one after another through one ring (HostRecordSink, with
  // O_DIRECT and io_uring on): the streamed resolve's reader. Null: one read per record instead.
  virtual HostRecordSink* ordered_reader() { return nullptr; }
  // The ordered reads' window for this sink's table: 0 to 32 pieces in flight, or -1 for the
  // process's fault_read_window() (a runtime sets the one it chose for its disk).
  virtual void set_read_window(int pieces) {}
  // Staging (a device sink with a host tier and staging arrays): plan the copy of `expert`'s
  // bytes into its row of the staging arrays (a whole layer, indexed by expert id), from pool
  // row `row`, or from the host tier when `row` < 0 (the tier must hold the expert). Called one
  // expert at a time, under the table's lock; 0 or an errno.
  virtual bool stages() const { return false; }
  virtual int stage(int64_t expert, int64_t row) { return ENOTSUP; }
  // A sink whose nodes look rows up on the device keeps a copy of the expert -> row table there:
  // told of the whole table (at construction and sync) and of each entry resolve() changes, under
  // the table's lock. The device's resolves that hit come back as uses, oldest first: each call
  // of next_device_use() takes one (its distinct experts into `uniq`, its routed pairs into
  // `pairs`), false once there is none.
  virtual void table_reset(const std::vector<int32_t>& table) {}
  virtual void table_changed(int64_t expert, int32_t row) {}
  virtual bool next_device_use(std::vector<int64_t>& uniq, uint64_t& pairs) { return false; }
};

// Host pools (MLX CPU, or unified memory): segments scattered into the rows by one preadv.
class HostRecordSink final : public RecordSink {
 public:
  HostRecordSink(std::shared_ptr<io::Destination> dest, uint64_t stride, std::vector<io::SegmentSpan> segments);
  ~HostRecordSink() override;
  int64_t rows() const override { return dest_->rows(); }
  int read(int fd, uint64_t offset, int64_t row, int64_t) override { return read_row(fd, offset, row); }
  uint32_t checksum(io::ChecksumKind kind, int64_t row, int64_t) override { return checksum_row(kind, row); }
  void set_direct(bool on) override { direct_.store(on, std::memory_order_relaxed); }
  HostRecordSink* ordered_reader() override;
  void set_read_window(int pieces) override { window_.store(pieces, std::memory_order_relaxed); }
  // Pieces in flight for this sink's ordered reads (its own window, else the process's).
  unsigned read_window() const;
  // Read records (file offset, pool row) in their order, `fault_read_window()` pieces in flight
  // through the calling thread's ring (chunked_read.h: read_ordered), and call `landed(k, err, ns)`
  // as record k's last byte is in its row: 0 or an errno, and the time since its first piece was
  // submitted. Every record gets one landed() call, in the order they land; a failure stops the
  // submissions, and a record it left unread gets ECANCELED. Only with O_DIRECT (ordered_reader()).
  void read_rows_ordered(int fd, const std::vector<std::pair<uint64_t, int64_t>>& records,
                         const std::function<void(size_t, int, int64_t)>& landed);
  // The same, by the destination's row alone (a device sink reads into a row of its mirror or
  // of its tier through these).
  int read_row(int fd, uint64_t offset, int64_t row);
  uint32_t checksum_row(io::ChecksumKind kind, int64_t row);

 private:
  int read_row_direct(int fd, uint64_t offset, int64_t row);
  // Whether O_DIRECT reads may land straight in this sink's rows (else through a buffer).
  bool in_place_allowed() const;
  std::atomic<bool> direct_{false};
  std::atomic<int> window_{-1};
  std::shared_ptr<io::Destination> dest_;
  uint64_t stride_;
  std::vector<io::SegmentSpan> segments_;  // sorted by offset
  std::vector<uint64_t> nbytes_;           // per segment, in segment order
  std::vector<size_t> order_;              // segments_[k] is segment order_[k] of the destination
  uint8_t* junk_ = nullptr;                // sink for the padding between segments
  bool blocks_only_ = false;               // segments are whole 4 KiB blocks end to end (see read_row_direct)
  uint64_t junk_bytes_ = 0;
};

// How the stream picks which lent row a faulted expert takes (the ledger's policy chooses which
// rows are lent; the stream, which sees every use first, ranks them):
// - LendOrder: the first lent row (the policy's own ranking at lend time);
// - Recency: the row whose expert was used longest ago (LRU);
// - Decayed: the row whose expert has the lowest use count decayed by age, each use weighing
//   half as much every `half_life` steps of this layer (recency and frequency together, LRFU).
// Free lent rows always go first; a row whose expert the current step routes is never taken.
enum class VictimOrder { LendOrder = 0, Recency = 1, Decayed = 2 };

// A routed id that names no expert (2**32 - 1, whatever the ids' dtype): resolve() maps it to row 0
// without a fault or a use. Queued steps route pairs whose products they discard this way (a slice
// of a switch that is not that pair's; see asyncside/models/queued.py).
inline constexpr int64_t kNoExpert = 0xFFFFFFFFll;

class FaultTable {
 public:
  // Takes ownership of `fd` (closed by the destructor). `path` and `layer` only name errors.
  FaultTable(int layer, int64_t n_experts, std::unique_ptr<RecordSink> sink, int fd, std::string path,
             uint64_t stride);
  ~FaultTable();
  FaultTable(const FaultTable&) = delete;
  FaultTable& operator=(const FaultTable&) = delete;

  int layer() const { return layer_; }
  RecordSink* sink() { return sink_.get(); }
  int64_t n_experts() const { return n_experts_; }
  int64_t rows() const { return rows_; }

  // ---- loop thread ----
  // Replace the expert -> row table (-1: absent). Only while nothing is lent and no queued step
  // that reads this table is in flight. Throws std::invalid_argument on a bad table.
  void sync(const std::vector<int32_t>& table);
  // Lend rows: the stream may fill them with faulted experts, evicting what they hold.
  void lend(const std::vector<int64_t>& rows);
  // Take back every lent row; returns them in lend order. Only once no queued step is in flight.
  std::vector<int64_t> reclaim();
  // Events and usage since the last drain.
  Drained drain();
  std::vector<int32_t> table();
  std::vector<int64_t> lent() const;
  std::map<std::string, uint64_t> counters();
  // Rank victims by `order`; Decayed: by each expert's use count decayed with `half_life` steps.
  // A count is kept under `half_life` and under each of `kept` (a policy's candidate half-lives):
  // one adopted later ranks by the counts it would have had all along, as the policy's shadows
  // judged it. A half-life not kept before starts from the counts of the one ranked until now.
  void set_order(VictimOrder order, double half_life, const std::vector<double>& kept = {});
  // Check every faulted record against `expected[expert]` (kind None: no check) before it is used.
  void set_checksums(io::ChecksumKind kind, std::vector<uint32_t> expected);
  // Drop each record from the page cache once it was read (POSIX_FADV_DONTNEED): when the store
  // is larger than the page cache a memory budget leaves, cached records only evict each other.
  void set_drop_cache(bool on);
  // A test's injected fault: every read of a record touching blob bytes [lo, hi) fails with `err`
  // (0: none), as the io reader's Faults fail its reads; counted in counters()'s faults_injected.
  // Throws std::invalid_argument on a negative errno or an empty range.
  void set_fault(uint64_t lo, uint64_t hi, int err);
  // The table's descriptor was opened with O_DIRECT: the sink reads aligned spans (see RecordSink).
  void set_direct(bool on) { sink_->set_direct(on); }
  // The ordered reads' window of this table (RecordSink::set_read_window); throws
  // std::invalid_argument outside -1 to 32.
  void set_read_window(int pieces);

  // ---- stream thread ----
  // These never throw a failed fault: they log it (the step's awaiter raises it from the log,
  // see the error codes above).
  //
  // Map ids[i] to rows in out[i], faulting absent experts in (kNoExpert: row 0, nothing else). An
  // id outside [0, n_experts) is logged (kOutsideExperts) and mapped to row 0. When a fault fails,
  // the log says which row the ledger must free, and its ids read row 0.
  void resolve(std::vector<int64_t> ids, uint32_t* out);
  // The staged form, for a switch whose experts would not fit the lent rows (a prefill chunk, a
  // large batch) on a device sink that stages: every routed expert's bytes are copied into the
  // sink's staging arrays at its own index, from its pool row when it has one (a hit, touched
  // as resolve touches it), else from the host tier, read and verified into the tier first when
  // the tier lacks it; out[i] = ids[i] (the gather indexes the staging arrays by expert id).
  // No row is taken, lent, filled or evicted. A failure is logged as an event of row -1, as
  // resolve's are; a staged copy is logged as an event of row -1 and error 0.
  void stage(std::vector<int64_t> ids, uint32_t* out);
  bool can_stage() const { return sink_ && sink_->stages(); }

  // The streamed form of resolve() (host sinks): out[i] is the row ids[i] has, or will have once
  // its read finished; the misses' reads run on the background read threads (read_pool.h) and
  // begin() returns at once. finish(ids) waits for the reads of those experts and publishes them
  // (row, table, log, policy) as resolve() does; when one failed it first waits for every read
  // still pending and publishes them. The next begin(), resolve() or
  // stage(), and sync() and reclaim(), first settle() whatever is pending, so a step that never
  // reached its finish() nodes leaves no read in flight and no row unlogged. drain(), table() and
  // lent() do not wait (mid-step, a pending fill's row is out of the lent list and unpublished,
  // as resolve()'s are while it reads).
  // `order` (when given; ids are tokens of `k` slots each): per token, its slots with the expert
  // in first (slot order), then the rest in the order their reads were issued.
  void begin(std::vector<int64_t> ids, uint32_t* out, size_t k = 0, uint32_t* order = nullptr);
  void finish(const std::vector<int64_t>& ids);
  // A prediction of the experts this layer will route next (host sinks): the absent ones get lent
  // rows and their reads start in the background, as begin()'s misses do, while the stream goes on.
  // Nothing is routed: no use is logged, no hit or resolve counted, and a prediction that finds no
  // lent row left takes none (a hint never fails a step). The layer's next begin() adopts
  // them: a predicted expert it routes is a hit whose read may still be landing (its finish()
  // waits for it alone, and a failed read then fails the step as a miss's does); the others stay
  // pending (their rows out of the lent list) until the next settle publishes them, or at once
  // where the begin's misses need their rows. resolve() and stage() settle them first. Published
  // prefetches are logged as FaultEvent::source 3 (not a miss). A failed read of an expert nothing
  // routed frees its row and is logged, not raised: the expert is read again if it is routed.
  void prefetch(std::vector<int64_t> ids);
  // A fault node failed as a whole (its task caught what it threw: an allocation, a table the
  // node cannot use): logged as an event of row -1, expert -1 and error kNodeFailed; failure()
  // is the latest such message (empty when none).
  void failed(const char* what) noexcept;
  std::string failure() const;
  // Test hook: the next resolve(), begin() or stage() throws `message` (as an allocation could),
  // once, before it touches anything.
  void testing_fail_next(std::string message);
  // Loop thread (off the event loop: it waits for reads): wait for every pending streamed read and
  // publish it, a failure only logged. Call once the steps that began them are done, before drain().
  void settle();
  bool pending() const;

 private:
  // Throws (and clears) what testing_fail_next() set, if anything.
  void throw_injected_locked();
  // Log `event` with its place among the resolves' uses (Drained::event_at); `ahead`: it belongs
  // to a resolve whose uses are logged just after it (an id collect_locked refuses).
  void log_event_locked(const FaultEvent& event, int32_t ahead = 0) {
    log_.events.push_back(event);
    log_.event_at.push_back(static_cast<int32_t>(log_.used_sizes.size()) + ahead);
  }
  // The distinct experts of `ids` (first-use order) into `uniq`; returns the routed pairs
  // (kNoExpert excluded). Logs the resolve's uses. An id outside the layer's experts is logged as
  // a failure (its message into `error`, when the first) and replaced in `ids` by kNoExpert.
  uint64_t collect_locked(std::vector<int64_t>& ids, uint64_t stamp, std::vector<int64_t>& uniq, std::string& error);
  // The message of a failed read of `expert` (into pool row `row`, or the host tier when < 0).
  std::string read_error(int64_t expert, int64_t row, int err, uint32_t got) const;
  // Replay the resolves the device answered alone (hits) into the policy and the log, in order.
  void absorb_device_uses_locked();
  int64_t pick_row_locked(uint64_t stamp);
  void touch_locked(int64_t expert, uint64_t stamp);
  // After a record at `offset` was read: the page-cache advice of set_drop_cache.
  void after_read(uint64_t offset);
  double rank_locked(int64_t expert, uint64_t stamp) const;

  // One record fault: its row, what the row held, and the read's outcome.
  struct Fill {
    int64_t expert = -1, row = -1, victim = -1;
    bool held = false;  // the sink holds the expert's verified bytes: no read
    int err = 0;
    uint32_t got = 0;
    int64_t ns = 0;
    bool done = false;  // streamed: the background read finished (guarded by mu_)
    bool prefetch = false;  // a prefetch's fill (prefetch()), not a miss
    bool routed = false;    // a prefetch's fill a begin() then routed (adopted: a hit whose read may be landing)
    bool started = false;   // its read was handed to the background threads
    uint64_t stamp = 0;     // the stamp it is published (touched) with
    // A routed prefetch's entry in log_.missed (logged a hit) and the drain it belongs to: a
    // failed read marks it a miss there, unless that log was drained meanwhile.
    size_t log_at = 0;
    uint64_t log_drain = 0;
  };
  // Rows for `missing` (evicting their experts from the table), appended to `fills`; an expert
  // left without a row is logged and named in `error` (`hint`: the rest take none, silently).
  void assign_rows_locked(const std::vector<int64_t>& missing, uint64_t stamp, std::deque<Fill>& fills,
                          std::string& error, bool hint = false);
  // Start the background reads of pending_'s fills not started yet and not done (begin(), prefetch()).
  void start_pending_reads_locked();
  // On the stream thread: settle_pending_locked, its wait counted as the stream's (read_wait_ns).
  void settle_on_stream_locked(std::unique_lock<std::mutex>& lk);
  // Wait for the pending prefetch fills nothing routed and publish them (their rows lent again).
  void settle_unrouted_locked(std::unique_lock<std::mutex>& lk);
  // Publish the pending prefetch fill that evicted `expert` (if any), waiting for its read: before
  // `expert`'s own fill is logged (finish()). True when it waited.
  bool publish_evictor_locked(std::unique_lock<std::mutex>& lk, int64_t expert, std::string& error);
  // pending_[i] is not published yet (pending_at_ names it; an expert may have older, published fills).
  bool still_pending_locked(size_t i) const;
  // A routed expert found in its row: counted as a prefetch's hit when a prefetch put it there.
  void note_hit_locked(int64_t expert);
  // Read and verify `expert`'s record into `row` (the sink's host tier when < 0), unlocked: 0 or
  // the read's errno (-1: checksum mismatch, the checksum into `got`); its time into `ns`.
  int read_record(int64_t expert, int64_t row, uint32_t& got, int64_t& ns);
  // After `expert`'s record was read into `row` (`err`: the read's result): drop it from the page
  // cache where asked, and check it; returns `err`, or -1 on a checksum mismatch (into `got`).
  int verify_record(int64_t expert, int64_t row, int err, uint32_t& got);
  // Read and verify one fill (unlocked: its row is out of the lent list and the table).
  void read_fill(Fill& f) { f.err = read_record(f.expert, f.row, f.got, f.ns); }
  // A background read is over (takes the lock): `f` done (none: an ordered read's job ending),
  // one pending read less, and its waiters woken. A job's last touch of the table.
  void read_done(Fill* f);
  // Log a finished fill and put its row back at the end of the lent list (published on success).
  // `background`: a streamed resolve's read (its time is not the stream's).
  void publish_locked(Fill& f, uint64_t stamp, std::string& error, bool background = false);
  // Wait for every pending streamed read and publish it (the first failure into `error`).
  void finish_all_locked(std::unique_lock<std::mutex>& lk, std::string& error);
  // finish_all_locked for loop-thread calls: a failure is only logged (the step reports it).
  void settle_pending_locked(std::unique_lock<std::mutex>& lk);

  const int layer_;
  const int64_t n_experts_;
  std::unique_ptr<RecordSink> sink_;
  const int fd_;
  const std::string path_;
  const uint64_t stride_;
  const int64_t rows_;

  mutable std::mutex mu_;
  std::string node_failure_;  // guarded by mu_
  std::string fail_next_;     // guarded by mu_ (testing_fail_next)
  std::vector<int32_t> table_;      // expert -> row
  std::vector<int64_t> owner_;      // row -> expert (-1: none, or a fill in progress)
  std::vector<uint8_t> lent_flag_;  // row -> lent (and not being filled right now)
  std::vector<int64_t> lent_;       // lent rows, lend order (a filled row goes to the back)
  std::vector<uint64_t> last_use_;  // expert -> stamp of the last resolve that routed it
  std::vector<double> score_;       // expert * half_lives_.size() + i -> decayed use count under
                                    // half_lives_[i] as of last_use_ (Decayed order)
  std::vector<uint8_t> prefetched_; // expert -> in its row by a prefetch, not routed since
  VictimOrder order_ = VictimOrder::Recency;
  io::ChecksumKind checksum_kind_ = io::ChecksumKind::None;
  std::atomic<bool> drop_cache_{false};
  std::vector<uint32_t> checksums_;
  std::vector<double> half_lives_{8.0};  // the half-lives counts are kept under
  size_t ranked_ = 0;                    // the one of half_lives_ the Decayed order ranks by
  std::vector<uint64_t> seen_;      // expert -> stamp of the resolve in progress (dedup)
  uint64_t clock_ = 0;
  Drained log_;
  uint64_t drains_ = 0;  // drain() calls: which log_ a Fill's log_at points into
  std::vector<int64_t> absorbed_;  // absorb_device_uses_locked's scratch
  // Streamed reads begin() started and finish() has not published (stable while any is pending:
  // background threads write into their elements).
  std::deque<Fill> pending_;  // a deque: appending never moves what running reads write into
  std::vector<int32_t> pending_at_;  // expert -> index into pending_ (-1: none)
  size_t pending_reads_ = 0;         // of pending_, reads not done yet (+1 while an ordered read's job runs)
  size_t pending_left_ = 0;          // of pending_, fills not published yet
  std::condition_variable read_done_;

  std::atomic<uint64_t> resolves_{0}, pairs_{0}, hits_{0}, faults_{0}, tier_faults_{0}, fault_errors_{0}, bytes_read_{0},
      fault_ns_{0}, staged_{0}, staged_copies_{0}, device_resolves_{0}, streamed_{0}, read_wait_ns_{0}, background_ns_{0},
      prefetches_{0}, prefetch_reads_{0}, prefetch_hits_{0}, prefetch_errors_{0};
  // set_fault's range: written on the loop thread, read by the readers (err last / first).
  std::atomic<uint64_t> fault_lo_{0}, fault_hi_{0}, faults_injected_{0};
  std::atomic<int> fault_err_{0};
};

// Process-wide balance counters for tests: tables built/destroyed, nodes built/destroyed.
struct GlobalCounters {
  std::atomic<uint64_t> tables_created{0}, tables_destroyed{0}, nodes_created{0}, nodes_destroyed{0};
  std::atomic<uint64_t> fault_errors{0};  // failed faults in every table: a cheap "did any fail?"
  std::atomic<uint64_t> shared_reads{0};  // resolves whose reads went to the read pool's workers too
  std::atomic<uint64_t> background_reads{0};  // streamed reads handed to the background threads
  std::atomic<uint64_t> direct_in_place{0};   // O_DIRECT reads straight into pool rows (no copy)
  std::atomic<uint64_t> chunked_reads{0};     // O_DIRECT record reads split into chunks (chunked_read.h)
  std::atomic<uint64_t> chunk_ops{0};         // requests those reads submitted (a short read's rest counts again)
  std::atomic<uint64_t> chunk_fallbacks{0};   // reads that would have been chunked, read whole (no io_uring ring)
  std::atomic<uint64_t> ordered_reads{0};     // streamed resolves whose records were read in order (read_ordered)
};
GlobalCounters& global_counters();
// Test hook: false reads every O_DIRECT record through an aligned buffer and copies it into the
// rows, never straight into them; `force` reads in place even into rows that do not take direct
// reads (io::Destination::takes_direct_reads: to show why they do not).
void set_direct_in_place(bool on, bool force = false);

uint64_t fault_errors_total();

}  // namespace asyncside::faults

namespace asyncside::io {
class HostMirror;
}

namespace asyncside::faults {
// The graph node: rows (uint32, ids' shape) of `ids` in `table`'s layer, faulting misses in when
// the stream reaches it. Integer ids of any shape and strides.
//  - CPU stream: a task on the stream resolves the ids (HostRecordSink: reads into the rows).
//  - CUDA: a child graph of MLX's encoder, kernel / host node / kernel (expert_faults_cuda.cpp;
//    the table's sink is the device one, reading into the pinned host mirror).
//  - Metal: memory is unified, so the node runs on the CPU stream: MLX makes that stream wait for
//    the GPU's shared event before it, and the GPU's command buffer wait for the CPU's after it.
//  `staged`: the node runs FaultTable::stage instead (a device table whose sink stages; its rows
//  are the expert ids, for a gather over the staging arrays).
mlx::core::array expert_rows(const mlx::core::array& ids, std::shared_ptr<FaultTable> table,
                             mlx::core::Stream stream, bool staged = false);

// The streamed pair (CPU stream, host sinks): `begin_rows` maps every id to its row and starts
// the misses' reads (FaultTable::begin); its output is the ids' shape with the last axis (a
// token's k slots) doubled: [the slots' rows | the order to compute them in: slots whose expert is
// in first, then the rest as their reads were issued]. `finish_rows(ids, rows)` passes `rows` (a
// part of the begin's rows, for the experts `ids`) through once those experts' reads are
// published (FaultTable::finish). A gather that depends on a finish node reads its rows in place.
mlx::core::array begin_rows(const mlx::core::array& ids, std::shared_ptr<FaultTable> table, mlx::core::Stream stream);
// A prefetch node (CPU stream, host sinks): `after` passed through, and when the stream gets there
// `table`'s layer prefetches the experts `ids` (FaultTable::prefetch). Placed where its layer's
// reads should start: the output must feed what comes next, or the node is never run.
mlx::core::array prefetch_rows(const mlx::core::array& after, const mlx::core::array& ids,
                               std::shared_ptr<FaultTable> table, mlx::core::Stream stream);
mlx::core::array finish_rows(const mlx::core::array& ids, const mlx::core::array& rows,
                             std::shared_ptr<FaultTable> table, mlx::core::Stream stream);

// A sink for device pools (MLX CUDA): reads land in `mirror` (pinned, mapped), copies to `pools`
// happen on the device. `by_expert`: `mirror` has one row per expert of the layer (a host tier:
// each record is read and verified once, later faults of it are a device copy alone); else one
// row per pool row. Throws where the CUDA path is not compiled in.
std::unique_ptr<RecordSink> make_device_sink(std::shared_ptr<io::HostMirror> mirror,
                                             std::vector<mlx::core::array> pools, uint64_t stride,
                                             std::vector<io::SegmentSpan> segments, uint32_t max_pairs,
                                             bool by_expert);
bool device_faults_available() noexcept;
// "device", "host" or "child" (expert_faults_cuda.cpp: ASYNCSIDE_CUDA_FAULT_NODE); "none" without CUDA.
const char* device_fault_node_form() noexcept;
// Give a device table's sink its staging arrays: one evaluated device array per segment, one row
// per expert of the layer (several layers of one shape may share them: queued steps order their
// users through data). Only before any queued step reads the table. Needs a host tier (a sink
// built by_expert); throws std::invalid_argument otherwise, or where CUDA is not compiled in.
void set_device_staging(FaultTable& table, std::vector<mlx::core::array> staging);

#if defined(ASYNCSIDE_CUDA)
mlx::core::array prepare_device_ids(const mlx::core::array& ids, mlx::core::Stream stream);
void eval_device_faults(const std::shared_ptr<FaultTable>& table, const mlx::core::array& ids,
                        mlx::core::array& out, mlx::core::Stream stream, bool staged);
#endif
}  // namespace asyncside::faults
static_assert(sizeof(asyncside::faults::FaultEvent) == 6 * sizeof(int64_t), "FaultEvent is read as int64 rows");
