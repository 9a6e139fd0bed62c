// Native completion bridge: an MLX primitive that, when its stream reaches it, posts a ticket to
// a CompletionQueue and wakes the event loop through a file descriptor (eventfd on Linux, a pipe
// elsewhere). Plain C++: nothing here knows Python. Every object counts what it creates and frees.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/stream.h"

namespace asyncside::bridge {

// Nanoseconds on the clock Python's time.monotonic_ns() reads (CLOCK_MONOTONIC on Linux).
int64_t monotonic_ns() noexcept;

// One posted completion: which ticket, and when the stream reached it.
struct Completion {
  uint64_t ticket;
  int64_t posted_ns;
};

// Process-wide counters, for tests (balance) and diagnostics. Atomics: bumped from any thread.
struct Counters {
  std::atomic<uint64_t> queues_created{0};
  std::atomic<uint64_t> queues_closed{0};     // fd closed (explicitly or by the destructor)
  std::atomic<uint64_t> queues_destroyed{0};  // C++ object freed (may lag close: a stream task holds it)
  std::atomic<uint64_t> signals_created{0};   // primitives constructed
  std::atomic<uint64_t> signals_destroyed{0};
  std::atomic<uint64_t> signals_dispatched{0};  // eval_cpu/eval_gpu scheduled the post
  std::atomic<uint64_t> signals_direct{0};  // posts queued straight on a CPU stream (backlog, barrier)
  std::atomic<uint64_t> schedule_whole{0};   // schedule_step calls that scheduled everything
  std::atomic<uint64_t> schedule_chunks{0};  // ... that scheduled a part (throttle would engage)
  std::atomic<uint64_t> schedule_waits{0};   // ... that found no room: await the frontier or the stream
  std::atomic<uint64_t> tickets_posted{0};    // post() called by a stream/callback thread
  std::atomic<uint64_t> tickets_reaped{0};    // handed to the loop by drain()
  std::atomic<uint64_t> tickets_dropped{0};   // posted after close(): nobody is listening
  std::atomic<uint64_t> tickets_abandoned{0};  // abandon(): issuing failed, the owner gave up
  std::atomic<uint64_t> wakeups_written{0};   // eventfd/pipe writes (posts coalesce while unread)
};
Counters& counters();

// A thread-safe queue of completed tickets with a readable fd. post() may be called from any
// thread (MLX stream thread, CUDA worker, Metal completion thread); drain()/close()/fd() belong to
// the thread that owns the event loop. The fd is closed under the mutex, so a late post() never
// writes into a closed (and possibly reused) descriptor.
class CompletionQueue {
 public:
  CompletionQueue();
  ~CompletionQueue();
  CompletionQueue(const CompletionQueue&) = delete;
  CompletionQueue& operator=(const CompletionQueue&) = delete;

  int fd() const noexcept { return read_fd_; }
  bool closed() const;

  // Any thread. Records (ticket, now) and makes the fd readable (one write per unread batch).
  void post(uint64_t ticket) noexcept;

  // Owner thread. Resets the fd's readiness and returns every completion posted so far, in post
  // order. Never blocks.
  std::vector<Completion> drain();

  // Owner thread. The ticket was never (or may not have been) scheduled: count it as abandoned.
  void abandon(uint64_t ticket) noexcept;

  // Owner thread. Closes the fd; later posts are dropped and counted. Idempotent.
  void close() noexcept;

  uint64_t posted() const;  // tickets posted to this queue (dropped ones included)
  uint64_t reaped() const;  // tickets drained from this queue

 private:
  void close_locked() noexcept;

  mutable std::mutex mu_;  // ready_, closed_, armed_, counts; never held across a syscall by post()
  std::mutex fd_mu_;       // held by post() around its wakeup write and by close(): fd lifetime
  std::vector<Completion> ready_;
  int read_fd_ = -1;
  int write_fd_ = -1;  // == read_fd_ for an eventfd
  bool closed_ = false;
  bool armed_ = false;  // a wakeup is written (or being written) and not yet drained
  uint64_t posted_ = 0;
  uint64_t reaped_ = 0;
};

// Build the completion signal for `x`: an (1,) uint64 array whose evaluation on `stream` posts
// `ticket` to `queue` once everything scheduled before it on that stream is done. Schedules x (if
// it is not yet) and the signal with async_eval, so on return both are queued on their streams and
// nothing waited. Default stream: the one x is computed on. When the build has no native GPU path,
// a GPU x is signalled from the default CPU stream (MLX makes that stream wait on x's event).
// Throws std::invalid_argument for an explicit GPU stream the build cannot signal from.
//
// MLX's eval throttles: after each array it evaluates, async_eval blocks its caller while more
// than 10 CPU task groups (~100 dispatches, all streams together) are in flight. The signal is no
// new work, so when the CPU stream it goes on is that backlogged, signal() does not async_eval
// it: it queues the post directly behind everything already on x's stream (same ordering, no
// array) and returns nullopt. Scheduling x itself (if unscheduled) is subject to the throttle.
//
// `then`: arrays to schedule right behind the signal. On a GPU stream they go in the signal's own
// async_eval (each async_eval commits a command buffer there, so this saves one per completion)
// and the result says so; on a CPU stream they are left to the caller, which queues them without
// ever meeting the throttle.
struct SignalResult {
  std::optional<mlx::core::array> signal;
  bool then_scheduled = false;
};
SignalResult signal(const mlx::core::array& x, std::shared_ptr<CompletionQueue> queue, uint64_t ticket,
                    std::optional<mlx::core::Stream> stream, const std::vector<mlx::core::array>& then = {});

// MLX's count of CPU task groups in flight (what its eval throttle compares with 10).
int mlx_active_tasks();

// Schedule the unscheduled part of the graphs of `roots` without letting MLX's eval throttle block
// the caller (MLX's async_eval waits while more than 10 task groups of ~10 dispatches are in
// flight). Schedules as much as fits now, inputs before users. Returns {true, nullopt} once every
// root is scheduled; otherwise {false, y}: await y (scheduled, not yet computed) and call again;
// or {false, nullopt} when nothing fits and no input of the graph is pending: await the roots'
// (CPU) stream with barrier(), then call again. On GPU streams, when nothing fits, one node is
// scheduled anyway (MLX then waits for at most one command buffer).
std::pair<bool, std::optional<mlx::core::array>> schedule_step(const std::vector<mlx::core::array>& roots);

// Post `ticket` to `queue` once CPU stream `s` has run everything queued on it so far (no array,
// no eval: never subject to MLX's throttle). Throws std::invalid_argument for a GPU stream.
void barrier(std::shared_ptr<CompletionQueue> queue, uint64_t ticket, mlx::core::Stream s);

// Whether x is safe to read without waiting (never blocks). Throws the MLX error if the
// computation that produced x failed (and clears it, as MLX does).
bool is_available(const mlx::core::array& x);

// "unscheduled" | "evaluated" | "available" (MLX's own status; "evaluated" may still be running).
std::string status(const mlx::core::array& x);

// The stream x is (or was) computed on, if MLX still knows it.
std::optional<mlx::core::Stream> stream_of(const mlx::core::array& x);

// Which native completion paths this build compiled: "cpu", plus "cuda"/"metal".
std::vector<std::string> paths();

// GPU completion hooks (bridge_cuda.cpp / bridge_metal.cpp). Each schedules `fn` to run once
// all work encoded so far on `s` has completed on the device. Defined only where compiled.
#if defined(ASYNCSIDE_CUDA)
void cuda_add_completed_handler(mlx::core::Stream s, std::function<void()> fn);
#endif
#if defined(ASYNCSIDE_METAL)
void metal_add_completed_handler(mlx::core::Stream s, std::function<void()> fn);
#endif

// ---- Test and benchmark helpers (deterministic orderings without timed assertions) ----------

// A gate on a stream: hold(x) returns an array equal to x (same buffer) whose evaluation blocks
// the stream thread until open() (or until `timeout_s` passes, which fails the stream with a
// clear error rather than hanging the process).
class TestingGate {
 public:
  explicit TestingGate(double timeout_s = 60.0);
  ~TestingGate();  // opens the gate: a dropped gate never strands a stream thread
  mlx::core::array hold(const mlx::core::array& x, std::optional<mlx::core::Stream> stream);
  void open();
  bool is_open() const;

  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool open = false;
    double timeout_s = 60.0;
  };

 private:
  std::shared_ptr<State> state_;
};

// An array equal to x whose evaluation task throws std::runtime_error(message) on the stream.
mlx::core::array testing_fail(const mlx::core::array& x, const std::string& message,
                              std::optional<mlx::core::Stream> stream);

// Physical floor of a cross-thread wakeup: a native thread writes an eventfd at t0, the calling
// thread sleeps in poll() and wakes; returns n latencies (ns). No Python involved.
std::vector<int64_t> wakeup_floor_ns(int n);

}  // namespace asyncside::bridge
