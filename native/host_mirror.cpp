#include "host_mirror.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

namespace asyncside::io {

namespace {
std::atomic<PinFn> g_pin{nullptr};
std::atomic<UnpinFn> g_unpin{nullptr};
}  // namespace

MirrorCounters& mirror_counters() {
  static MirrorCounters c;
  return c;
}

void set_pin_hooks(PinFn pin, UnpinFn unpin) {
  g_pin.store(pin);
  g_unpin.store(unpin);
}

HostMirror::HostMirror(int64_t rows, std::vector<uint64_t> segment_nbytes)
    : rows_(rows), row_nbytes_(std::move(segment_nbytes)) {
  if (rows_ < 1) throw std::invalid_argument("rows: expected >= 1, got " + std::to_string(rows_));
  for (size_t i = 0; i < row_nbytes_.size(); ++i) {
    if (row_nbytes_[i] == 0) throw std::invalid_argument("segment_nbytes[" + std::to_string(i) + "]: expected > 0");
    if (row_nbytes_[i] > (UINT64_MAX / 2) / static_cast<uint64_t>(rows_)) {
      throw std::invalid_argument("segment_nbytes[" + std::to_string(i) + "]: rows x nbytes overflows");
    }
  }
  PinFn pin = g_pin.load();
  for (uint64_t nb : row_nbytes_) {
    // Page-aligned and rounded up to whole pages: O_DIRECT-friendly and pinnable.
    uint64_t n = (static_cast<uint64_t>(rows_) * nb + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
    void* p = nullptr;
    if (posix_memalign(&p, kDirectAlign, n) != 0) {
      for (size_t i = 0; i < base_.size(); ++i) {
        std::free(base_[i]);
        mirror_counters().bytes_freed += alloc_[i];
      }
      throw std::bad_alloc();
    }
    std::memset(p, 0, n);
    base_.push_back(static_cast<uint8_t*>(p));
    alloc_.push_back(n);
    mirror_counters().bytes_allocated += n;
  }
  if (pin != nullptr) {
    pinned_ = true;
    for (size_t i = 0; i < base_.size(); ++i) pinned_ = pin(base_[i], alloc_[i]) && pinned_;
    if (pinned_) mirror_counters().pinned++;
  }
  mirror_counters().created++;
}

HostMirror::~HostMirror() {
  UnpinFn unpin = g_unpin.load();
  for (size_t i = 0; i < base_.size(); ++i) {
    if (pinned_ && unpin != nullptr) unpin(base_[i]);
    std::free(base_[i]);
    mirror_counters().bytes_freed += alloc_[i];
  }
  if (pinned_) mirror_counters().unpinned++;
  base_.clear();
  alloc_.clear();
  mirror_counters().destroyed++;
}

}  // namespace asyncside::io
