// The release thread for scheduled step graphs (see graph_release.h).
#include "graph_release.h"

#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <string>
#include <thread>

#include <unistd.h>

namespace mx = mlx::core;

namespace asyncside::plan {

namespace {

class Releaser {
 public:
  void release(std::vector<mx::array>&& arrays) {
    std::unique_lock<std::mutex> lk(mu_);
    if (stopped_ || (started_ && owner_ != getpid())) {
      lk.unlock();
      arrays.clear();  // at exit, or in a forked child (no release thread there): here and now
      return;
    }
    if (!started_) {
      std::thread([this] { work(); }).detach();
      started_ = true;
      owner_ = getpid();
    }
    queue_.push_back(std::move(arrays));
    ++pending_;
    lk.unlock();
    wake_.notify_one();
  }

  size_t pending() {
    std::lock_guard<std::mutex> lk(mu_);
    return pending_;
  }

  void wait() {
    std::unique_lock<std::mutex> lk(mu_);
    if (owner_ != getpid()) return;
    drained_.wait(lk, [&] { return pending_ == 0 || stopped_; });
  }

  void stop() {
    std::unique_lock<std::mutex> lk(mu_);
    stopped_ = true;
    if (owner_ != getpid()) return;
    // What is queued stays queued (the process is ending); one being dropped is finished first.
    drained_.wait(lk, [&] { return !dropping_; });
  }

 private:
  void work() {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      wake_.wait(lk, [&] { return !queue_.empty() && !stopped_; });
      std::vector<mx::array> arrays = std::move(queue_.front());
      queue_.pop_front();
      dropping_ = true;
      lk.unlock();
      arrays.clear();
      lk.lock();
      dropping_ = false;
      --pending_;
      drained_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable drained_;
  std::deque<std::vector<mx::array>> queue_;
  size_t pending_ = 0;
  bool started_ = false;
  bool stopped_ = false;
  bool dropping_ = false;
  pid_t owner_ = 0;
};

Releaser& releaser() {
  static Releaser* r = new Releaser();  // never destroyed: its detached thread may outlive static destructors
  return *r;
}

}  // namespace

void release_later(std::vector<mx::array>&& arrays) {
  // A diagnostic switch for A/B runs (docs/ARCHITECTURE.md): every release on the caller.
  static const bool on_caller = [] {
    const char* env = std::getenv("ASYNCSIDE_GRAPH_RELEASE");
    return env != nullptr && std::string(env) == "caller";
  }();
  if (on_caller) {
    arrays.clear();
    return;
  }
  if (!arrays.empty()) releaser().release(std::move(arrays));
}

size_t pending_releases() { return releaser().pending(); }

void wait_for_releases() { releaser().wait(); }

void stop_releases() { releaser().stop(); }

}  // namespace asyncside::plan
