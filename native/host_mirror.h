// A host mirror of one layer's pools: page-aligned host memory laid out exactly like the pools
// (one buffer per segment, rows x segment nbytes). On a device whose pools live in device memory
// (MLX CUDA) the readers fill the mirror, and an upload copies a row to the device; a host
// pointer into a device pool is never taken (on CUDA that migrates the pool to managed memory).
//
// Plain C++: nothing here knows Python.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "io_reader.h"

namespace asyncside::io {

struct MirrorCounters {
  std::atomic<uint64_t> created{0}, destroyed{0}, bytes_allocated{0}, bytes_freed{0};
  std::atomic<uint64_t> pinned{0}, unpinned{0};
};
MirrorCounters& mirror_counters();

// Optional page-locking of the mirror for DMA (CUDA builds set these; elsewhere they stay null).
using PinFn = bool (*)(void* ptr, uint64_t nbytes);
using UnpinFn = void (*)(void* ptr);
void set_pin_hooks(PinFn pin, UnpinFn unpin);

// enable_shared_from_this: when Python hands a mirror to C++ (a reader layout, a fault table, an
// upload), the binding layer then shares the C++ owner made at construction instead of making a
// holder that keeps the Python object alive. Such a holder takes the GIL when dropped, and the
// holders here are dropped by native threads and by a reader's close() under its lock, which a
// thread holding the GIL may be waiting for: a deadlock.
class HostMirror final : public Destination, public std::enable_shared_from_this<HostMirror> {
 public:
  // Throws std::invalid_argument when rows < 1 or a segment is empty, std::bad_alloc on failure.
  HostMirror(int64_t rows, std::vector<uint64_t> segment_nbytes);
  ~HostMirror() override;
  HostMirror(const HostMirror&) = delete;
  HostMirror& operator=(const HostMirror&) = delete;

  int64_t rows() const override { return rows_; }
  uint8_t* host_row(size_t segment, int64_t row) override {
    return base_[segment] + static_cast<uint64_t>(row) * row_nbytes_[segment];
  }
  size_t segments() const { return base_.size(); }
  uint64_t row_nbytes(size_t segment) const { return row_nbytes_.at(segment); }
  bool pinned() const { return pinned_; }

 private:
  int64_t rows_;
  std::vector<uint64_t> row_nbytes_;
  std::vector<uint8_t*> base_;
  std::vector<uint64_t> alloc_;
  bool pinned_ = false;
};

}  // namespace asyncside::io
