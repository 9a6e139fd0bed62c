// The fault resolve's read pool (see read_pool.h).
#include "read_pool.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

namespace asyncside::faults {

namespace {

// One parallel_reads call: items are taken by index until none is left.
struct Batch {
  const std::function<void(size_t)>* fn;
  size_t n;
  std::atomic<size_t> next{0};
  std::atomic<size_t> done{0};
  std::mutex mu;
  std::condition_variable finished;

  // Run items until none is left; true when this call ran the last one to finish.
  void drain() {
    size_t ran = 0;
    for (size_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      (*fn)(i);
      ++ran;
    }
    if (ran && done.fetch_add(ran) + ran == n) {
      std::lock_guard<std::mutex> lk(mu);
      finished.notify_all();
    }
  }
};

size_t default_threads() {
  if (const char* env = std::getenv("ASYNCSIDE_FAULT_READ_THREADS")) {
    char* end = nullptr;
    const unsigned long n = std::strtoul(env, &end, 10);
    if (end != env && *end == '\0') return std::min<size_t>(n, 64);
  }
  const size_t cores = std::max(1u, std::thread::hardware_concurrency());
  return cores >= 4 ? std::min<size_t>(7, cores / 2 - 1) : 0;
}

class Pool {
 public:
  void run(size_t n, const std::function<void(size_t)>& fn) {
    const size_t want = std::min(wanted_.load(), n - 1);
    if (n <= 1 || want == 0) {
      for (size_t i = 0; i < n; ++i) fn(i);
      return;
    }
    auto batch = std::make_shared<Batch>();
    batch->fn = &fn;
    batch->n = n;
    {
      std::lock_guard<std::mutex> lk(mu_);
      while (started_ < want) {
        std::thread([this] { work(); }).detach();
        ++started_;
      }
      for (size_t i = 0; i < want; ++i) queue_.push_back(batch);
    }
    if (want == 1) wake_.notify_one(); else wake_.notify_all();
    batch->drain();
    std::unique_lock<std::mutex> lk(batch->mu);
    batch->finished.wait(lk, [&] { return batch->done.load() == n; });
    // Workers that pop this batch later find no item left and drop it; `fn` is not touched then.
  }

  std::atomic<size_t> wanted_{default_threads()};

 private:
  void work() {
    for (;;) {
      std::shared_ptr<Batch> b;
      {
        std::unique_lock<std::mutex> lk(mu_);
        wake_.wait(lk, [&] { return !queue_.empty(); });
        b = std::move(queue_.front());
        queue_.pop_front();
      }
      b->drain();
    }
  }

  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<Batch>> queue_;
  size_t started_ = 0;
};

Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: its detached workers may outlive static destructors
  return *p;
}

size_t default_background_threads() {
  if (const char* env = std::getenv("ASYNCSIDE_FAULT_BACKGROUND_THREADS")) {
    char* end = nullptr;
    const unsigned long n = std::strtoul(env, &end, 10);
    if (end != env && *end == '\0' && n >= 1) return std::min<size_t>(n, 64);
  }
  return std::max<size_t>(2, default_threads());
}

// A plain FIFO of jobs and workers started on first use (detached, never joined; see Pool).
class Background {
 public:
  void submit(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      jobs_.push_back(std::move(job));
      if (started_ < threads_ && idle_ < jobs_.size()) {
        std::thread([this] { work(); }).detach();
        ++started_;
        return;
      }
    }
    wake_.notify_one();
  }
  const size_t threads_ = default_background_threads();

 private:
  void work() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lk(mu_);
        ++idle_;
        wake_.wait(lk, [&] { return !jobs_.empty(); });
        --idle_;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }

  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> jobs_;
  size_t started_ = 0;
  size_t idle_ = 0;
};

Background& background() {
  static Background* b = new Background();  // never destroyed, as pool()
  return *b;
}

}  // namespace

void submit_background(std::function<void()> job) { background().submit(std::move(job)); }

size_t background_threads() { return background().threads_; }

void parallel_reads(size_t n, const std::function<void(size_t)>& fn) { pool().run(n, fn); }

size_t read_threads() { return pool().wanted_.load(); }

void set_read_threads(size_t n) { pool().wanted_.store(std::min<size_t>(n, 64)); }

}  // namespace asyncside::faults
