// Why: on the GPU the engine is correct because of stream order: the
// backend's copies and kernels run on the calling thread's current stream,
// and communication either on the same stream or on the communicator's own,
// ordered against it with events (Ops<Cuda>::Overlap), without host
// synchronisation. This header owns that per-thread "current stream" (as
// c10's current stream does), so the backend (zero/backend/cuda.hpp) and the
// communicators (zero/comm/nccl.hpp, zero/comm/local_device.hpp) agree on it
// without including each other.
//
// It also owns the one way the library waits for a stream on the host,
// wait_stream(). A plain cudaStreamSynchronize would hang forever behind a
// collective whose peer died; wait_stream instead polls the stream and, while
// it waits, every registered StreamWatcher (each comm::Nccl is one), which
// aborts its communicator and throws CommError past its timeout or on an
// asynchronous NCCL error. With no watcher registered it is exactly
// cudaStreamSynchronize.
#pragma once

#include "zero/compiler.hpp"

#include "zero/cuda/runtime.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "zero/cuda/check.hpp"
#include "zero/error.hpp"

namespace zero::cuda {

// Something that can tell, without blocking, that work it enqueued will never
// finish (and then throws). poll() may be called from any thread.
class StreamWatcher {
 public:
  virtual void poll() = 0;

 protected:
  ~StreamWatcher() = default;
};

namespace detail {

// This thread's current stream: one the user set, or one created lazily
// (non-blocking, so it never serialises with the legacy default stream).
struct ThreadStream {
  cudaStream_t user = nullptr;
  bool user_set = false;
  cudaStream_t owned = nullptr;
  ThreadStream() = default;
  ThreadStream(const ThreadStream&) = delete;
  ThreadStream& operator=(const ThreadStream&) = delete;
  // Thread-storage destructors run before CUDA's own teardown at exit; an
  // error here has nothing left to protect, so it is ignored.
  ~ThreadStream() {
    if (owned != nullptr) cudaStreamDestroy(owned);
  }
};

inline ThreadStream& thread_stream() {
  thread_local ThreadStream s;
  return s;
}

struct WatcherRegistry {
  std::mutex mutex;
  std::vector<StreamWatcher*> watchers;
  std::atomic<int> count{0};
};

inline WatcherRegistry& watcher_registry() {
  static WatcherRegistry r;
  return r;
}

inline void poll_watchers() {
  WatcherRegistry& r = watcher_registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  for (StreamWatcher* w : r.watchers) w->poll();
}

}  // namespace detail

// The stream every zero operation of this thread is enqueued on. Created on
// first use on the then-current device (threads that switch devices should
// set their own stream per device with set_current_stream).
inline cudaStream_t current_stream() {
  detail::ThreadStream& s = detail::thread_stream();
  if (s.user_set) return s.user;
  if (s.owned == nullptr) ZERO_CUDA_CHECK(cudaStreamCreateWithFlags(&s.owned, cudaStreamNonBlocking));
  return s.owned;
}

// Makes `stream` this thread's current stream (not owned: the caller keeps it
// alive while it is current). 0 selects the legacy default stream.
inline void set_current_stream(cudaStream_t stream) {
  detail::ThreadStream& s = detail::thread_stream();
  s.user = stream;
  s.user_set = true;
}

// Back to the lazily created per-thread stream.
inline void reset_current_stream() {
  detail::ThreadStream& s = detail::thread_stream();
  s.user = nullptr;
  s.user_set = false;
}

// Work enqueued on `waiter` from now on starts after all work enqueued on
// `producer` so far (through `event`, which is re-recorded; the wait captures
// this record, so the event may be reused at once). No host wait.
inline void order_after(cudaStream_t waiter, cudaStream_t producer, cudaEvent_t event) {
  ZERO_CUDA_CHECK(cudaEventRecord(event, producer));
  ZERO_CUDA_CHECK(cudaStreamWaitEvent(waiter, event, 0));
}

// Makes `stream` the thread's current stream for a scope and restores what
// was current before (a user's stream or the lazily created one) at its end.
class CurrentStreamScope {
 public:
  explicit CurrentStreamScope(cudaStream_t stream) : saved_user_(detail::thread_stream().user),
                                                      saved_user_set_(detail::thread_stream().user_set) {
    set_current_stream(stream);
  }
  CurrentStreamScope(const CurrentStreamScope&) = delete;
  CurrentStreamScope& operator=(const CurrentStreamScope&) = delete;
  ~CurrentStreamScope() {
    detail::ThreadStream& s = detail::thread_stream();
    s.user = saved_user_;
    s.user_set = saved_user_set_;
  }

 private:
  cudaStream_t saved_user_;
  bool saved_user_set_;
};

// Registration of watchers (see StreamWatcher); a watcher unregisters itself
// before it is destroyed.
inline void register_watcher(StreamWatcher* w) {
  detail::WatcherRegistry& r = detail::watcher_registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  r.watchers.push_back(w);
  r.count.fetch_add(1, std::memory_order_release);
}
inline void unregister_watcher(StreamWatcher* w) noexcept {
  detail::WatcherRegistry& r = detail::watcher_registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  auto it = std::find(r.watchers.begin(), r.watchers.end(), w);
  if (it != r.watchers.end()) {
    r.watchers.erase(it);
    r.count.fetch_sub(1, std::memory_order_release);
  }
}

// Blocks until all work enqueued on `stream` so far has finished. Throws
// BackendError when the stream reports a CUDA error, and whatever a watcher
// throws (CommError) when a collective it tracks will not finish.
inline void wait_stream(cudaStream_t stream) {
  if (detail::watcher_registry().count.load(std::memory_order_acquire) == 0) {
    ZERO_CUDA_CHECK(cudaStreamSynchronize(stream));
    return;
  }
  using clock = std::chrono::steady_clock;
  auto next_poll = clock::now();
  for (int spin = 0;; ++spin) {
    const cudaError_t status = cudaStreamQuery(stream);
    if (status == cudaSuccess) return;
    if (status != cudaErrorNotReady) zero::cuda::detail::throw_cuda_error(status, "cudaStreamQuery(stream)", __FILE__, __LINE__);
    const auto now = clock::now();
    if (now >= next_poll) {
      detail::poll_watchers();
      next_poll = now + std::chrono::milliseconds(1);
    }
    // Short waits (a small copy) answer within microseconds; long ones must
    // not burn a core that another rank thread needs.
    if (spin < 64)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(spin < 1024 ? 20 : 200));
  }
}

}  // namespace zero::cuda
