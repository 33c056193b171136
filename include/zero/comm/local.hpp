// Why: ZeRO is about N ranks, and every test of it needs N ranks. comm::Local
// runs them as threads of one process over host memory: real collectives with
// real synchronisation (so ordering bugs deadlock or fail here as they would
// with NCCL), deterministic results, and no MPI launcher. A rank that throws
// or stops calling collectives aborts the group: the others get a CommError
// naming the rank instead of hanging; ranks that make different calls at the
// same point (kind, element count, type, operation or root) all get a
// CommError naming both calls, before any rank touches another's buffer.
//
// Speed: the ranks move data in parallel, each over its own disjoint part,
// straight between the user's buffers (no staging copies), so a collective
// runs near the memory bandwidth of the cores (bench/bench_comm measures it).
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
      : ranks_(ranks),
        options_(options),
        send_(static_cast<std::size_t>(ranks)),
        recv_(static_cast<std::size_t>(ranks)),
        calls_(static_cast<std::size_t>(ranks)) {
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

  // What a rank asked for, posted with its buffers so that every rank can
  // check that all made the same call before reading anyone's buffers.
  struct Call {
    enum class Kind : std::uint8_t { barrier, all_reduce, reduce_scatter, all_gather, broadcast };
    Kind kind = Kind::barrier;
    std::size_t count = 0;  // elements: all_reduce and broadcast the buffer, reduce_scatter recv, all_gather send
    DType dtype = DType::f32;
    ReduceOp op = ReduceOp::sum;  // all_reduce
    int root = 0;                 // broadcast

    bool operator==(const Call&) const = default;
    std::string describe() const {
      static constexpr const char* names[] = {"barrier", "all_reduce", "reduce_scatter", "all_gather", "broadcast"};
      const char* name = names[static_cast<int>(kind)];
      if (kind == Kind::barrier) return zero::detail::concat(name, "()");
      std::string s = zero::detail::concat(name, "(", count, " x ", dtype_name(dtype));
      if (kind == Kind::all_reduce) s += op == ReduceOp::sum ? ", sum" : ", max";
      if (kind == Kind::broadcast) s += zero::detail::concat(", root ", root);
      return s + ")";
    }
  };

  // After the rendezvous that follows every rank's posting of its Call:
  // throws the same CommError on every rank if any rank's call differs from
  // rank 0's (so no rank goes on to read a buffer of the wrong size).
  void check_same_call() const {
    for (int s = 1; s < ranks_; ++s) {
      if (calls_[static_cast<std::size_t>(s)] == calls_[0]) continue;
      throw CommError(zero::detail::concat("comm::Local: rank ", s, " called ", calls_[static_cast<std::size_t>(s)].describe(),
                                           " while rank 0 called ", calls_[0].describe(),
                                           "; every rank must make the same collective calls (kind, element count, "
                                           "type, operation or root) in the same order"));
    }
  }

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
  std::vector<Call> calls_;
};

// One rank's handle. Host memory only; all calls are collective.
class Local {
 public:
  Local(LocalGroup& group, int rank) : group_(&group), rank_(rank) {}

  int rank() const { return rank_; }
  int size() const { return group_->ranks_; }
  const ByteCounters& counters() const { return counters_; }
  void reset_counters() { counters_ = {}; }

  void barrier() {
    publish({Call::Kind::barrier}, nullptr, nullptr, "barrier");
    // Like every collective, a second rendezvous: no rank posts its next call
    // while another still checks this one.
    group_->arrive_and_wait(rank_, "barrier");
  }

  void all_reduce(void* buf, std::size_t count, DType t, ReduceOp op = ReduceOp::sum, bool control = false) {
    publish({Call::Kind::all_reduce, count, t, op}, buf, buf, "all_reduce");
    // Rank r owns chunk r: it reduces that chunk of every rank's buffer and
    // writes the result into all of them, so each byte is read once and
    // written once, and the ranks work on disjoint chunks at the same time.
    const int n = size();
    const detail::ReduceArgs chunk{group_->recv_.data(), n, group_->send_.data(), n, chunk_begin(count, rank_, n),
                                   chunk_begin(count, rank_ + 1, n), detail::streaming_pays(footprint(count, t))};
    detail::reduce(t, chunk, op);
    group_->arrive_and_wait(rank_, "all_reduce");
    counters_.count_all_reduce(count * dtype_bytes(t), n, control);
  }

  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType t) {
    const std::size_t bytes = dtype_bytes(t);
    publish({Call::Kind::reduce_scatter, recv_count, t}, send, recv, "reduce_scatter");
    const int n = size();
    std::vector<const void*>& blocks = scratch_;
    blocks.resize(static_cast<std::size_t>(n));
    for (int s = 0; s < n; ++s)
      blocks[s] = static_cast<const char*>(group_->send_[s]) + static_cast<std::size_t>(rank_) * recv_count * bytes;
    // Only this rank reads block `rank` of any buffer, so writing recv (which
    // may be that very block of our own send buffer) is safe.
    void* const out[1] = {recv};
    detail::reduce(t,
                   detail::ReduceArgs{out, 1, blocks.data(), n, 0, recv_count,
                                      detail::streaming_pays(footprint(recv_count * static_cast<std::size_t>(n), t))},
                   ReduceOp::sum);
    group_->arrive_and_wait(rank_, "reduce_scatter");
    counters_.count_reduce_scatter(recv_count * static_cast<std::size_t>(n) * bytes, n);
  }

  void all_gather(const void* send, void* recv, std::size_t send_count, DType t, bool control = false) {
    const std::size_t bytes = dtype_bytes(t);
    publish({Call::Kind::all_gather, send_count, t}, send, recv, "all_gather");
    const int n = size();
    // Rank r pushes its block into block r of every receive buffer: each
    // block is read once, and nobody reads what others write (in place, a
    // rank's send block is its own receive block, which no other rank writes).
    const std::size_t offset = static_cast<std::size_t>(rank_) * send_count * bytes;
    std::vector<void*>& dsts = destinations_;
    dsts.clear();
    for (int s = 0; s < n; ++s) {
      char* dst = static_cast<char*>(group_->recv_[s]) + offset;
      if (dst != send) dsts.push_back(dst);
    }
    detail::copy(dsts.data(), static_cast<int>(dsts.size()), send, send_count * bytes,
                 detail::streaming_pays(footprint(send_count * static_cast<std::size_t>(n), t)));
    group_->arrive_and_wait(rank_, "all_gather");
    counters_.count_all_gather(send_count * static_cast<std::size_t>(n) * bytes, n, control);
  }

  void broadcast(void* buf, std::size_t count, DType t, int root) {
    require(root >= 0 && root < size(), "broadcast root ", root, " is not a rank of this group of ", size());
    const std::size_t bytes = dtype_bytes(t);
    publish({Call::Kind::broadcast, count, t, ReduceOp::sum, root}, buf, buf, "broadcast");
    // Rank r copies part r of the root's buffer into every other buffer: the
    // root's buffer is read once, by all ranks at once. Parts start on cache
    // lines.
    const std::size_t total = count * bytes, line = 64;
    const int n = size();
    const std::size_t begin = chunk_begin(total / line, rank_, n) * line;
    const std::size_t end = rank_ + 1 == n ? total : chunk_begin(total / line, rank_ + 1, n) * line;
    std::vector<void*>& dsts = destinations_;
    dsts.clear();
    for (int s = 0; s < n; ++s)
      if (s != root) dsts.push_back(static_cast<char*>(group_->recv_[s]) + begin);
    detail::copy(dsts.data(), static_cast<int>(dsts.size()), static_cast<const char*>(group_->send_[root]) + begin,
                 end - begin, detail::streaming_pays(footprint(count, t)));
    group_->arrive_and_wait(rank_, "broadcast");
    counters_.count_broadcast(count * bytes, size());
  }

 private:
  friend class LocalDevice;  // builds on this rank's group and rank
  using Call = LocalGroup::Call;

  // Bytes of all ranks' buffers of `count` elements: what decides whether
  // the outputs are better streamed past the cache.
  std::size_t footprint(std::size_t count, DType t) const {
    return count * dtype_bytes(t) * static_cast<std::size_t>(size());
  }
  static std::size_t chunk_begin(std::size_t count, int part, int parts) {
    return count * static_cast<std::size_t>(part) / static_cast<std::size_t>(parts);
  }
  // Posts this rank's call and pointers, waits until every rank has posted,
  // and checks that all made the same call.
  void publish(const Call& call, const void* send, void* recv, const char* what) {
    // The previous collective's last rendezvous guarantees nobody still reads the slots.
    group_->calls_[rank_] = call;
    group_->send_[rank_] = send;
    group_->recv_[rank_] = recv;
    group_->arrive_and_wait(rank_, what);
    group_->check_same_call();
  }

  LocalGroup* group_;
  int rank_;
  ByteCounters counters_;
  // Reused: collectives allocate nothing after the first call.
  std::vector<const void*> scratch_;
  std::vector<void*> destinations_;
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
