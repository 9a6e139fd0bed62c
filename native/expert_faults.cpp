// Expert faults served inside the stream: the fault table and the `expert_rows` graph node.
#include "expert_faults.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <stdexcept>

#include <fcntl.h>
#include <sys/uio.h>
#include <unistd.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "chunked_read.h"
#include "read_pool.h"

namespace mx = mlx::core;

namespace asyncside::faults {

GlobalCounters& global_counters() {
  static GlobalCounters c;
  return c;
}

uint64_t fault_errors_total() { return global_counters().fault_errors.load(std::memory_order_acquire); }

namespace {

// Gaps between segments up to this are read into a sink; a larger one ends the vector.
constexpr uint64_t kMaxSink = 64ull << 10;

std::string errno_text(int e) {
  return std::string(std::strerror(e)) + " (errno " + std::to_string(e) + ")";
}

}  // namespace

// ---- HostRecordSink --------------------------------------------------------------------------

HostRecordSink::HostRecordSink(std::shared_ptr<io::Destination> dest, uint64_t stride,
                               std::vector<io::SegmentSpan> segments)
    : dest_(std::move(dest)), stride_(stride) {
  if (!dest_) throw std::invalid_argument("destination: expected pools, got none");
  if (segments.empty()) throw std::invalid_argument("segments: a record needs at least one segment");
  for (const auto& s : segments) nbytes_.push_back(s.nbytes);
  order_.resize(segments.size());
  std::iota(order_.begin(), order_.end(), size_t{0});
  std::sort(order_.begin(), order_.end(),
            [&](size_t a, size_t b) { return segments[a].offset < segments[b].offset; });
  uint64_t end = 0;
  for (size_t k : order_) {
    const auto& s = segments[k];
    if (s.offset < end || s.offset + s.nbytes > stride) {
      throw std::invalid_argument("segments: segment " + std::to_string(k) + " [" + std::to_string(s.offset) + ", " +
                                  std::to_string(s.offset + s.nbytes) + ") overlaps another or leaves the record (stride " +
                                  std::to_string(stride) + ")");
    }

    if (end && s.offset > end) junk_bytes_ = std::max(junk_bytes_, std::min(s.offset - end, kMaxSink));
    end = s.offset + s.nbytes;
    segments_.push_back(s);
  }
  blocks_only_ = true;
  for (size_t k = 0; k < segments_.size(); ++k) {
    const auto& seg = segments_[k];
    const bool adjacent = k == 0 || seg.offset == segments_[k - 1].offset + segments_[k - 1].nbytes;
    if (!adjacent || seg.offset % 4096 || seg.nbytes % 4096) blocks_only_ = false;
  }
  if (junk_bytes_) {
    junk_ = static_cast<uint8_t*>(std::malloc(junk_bytes_));
    if (!junk_) throw std::runtime_error("cannot allocate the padding sink");
  }
}

HostRecordSink::~HostRecordSink() { std::free(junk_); }

uint32_t HostRecordSink::checksum_row(io::ChecksumKind kind, int64_t row) {
  uint32_t state = 0;
  for (size_t i = 0; i < nbytes_.size(); ++i) state = io::checksum_update(kind, state, dest_->host_row(i, row), nbytes_[i]);
  return state;
}

namespace {

constexpr uint64_t kDirectAlign = 4096;

// One aligned buffer per reading thread (reads of a resolve run side by side on the read pool),
// grown to the largest span read; freed when the thread ends.
struct AlignedScratch {
  uint8_t* data = nullptr;
  uint64_t size = 0;
  ~AlignedScratch() { std::free(data); }
  uint8_t* at_least(uint64_t n) {
    if (n > size) {
      std::free(data);
      data = static_cast<uint8_t*>(std::aligned_alloc(kDirectAlign, n));
      size = data ? n : 0;
    }
    return data;
  }
};

std::atomic<bool> g_direct_in_place{true};  // testing: false sends every O_DIRECT read through a buffer
std::atomic<bool> g_force_in_place{false};  // testing: true reads in place where the rows take no direct reads

}  // namespace

void set_direct_in_place(bool on, bool force) {
  g_direct_in_place.store(on, std::memory_order_relaxed);
  g_force_in_place.store(on && force, std::memory_order_relaxed);
}

bool HostRecordSink::in_place_allowed() const {
  return g_direct_in_place.load(std::memory_order_relaxed) &&
         (dest_->takes_direct_reads() || g_force_in_place.load(std::memory_order_relaxed));
}

int HostRecordSink::read_row_direct(int fd, uint64_t offset, int64_t row) {
  // Straight into the pool rows when the record is whole blocks end to end (every segment block
  // aligned and sized, no gap between them) and so are the rows: no copy pass over the record.
  if (blocks_only_ && in_place_allowed()) {
    std::vector<iovec> iov;
    iov.reserve(segments_.size());
    bool aligned = true;
    for (size_t k = 0; k < segments_.size() && aligned; ++k) {
      uint8_t* dst = dest_->host_row(order_[k], row);
      aligned = reinterpret_cast<uintptr_t>(dst) % kDirectAlign == 0;
      iov.push_back({dst, segments_[k].nbytes});
    }
    if (aligned) {
      global_counters().direct_in_place.fetch_add(1, std::memory_order_relaxed);
      return read_direct_chunked(fd, iov, offset + segments_.front().offset);
    }
  }
  // Else the record's span from its first segment to its last, widened to whole blocks, into an
  // aligned buffer, and the segments copied out: records are block aligned in the blob, so the
  // widened span never leaves the record.
  thread_local AlignedScratch scratch;
  const uint64_t first = segments_.front().offset / kDirectAlign * kDirectAlign;
  const uint64_t end = (segments_.back().offset + segments_.back().nbytes + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
  uint8_t* buf = scratch.at_least(end - first);
  if (!buf) return ENOMEM;
  if (int err = read_direct_chunked(fd, {iovec{buf, end - first}}, offset + first)) return err;
  for (size_t k = 0; k < segments_.size(); ++k) {
    const auto& s = segments_[k];
    std::memcpy(dest_->host_row(order_[k], row), buf + (s.offset - first), s.nbytes);
  }
  return 0;
}

unsigned HostRecordSink::read_window() const {
  const int own = window_.load(std::memory_order_relaxed);
  return own < 0 ? fault_read_window() : static_cast<unsigned>(own);
}

HostRecordSink* HostRecordSink::ordered_reader() {
  return direct_.load(std::memory_order_relaxed) && fault_read_chunk() > 0 && read_window() > 0 &&
                 ordered_reads_possible()
             ? this
             : nullptr;
}

void HostRecordSink::read_rows_ordered(int fd, const std::vector<std::pair<uint64_t, int64_t>>& records,
                                       const std::function<void(size_t, int, int64_t)>& landed) {
  using clock = std::chrono::steady_clock;
  auto since = [](clock::time_point t0) {
    return static_cast<int64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - t0).count());
  };
  if (!ordered_reads_ready()) {
    // No ring on this thread: one record after another, still in order.
    for (size_t k = 0; k < records.size(); ++k) {
      const auto t0 = clock::now();
      const int err = read_row(fd, records[k].first, records[k].second);
      landed(k, err, since(t0));
    }
    return;
  }
  // The record's bytes as read: its first segment to its last, widened to whole blocks (records
  // are block aligned in the blob, so the span never leaves the record).
  const uint64_t first = segments_.front().offset / kDirectAlign * kDirectAlign;
  const uint64_t end = (segments_.back().offset + segments_.back().nbytes + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
  const uint64_t chunk = std::min<uint64_t>(fault_read_chunk(), end - first);
  const unsigned window = read_window();
  // Where a record's segments are whole blocks end to end, and so are its rows, its pieces read
  // straight into them; else each piece lands in one of `window` bounce buffers (one per piece in
  // flight, so memory does not grow with the record) and its bytes are copied into the rows.
  std::vector<uint8_t> in_place(records.size(), 0);
  for (size_t k = 0; k < records.size(); ++k) {
    bool aligned = blocks_only_ && in_place_allowed() && records[k].first % kDirectAlign == 0;
    for (size_t s = 0; s < segments_.size() && aligned; ++s) {
      aligned = reinterpret_cast<uintptr_t>(dest_->host_row(order_[s], records[k].second)) % kDirectAlign == 0;
    }
    in_place[k] = aligned ? 1 : 0;
    if (aligned) global_counters().direct_in_place.fetch_add(1, std::memory_order_relaxed);
  }
  thread_local AlignedScratch bounce;
  uint8_t* buffers = bounce.at_least(chunk * window);
  const size_t per_record = static_cast<size_t>((end - first + chunk - 1) / chunk);
  const size_t n = per_record * records.size();
  std::vector<ReadPiece> pieces(n);
  std::vector<int> slot_of(n, -1);           // piece -> bounce buffer
  std::vector<int> free_slots;               // bounce buffers no piece in flight holds
  for (unsigned b = window; b-- > 0;) free_slots.push_back(static_cast<int>(b));
  std::vector<size_t> left(records.size(), per_record);  // pieces not landed, per record
  std::vector<int> failed(records.size(), 0);
  std::vector<uint8_t> told(records.size(), 0);
  std::vector<clock::time_point> started(records.size());
  // Piece p's bytes within its record: [a, b).
  auto span = [&](size_t p) {
    const uint64_t a = first + (p % per_record) * chunk;
    return std::pair<uint64_t, uint64_t>{a, std::min(a + chunk, end)};
  };
  // The part [lo, hi) of piece p's range (relative to the record) in segment s, handed to
  // `fn(segment, lo, hi)` for every segment the range meets.
  auto overlaps = [&](size_t p, const auto& fn) {
    const auto [a, b] = span(p);
    for (size_t s = 0; s < segments_.size(); ++s) {
      const uint64_t lo = std::max(a, segments_[s].offset);
      const uint64_t hi = std::min(b, segments_[s].offset + segments_[s].nbytes);
      if (lo < hi) fn(s, lo, hi);
    }
  };
  auto prepare = [&](size_t p) -> ReadPiece& {
    const size_t k = p / per_record;
    if (p % per_record == 0) started[k] = clock::now();
    const auto [a, b] = span(p);
    ReadPiece& pc = pieces[p];
    pc.off = records[k].first + a;
    pc.left = b - a;
    if (in_place[k]) {
      overlaps(p, [&](size_t s, uint64_t lo, uint64_t hi) {
        pc.iov.push_back({dest_->host_row(order_[s], records[k].second) + (lo - segments_[s].offset), hi - lo});
      });
    } else {
      slot_of[p] = free_slots.back();
      free_slots.pop_back();
      pc.iov.push_back({buffers + static_cast<uint64_t>(slot_of[p]) * chunk, b - a});
    }
    return pc;
  };
  auto piece_landed = [&](size_t p, int err) {
    const size_t k = p / per_record;
    if (slot_of[p] >= 0) {
      uint8_t* buf = buffers + static_cast<uint64_t>(slot_of[p]) * chunk;
      if (err == 0) {
        const uint64_t a = span(p).first;
        overlaps(p, [&](size_t s, uint64_t lo, uint64_t hi) {
          std::memcpy(dest_->host_row(order_[s], records[k].second) + (lo - segments_[s].offset), buf + (lo - a), hi - lo);
        });
      }
      free_slots.push_back(slot_of[p]);
      slot_of[p] = -1;
    }
    if (err != 0 && failed[k] == 0) failed[k] = err;
    if (--left[k] == 0) {
      told[k] = 1;
      landed(k, failed[k], since(started[k]));
    }
  };
  if (buffers == nullptr) {
    for (size_t k = 0; k < records.size(); ++k) landed(k, ENOMEM, 0);
    return;
  }
  read_ordered(fd, n, window, prepare, piece_landed);
  // A failure stops the submissions: the records it left unread (wholly or in part) are not
  // read, and say so (ECANCELED), not the failure's errno, which is another record's.
  for (size_t k = 0; k < records.size(); ++k) {
    if (!told[k]) landed(k, failed[k] != 0 ? failed[k] : ECANCELED, 0);
  }
}

int HostRecordSink::read_row(int fd, uint64_t offset, int64_t row) {
  if (direct_.load(std::memory_order_relaxed) && offset % kDirectAlign == 0) return read_row_direct(fd, offset, row);
  // Segments in file order, each straight into its pool row; small gaps into the sink, large
  // gaps split the read in two.
  std::vector<iovec> iov;
  uint64_t start = segments_.front().offset;
  uint64_t end = start;
  for (size_t k = 0; k < segments_.size(); ++k) {
    const auto& s = segments_[k];
    if (s.offset > end) {
      if (s.offset - end > kMaxSink) {
        if (int err = preadv_full(fd, iov, offset + start)) return err;
        iov.clear();
        start = s.offset;
      } else {
        iov.push_back({junk_, s.offset - end});
      }
    }
    iov.push_back({dest_->host_row(order_[k], row), s.nbytes});
    end = s.offset + s.nbytes;
  }
  return preadv_full(fd, iov, offset + start);
}

// ---- FaultTable ------------------------------------------------------------------------------

FaultTable::FaultTable(int layer, int64_t n_experts, std::unique_ptr<RecordSink> sink, int fd, std::string path,
                       uint64_t stride)
    : layer_(layer),
      n_experts_(n_experts),
      sink_(std::move(sink)),
      fd_(fd),
      path_(std::move(path)),
      stride_(stride),
      rows_(sink_ ? sink_->rows() : 0) {
  if (fd_ < 0) throw std::invalid_argument("fd: expected an open descriptor of the layer blob");
  if (n_experts_ < 1) throw std::invalid_argument("n_experts: expected >= 1");
  if (rows_ < 1) throw std::invalid_argument("pools: expected at least one row");
  table_.assign(static_cast<size_t>(n_experts_), -1);
  owner_.assign(static_cast<size_t>(rows_), -1);
  lent_flag_.assign(static_cast<size_t>(rows_), 0);
  last_use_.assign(static_cast<size_t>(n_experts_), 0);
  score_.assign(static_cast<size_t>(n_experts_), 0.0);
  seen_.assign(static_cast<size_t>(n_experts_), 0);
  prefetched_.assign(static_cast<size_t>(n_experts_), 0);
  sink_->table_reset(table_);
  global_counters().tables_created.fetch_add(1, std::memory_order_relaxed);
}

FaultTable::~FaultTable() {
  {
    // Background reads of a begin() write into this table's rows and members: none may outlive it.
    std::unique_lock<std::mutex> lk(mu_);
    read_done_.wait(lk, [&] { return pending_reads_ == 0; });
  }
  ::close(fd_);
  global_counters().tables_destroyed.fetch_add(1, std::memory_order_relaxed);
}

void FaultTable::sync(const std::vector<int32_t>& table) {
  std::unique_lock<std::mutex> lk(mu_);
  settle_pending_locked(lk);
  absorb_device_uses_locked();
  if (!lent_.empty()) {
    throw std::invalid_argument("layer " + std::to_string(layer_) + ": sync() with " + std::to_string(lent_.size()) +
                                " rows still lent; reclaim() them first");
  }
  if (static_cast<int64_t>(table.size()) != n_experts_) {
    throw std::invalid_argument("table: expected " + std::to_string(n_experts_) + " entries, got " +
                                std::to_string(table.size()));
  }
  std::vector<int64_t> owner(static_cast<size_t>(rows_), -1);
  for (int64_t e = 0; e < n_experts_; ++e) {
    const int32_t r = table[static_cast<size_t>(e)];
    if (r < 0) continue;
    if (r >= rows_) {
      throw std::invalid_argument("table: expert " + std::to_string(e) + " maps to row " + std::to_string(r) +
                                  ", outside [0, " + std::to_string(rows_) + ")");
    }
    if (owner[static_cast<size_t>(r)] >= 0) {
      throw std::invalid_argument("table: row " + std::to_string(r) + " holds experts " +
                                  std::to_string(owner[static_cast<size_t>(r)]) + " and " + std::to_string(e));
    }
    owner[static_cast<size_t>(r)] = e;
  }
  table_ = table;
  owner_ = std::move(owner);
  sink_->table_reset(table_);
}

void FaultTable::lend(const std::vector<int64_t>& rows) {
  std::lock_guard<std::mutex> lk(mu_);
  for (size_t i = 0; i < rows.size(); ++i) {
    const int64_t r = rows[i];
    if (r < 0 || r >= rows_) {
      throw std::invalid_argument("rows: " + std::to_string(r) + " is outside [0, " + std::to_string(rows_) + ")");
    }
    if (lent_flag_[static_cast<size_t>(r)] || std::find(rows.begin(), rows.begin() + i, r) != rows.begin() + i) {
      throw std::invalid_argument("rows: " + std::to_string(r) + " is already lent");
    }
  }
  for (int64_t r : rows) {
    lent_flag_[static_cast<size_t>(r)] = 1;
    lent_.push_back(r);
  }
}

std::vector<int64_t> FaultTable::reclaim() {
  std::unique_lock<std::mutex> lk(mu_);
  settle_pending_locked(lk);
  std::vector<int64_t> out;
  out.swap(lent_);
  for (int64_t r : out) lent_flag_[static_cast<size_t>(r)] = 0;
  return out;
}

void FaultTable::failed(const char* what) noexcept {
  try {
    std::lock_guard<std::mutex> lk(mu_);
    log_event_locked({-1, -1, -1, 0, kNodeFailed, 0});
    node_failure_ = std::string("[asyncside] layer ") + std::to_string(layer_) + ": a fault node failed: " + what;
  } catch (...) {
    // Out of memory for the log itself: the counters below still fail the step.
  }
  fault_errors_.fetch_add(1, std::memory_order_relaxed);
  global_counters().fault_errors.fetch_add(1, std::memory_order_release);
}

void FaultTable::testing_fail_next(std::string message) {
  std::lock_guard<std::mutex> lk(mu_);
  fail_next_ = std::move(message);
}

void FaultTable::throw_injected_locked() {
  if (fail_next_.empty()) return;
  std::string message = std::move(fail_next_);
  fail_next_.clear();
  throw std::runtime_error(message);
}

std::string FaultTable::failure() const {
  std::lock_guard<std::mutex> lk(mu_);
  return node_failure_;
}

Drained FaultTable::drain() {
  std::lock_guard<std::mutex> lk(mu_);
  absorb_device_uses_locked();
  Drained out;
  std::swap(out, log_);
  ++drains_;
  return out;
}

std::vector<int32_t> FaultTable::table() {
  std::lock_guard<std::mutex> lk(mu_);
  absorb_device_uses_locked();
  return table_;
}

std::vector<int64_t> FaultTable::lent() const {
  std::lock_guard<std::mutex> lk(mu_);
  return lent_;
}

std::map<std::string, uint64_t> FaultTable::counters() {
  uint64_t pending_fills = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    absorb_device_uses_locked();
    pending_fills = pending_.size();
  }
  return {{"pending_fills", pending_fills},       {"resolves", resolves_.load()},         {"pairs", pairs_.load()},
          {"hits", hits_.load()},                 {"faults", faults_.load()},
          {"fault_errors", fault_errors_.load()}, {"bytes_read", bytes_read_.load()},
          {"fault_ns", fault_ns_.load()},         {"tier_faults", tier_faults_.load()},
          {"staged", staged_.load()},             {"staged_copies", staged_copies_.load()},
          {"device_resolves", device_resolves_.load()}, {"streamed", streamed_.load()},
          {"read_wait_ns", read_wait_ns_.load()}, {"background_ns", background_ns_.load()},
          {"prefetches", prefetches_.load()},     {"prefetch_reads", prefetch_reads_.load()},
          {"prefetch_hits", prefetch_hits_.load()}, {"prefetch_errors", prefetch_errors_.load()},
          {"faults_injected", faults_injected_.load()}};
}

void FaultTable::absorb_device_uses_locked() {
  uint64_t pairs = 0;
  while (sink_->next_device_use(absorbed_, pairs)) {
    // What resolve() does for a step whose experts all hit, as of when the device ran it: every
    // resolve since (on the host, or replayed here) came after it, so the stamps keep the order.
    resolves_.fetch_add(1, std::memory_order_relaxed);
    device_resolves_.fetch_add(1, std::memory_order_relaxed);
    pairs_.fetch_add(pairs, std::memory_order_relaxed);
    hits_.fetch_add(absorbed_.size(), std::memory_order_relaxed);
    const uint64_t stamp = ++clock_;
    for (int64_t e : absorbed_) {
      seen_[static_cast<size_t>(e)] = stamp;
      touch_locked(e, stamp);
      log_.used.push_back(static_cast<int32_t>(e));
    }
    log_.used_sizes.push_back(static_cast<int32_t>(absorbed_.size()));
    log_.missed.resize(log_.used.size(), 0);  // a device resolve is all hits
  }
}

void FaultTable::set_order(VictimOrder order, double half_life, const std::vector<double>& kept) {
  if (!(half_life > 0.0)) throw std::invalid_argument("half_life: expected > 0");
  for (double h : kept) {
    if (!(h > 0.0)) throw std::invalid_argument("kept half-lives: expected each > 0, got " + std::to_string(h));
  }
  std::lock_guard<std::mutex> lk(mu_);
  order_ = order;
  std::vector<double> want = half_lives_;
  auto index = [&want](double h) -> size_t {
    for (size_t i = 0; i < want.size(); ++i) {
      if (want[i] == h) return i;
    }
    want.push_back(h);
    return want.size() - 1;
  };
  for (double h : kept) index(h);
  const size_t ranked = index(half_life);
  if (want.size() != half_lives_.size()) {
    // New columns start from the ranked one's counts (as one count re-read under another half-life).
    const size_t old_h = half_lives_.size(), new_h = want.size();
    std::vector<double> grown(static_cast<size_t>(n_experts_) * new_h, 0.0);
    for (size_t e = 0; e < static_cast<size_t>(n_experts_); ++e) {
      for (size_t i = 0; i < new_h; ++i) {
        grown[e * new_h + i] = score_[e * old_h + (i < old_h ? i : ranked_)];
      }
    }
    score_ = std::move(grown);
    half_lives_ = std::move(want);
  }
  ranked_ = ranked;
}

void FaultTable::set_checksums(io::ChecksumKind kind, std::vector<uint32_t> expected) {
  if (kind != io::ChecksumKind::None && static_cast<int64_t>(expected.size()) != n_experts_) {
    throw std::invalid_argument("checksums: expected " + std::to_string(n_experts_) + ", got " +
                                std::to_string(expected.size()));
  }
  std::unique_lock<std::mutex> lk(mu_);
  settle_pending_locked(lk);
  checksum_kind_ = kind;
  checksums_ = std::move(expected);
}

void FaultTable::set_drop_cache(bool on) { drop_cache_.store(on, std::memory_order_relaxed); }

void FaultTable::set_fault(uint64_t lo, uint64_t hi, int err) {
  if (err < 0) throw std::invalid_argument("set_fault: err must be an errno >= 0, got " + std::to_string(err));
  if (err != 0 && hi <= lo) {
    throw std::invalid_argument("set_fault: an empty range [" + std::to_string(lo) + ", " + std::to_string(hi) + ")");
  }
  fault_err_.store(0, std::memory_order_release);  // off while the range changes
  fault_lo_.store(lo, std::memory_order_relaxed);
  fault_hi_.store(hi, std::memory_order_relaxed);
  fault_err_.store(err, std::memory_order_release);
}

void FaultTable::set_read_window(int pieces) {
  if (pieces < -1 || pieces > static_cast<int>(kMaxFaultReadWindow)) {
    throw std::invalid_argument("read window: expected -1 (the process's), 0 (a background job per record) or 1 to " +
                                std::to_string(kMaxFaultReadWindow) + " pieces in flight, got " + std::to_string(pieces));
  }
  sink_->set_read_window(pieces);
}

void FaultTable::after_read(uint64_t offset) {
  // Advice only: a failure leaves the pages cached, nothing else.
  if (drop_cache_.load(std::memory_order_relaxed)) {
    ::posix_fadvise(fd_, static_cast<off_t>(offset), static_cast<off_t>(stride_), POSIX_FADV_DONTNEED);
  }
}

void FaultTable::touch_locked(int64_t expert, uint64_t stamp) {
  const auto e = static_cast<size_t>(expert);
  // The decayed counts are kept in every order: the policy may switch the order between steps
  // (LRFU's recency guard), and ranks by them must then be current, not as of the switch.
  const double age = static_cast<double>(stamp - last_use_[e]);
  const size_t n = half_lives_.size();
  for (size_t i = 0; i < n; ++i) {
    double& s = score_[e * n + i];
    s = (last_use_[e] ? s * std::exp2(-age / half_lives_[i]) : 0.0) + 1.0;
  }
  last_use_[e] = stamp;
}

double FaultTable::rank_locked(int64_t expert, uint64_t stamp) const {
  // Lower ranks are evicted first.
  const auto e = static_cast<size_t>(expert);
  switch (order_) {
    case VictimOrder::LendOrder:
      return 0.0;
    case VictimOrder::Recency:
      return static_cast<double>(last_use_[e]);
    case VictimOrder::Decayed:
      return last_use_[e] ? score_[e * half_lives_.size() + ranked_] *
                                std::exp2(-static_cast<double>(stamp - last_use_[e]) / half_lives_[ranked_])
                          : 0.0;
  }
  return 0.0;
}

int64_t FaultTable::pick_row_locked(uint64_t stamp) {
  // A free lent row first; else the lent row whose expert ranks lowest (ties: lend order, i.e.
  // the ledger's policy order). Never a row whose expert this very resolve routes.
  size_t best = lent_.size();
  double best_rank = 0.0;
  for (size_t i = 0; i < lent_.size(); ++i) {
    const int64_t owner = owner_[static_cast<size_t>(lent_[i])];
    if (owner < 0) {
      best = i;
      break;
    }
    if (seen_[static_cast<size_t>(owner)] == stamp) continue;
    const double r = rank_locked(owner, stamp);
    if (best == lent_.size() || r < best_rank) {
      best = i;
      best_rank = r;
    }
  }
  if (best == lent_.size()) return -1;
  const int64_t row = lent_[best];
  lent_.erase(lent_.begin() + static_cast<std::ptrdiff_t>(best));
  lent_flag_[static_cast<size_t>(row)] = 0;
  return row;
}

uint64_t FaultTable::collect_locked(std::vector<int64_t>& ids, uint64_t stamp, std::vector<int64_t>& uniq,
                                   std::string& error) {
  uint64_t pairs = 0;
  for (int64_t& e : ids) {
    if (e == kNoExpert) continue;
    if (e < 0 || e >= n_experts_) {
      // A router (or a replayed trace) named no expert of this layer: logged as a failed fault of
      // row -1, so the step's awaiter raises it, and routed nowhere (row 0) from here on.
      log_event_locked({-1, -1, e, 0, kOutsideExperts, 0}, 1);
      fault_errors_.fetch_add(1, std::memory_order_relaxed);
      global_counters().fault_errors.fetch_add(1, std::memory_order_release);
      if (error.empty()) {
        error = "[asyncside] layer " + std::to_string(layer_) + ": routed expert id " + std::to_string(e) +
                " is outside [0, " + std::to_string(n_experts_) + ")";
      }
      e = kNoExpert;
      continue;
    }
    ++pairs;
    if (seen_[static_cast<size_t>(e)] != stamp) {
      seen_[static_cast<size_t>(e)] = stamp;
      uniq.push_back(e);
    }
  }
  pairs_.fetch_add(pairs, std::memory_order_relaxed);
  for (int64_t e : uniq) log_.used.push_back(static_cast<int32_t>(e));
  log_.used_sizes.push_back(static_cast<int32_t>(uniq.size()));
  log_.missed.resize(log_.used.size(), 0);  // hits until the caller marks its misses
  return pairs;
}

std::string FaultTable::read_error(int64_t expert, int64_t row, int err, uint32_t got) const {
  return "[asyncside] layer " + std::to_string(layer_) + ": reading expert " + std::to_string(expert) +
         (row >= 0 ? " into row " + std::to_string(row) : std::string(" into the host tier")) + " from " + path_ +
         " failed: " +
         (err == ENODATA     ? std::string("the file ended before the record did")
          : err == ECANCELED ? std::string("not read: an earlier record of the same streamed read failed first")
          : err == -1        ? "checksum mismatch (expected " + std::to_string(checksums_[static_cast<size_t>(expert)]) +
                                   ", got " + std::to_string(got) + ")"
                             : errno_text(err));
}

void FaultTable::assign_rows_locked(const std::vector<int64_t>& missing, uint64_t stamp, std::deque<Fill>& fills,
                                    std::string& error, bool hint) {
  // Rows for every miss first (each leaves the lent list until its fault is logged, so no two
  // misses get one row, and no row of an expert this resolve routes is taken).
  for (int64_t e : missing) {
    const int64_t row = pick_row_locked(stamp);
    if (row < 0 && hint) return;  // a prediction takes what rows there are, and fails nothing
    if (row < 0) {
      log_event_locked({-1, -1, e, 0, -2, 0});
      fault_errors_.fetch_add(1, std::memory_order_relaxed);
      global_counters().fault_errors.fetch_add(1, std::memory_order_release);
      if (error.empty()) {
        error = "[asyncside] layer " + std::to_string(layer_) + ": expert " + std::to_string(e) +
                " has no row and no lent row is left for it (the step needs more rows than were lent)";
      }
      continue;
    }
    const int64_t victim = owner_[static_cast<size_t>(row)];
    if (victim >= 0) {
      table_[static_cast<size_t>(victim)] = -1;
      prefetched_[static_cast<size_t>(victim)] = 0;
      sink_->table_changed(victim, -1);
    }
    owner_[static_cast<size_t>(row)] = -1;  // its bytes are about to change
    Fill f;
    f.expert = e;
    f.row = row;
    f.victim = victim;
    f.held = sink_->holds(e);
    f.stamp = stamp;
    fills.push_back(f);
  }
}

int FaultTable::read_record(int64_t expert, int64_t row, uint32_t& got, int64_t& ns) {
  const auto t0 = std::chrono::steady_clock::now();
  const uint64_t offset = static_cast<uint64_t>(expert) * stride_;
  const int err = verify_record(expert, row, sink_->read(fd_, offset, row, expert), got);
  ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  return err;
}

int FaultTable::verify_record(int64_t expert, int64_t row, int err, uint32_t& got) {
  const uint64_t offset = static_cast<uint64_t>(expert) * stride_;
  after_read(offset);
  // A test's injected fault fails the read as the disk would: the row's bytes are not used.
  if (err == 0) {
    if (const int injected = fault_err_.load(std::memory_order_acquire)) {
      if (offset < fault_hi_.load(std::memory_order_relaxed) && offset + stride_ > fault_lo_.load(std::memory_order_relaxed)) {
        faults_injected_.fetch_add(1, std::memory_order_relaxed);
        return injected;
      }
    }
  }
  if (err == 0 && checksum_kind_ != io::ChecksumKind::None) {
    // A row is used only after its bytes verified (checksum_kind_ / checksums_ change only
    // while nothing is queued, so reading them unlocked is safe).
    got = sink_->checksum(checksum_kind_, row, expert);
    if (got != checksums_[static_cast<size_t>(expert)]) err = -1;
  }
  return err;
}

void FaultTable::publish_locked(Fill& f, uint64_t stamp, std::string& error, bool background) {
  (background ? background_ns_ : fault_ns_).fetch_add(static_cast<uint64_t>(f.ns), std::memory_order_relaxed);
  if (f.err == 0 && !f.held) sink_->keep(f.expert);
  if (f.err == 0) f.err = sink_->publish(f.row, f.expert);
  // A prefetch's read is not a miss (source 3), unless it was routed and failed: that fails the
  // step as a miss's failed read does (source 2).
  const bool hint = f.prefetch && !(f.routed && f.err != 0);
  log_event_locked({f.row, f.victim, f.expert, f.ns, f.err, hint ? 3 : f.held ? 1 : background ? 2 : 0});
  // The row stays lent (the stream may reuse it in a later step, once this step's gathers have
  // run), at the back of the lend order: it was just filled.
  lent_flag_[static_cast<size_t>(f.row)] = 1;
  lent_.push_back(f.row);
  if (f.err == 0) {
    owner_[static_cast<size_t>(f.row)] = f.expert;
    table_[static_cast<size_t>(f.expert)] = static_cast<int32_t>(f.row);
    sink_->table_changed(f.expert, static_cast<int32_t>(f.row));
    touch_locked(f.expert, stamp);
    if (f.prefetch) {
      prefetched_[static_cast<size_t>(f.expert)] = f.routed ? 0 : 1;  // a routed one counts its hit here
      if (f.routed) {
        hits_.fetch_add(1, std::memory_order_relaxed);
        prefetch_hits_.fetch_add(1, std::memory_order_relaxed);
      }
      prefetch_reads_.fetch_add(1, std::memory_order_relaxed);
    } else {
      faults_.fetch_add(1, std::memory_order_relaxed);
    }
    if (f.held) {
      tier_faults_.fetch_add(1, std::memory_order_relaxed);
    } else {
      bytes_read_.fetch_add(stride_, std::memory_order_relaxed);
    }
  } else if (hint) {
    // A hint's read failed: its row is free again (the log says so), and the expert is read again
    // if it is routed; nothing fails the step.
    prefetch_errors_.fetch_add(1, std::memory_order_relaxed);
  } else {
    // A routed prefetch was logged a hit when adopted; it never reached its row.
    if (f.prefetch && f.log_drain == drains_ && f.log_at < log_.missed.size()) log_.missed[f.log_at] = 1;
    fault_errors_.fetch_add(1, std::memory_order_relaxed);
    global_counters().fault_errors.fetch_add(1, std::memory_order_release);
    if (error.empty()) error = read_error(f.expert, f.row, f.err, f.got);
  }
}

void FaultTable::note_hit_locked(int64_t expert) {
  hits_.fetch_add(1, std::memory_order_relaxed);
  auto& p = prefetched_[static_cast<size_t>(expert)];
  if (p) {
    p = 0;
    prefetch_hits_.fetch_add(1, std::memory_order_relaxed);
  }
}

void FaultTable::resolve(std::vector<int64_t> ids, uint32_t* out) {
  resolves_.fetch_add(1, std::memory_order_relaxed);
  std::unique_lock<std::mutex> lk(mu_);
  throw_injected_locked();
  settle_on_stream_locked(lk);
  absorb_device_uses_locked();
  const uint64_t stamp = ++clock_;
  std::vector<int64_t> uniq;
  std::string error;
  collect_locked(ids, stamp, uniq, error);
  const size_t logged = log_.missed.size() - uniq.size();  // this resolve's entries in the log
  std::vector<int64_t> missing;
  for (size_t j = 0; j < uniq.size(); ++j) {
    const int64_t e = uniq[j];
    if (table_[static_cast<size_t>(e)] >= 0) {
      touch_locked(e, stamp);
      note_hit_locked(e);
    } else {
      missing.push_back(e);
      log_.missed[logged + j] = 1;
    }
  }
  // Rows first, then the reads, unlocked and side by side, then the results, in miss order.
  std::deque<Fill> reads;
  assign_rows_locked(missing, stamp, reads, error);
  std::vector<size_t> to_read;  // the reads that go to the store (the others the sink holds)
  for (size_t i = 0; i < reads.size(); ++i) {
    if (!reads[i].held) to_read.push_back(i);
  }
  if (!to_read.empty()) {
    if (to_read.size() > 1 && read_threads() > 0) global_counters().shared_reads.fetch_add(1, std::memory_order_relaxed);
    lk.unlock();
    parallel_reads(to_read.size(), [&](size_t i) { read_fill(reads[to_read[i]]); });
    lk.lock();
  }
  for (Fill& r : reads) publish_locked(r, stamp, error);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] == kNoExpert) {
      out[i] = 0u;
      continue;
    }
    const int32_t r = table_[static_cast<size_t>(ids[i])];
    out[i] = r >= 0 ? static_cast<uint32_t>(r) : 0u;  // 0 only when the step fails below
  }
  lk.unlock();
}

void FaultTable::begin(std::vector<int64_t> ids, uint32_t* out, size_t k, uint32_t* order) {
  resolves_.fetch_add(1, std::memory_order_relaxed);
  streamed_.fetch_add(1, std::memory_order_relaxed);
  std::unique_lock<std::mutex> lk(mu_);
  throw_injected_locked();
  // A prefetch's pending fills are adopted below; any other (a step that never reached its
  // finish nodes) is settled first.
  bool prefetched_only = true;
  for (size_t i = 0; i < pending_.size(); ++i) {
    const Fill& f = pending_[i];
    if (still_pending_locked(i)) prefetched_only = prefetched_only && f.prefetch && !f.routed;
  }
  if (!prefetched_only) {
    settle_on_stream_locked(lk);
  } else if (pending_.size() > pending_left_ && pending_reads_ == 0) {
    // Unrouted prefetches keep the list (it is cleared once none is pending): drop the fills
    // published since, or it grows by every miss while no prefetch or settle comes. No read
    // runs, so none writes into what moves.
    std::deque<Fill> kept;
    for (size_t i = 0; i < pending_.size(); ++i) {
      if (!still_pending_locked(i)) continue;
      pending_at_[static_cast<size_t>(pending_[i].expert)] = static_cast<int32_t>(kept.size());
      kept.push_back(pending_[i]);
    }
    pending_.swap(kept);
  }
  absorb_device_uses_locked();
  const uint64_t stamp = ++clock_;
  std::vector<int64_t> uniq;
  std::string error;
  collect_locked(ids, stamp, uniq, error);
  const size_t logged = log_.missed.size() - uniq.size();  // this begin's entries in the log
  std::vector<int64_t> missing;
  size_t adopted = 0;
  for (size_t j = 0; j < uniq.size(); ++j) {
    const int64_t e = uniq[j];
    const int32_t at = pending_at_.empty() ? -1 : pending_at_[static_cast<size_t>(e)];
    if (table_[static_cast<size_t>(e)] >= 0) {
      touch_locked(e, stamp);
      note_hit_locked(e);
    } else if (at >= 0) {
      // Predicted right: a hit whose read may still be landing (its finish() waits for it).
      Fill& f = pending_[static_cast<size_t>(at)];
      f.routed = true;
      f.stamp = stamp;
      f.log_at = logged + j;
      f.log_drain = drains_;
      ++adopted;  // a hit once its read verified (publish_locked)
    } else {
      missing.push_back(e);
      log_.missed[logged + j] = 1;
    }
  }
  if (!missing.empty() && pending_left_ > adopted) {
    // The unrouted prefetches hold rows out of the lent list: publish them first where the
    // misses would otherwise run out of rows (a row whose expert this begin routes is not one).
    size_t free_rows = 0;
    for (int64_t row : lent_) {
      const int64_t owner = owner_[static_cast<size_t>(row)];
      if (owner < 0 || seen_[static_cast<size_t>(owner)] != stamp) ++free_rows;
    }
    if (free_rows < missing.size()) settle_unrouted_locked(lk);
  }
  if (pending_left_ == 0) pending_.clear();
  const size_t first_new = pending_.size();
  assign_rows_locked(missing, stamp, pending_, error);
  pending_left_ += pending_.size() - first_new;
  if (pending_at_.empty()) pending_at_.assign(static_cast<size_t>(n_experts_), -1);
  for (size_t i = first_new; i < pending_.size(); ++i) {
    pending_at_[static_cast<size_t>(pending_[i].expert)] = static_cast<int32_t>(i);
    if (pending_[i].held) pending_[i].done = true;
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] == kNoExpert) {
      out[i] = 0u;
      continue;
    }
    const auto e = static_cast<size_t>(ids[i]);
    const int32_t p = pending_at_[e];
    const int64_t r = p >= 0 ? pending_[static_cast<size_t>(p)].row : table_[e];
    out[i] = r >= 0 ? static_cast<uint32_t>(r) : 0u;  // 0 only when the step fails below
  }
  if (order != nullptr && k > 0) {
    // Per token (k ids each): the slots whose experts are in first, in slot order, then the
    // others in the order their reads were issued (and so, about, land).
    std::vector<std::pair<int64_t, uint32_t>> keyed(k);
    for (size_t t = 0; t + k <= ids.size(); t += k) {
      for (size_t j = 0; j < k; ++j) {
        const int64_t e = ids[t + j];
        const int32_t p = e == kNoExpert ? -1 : pending_at_[static_cast<size_t>(e)];
        keyed[j] = {p < 0 ? -1 : p, static_cast<uint32_t>(j)};
      }
      std::stable_sort(keyed.begin(), keyed.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
      for (size_t j = 0; j < k; ++j) order[t + j] = keyed[j].second;
    }
  }
  start_pending_reads_locked();
  lk.unlock();
}

void FaultTable::start_pending_reads_locked() {
  std::vector<Fill*> to_read;
  for (Fill& f : pending_) {
    if (!f.done && !f.started) {
      f.started = true;
      to_read.push_back(&f);
    }
  }
  global_counters().background_reads.fetch_add(to_read.size(), std::memory_order_relaxed);
  // A job touches this table until it signals under the lock; every path that ends the table
  // (the destructor included) waits for pending_reads_ to reach 0 first.
  if (HostRecordSink* reader = to_read.empty() ? nullptr : sink_->ordered_reader()) {
    // One job reads them all in order through one ring, each record landing before the next
    // (read_rows_ordered): the step's first slot can compute after one record's time, not after
    // every record read side by side shared the disk. It holds one more count than its reads,
    // dropped last, so the table outlives the job's last touch of it.
    pending_reads_ += to_read.size() + 1;
    submit_background([this, reader, to_read = std::move(to_read)] {
      std::vector<std::pair<uint64_t, int64_t>> records;
      records.reserve(to_read.size());
      for (const Fill* f : to_read) records.emplace_back(static_cast<uint64_t>(f->expert) * stride_, f->row);
      reader->read_rows_ordered(fd_, records, [&](size_t k, int err, int64_t ns) {
        Fill& f = *to_read[k];
        const auto t0 = std::chrono::steady_clock::now();
        f.err = verify_record(f.expert, f.row, err, f.got);
        f.ns = ns + std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
        read_done(&f);
      });
      read_done(nullptr);
    });
  } else {
    for (Fill* fp : to_read) {
      ++pending_reads_;
      submit_background([this, fp] {
        read_fill(*fp);
        read_done(fp);
      });
    }
  }
}

void FaultTable::prefetch(std::vector<int64_t> ids) {
  prefetches_.fetch_add(1, std::memory_order_relaxed);
  std::unique_lock<std::mutex> lk(mu_);
  settle_on_stream_locked(lk);
  absorb_device_uses_locked();
  // A stamp of its own: no predicted expert evicts another. None is touched here; a fill is
  // touched with this stamp once published (a predicted expert ranks as recent as its prediction).
  const uint64_t stamp = ++clock_;
  std::vector<int64_t> missing;
  for (int64_t e : ids) {
    if (e < 0 || e >= n_experts_) continue;  // kNoExpert included: a hint names what it names
    auto& seen = seen_[static_cast<size_t>(e)];
    if (seen == stamp) continue;
    seen = stamp;
    if (table_[static_cast<size_t>(e)] < 0) missing.push_back(e);
  }
  if (missing.empty()) return;
  std::string error;  // never set: a hint takes the rows there are
  pending_.clear();  // settled above
  assign_rows_locked(missing, stamp, pending_, error, true);
  pending_left_ = pending_.size();
  if (pending_at_.empty()) pending_at_.assign(static_cast<size_t>(n_experts_), -1);
  for (size_t i = 0; i < pending_.size(); ++i) {
    Fill& f = pending_[i];
    f.prefetch = true;
    pending_at_[static_cast<size_t>(f.expert)] = static_cast<int32_t>(i);
    if (f.held) f.done = true;
  }
  start_pending_reads_locked();
}

bool FaultTable::still_pending_locked(size_t i) const {
  // The expert's entry names its latest fill: an earlier one of the same expert (published, the
  // expert evicted since and read again while an unrouted prefetch kept the list) is not pending.
  return pending_at_[static_cast<size_t>(pending_[i].expert)] == static_cast<int32_t>(i);
}

void FaultTable::read_done(Fill* f) {
  std::lock_guard<std::mutex> g(mu_);
  if (f != nullptr) f->done = true;
  --pending_reads_;
  read_done_.notify_all();
}

void FaultTable::finish(const std::vector<int64_t>& ids) {
  std::unique_lock<std::mutex> lk(mu_);
  std::string error;
  const auto t0 = std::chrono::steady_clock::now();
  bool waited = false;
  for (int64_t e : ids) {
    if (e == kNoExpert || e < 0 || e >= n_experts_ || pending_at_.empty()) continue;
    auto& at = pending_at_[static_cast<size_t>(e)];
    if (at < 0) continue;  // published already (an earlier slot, or settle())
    waited = publish_evictor_locked(lk, e, error) || waited;
    if (at < 0) continue;
    if (!pending_[static_cast<size_t>(at)].done) {
      waited = true;
      // settle() on the loop thread may publish it meanwhile (and clear pending_): look again.
      read_done_.wait(lk, [&] { return at < 0 || pending_[static_cast<size_t>(at)].done; });
      if (at < 0) continue;
    }
    Fill& f = pending_[static_cast<size_t>(at)];
    at = -1;
    publish_locked(f, f.stamp, error, true);
    if (--pending_left_ == 0) pending_.clear();
    if (!error.empty()) break;
  }
  if (waited) {
    read_wait_ns_.fetch_add(static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                      std::chrono::steady_clock::now() - t0)
                                                      .count()),
                            std::memory_order_relaxed);
  }
  if (!error.empty()) {
    // The step fails: publish (log) every other read of the begin first, so nothing stays in
    // flight into a lent row and the ledger hears of every row the begin took.
    finish_all_locked(lk, error);
  }
}

bool FaultTable::publish_evictor_locked(std::unique_lock<std::mutex>& lk, int64_t expert, std::string& error) {
  // A prefetch's fill took `expert`'s row, and a begin routed `expert` since and read it into
  // another: the log says it left that row before it says it filled another (the ledger applies
  // the log in order). Only a prefetch's fill evicts an expert a later begin reads again.
  for (size_t i = 0; i < pending_.size(); ++i) {
    if (!pending_[i].prefetch || pending_[i].victim != expert || !still_pending_locked(i)) continue;
    const int32_t want = static_cast<int32_t>(i);
    const auto& at = pending_at_[static_cast<size_t>(pending_[i].expert)];
    const bool wait = !pending_[i].done;
    // settle() on the loop thread may publish it meanwhile (and clear pending_): look again.
    read_done_.wait(lk, [&] { return at != want || pending_[i].done; });
    if (at != want) return wait;
    Fill& f = pending_[i];
    pending_at_[static_cast<size_t>(f.expert)] = -1;
    publish_locked(f, f.stamp, error, true);
    --pending_left_;  // the fill finish() publishes next is still pending: never the last
    return wait;
  }
  return false;
}

void FaultTable::finish_all_locked(std::unique_lock<std::mutex>& lk, std::string& error) {
  if (pending_.empty()) return;
  read_done_.wait(lk, [&] { return pending_reads_ == 0; });
  for (size_t i = 0; i < pending_.size(); ++i) {
    if (!still_pending_locked(i)) continue;  // published already
    Fill& f = pending_[i];
    pending_at_[static_cast<size_t>(f.expert)] = -1;
    publish_locked(f, f.stamp, error, true);
  }
  pending_.clear();
  pending_left_ = 0;
  read_done_.notify_all();  // a finish() waiting for one of them looks again
}

void FaultTable::settle() {
  std::unique_lock<std::mutex> lk(mu_);
  settle_pending_locked(lk);
}

bool FaultTable::pending() const {
  std::lock_guard<std::mutex> lk(mu_);
  return pending_left_ > 0;
}

void FaultTable::settle_pending_locked(std::unique_lock<std::mutex>& lk) {
  std::string error;  // a failed read is in the log: the step that began it reports it
  finish_all_locked(lk, error);
}

namespace {
uint64_t ns_since(std::chrono::steady_clock::time_point t0) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
}
}  // namespace

void FaultTable::settle_on_stream_locked(std::unique_lock<std::mutex>& lk) {
  if (pending_.empty()) return;
  const auto t0 = std::chrono::steady_clock::now();
  settle_pending_locked(lk);
  read_wait_ns_.fetch_add(ns_since(t0), std::memory_order_relaxed);
}

void FaultTable::settle_unrouted_locked(std::unique_lock<std::mutex>& lk) {
  const auto t0 = std::chrono::steady_clock::now();
  std::string error;  // a hint's failure sets none
  for (size_t i = 0; i < pending_.size(); ++i) {
    if (!still_pending_locked(i) || !pending_[i].prefetch || pending_[i].routed) continue;
    const int32_t want = static_cast<int32_t>(i);
    const auto& at = pending_at_[static_cast<size_t>(pending_[i].expert)];
    // settle() on the loop thread may publish it meanwhile (and clear pending_): look again.
    read_done_.wait(lk, [&] { return at != want || pending_[i].done; });
    if (at != want) break;  // settled: nothing of the list is pending any more
    Fill& f = pending_[i];
    pending_at_[static_cast<size_t>(f.expert)] = -1;
    publish_locked(f, f.stamp, error, true);
    --pending_left_;
  }
  read_wait_ns_.fetch_add(ns_since(t0), std::memory_order_relaxed);
}

void FaultTable::stage(std::vector<int64_t> ids, uint32_t* out) {
  resolves_.fetch_add(1, std::memory_order_relaxed);
  staged_.fetch_add(1, std::memory_order_relaxed);
  std::unique_lock<std::mutex> lk(mu_);
  throw_injected_locked();
  settle_on_stream_locked(lk);
  absorb_device_uses_locked();
  if (!sink_->stages()) {
    throw std::runtime_error("[asyncside] layer " + std::to_string(layer_) +
                             ": a staged resolve needs a device table with a host tier and staging arrays");
  }
  const uint64_t stamp = ++clock_;
  std::vector<int64_t> uniq;
  std::string error;
  collect_locked(ids, stamp, uniq, error);
  auto fail = [&](int64_t e, int err, uint32_t got, int64_t ns) {
    log_event_locked({-1, -1, e, ns, err, 0});
    fault_errors_.fetch_add(1, std::memory_order_relaxed);
    global_counters().fault_errors.fetch_add(1, std::memory_order_release);
    if (error.empty()) error = read_error(e, -1, err, got);
  };
  // Hits copy from their pool rows, which only a later resolve of this table (after this node's
  // copies ran, in stream order) may refill. The rest come from the host tier.
  struct Read {
    int64_t expert;
    int err = 0;
    uint32_t got = 0;
    int64_t ns = 0;
  };
  std::vector<Read> reads;
  std::vector<int64_t> from_tier;
  const size_t logged = log_.missed.size() - uniq.size();  // this resolve's entries in the log
  for (size_t j = 0; j < uniq.size(); ++j) {
    const int64_t e = uniq[j];
    const int32_t row = table_[static_cast<size_t>(e)];
    if (row >= 0) {
      touch_locked(e, stamp);
      hits_.fetch_add(1, std::memory_order_relaxed);
      if (const int err = sink_->stage(e, row); err != 0) fail(e, err, 0, 0);
      continue;
    }
    log_.missed[logged + j] = 1;
    if (sink_->holds(e)) {
      from_tier.push_back(e);
    } else {
      reads.push_back({e});
    }
  }
  if (!reads.empty()) {
    // Into the expert's tier row, unlocked and side by side as resolve's reads: no other resolve
    // runs meanwhile (host nodes run one at a time), and a tier row is read only while the tier
    // does not hold it, so no copy of an earlier node reads it.
    if (reads.size() > 1 && read_threads() > 0) global_counters().shared_reads.fetch_add(1, std::memory_order_relaxed);
    lk.unlock();
    parallel_reads(reads.size(), [&](size_t i) {
      Read& r = reads[i];
      r.err = read_record(r.expert, -1, r.got, r.ns);  // into the expert's tier row
    });
    lk.lock();
  }
  for (int64_t e : from_tier) {
    if (const int err = sink_->stage(e, -1); err != 0) {
      fail(e, err, 0, 0);
      continue;
    }
    log_event_locked({-1, -1, e, 0, 0, 1});
    staged_copies_.fetch_add(1, std::memory_order_relaxed);
  }
  for (Read& r : reads) {
    fault_ns_.fetch_add(static_cast<uint64_t>(r.ns), std::memory_order_relaxed);
    if (r.err == 0) {
      sink_->keep(r.expert);
      r.err = sink_->stage(r.expert, -1);
    }
    if (r.err != 0) {
      fail(r.expert, r.err, r.got, r.ns);
      continue;
    }
    log_event_locked({-1, -1, r.expert, r.ns, 0, 0});
    staged_copies_.fetch_add(1, std::memory_order_relaxed);
    bytes_read_.fetch_add(stride_, std::memory_order_relaxed);
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    out[i] = ids[i] == kNoExpert ? 0u : static_cast<uint32_t>(ids[i]);
  }
  lk.unlock();
}

// ---- the graph node ----------------------------------------------------------------------------

namespace {

template <class T>
void read_ids(const mx::array& a, std::vector<int64_t>& out) {
  const T* base = a.data<T>();
  const size_t n = a.size();
  out.resize(n);
  if (a.flags().row_contiguous) {
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<int64_t>(base[i]);
    return;
  }
  // Strided (e.g. the first k of an argpartition): walk the index in row-major order.
  const int nd = a.ndim();
  std::vector<int64_t> idx(static_cast<size_t>(nd), 0);
  for (size_t i = 0; i < n; ++i) {
    int64_t off = 0;
    for (int d = 0; d < nd; ++d) off += idx[static_cast<size_t>(d)] * a.strides()[static_cast<size_t>(d)];
    out[i] = static_cast<int64_t>(base[off]);
    for (int d = nd - 1; d >= 0; --d) {
      if (++idx[static_cast<size_t>(d)] < a.shape(d)) break;
      idx[static_cast<size_t>(d)] = 0;
    }
  }
}

void read_any_ids(const mx::array& a, std::vector<int64_t>& out) {
  switch (a.dtype()) {
    case mx::uint32: return read_ids<uint32_t>(a, out);
    case mx::int32: return read_ids<int32_t>(a, out);
    case mx::int64: return read_ids<int64_t>(a, out);
    case mx::uint64: return read_ids<uint64_t>(a, out);
    case mx::int16: return read_ids<int16_t>(a, out);
    case mx::uint16: return read_ids<uint16_t>(a, out);
    case mx::int8: return read_ids<int8_t>(a, out);
    case mx::uint8: return read_ids<uint8_t>(a, out);
    default: throw std::runtime_error("[asyncside] expert_rows: ids must be an integer array");
  }
}

// Run a fault node's task on the stream thread, never letting it throw there (see kNodeFailed):
// what it throws fails the step through the table's log, and its `n` output rows read row 0.
template <class F>
void guarded(FaultTable& table, uint32_t* out, size_t n, F&& task) noexcept {
  try {
    task();
  } catch (const std::exception& e) {
    std::fill(out, out + n, 0u);
    table.failed(e.what());
  } catch (...) {
    std::fill(out, out + n, 0u);
    table.failed("an exception that is not a std::exception");
  }
}

class ExpertRows : public mx::Primitive {
 public:
  ExpertRows(mx::Stream s, std::shared_ptr<FaultTable> table, bool staged)
      : mx::Primitive(s), table_(std::move(table)), staged_(staged) {
    global_counters().nodes_created.fetch_add(1, std::memory_order_relaxed);
  }
  ~ExpertRows() override { global_counters().nodes_destroyed.fetch_add(1, std::memory_order_relaxed); }

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(inputs[0]);
    enc.set_output_array(out);
    // The task holds the ids array (its buffer) and the table; both are plain C++ objects.
    enc.dispatch([table = table_, ids = inputs[0], out_ptr = out.data<uint32_t>(), n = out.size(),
                  staged = staged_]() noexcept {
      guarded(*table, out_ptr, n, [&] {
        std::vector<int64_t> v;
        read_any_ids(ids, v);
        if (staged) {
          table->stage(std::move(v), out_ptr);
        } else {
          table->resolve(std::move(v), out_ptr);
        }
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return staged_ ? "AsyncsideStagedRows" : "AsyncsideExpertRows"; }
  // Every node resolves (and may fault) on its own: never merged by compile's CSE.
  bool is_equivalent(const mx::Primitive&) const override { return false; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  std::shared_ptr<FaultTable> table_;
  bool staged_;
};

void ExpertRows::eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
#if defined(ASYNCSIDE_CUDA)
  eval_device_faults(table_, inputs[0], outputs[0], stream(), staged_);
#else
  (void)inputs;
  (void)outputs;
  // Metal builds never get here (expert_rows() puts the node on the CPU stream).
  throw std::runtime_error(
      "[asyncside] expert_rows on a GPU stream needs the device fault path, which this build of "
      "asyncside._native lacks (build with -DASYNCSIDE_CUDA=ON)");
#endif
}

// What the streamed nodes share (CPU stream only: the table's sink is a host one): their table,
// the node counters, and no GPU form.
class HostTableNode : public mx::Primitive {
 public:
  HostTableNode(mx::Stream s, std::shared_ptr<FaultTable> table, const char* what)
      : mx::Primitive(s), table_(std::move(table)), what_(what) {
    global_counters().nodes_created.fetch_add(1, std::memory_order_relaxed);
  }
  ~HostTableNode() override { global_counters().nodes_destroyed.fetch_add(1, std::memory_order_relaxed); }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string("[asyncside] ") + what_ + " runs on the CPU stream only");
  }
  // Every node resolves (and may read) on its own: never merged by compile's CSE.
  bool is_equivalent(const mx::Primitive&) const override { return false; }

 protected:
  // Allocate `out` and register the node's arrays with its stream's encoder, returned for the task.
  mx::cpu::CommandEncoder& encode(const std::vector<mx::array>& inputs, mx::array& out) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    return enc;
  }

  std::shared_ptr<FaultTable> table_;

 private:
  const char* what_;
};

class BeginRows : public HostTableNode {
 public:
  BeginRows(mx::Stream s, std::shared_ptr<FaultTable> table) : HostTableNode(s, std::move(table), "begin_rows") {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    auto& enc = encode(inputs, out);
    const size_t k = inputs[0].ndim() ? static_cast<size_t>(inputs[0].shape(-1)) : 1;
    enc.dispatch([table = table_, ids = inputs[0], out_ptr = out.data<uint32_t>(), n = out.size(), k]() noexcept {
      guarded(*table, out_ptr, n, [&] {
        std::vector<int64_t> v;
        read_any_ids(ids, v);
        // Rows and order side by side per token: [rows of its k slots | order of its k slots].
        std::vector<uint32_t> rows(v.size()), order(v.size());
        table->begin(std::move(v), rows.data(), k, order.data());
        for (size_t t = 0; t + k <= rows.size(); t += k) {
          std::copy(rows.begin() + t, rows.begin() + t + k, out_ptr + 2 * t);
          std::copy(order.begin() + t, order.begin() + t + k, out_ptr + 2 * t + k);
        }
      });
    });
  }
  const char* name() const override { return "AsyncsideBeginRows"; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {doubled(inputs[0].shape())};
  }
  static mx::Shape doubled(mx::Shape shape) {
    if (shape.empty()) shape.push_back(1);
    shape.back() *= 2;
    return shape;
  }
};

class FinishRows : public HostTableNode {
 public:
  FinishRows(mx::Stream s, std::shared_ptr<FaultTable> table) : HostTableNode(s, std::move(table), "finish_rows") {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    auto& enc = encode(inputs, out);
    enc.dispatch([table = table_, ids = inputs[0], rows = inputs[1], out_ptr = out.data<uint32_t>(),
                  n = out.size()]() noexcept {
      guarded(*table, out_ptr, n, [&] {
        std::vector<int64_t> v;
        read_any_ids(ids, v);
        table->finish(v);
        read_any_ids(rows, v);
        for (size_t i = 0; i < v.size() && i < n; ++i) out_ptr[i] = static_cast<uint32_t>(v[i]);
      });
    });
  }
  const char* name() const override { return "AsyncsideFinishRows"; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[1].shape()}; }
};

// A prefetch: `after` passed through (a few uint32 rows), the prediction handed to the table.
class PrefetchRows : public HostTableNode {
 public:
  PrefetchRows(mx::Stream s, std::shared_ptr<FaultTable> table)
      : HostTableNode(s, std::move(table), "prefetch_rows") {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    auto& enc = encode(inputs, out);
    enc.dispatch([table = table_, after = inputs[0], ids = inputs[1], out_ptr = out.data<uint32_t>(),
                  n = out.size()]() noexcept {
      std::vector<int64_t> v;
      // The rows passed through are what the gather after reads: a failure there fails the step,
      // as any fault node's does (never row 0 without a word).
      guarded(*table, out_ptr, n, [&] {
        read_any_ids(after, v);
        for (size_t i = 0; i < n; ++i) out_ptr[i] = static_cast<uint32_t>(v[i]);
      });
      // A prediction is a hint: whatever it throws (an allocation) only costs the prefetch.
      try {
        read_any_ids(ids, v);
        table->prefetch(std::move(v));
      } catch (...) {
      }
    });
  }
  const char* name() const override { return "AsyncsidePrefetchRows"; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }
};

}  // namespace

mx::array expert_rows(const mx::array& ids, std::shared_ptr<FaultTable> table, mx::Stream stream, bool staged) {
  if (!table) throw std::invalid_argument("table: expected a FaultTable, got None");
  if (staged && !table->can_stage()) {
    throw std::invalid_argument("table: layer " + std::to_string(table->layer()) +
                                " cannot stage (it needs device pools, a host tier and staging arrays)");
  }
  if (!mx::issubdtype(ids.dtype(), mx::integer)) {
    throw std::invalid_argument("ids: expected an integer array of expert ids");
  }
  mx::array in = ids;
  if (stream.device.type == mx::Device::gpu) {
#if defined(ASYNCSIDE_CUDA)
    in = prepare_device_ids(ids, stream);  // uint32, contiguous: what the device kernels read
#elif defined(ASYNCSIDE_METAL)
    // Unified memory: resolve on the CPU stream between the GPU work before and after it.
    stream = mx::default_stream(mx::Device::cpu);
#endif
  }
  return mx::array(in.shape(), mx::uint32, std::make_shared<ExpertRows>(stream, std::move(table), staged), {in});
}

namespace {

void check_streamed(const mx::array& ids, const std::shared_ptr<FaultTable>& table, const mx::Stream& stream,
                    const char* what) {
  if (!table) throw std::invalid_argument("table: expected a FaultTable, got None");
  if (stream.device.type != mx::Device::cpu) {
    throw std::invalid_argument(std::string(what) + ": the streamed pair runs on a CPU stream only");
  }
  if (table->can_stage()) {
    throw std::invalid_argument(std::string(what) + ": layer " + std::to_string(table->layer()) +
                                " has a device table; the streamed pair needs host pools");
  }
  if (!mx::issubdtype(ids.dtype(), mx::integer)) {
    throw std::invalid_argument("ids: expected an integer array of expert ids");
  }
}

}  // namespace

mx::array begin_rows(const mx::array& ids, std::shared_ptr<FaultTable> table, mx::Stream stream) {
  check_streamed(ids, table, stream, "begin_rows");
  return mx::array(BeginRows::doubled(ids.shape()), mx::uint32, std::make_shared<BeginRows>(stream, std::move(table)),
                   {ids});
}

mx::array prefetch_rows(const mx::array& after, const mx::array& ids, std::shared_ptr<FaultTable> table,
                        mx::Stream stream) {
  check_streamed(ids, table, stream, "prefetch_rows");
  if (!mx::issubdtype(after.dtype(), mx::integer)) throw std::invalid_argument("after: expected an integer array");
  return mx::array(after.shape(), mx::uint32, std::make_shared<PrefetchRows>(stream, std::move(table)), {after, ids});
}

mx::array finish_rows(const mx::array& ids, const mx::array& rows, std::shared_ptr<FaultTable> table,
                      mx::Stream stream) {
  check_streamed(ids, table, stream, "finish_rows");
  if (!mx::issubdtype(rows.dtype(), mx::integer)) throw std::invalid_argument("rows: expected an integer array");
  return mx::array(rows.shape(), mx::uint32, std::make_shared<FinishRows>(stream, std::move(table)), {ids, rows});
}

}  // namespace asyncside::faults
