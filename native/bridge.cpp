// Native completion bridge: CPU path, the completion queue, and the test/bench helpers.
// The CUDA and Metal completion hooks live in bridge_cuda.cpp / bridge_metal.cpp behind their
// compile guards. No Python here: the stream thread only touches C++ objects.
#include "bridge.h"

#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <unordered_set>

#include <fcntl.h>
#include <poll.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/eventfd.h>
#endif

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/scheduler.h"
#include "mlx/transforms.h"

namespace mx = mlx::core;

namespace asyncside::bridge {

int64_t monotonic_ns() noexcept {
  // CLOCK_MONOTONIC: the clock behind Python's time.monotonic_ns() on Linux, so the bench can
  // subtract a native post time from a Python resume time.
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

Counters& counters() {
  static Counters c;
  return c;
}

namespace {

// ---- wake descriptors: an eventfd on Linux, a non-blocking pipe elsewhere --------------------

void make_wake_fds(int& read_fd, int& write_fd) {
#if defined(__linux__)
  int fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (fd < 0) {
    throw std::system_error(errno, std::generic_category(), "[asyncside] eventfd() failed");
  }
  read_fd = write_fd = fd;
#else
  int p[2];
  if (::pipe(p) != 0) {
    throw std::system_error(errno, std::generic_category(), "[asyncside] pipe() failed");
  }
  for (int fd : p) {
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
    ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  }
  read_fd = p[0];
  write_fd = p[1];
#endif
}

void wake(int write_fd) noexcept {
#if defined(__linux__)
  uint64_t one = 1;
  ssize_t r;
  do {
    r = ::write(write_fd, &one, sizeof(one));
  } while (r < 0 && errno == EINTR);
#else
  char b = 1;
  ssize_t r;
  do {
    r = ::write(write_fd, &b, 1);
  } while (r < 0 && errno == EINTR);
#endif
  // EAGAIN cannot happen: at most one unread wakeup is outstanding per queue.
}

void unwake(int read_fd) noexcept {
#if defined(__linux__)
  uint64_t v;
  ssize_t r;
  do {
    r = ::read(read_fd, &v, sizeof(v));
  } while (r < 0 && errno == EINTR);
#else
  char buf[64];
  while (::read(read_fd, buf, sizeof(buf)) > 0) {
  }
#endif
}

// ---- the completion signal primitive -----------------------------------------------------------

// Input: x (so MLX orders the signal after x). Output: (1,) uint64 holding the ticket (CPU; on
// GPU the output buffer is allocated but not written). Evaluating it posts the ticket once all
// work scheduled before it on its stream has completed.
class CompletionSignal : public mx::Primitive {
 public:
  CompletionSignal(mx::Stream s, std::shared_ptr<CompletionQueue> queue, uint64_t ticket)
      : mx::Primitive(s), queue_(std::move(queue)), ticket_(ticket) {
    counters().signals_created.fetch_add(1, std::memory_order_relaxed);
  }
  ~CompletionSignal() override {
    counters().signals_destroyed.fetch_add(1, std::memory_order_relaxed);
  }

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_output_array(out);
    // The output buffer outlives this task: MLX's eval synchronizer holds every output's buffer
    // until a task queued after this one has run. The lambda holds the queue (pure C++).
    enc.dispatch([queue = queue_, ticket = ticket_, out_ptr = out.data<uint64_t>()]() {
      *out_ptr = ticket;
      queue->post(ticket);
    });
    counters().signals_dispatched.fetch_add(1, std::memory_order_relaxed);
  }

  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto post = [queue = queue_, ticket = ticket_]() { queue->post(ticket); };
#if defined(ASYNCSIDE_CUDA)
    cuda_add_completed_handler(stream(), std::move(post));
#elif defined(ASYNCSIDE_METAL)
    metal_add_completed_handler(stream(), std::move(post));
#else
    (void)post;
    throw std::runtime_error(
        "[asyncside] completion signal on a GPU stream, but this build of asyncside._native "
        "has no GPU completion path (rebuild with -DASYNCSIDE_CUDA=ON on CUDA; Metal is compiled "
        "on Apple). Signal from a CPU stream instead (stream=mx.cpu).");
#endif
    counters().signals_dispatched.fetch_add(1, std::memory_order_relaxed);
  }

  const char* name() const override { return "AsyncsideCompletionSignal"; }
  // Two signals are never interchangeable (each posts its own ticket): keep compile's
  // common-subexpression elimination from merging them.
  bool is_equivalent(const mx::Primitive&) const override { return false; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>&) override {
    return {mx::Shape{1}};
  }

 private:
  std::shared_ptr<CompletionQueue> queue_;
  uint64_t ticket_;
};

// MLX's eval blocks its caller while more task groups than this are in flight
// (MAX_ACTIVE_TASKS in mlx/transforms.cpp, MLX 0.32).
constexpr int kMlxMaxActiveTasks = 10;

bool gpu_path_compiled() {
#if defined(ASYNCSIDE_CUDA) || defined(ASYNCSIDE_METAL)
  return true;
#else
  return false;
#endif
}

// ---- test primitives: an output aliasing x, plus a task on the stream ------------------------

class GateHold : public mx::Primitive {
 public:
  GateHold(mx::Stream s, std::shared_ptr<TestingGate::State> state)
      : mx::Primitive(s), state_(std::move(state)) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    outputs[0].copy_shared_buffer(inputs[0]);
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.dispatch([state = state_]() {
      std::unique_lock<std::mutex> lk(state->mu);
      auto limit = std::chrono::duration<double>(state->timeout_s);
      if (!state->cv.wait_for(lk, limit, [&] { return state->open; })) {
        throw std::runtime_error("[asyncside] testing gate was never opened (timed out)");
      }
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[asyncside] TestingGate runs on CPU streams only");
  }
  const char* name() const override { return "AsyncsideTestingGate"; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  std::shared_ptr<TestingGate::State> state_;
};

class FailOnStream : public mx::Primitive {
 public:
  FailOnStream(mx::Stream s, std::string message)
      : mx::Primitive(s), message_(std::move(message)) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    outputs[0].copy_shared_buffer(inputs[0]);
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.dispatch([message = message_]() { throw std::runtime_error(message); });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[asyncside] testing_fail runs on CPU streams only");
  }
  const char* name() const override { return "AsyncsideTestingFail"; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  std::string message_;
};

mx::Stream cpu_stream_for(const mx::array& x, std::optional<mx::Stream> stream, const char* who) {
  mx::Stream s = stream ? *stream : stream_of(x).value_or(mx::default_stream(mx::Device::cpu));
  if (s.device.type != mx::Device::cpu) {
    throw std::invalid_argument(std::string("[asyncside] ") + who + ": needs a CPU stream");
  }
  return s;
}

}  // namespace

// ---- CompletionQueue ---------------------------------------------------------------------------

CompletionQueue::CompletionQueue() {
  make_wake_fds(read_fd_, write_fd_);
  counters().queues_created.fetch_add(1, std::memory_order_relaxed);
}

CompletionQueue::~CompletionQueue() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    close_locked();
  }
  counters().queues_destroyed.fetch_add(1, std::memory_order_relaxed);
}

bool CompletionQueue::closed() const {
  std::lock_guard<std::mutex> lk(mu_);
  return closed_;
}

void CompletionQueue::post(uint64_t ticket) noexcept {
  const int64_t now = monotonic_ns();
  counters().tickets_posted.fetch_add(1, std::memory_order_relaxed);
  bool wake_loop = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    ++posted_;
    if (closed_) {
      counters().tickets_dropped.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    try {
      ready_.push_back(Completion{ticket, now});
    } catch (...) {  // out of memory: lose the ticket, never throw into MLX's stream thread
      counters().tickets_dropped.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    // One write per batch: later posts ride on the wakeup already pending.
    wake_loop = !armed_;
    armed_ = true;
  }
  if (wake_loop) {
    // Written after releasing mu_: the woken loop thread often lands on this very CPU and goes
    // straight for drain(); holding mu_ across the write made it block on us (BENCHMARKS.md).
    // fd_mu_ only keeps close() from closing the descriptor under this write.
    std::lock_guard<std::mutex> lk(fd_mu_);
    if (write_fd_ >= 0) {
      wake(write_fd_);
      counters().wakeups_written.fetch_add(1, std::memory_order_relaxed);
    }
  }
}

std::vector<Completion> CompletionQueue::drain() {
  std::vector<Completion> out;
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) {
    return out;
  }
  // Always reset the fd (non-blocking read): a post's write may land after an earlier drain took
  // its ticket, and a level-triggered loop would otherwise see it readable forever.
  unwake(read_fd_);
  armed_ = false;
  out.swap(ready_);
  reaped_ += out.size();
  counters().tickets_reaped.fetch_add(out.size(), std::memory_order_relaxed);
  return out;
}

void CompletionQueue::abandon(uint64_t) noexcept {
  counters().tickets_abandoned.fetch_add(1, std::memory_order_relaxed);
}

void CompletionQueue::close() noexcept {
  std::lock_guard<std::mutex> lk(mu_);
  close_locked();
}

void CompletionQueue::close_locked() noexcept {
  if (closed_) {
    return;
  }
  closed_ = true;
  // Completions posted but never drained are lost with the queue: count them as dropped so
  // posted == reaped + dropped holds.
  counters().tickets_dropped.fetch_add(ready_.size(), std::memory_order_relaxed);
  ready_.clear();
  std::lock_guard<std::mutex> fd_lock(fd_mu_);  // wait out a post() writing right now
  ::close(read_fd_);
  if (write_fd_ != read_fd_) {
    ::close(write_fd_);
  }
  read_fd_ = write_fd_ = -1;
  counters().queues_closed.fetch_add(1, std::memory_order_relaxed);
}

uint64_t CompletionQueue::posted() const {
  std::lock_guard<std::mutex> lk(mu_);
  return posted_;
}

uint64_t CompletionQueue::reaped() const {
  std::lock_guard<std::mutex> lk(mu_);
  return reaped_;
}

// ---- signal and array status -------------------------------------------------------------------

std::optional<mx::Stream> stream_of(const mx::array& x) {
  if (x.has_primitive()) {
    return const_cast<mx::array&>(x).primitive().stream();
  }
  if (x.event().valid()) {
    return x.event().stream();
  }
  return std::nullopt;
}

SignalResult signal(const mx::array& x, std::shared_ptr<CompletionQueue> queue, uint64_t ticket,
                    std::optional<mx::Stream> stream, const std::vector<mx::array>& then) {
  if (!queue) {
    throw std::invalid_argument("[asyncside] signal: queue is None");
  }
  if (queue->closed()) {
    throw std::invalid_argument("[asyncside] signal: the completion queue is closed");
  }
  const std::optional<mx::Stream> x_stream = stream_of(x);
  mx::Stream s = mx::default_stream(mx::default_device());
  if (stream) {
    s = *stream;
    if (s.device.type == mx::Device::gpu && !gpu_path_compiled()) {
      throw std::invalid_argument(
          "[asyncside] signal: stream is a GPU stream, but this build has no GPU completion "
          "path (compiled: cpu only); pass a CPU stream or leave stream unset");
    }
  } else if (x_stream) {
    s = *x_stream;
    if (s.device.type == mx::Device::gpu && !gpu_path_compiled()) {
      // No native GPU hook: signal from the CPU stream, which MLX makes wait on x's event.
      s = mx::default_stream(mx::Device::cpu);
    }
  }
  mx::array xs = x;
  // Schedule x first, in its own async_eval: that eval ends by signalling x's event on its
  // stream, and the signal below is queued after it, so when the ticket posts x is not only
  // computed but marked available (reading it then never waits).
  if (xs.status() == mx::array::Status::unscheduled) {
    mx::async_eval({xs});
  }
  if (s.device.type == mx::Device::cpu && (!x_stream || *x_stream == s) &&
      mx::scheduler::n_active_tasks() >= kMlxMaxActiveTasks) {
    // Backlogged: async_eval of the signal (a few dispatches: at most one more task group) could
    // take MLX's count past its limit, and MLX would then block this (the event loop's) thread
    // until the stream drained below it. Queue the post behind everything on the stream instead.
    mx::scheduler::enqueue(s, [queue = std::move(queue), ticket]() { queue->post(ticket); });
    counters().signals_direct.fetch_add(1, std::memory_order_relaxed);
    return {std::nullopt, false};
  }
  mx::array y(mx::Shape{1}, mx::uint64,
              std::make_shared<CompletionSignal>(s, std::move(queue), ticket), {xs});
  if (s.device.type == mx::Device::gpu && !then.empty()) {
    std::vector<mx::array> all{y};
    all.insert(all.end(), then.begin(), then.end());
    mx::async_eval(std::move(all));
    return {y, true};
  }
  mx::async_eval({y});
  return {y, false};
}

int mlx_active_tasks() {
  return mx::scheduler::n_active_tasks();
}

namespace {

// Unscheduled nodes of the graphs of `roots`, every node after its inputs (iterative post-order
// DFS: graphs are deep). `frontier` receives one scheduled but not yet computed input, if any.
std::vector<mx::array> unscheduled_nodes(const std::vector<mx::array>& roots,
                                         std::optional<mx::array>& frontier) {
  std::vector<mx::array> order;
  std::unordered_set<std::uintptr_t> seen;
  std::vector<std::pair<mx::array, size_t>> stack;
  for (const auto& r : roots) {
    if (r.status() != mx::array::Status::unscheduled || !seen.insert(r.id()).second) {
      continue;
    }
    stack.emplace_back(r, 0);
    while (!stack.empty()) {
      const size_t top = stack.size() - 1;
      const auto& ins = stack[top].first.inputs();
      if (stack[top].second < ins.size()) {
        mx::array in = ins[stack[top].second++];
        if (in.status() == mx::array::Status::unscheduled) {
          if (seen.insert(in.id()).second) {
            stack.emplace_back(std::move(in), 0);
          }
        } else if (!frontier && !in.is_available()) {
          frontier = in;
        }
      } else {
        order.push_back(std::move(stack[top].first));
        stack.pop_back();
      }
    }
  }
  return order;
}

}  // namespace

// Nodes one async_eval may carry when `active` task groups are in flight, so that MLX's count
// stays at or under its limit (MLX blocks the caller once it is above). A node is usually one
// dispatch (plus one for the buffers MLX holds), a task group ten dispatches, and async_eval adds
// a synchronizer node: n nodes are at most 2n + 2 dispatches, at most (2n + 2) / 10 + 1 groups.
// 0: no room (the caller awaits the stream instead of letting MLX block it).
static size_t nodes_that_fit(int active) {
  const int budget = kMlxMaxActiveTasks - active;  // task groups that may still be added
  if (budget <= 0) {
    return 0;
  }
  constexpr size_t kGroup = 24;  // re-check the count at least this often
  const size_t n = budget == 1 ? 1 : static_cast<size_t>(budget - 1) * 5 - 1;
  return std::min(kGroup, std::max<size_t>(1, n));
}

std::pair<bool, std::optional<mx::array>> schedule_step(const std::vector<mx::array>& roots) {
  std::optional<mx::array> frontier;
  std::vector<mx::array> nodes = unscheduled_nodes(roots, frontier);
  if (nodes.empty()) {
    return {true, std::nullopt};
  }
  // MLX counts task groups of DISPATCHES_PER_TASK dispatches and blocks eval's caller above
  // kMlxMaxActiveTasks. Nodes therefore go in groups sized to the room left (nodes_that_fit),
  // and the count is read again between groups. Some nodes are many dispatches (a long
  // prefill's attention and sorted expert gathers), so a group can still overshoot; then MLX
  // waits for one task group, never more.
  //
  // A GPU stream counts a task per committed command buffer, not per dispatch, and every
  // async_eval commits one (on CUDA: a graph launch). Nodes all on GPU streams therefore go in one
  // async_eval: groups would cost a commit each (the GPU profile of a decode step showed ~5 per
  // layer) and would not bring the count any closer to the limit.
  bool all_gpu = true;
  for (const auto& n : nodes) {
    if (!n.has_primitive() || n.primitive().device() != mx::Device::gpu) {
      all_gpu = false;
      break;
    }
  }
  if (nodes_that_fit(mx::scheduler::n_active_tasks()) == 0) {
    counters().schedule_waits.fetch_add(1, std::memory_order_relaxed);
    if (frontier) {
      return {false, frontier};  // our own input is on the stream: await it, then go on
    }
    if (!all_gpu) {
      // The backlog is other work: the caller awaits its stream (a barrier ticket) rather than
      // have MLX block it. Many independent completions at once then wait their turn on the
      // event loop instead of each blocking it for a task group.
      return {false, std::nullopt};
    }
    // GPU: a barrier on the stream's host queue says nothing of the device. One commit; MLX
    // waits at most for one command buffer.
    nodes.erase(nodes.begin() + 1, nodes.end());
  }
  size_t done = 0;
  while (done < nodes.size()) {
    const size_t fit = nodes_that_fit(mx::scheduler::n_active_tasks());
    if (done > 0 && fit == 0) {
      break;
    }
    const size_t g = all_gpu ? nodes.size() : std::max<size_t>(1, fit);
    const size_t end = std::min(nodes.size(), done + g);
    std::vector<mx::array> group(nodes.begin() + static_cast<long>(done), nodes.begin() + static_cast<long>(end));
    mx::async_eval(std::move(group));
    done = end;
  }
  bool all = true;
  for (const auto& r : roots) {
    all = all && r.status() != mx::array::Status::unscheduled;
  }
  if (all) {
    counters().schedule_whole.fetch_add(1, std::memory_order_relaxed);
    return {true, std::nullopt};
  }
  counters().schedule_chunks.fetch_add(1, std::memory_order_relaxed);
  // Wait for the middle of what was just queued, not its end: when the caller wakes, half of it
  // is still queued, so the stream keeps busy while the next part is scheduled.
  return {false, nodes[(done - 1) / 2]};
}

void barrier(std::shared_ptr<CompletionQueue> queue, uint64_t ticket, mx::Stream s) {
  if (!queue) {
    throw std::invalid_argument("[asyncside] barrier: queue is None");
  }
  if (queue->closed()) {
    throw std::invalid_argument("[asyncside] barrier: the completion queue is closed");
  }
  if (s.device.type != mx::Device::cpu) {
    throw std::invalid_argument("[asyncside] barrier: needs a CPU stream");
  }
  mx::scheduler::enqueue(s, [queue = std::move(queue), ticket]() { queue->post(ticket); });
  counters().signals_direct.fetch_add(1, std::memory_order_relaxed);
}

bool is_available(const mx::array& x) {
  return x.is_available();
}

std::string status(const mx::array& x) {
  switch (x.status()) {
    case mx::array::Status::unscheduled:
      return "unscheduled";
    case mx::array::Status::evaluated:
      return "evaluated";
    case mx::array::Status::available:
      return "available";
  }
  return "unknown";
}

std::vector<std::string> paths() {
  std::vector<std::string> p{"cpu"};
#if defined(ASYNCSIDE_CUDA)
  p.emplace_back("cuda");
#endif
#if defined(ASYNCSIDE_METAL)
  p.emplace_back("metal");
#endif
  return p;
}

// ---- test and bench helpers --------------------------------------------------------------------

TestingGate::TestingGate(double timeout_s) : state_(std::make_shared<State>()) {
  if (!(timeout_s > 0)) {
    throw std::invalid_argument("[asyncside] TestingGate: timeout_s must be > 0");
  }
  state_->timeout_s = timeout_s;
}

TestingGate::~TestingGate() { open(); }

mx::array TestingGate::hold(const mx::array& x, std::optional<mx::Stream> stream) {
  mx::Stream s = cpu_stream_for(x, stream, "TestingGate.hold");
  return mx::array(x.shape(), x.dtype(), std::make_shared<GateHold>(s, state_), {x});
}

void TestingGate::open() {
  {
    std::lock_guard<std::mutex> lk(state_->mu);
    state_->open = true;
  }
  state_->cv.notify_all();
}

bool TestingGate::is_open() const {
  std::lock_guard<std::mutex> lk(state_->mu);
  return state_->open;
}

mx::array testing_fail(const mx::array& x, const std::string& message,
                       std::optional<mx::Stream> stream) {
  mx::Stream s = cpu_stream_for(x, stream, "testing_fail");
  return mx::array(x.shape(), x.dtype(), std::make_shared<FailOnStream>(s, message), {x});
}

std::vector<int64_t> wakeup_floor_ns(int n) {
  if (n <= 0) {
    throw std::invalid_argument("[asyncside] wakeup_floor_ns: n must be > 0");
  }
  int rd = -1, wr = -1, ack_rd = -1, ack_wr = -1;
  make_wake_fds(rd, wr);
  try {
    make_wake_fds(ack_rd, ack_wr);
  } catch (...) {
    ::close(rd);
    if (wr != rd) ::close(wr);
    throw;
  }
  std::vector<int64_t> lat(static_cast<size_t>(n));
  std::atomic<int64_t> t0{0};
  std::thread writer([&] {
    for (int i = 0; i < n; ++i) {
      if (i > 0) {  // wait for the reader's ack of the previous round
        pollfd p{ack_rd, POLLIN, 0};
        while (::poll(&p, 1, -1) < 0 && errno == EINTR) {
        }
        unwake(ack_rd);
      }
      // Give the reader time to fall asleep in poll(): we measure a wakeup, not a spin.
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      t0.store(monotonic_ns(), std::memory_order_release);
      wake(wr);
    }
  });
  for (int i = 0; i < n; ++i) {
    pollfd p{rd, POLLIN, 0};
    while (::poll(&p, 1, -1) < 0 && errno == EINTR) {
    }
    const int64_t t1 = monotonic_ns();
    unwake(rd);
    lat[static_cast<size_t>(i)] = t1 - t0.load(std::memory_order_acquire);
    wake(ack_wr);
  }
  writer.join();
  // An eventfd is its own write end: close each descriptor exactly once (a second close could
  // hit a descriptor another thread just opened).
  ::close(rd);
  if (wr != rd) ::close(wr);
  ::close(ack_rd);
  if (ack_wr != ack_rd) ::close(ack_wr);
  return lat;
}

}  // namespace asyncside::bridge
