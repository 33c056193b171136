// Why: the library's watched waits exist for work that will never finish (a
// collective whose peer died), and a test needs such work on demand without
// a second GPU: a kernel that spins until the host releases it blocks its
// stream. A helper thread releases it after a bound, so a test of code that
// waits unwatched fails slowly instead of hanging; release() ends it early,
// as ncclCommAbort releases kernels stuck in NCCL. Shared by the CUDA tests;
// host code, with the kernel in blocked_stream.cu (the tests link its object).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "zero/cuda/check.hpp"

namespace zero::test {

// Enqueues on `s` a kernel that spins until *flag (mapped host memory) is not 0.
void spin_until(const volatile int* flag, cudaStream_t s);

class BlockedStream {
 public:
  BlockedStream(cudaStream_t s, std::chrono::milliseconds release_after) {
    ZERO_CUDA_CHECK(cudaHostAlloc(&flag_, sizeof(int), cudaHostAllocMapped));
    *flag_ = 0;
    int* device_flag = nullptr;
    ZERO_CUDA_CHECK(cudaHostGetDevicePointer(&device_flag, flag_, 0));
    spin_until(device_flag, s);
    releaser_ = std::thread([this, release_after] {
      std::unique_lock<std::mutex> lock(mutex_);
      released_.wait_for(lock, release_after, [this] { return done_; });
      reinterpret_cast<std::atomic<int>*>(flag_)->store(1);
    });
  }
  BlockedStream(const BlockedStream&) = delete;
  BlockedStream& operator=(const BlockedStream&) = delete;
  ~BlockedStream() {
    release();
    releaser_.join();
    cudaDeviceSynchronize();
    cudaFreeHost(flag_);
  }

  // Lets the spinning kernel finish now.
  void release() {
    reinterpret_cast<std::atomic<int>*>(flag_)->store(1);
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    released_.notify_all();
  }

 private:
  int* flag_ = nullptr;
  std::mutex mutex_;
  std::condition_variable released_;
  bool done_ = false;
  std::thread releaser_;  // last: started once the members it uses exist
};

}  // namespace zero::test
