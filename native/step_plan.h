// Scheduling one queued step without blocking its caller.
//
// MLX's eval blocks its caller while more than a few task groups are in flight on the CPU (its
// throttle), and a decode step is many times that many dispatches. So a step is scheduled in
// chunks that fit under the throttle, the caller awaiting a node in the middle of each chunk (the
// stream keeps busy with the second half while the caller wakes up) before the next. A StepPlan
// walks the graph once, in dependency order, and hands out those chunks; the per-call graph walk
// and small eval groups of a general-purpose scheduler cost the caller more than the step's own
// dispatches do.
//
// Plain C++: nothing here knows Python. Only the thread that owns the stream may use a plan.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "mlx/array.h"

namespace asyncside::plan {

class StepPlan {
 public:
  // The unscheduled nodes of the graphs of `roots`, inputs before users.
  explicit StepPlan(const std::vector<mlx::core::array>& roots);

  // Schedule the next chunk: what fits under the throttle, then, for up to `budget_ns`, more,
  // letting MLX's throttle block for a task group at a time (each a fraction of a millisecond:
  // fewer, larger chunks cost the caller fewer wake-ups). Returns {true, nullopt} once every node
  // is scheduled; otherwise {false, y}: await y (scheduled, not yet computed), then call again.
  //
  // `slice_ns` > 0 caps the caller's time in one call (an event loop's thread must not stay away
  // long: on a slow CPU MLX's encoding of a chunk under the throttle takes over a millisecond).
  // The chunk is then handed over in small groups, and once `slice_ns` is spent while the
  // throttle still has room the call returns {false, nullopt}: let other work run, call again.
  //
  // `lend`: go past the throttle instead (CPU steps): MLX's count of task groups in flight is
  // lowered around each group's async_eval and raised back after, so nothing ever waits; the
  // call returns {true, nullopt} once all is scheduled, or {false, nullopt} when the slice is
  // spent, never a node to await. The caller thus queues the whole step at once, as mlx-lm's
  // caller does by blocking in the throttle, without ~17 wake-ups per decode step.
  std::pair<bool, std::optional<mlx::core::array>> advance(int64_t budget_ns = 0, int64_t slice_ns = 0,
                                                            bool lend = false);

  size_t size() const { return size_; }
  size_t scheduled() const { return next_; }
  size_t chunks() const { return chunks_; }

 private:
  // Once every node is scheduled, the nodes go to the release thread (graph_release.h); a GPU
  // step's are dropped on the caller.
  void finish();
  // advance() with lend: the step goes to MLX past its throttle, never waiting (see the .cpp).
  std::pair<bool, std::optional<mlx::core::array>> advance_lent(std::chrono::steady_clock::time_point t0,
                                                                int64_t slice_ns);

  std::vector<mlx::core::array> order_;
  std::vector<mlx::core::array> roots_;  // a GPU step goes to MLX as its roots (see advance)
  size_t size_ = 0;
  size_t next_ = 0;
  size_t chunks_ = 0;
  std::optional<mlx::core::array> frontier_;  // a scheduled input not computed yet (from the walk)
  std::optional<mlx::core::array> last_mid_;  // the middle node of the last chunk
  bool all_gpu_ = true;                        // every node on a GPU stream: one eval, no chunks
};

}  // namespace asyncside::plan
