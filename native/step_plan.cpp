// Scheduling one queued step in chunks under MLX's eval throttle (see step_plan.h).
#include "step_plan.h"

#include "graph_release.h"

#include <algorithm>
#include <chrono>
#include <unordered_set>

#include "mlx/primitives.h"
#include "mlx/scheduler.h"
#include "mlx/transforms.h"

namespace mx = mlx::core;

namespace asyncside::plan {

namespace {

// MLX's eval blocks its caller while more task groups than this are in flight (MLX 0.32).
constexpr int kMaxActiveTasks = 10;
// MLX's CPU encoder counts one task per 10 dispatches, and a node of a decode step dispatches
// about twice on average (copies to contiguous layouts, the quantized products' own steps): 5
// nodes per task. With 8 the chunks overshot the throttle and MLX blocked the loop thread inside
// async_eval several times longer than with 5, which is MLX's own encoding work (BENCHMARKS.md,
// "Measurements behind code choices").
constexpr size_t kNodesPerTask = 5;
constexpr size_t kMinGroup = 2;
// With a time slice, nodes per async_eval call, so the slice is checked often enough (a small
// part of the slice of MLX's CPU encoding; BENCHMARKS.md, "Loop lag").
constexpr size_t kSlicedGroup = 10;
// advance(lend): nodes per async_eval call without a time slice, and the task groups hidden from
// MLX's count around each call (room for this many nodes' dispatches, many times over).
constexpr size_t kLentGroup = 64;
constexpr int kLentRoom = 256;

}  // namespace

StepPlan::StepPlan(const std::vector<mx::array>& roots) {
  // Iterative post-order walk (graphs are deep): every node after its inputs.
  std::unordered_set<std::uintptr_t> seen;
  std::vector<std::pair<mx::array, size_t>> stack;
  for (const auto& r : roots) {
    if (r.status() != mx::array::Status::unscheduled || !seen.insert(r.id()).second) continue;
    stack.emplace_back(r, 0);
    while (!stack.empty()) {
      const size_t top = stack.size() - 1;
      const auto& ins = stack[top].first.inputs();
      if (stack[top].second < ins.size()) {
        const mx::array& in = ins[stack[top].second++];
        if (in.status() == mx::array::Status::unscheduled) {
          if (seen.insert(in.id()).second) stack.emplace_back(in, 0);
        } else if (!frontier_ && in.status() == mx::array::Status::evaluated && in.has_primitive()) {
          frontier_ = in;  // queued by an earlier step, maybe still running
        }
      } else {
        order_.push_back(std::move(stack[top].first));
        stack.pop_back();
      }
    }
  }
  size_ = order_.size();
  for (const auto& n : order_) {
    if (!n.has_primitive() || const_cast<mx::array&>(n).primitive().device() != mx::Device::gpu) {
      all_gpu_ = false;
      break;
    }
  }
  if (all_gpu_) {
    for (const auto& r : roots) {
      if (r.status() == mx::array::Status::unscheduled) roots_.push_back(r);
    }
  }
}

std::pair<bool, std::optional<mx::array>> StepPlan::advance(int64_t budget_ns, int64_t slice_ns, bool lend) {
  while (next_ < order_.size() && order_[next_].status() != mx::array::Status::unscheduled) ++next_;
  if (next_ >= order_.size()) {
    finish();
    return {true, std::nullopt};
  }
  if (all_gpu_) {
    // A GPU stream counts one task per committed command buffer (on CUDA a graph launch), and
    // every eval commits one: the whole step goes in one eval, which never waits here. It goes
    // as its roots, with this plan's references to the other nodes dropped first, as mlx-lm
    // hands over its own step: MLX lets an op reuse an input's buffer only where nothing else
    // holds that input, and every node listed (or held here) kept its own buffer: a step took a
    // buffer per node (tests/test_step_plan_gpu.py).
    std::vector<mx::array> roots = std::move(roots_);
    roots_.clear();
    next_ = order_.size();
    order_.clear();
    mx::async_eval(std::move(roots));
    ++chunks_;
    finish();
    return {true, std::nullopt};
  }
  const auto t0 = std::chrono::steady_clock::now();
  if (lend) return advance_lent(t0, slice_ns);
  int active = mx::scheduler::n_active_tasks();
  if (active >= kMaxActiveTasks && budget_ns <= 0) {
    // The stream is full (an earlier step, or this one's last chunk): wait for what is queued.
    if (last_mid_ && !last_mid_->is_available()) return {false, last_mid_};
    if (frontier_ && !frontier_->is_available()) return {false, frontier_};
    active = kMaxActiveTasks - 1;  // nothing of ours to wait for: MLX waits for one task group
  }
  const size_t first = next_;
  bool sliced = false;  // the slice ran out with room left under the throttle
  while (next_ < order_.size()) {
    const bool full = active >= kMaxActiveTasks;
    if (full || slice_ns > 0) {
      const int64_t spent =
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
      // Past the throttle: go on only within the budget, a small group at a time (MLX blocks
      // this thread until a task group completes, then takes the group).
      if (full && spent >= budget_ns) break;
      if (slice_ns > 0 && next_ > first && spent >= slice_ns) {
        sliced = !full;
        break;
      }
    }
    size_t room = full ? kMinGroup : static_cast<size_t>(kMaxActiveTasks - active) * kNodesPerTask;
    if (slice_ns > 0) room = std::min(room, kSlicedGroup);
    const size_t end = std::min(order_.size(), next_ + std::max(kMinGroup, room));
    mx::async_eval(std::vector<mx::array>(order_.begin() + static_cast<std::ptrdiff_t>(next_),
                                          order_.begin() + static_cast<std::ptrdiff_t>(end)));
    next_ = end;
    active = mx::scheduler::n_active_tasks();
  }
  ++chunks_;
  if (next_ >= order_.size()) {
    finish();
    return {true, std::nullopt};
  }
  last_mid_ = order_[first + (next_ - first - 1) / 2];
  if (sliced) return {false, std::nullopt};  // nothing to wait for: the throttle has room
  return {false, last_mid_};
}

std::pair<bool, std::optional<mx::array>> StepPlan::advance_lent(std::chrono::steady_clock::time_point t0,
                                                                 int64_t slice_ns) {
  const size_t first = next_;
  const size_t group = slice_ns > 0 ? kSlicedGroup : kLentGroup;
  while (next_ < order_.size()) {
    if (slice_ns > 0 && next_ > first &&
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count() >=
            slice_ns) {
      ++chunks_;
      return {false, std::nullopt};
    }
    const size_t end = std::min(order_.size(), next_ + group);
    // Hide the task groups in flight, and room for this group's own, from MLX's throttle while
    // the group is queued: the count is lowered by that much and raised back by as much after,
    // so completions that arrive meanwhile are counted as usual and the count is exact again
    // once the call returns. Below zero meanwhile, it is only compared with MLX's limits (the
    // memory limit's wait is skipped as well: a step's nodes are held until it is all
    // scheduled anyway, see finish()).
    const mx::Stream s = mx::default_stream(mx::Device::cpu);
    const int lent = std::max(0, mx::scheduler::n_active_tasks()) + kLentRoom;
    for (int i = 0; i < lent; ++i) mx::scheduler::notify_task_completion(s);
    try {
      mx::async_eval(std::vector<mx::array>(order_.begin() + static_cast<std::ptrdiff_t>(next_),
                                            order_.begin() + static_cast<std::ptrdiff_t>(end)));
    } catch (...) {
      for (int i = 0; i < lent; ++i) mx::scheduler::notify_new_task(s);
      throw;
    }
    for (int i = 0; i < lent; ++i) mx::scheduler::notify_new_task(s);
    next_ = end;
  }
  ++chunks_;
  finish();
  return {true, std::nullopt};
}

void StepPlan::finish() {
  frontier_.reset();
  last_mid_.reset();
  if (all_gpu_) {
    // On a GPU the release thread made the host time per step worse, not better (mlx-lm's own
    // steps in the same process slower too; BENCHMARKS.md, "MLX CUDA"): a GPU step's nodes are
    // dropped here, on the caller, with the GIL released.
    order_.clear();
    return;
  }
  release_later(std::move(order_));
  order_.clear();  // moved from: valid, now empty
}

}  // namespace asyncside::plan
