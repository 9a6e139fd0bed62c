// The fault server's thread (fault_server.h).
#include "fault_server.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <pthread.h>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace asyncside::faults {

namespace {

void relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// After its last answer the server spins this long (a step's next miss is usually a layer or two
// away), then sleeps this long between polls.
constexpr auto kSpin = std::chrono::milliseconds(2);
constexpr auto kNap = std::chrono::microseconds(20);

class Server {
 public:
  void enter(std::shared_ptr<Pollable> node) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      nodes_.push_back(std::move(node));
      generation_.fetch_add(1, std::memory_order_release);
      if (!started_) {
        started_ = true;
        std::thread([this] { run(); }).detach();
      }
    }
    cv_.notify_one();
  }

  void leave(const Pollable* node) {
    std::shared_ptr<Pollable> last;  // dropped here, on the caller's thread, after both locks
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = std::find_if(nodes_.begin(), nodes_.end(), [node](const auto& p) { return p.get() == node; });
      if (it == nodes_.end()) return;
      last = std::move(*it);
      nodes_.erase(it);
      generation_.fetch_add(1, std::memory_order_release);
    }
    // A sweep that began before the erase may still hold the node: wait for it to end (the next
    // one starts from the new generation).
    std::lock_guard<std::mutex> sweep(sweep_mu_);
  }

  uint64_t registered() {
    std::lock_guard<std::mutex> lk(mu_);
    return nodes_.size();
  }
  uint64_t served() const { return served_.load(std::memory_order_relaxed); }

 private:
  // The thread holds plain pointers only, never a reference: dropping the last reference to a
  // fault table frees pinned memory, and cudaFreeHost waits for the device, which may be waiting
  // for this very thread to answer a request.
  void run() {
    std::vector<Pollable*> mine;
    uint64_t seen = ~0ull;
    auto last = std::chrono::steady_clock::now();
    for (;;) {
      uint64_t answered = 0;
      {
        std::unique_lock<std::mutex> sweep(sweep_mu_);
        if (generation_.load(std::memory_order_acquire) != seen) {
          std::unique_lock<std::mutex> lk(mu_);
          if (nodes_.empty()) {
            sweep.unlock();  // leave() may be waiting for it
            cv_.wait(lk, [this] { return !nodes_.empty(); });
            continue;
          }
          mine.clear();
          for (const auto& p : nodes_) mine.push_back(p.get());
          seen = generation_.load(std::memory_order_acquire);
        }
        for (Pollable* p : mine) answered += p->poll() ? 1 : 0;
      }
      const auto now = std::chrono::steady_clock::now();
      if (answered) {
        served_.fetch_add(answered, std::memory_order_relaxed);
        last = now;
      } else if (now - last > kSpin) {
        std::this_thread::sleep_for(kNap);
      } else {
        relax();
      }
    }
  }

  std::mutex mu_;        // nodes_, started_
  std::mutex sweep_mu_;  // held by the thread while it polls its snapshot of nodes_
  std::condition_variable cv_;
  std::vector<std::shared_ptr<Pollable>> nodes_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<uint64_t> served_{0};
  bool started_ = false;
};

// Never destroyed: the thread may be polling while the process exits. A child after fork has no
// server thread (and its copy of the locks may be held): it starts from a fresh one.
std::atomic<Server*> g_server{nullptr};

Server& server() {
  static const bool once = [] {
    g_server.store(new Server(), std::memory_order_release);
    pthread_atfork(nullptr, nullptr, [] { g_server.store(new Server(), std::memory_order_release); });
    return true;
  }();
  (void)once;
  return *g_server.load(std::memory_order_acquire);
}

}  // namespace

void server_enter(std::shared_ptr<Pollable> node) { server().enter(std::move(node)); }
void server_leave(const Pollable* node) { server().leave(node); }
uint64_t server_registered() { return server().registered(); }
uint64_t server_served() { return server().served(); }

}  // namespace asyncside::faults
