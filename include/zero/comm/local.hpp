// Why: ZeRO is about N ranks, and every test of it needs N ranks. comm::Local
// runs them as threads of one process over host memory: real collectives with
// real synchronisation (so ordering bugs deadlock or fail here as they would
// with NCCL), deterministic results, and no MPI launcher. A rank that throws
// or stops calling collectives aborts the group: the others get a CommError
// naming the rank instead of hanging.
#pragma once

#include "zero/config.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "zero/comm/communicator.hpp"
#include "zero/comm/reduce.hpp"
#include "zero/error.hpp"

#if ZERO_HAS_OPENMP
#include <omp.h>
#endif

namespace zero::comm {

class Local;
class LocalDevice;  // zero/comm/local_device.cuh: the same ranks over device memory

// The shared state of N in-process ranks. Create one, then run():
//
//   zero::comm::LocalGroup group(4);
//   group.run([&](zero::comm::Local& comm) { ... comm.rank() ... });
class LocalGroup {
 public:
  struct Options {
    // A rank waiting longer than this at a collective aborts the group: some
    // rank made a different sequence of calls (or is stuck).
    std::chrono::milliseconds timeout{std::chrono::minutes(5)};
    // OpenMP threads each rank's host kernels may use (0: cores / ranks).
    int threads_per_rank = 0;
  };

  explicit LocalGroup(int ranks) : LocalGroup(ranks, Options{}) {}
  LocalGroup(int ranks, Options options)
      : ranks_(ranks), options_(options), send_(static_cast<std::size_t>(ranks)), recv_(static_cast<std::size_t>(ranks)) {
    require(ranks >= 1, "comm::LocalGroup needs at least 1 rank, got ", ranks);
  }

  int size() const { return ranks_; }

  // Runs fn(Local&) on `size()` threads, one per rank, and waits for all.
  // If any rank throws, the others are released from their collectives with
  // a CommError, and the first rank's exception is rethrown here.
  template <class Fn>
  void run(Fn&& fn);

 private:
  friend class Local;
  friend class LocalDevice;

  // Waits until all ranks arrive. Throws CommError if the group was aborted
  // or the wait exceeds the timeout (then the group is aborted for all).
  void arrive_and_wait(int rank, const char* what) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (aborted_) throw CommError(abort_message_);
    const std::uint64_t generation = generation_;
    if (++arrived_ == ranks_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    if (!cv_.wait_for(lock, options_.timeout, [&] { return generation_ != generation || aborted_; })) {
      abort_locked(zero::detail::concat("comm::Local: rank ", rank, " waited more than ", options_.timeout.count(),
                                  " ms in ", what,
                                  " for the other ranks; every rank must make the same collective calls in the "
                                  "same order"));
    }
    if (aborted_) throw CommError(abort_message_);
  }

  void abort_locked(std::string message) {
    if (!aborted_) {
      aborted_ = true;
      abort_message_ = std::move(message);
    }
    cv_.notify_all();
  }
  void abort(std::string message) {
    std::lock_guard<std::mutex> lock(mutex_);
    abort_locked(std::move(message));
  }
  void reset() {
    std::lock_guard<std::mutex> lock(mutex_);
    aborted_ = false;
    arrived_ = 0;
    abort_message_.clear();
  }

  int ranks_;
  Options options_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
  bool aborted_ = false;
  std::string abort_message_;
  std::vector<const void*> send_;
  std::vector<void*> recv_;
};

// One rank's handle. Host memory only; all calls are collective.
class Local {
 public:
  Local(LocalGroup& group, int rank) : group_(&group), rank_(rank) {}

  int rank() const { return rank_; }
  int size() const { return group_->ranks_; }
  const ByteCounters& counters() const { return counters_; }
  void reset_counters() { counters_ = {}; }

  void barrier() { group_->arrive_and_wait(rank_, "barrier"); }

  void all_reduce(void* buf, std::size_t count, DType t, ReduceOp op = ReduceOp::sum, bool control = false) {
    const std::size_t bytes = dtype_bytes(t);
    publish(buf, buf, "all_reduce");
    // Rank r reduces chunk r of every buffer into its own buffer, then every
    // rank copies the other chunks from their owners.
    const int n = size();
    const std::size_t begin = chunk_begin(count, rank_, n), end = chunk_begin(count, rank_ + 1, n);
    detail::reduce(t, buf, group_->send_.data(), n, begin, end, op);
    group_->arrive_and_wait(rank_, "all_reduce");
    for (int s = 0; s < n; ++s) {
      if (s == rank_) continue;
      const std::size_t b = chunk_begin(count, s, n), e = chunk_begin(count, s + 1, n);
      std::memcpy(static_cast<char*>(buf) + b * bytes, static_cast<const char*>(group_->send_[s]) + b * bytes,
                  (e - b) * bytes);
    }
    group_->arrive_and_wait(rank_, "all_reduce");
    counters_.count_all_reduce(count * bytes, n, control);
  }

  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType t) {
    const std::size_t bytes = dtype_bytes(t);
    publish(send, recv, "reduce_scatter");
    const int n = size();
    std::vector<const void*>& blocks = scratch_;
    blocks.resize(static_cast<std::size_t>(n));
    for (int s = 0; s < n; ++s)
      blocks[s] = static_cast<const char*>(group_->send_[s]) + static_cast<std::size_t>(rank_) * recv_count * bytes;
    // Only this rank reads block `rank` of any buffer, so writing recv (which
    // may be that very block of our own send buffer) is safe.
    detail::reduce(t, recv, blocks.data(), n, 0, recv_count, ReduceOp::sum);
    group_->arrive_and_wait(rank_, "reduce_scatter");
    counters_.count_reduce_scatter(recv_count * static_cast<std::size_t>(n) * bytes, n);
  }

  void all_gather(const void* send, void* recv, std::size_t send_count, DType t, bool control = false) {
    const std::size_t bytes = dtype_bytes(t);
    publish(send, recv, "all_gather");
    const int n = size();
    for (int s = 0; s < n; ++s) {
      char* dst = static_cast<char*>(recv) + static_cast<std::size_t>(s) * send_count * bytes;
      if (dst != group_->send_[s]) std::memmove(dst, group_->send_[s], send_count * bytes);
    }
    group_->arrive_and_wait(rank_, "all_gather");
    counters_.count_all_gather(send_count * static_cast<std::size_t>(n) * bytes, n, control);
  }

  void broadcast(void* buf, std::size_t count, DType t, int root) {
    require(root >= 0 && root < size(), "broadcast root ", root, " is not a rank of this group of ", size());
    const std::size_t bytes = dtype_bytes(t);
    publish(buf, buf, "broadcast");
    if (rank_ != root) std::memcpy(buf, group_->send_[root], count * bytes);
    group_->arrive_and_wait(rank_, "broadcast");
    counters_.count_broadcast(count * bytes, size());
  }

 private:
  friend class LocalDevice;  // builds on this rank's group and rank

  static std::size_t chunk_begin(std::size_t count, int part, int parts) {
    return count * static_cast<std::size_t>(part) / static_cast<std::size_t>(parts);
  }
  // Posts this rank's pointers and waits until every rank has posted.
  void publish(const void* send, void* recv, const char* what) {
    // The previous collective's last barrier guarantees nobody still reads the slots.
    group_->send_[rank_] = send;
    group_->recv_[rank_] = recv;
    group_->arrive_and_wait(rank_, what);
  }

  LocalGroup* group_;
  int rank_;
  ByteCounters counters_;
  std::vector<const void*> scratch_;  // reused: collectives allocate nothing after the first call
};

template <class Fn>
void LocalGroup::run(Fn&& fn) {
  reset();
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(ranks_));
  std::vector<int> failed_first;
  std::mutex order_mutex;
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int per_rank = options_.threads_per_rank > 0 ? options_.threads_per_rank : std::max(1, hw / ranks_);
  auto body = [&](int r) {
#if ZERO_HAS_OPENMP
    omp_set_num_threads(per_rank);
#else
    (void)per_rank;
#endif
    Local comm(*this, r);
    try {
      fn(comm);
    } catch (...) {
      errors[r] = std::current_exception();
      {
        std::lock_guard<std::mutex> lock(order_mutex);
        failed_first.push_back(r);
      }
      std::string what = "unknown exception";
      try {
        throw;
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      abort(zero::detail::concat("comm::Local: rank ", r, " failed (", what, "); the group was aborted"));
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(ranks_));
  for (int r = 0; r < ranks_; ++r) threads.emplace_back(body, r);
  for (auto& t : threads) t.join();
  if (!failed_first.empty()) std::rethrow_exception(errors[failed_first.front()]);
}

}  // namespace zero::comm
