// Why: the delayed parameter update (Options::delayed_update) runs step t's
// CPU update while the caller's thread goes on with step t+1's forward and
// backward. One thread, started once and kept, runs it: a thread per step
// would cost a clone() and an allocation every step, and the steady-state
// step allocates nothing. An exception thrown by the update is kept and
// rethrown by the next wait(), on the caller's thread.
#pragma once

#include "zero/compiler.hpp"

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

namespace zero::detail {

class UpdateWorker {
 public:
  UpdateWorker() = default;
  UpdateWorker(const UpdateWorker&) = delete;
  UpdateWorker& operator=(const UpdateWorker&) = delete;
  ~UpdateWorker() {
    if (!thread_.joinable()) return;
    {
      std::unique_lock lock(mutex_);
      done_.wait(lock, [&] { return task_ == nullptr; });
      stop_ = true;
    }
    ready_.notify_all();
    thread_.join();
  }

  // Runs task() on the worker thread; at most one task at a time (call
  // wait() in between). The callers' tasks capture one pointer, which
  // std::function keeps without allocating.
  void start(std::function<void()> task) {
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    {
      std::lock_guard lock(mutex_);
      task_ = std::move(task);
    }
    ready_.notify_all();
  }
  bool busy() {
    std::lock_guard lock(mutex_);
    return task_ != nullptr;
  }
  // Until the task has finished; rethrows what it threw.
  void wait() {
    std::unique_lock lock(mutex_);
    done_.wait(lock, [&] { return task_ == nullptr; });
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  void loop() {
    std::unique_lock lock(mutex_);
    for (;;) {
      ready_.wait(lock, [&] { return stop_ || task_ != nullptr; });
      if (stop_) return;
      lock.unlock();
      std::exception_ptr error;
      try {
        task_();
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      error_ = error;
      task_ = nullptr;
      done_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable ready_, done_;
  std::function<void()> task_;
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace zero::detail
