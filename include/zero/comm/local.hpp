// Why: ZeRO is about N ranks, and every test of it needs N ranks. comm::Local
// runs them as threads of one process over host memory: real collectives with
// real synchronisation (so ordering bugs deadlock or fail here as they would
// with NCCL), deterministic results, and no MPI launcher. A rank that throws
// or returns while others wait for it fails their pending and later
// collectives at once, with a CommError naming the rank, how it left, and
// the collective and library call (comm::ApiCall) each waiter is in; one
// that stops calling collectives without leaving fails them after the
// timeout. Ranks that make different calls at the same point (kind, element
// count, type, operation or root), or the same call for different purposes
// (comm::Purpose: another unit, bucket or exchange of the optimizer), all get
// a CommError naming both calls, their purposes and the library call each
// rank was in, before any rank touches another's buffer.
//
// Speed: the ranks move data in parallel, straight between the user's
// buffers (no staging copies), so a collective runs near the memory bandwidth
// of the cores (bench/bench_comm measures it). The work is cut into pieces
// that whichever rank threads are running take from a shared counter: with
// more ranks than cores, or on a busy machine, a thread the scheduler leaves
// out holds up nobody for more than one piece. Which thread computes an
// element never changes its value: every element is reduced in rank order.
#pragma once

#include "zero/compiler.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "zero/comm/communicator.hpp"
#include "zero/comm/reduce.hpp"
#include "zero/comm/topology.hpp"
#include "zero/error.hpp"

#if ZERO_HAS_OPENMP
#include <omp.h>
#endif

namespace zero::comm {

class Local;
class LocalDevice;  // zero/comm/local_device.hpp: the same ranks over device memory

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
    // Ranks per simulated node (comm/topology.hpp; 0: one node of every
    // rank): what the byte counters count as crossing nodes, and what
    // Local::node() and Local::across() split the group into.
    int ranks_per_node = 0;
  };

  explicit LocalGroup(int ranks) : LocalGroup(ranks, Options{}) {}
  LocalGroup(int ranks, Options options)
      : ranks_(ranks),
        options_(options),
        send_(static_cast<std::size_t>(ranks)),
        recv_(static_cast<std::size_t>(ranks)),
        calls_(static_cast<std::size_t>(ranks)),
        api_calls_(static_cast<std::size_t>(ranks)),
        purposes_(static_cast<std::size_t>(ranks)),
        purpose_codes_(static_cast<std::size_t>(ranks)),
        topology_(Topology::checked(ranks, options.ranks_per_node, "comm::LocalGroup::Options::ranks_per_node")) {
    require(ranks >= 1, "comm::LocalGroup needs at least 1 rank, got ", ranks);
  }

  int size() const { return ranks_; }
  const Topology& topology() const { return topology_; }

  // Runs fn(Local&) on `size()` threads, one per rank, and waits for all.
  // A rank whose fn throws or returns leaves the group: the others' pending
  // and later collectives (which can no longer complete) fail at once with a
  // CommError naming it. The first exception any rank threw is rethrown here.
  template <class Fn>
  void run(Fn&& fn);

 private:
  friend class Local;
  friend class LocalDevice;

  // What a rank asked for, posted with its buffers so that every rank can
  // check that all made the same call before reading anyone's buffers.
  struct Call {
    enum class Kind : std::uint8_t { barrier, all_reduce, reduce_scatter, all_gather, broadcast, all_to_all };
    Kind kind = Kind::barrier;
    std::size_t count = 0;  // elements: all_reduce and broadcast the buffer, reduce_scatter recv, all_gather send,
                            // all_to_all one block
    DType dtype = DType::f32;
    ReduceOp op = ReduceOp::sum;  // all_reduce
    int root = 0;                 // broadcast

    bool operator==(const Call&) const = default;
    std::string describe() const {
      static constexpr const char* names[] = {"barrier",    "all_reduce", "reduce_scatter",
                                              "all_gather", "broadcast",  "all_to_all"};
      const char* name = names[static_cast<int>(kind)];
      if (kind == Kind::barrier) return zero::detail::concat(name, "()");
      std::string s = zero::detail::concat(name, "(", count, " x ", dtype_name(dtype));
      if (kind == Kind::all_reduce) s += op == ReduceOp::sum ? ", sum" : ", max";
      if (kind == Kind::broadcast) s += zero::detail::concat(", root ", root);
      return s + ")";
    }
  };

  // After the rendezvous that follows every rank's posting of its Call:
  // throws the same CommError on every rank if any rank's call, or what the
  // optimizer made it for (comm::Purpose), differs from rank 0's (so no rank
  // goes on to read a buffer of the wrong size, or a shard of another unit).
  // Every rank finds the same difference; they meet once more before
  // throwing, since the message reads the others' purposes, which live in
  // their scopes (comm::PurposeScope) until they throw.
  void check_same_call(int rank) {
    const std::string differ = differing_call();
    if (differ.empty()) return;
    arrive_and_wait(rank, "the check that every rank makes the same call");
    throw CommError(differ);
  }
  // The first rank's call that differs from rank 0's, described, or empty.
  std::string differing_call() const {
    for (int s = 1; s < ranks_; ++s) {
      const auto i = static_cast<std::size_t>(s);
      if (calls_[i] == calls_[0] && purpose_codes_[i] == purpose_codes_[0]) continue;
      return zero::detail::concat(
          "comm::Local", label_, ": rank ", global(s), " ", describe_posted(i), " while rank ", global(0), " ",
          describe_posted(0), "; every rank must make the same collective calls (kind, element count, type, "
          "operation or root), for the same units and buckets, in the same order (ranks that acquire units in "
          "different orders, or one more than the others, pair the wrong exchanges)");
    }
    return {};
  }
  // Posts rank r's call, with the library call and purpose it is made in
  // (this thread's), for check_same_call; Local and LocalDevice post theirs here.
  void post_call(int r, const Call& call) {
    const auto i = static_cast<std::size_t>(r);
    calls_[i] = call;
    api_calls_[i] = ApiCall::current();
    purposes_[i] = Purpose::current();
    purpose_codes_[i] = Purpose::code_of(purposes_[i]);
  }
  std::string describe_posted(std::size_t i) const {
    return Purpose::describe_call(purposes_[i], calls_[i].describe()) + ApiCall::where(api_calls_[i]);
  }

  // Waits until all ranks arrive. Throws CommError if the group was aborted,
  // a rank left (it can never arrive), or the wait exceeds the timeout (then
  // the group is aborted for all).
  void arrive_and_wait(int rank, const char* what) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (aborted_) throw CommError(abort_message_);
    if (left_rank_ >= 0) throw CommError(left_message(rank, what));
    const std::uint64_t generation = generation_;
    if (++arrived_ == ranks_) {
      arrived_ = 0;
      ++generation_;
      // Every rank is done with the pieces of the last collective.
      next_piece_.store(0, std::memory_order_relaxed);
      cv_.notify_all();
      return;
    }
    const bool woken = cv_.wait_for(lock, options_.timeout,
                                    [&] { return generation_ != generation || aborted_ || left_rank_ >= 0; });
    // Everyone arrived (a rank may have left or failed since: the next call reports it).
    if (generation_ != generation) return;
    if (!woken) {
      abort_locked(zero::detail::concat("comm::Local", label_, ": rank ", global(rank), " waited more than ",
                                        options_.timeout.count(), " ms in ", what, ApiCall::where(ApiCall::current()),
                                        " for the other ranks; every rank must make the same collective calls in the "
                                        "same order"));
    }
    if (aborted_) throw CommError(abort_message_);
    throw CommError(left_message(rank, what));
  }

  // Rank r's fn returned or threw (`how`: "returned", "left (threw: ...)"):
  // the collectives that wait for it, now and later, cannot complete; nor
  // can those of the node and across groups that hold it.
  void leave(int r, std::string how, bool threw = false) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (left_rank_ < 0) {
      left_rank_ = r;
      left_threw_ = threw;
      left_how_ = how;
    }
    cv_.notify_all();
    if (!node_groups_.empty() && node_groups_[topology_.node_of(r)])
      node_groups_[topology_.node_of(r)]->leave(topology_.local_rank(r), how, threw);
    if (!across_groups_.empty() && across_groups_[topology_.local_rank(r)])
      across_groups_[topology_.local_rank(r)]->leave(topology_.node_of(r), how, threw);
  }
  std::string left_message(int rank, const char* what) const {
    return zero::detail::concat("comm::Local", label_, ": rank ", global(left_rank_), " ", left_how_, " while rank ",
                                global(rank), " waits in ", what, ApiCall::where(ApiCall::current()),
                                left_threw_ ? "; the group was aborted"
                                            : "; every rank must make the same collective calls in the same order (a "
                                              "rank that skips a micro-batch, step() or save(), or returns early, "
                                              "leaves the others waiting)");
  }

  void abort_locked(std::string message) {
    if (!aborted_) {
      aborted_ = true;
      abort_message_ = message;
    }
    cv_.notify_all();
    // A timeout aborts the whole group: its node and across groups too.
    for (auto* children : {&node_groups_, &across_groups_})
      for (auto& g : *children)
        if (g) {
          std::lock_guard<std::mutex> child_lock(g->mutex_);
          g->abort_locked(message);
        }
  }
  void reset() {
    std::lock_guard<std::mutex> lock(mutex_);
    aborted_ = false;
    arrived_ = 0;
    abort_message_.clear();
    left_rank_ = -1;
    left_threw_ = false;
    left_how_.clear();
    for (auto* children : {&node_groups_, &across_groups_})
      for (auto& g : *children)
        if (g) g->reset();
  }

  // The group of node `node`'s ranks, and the group of the ranks at place
  // `local` on every node (Local::node(), Local::across()): made by the
  // first rank that asks, shared by the others.
  LocalGroup& node_group(int node) {
    return child(node_groups_, node, Split::node, node * topology_.ranks_per_node, 1);
  }
  LocalGroup& across_group(int local) { return child(across_groups_, local, Split::across, local, topology_.ranks_per_node); }
  // Messages name a rank by its number in the whole group.
  int global(int rank) const { return first_ + rank * stride_; }
  enum class Split { node, across };
  // Child `index` of one split: its ranks are first, first + stride, ... of this group.
  LocalGroup& child(std::vector<std::unique_ptr<LocalGroup>>& children, int index, Split split, int first, int stride) {
    std::lock_guard<std::mutex> lock(mutex_);
    const bool node = split == Split::node;
    const int ranks = node ? topology_.ranks_per_node : topology_.nodes();  // in each child
    if (children.empty()) children.resize(static_cast<std::size_t>(ranks_ / ranks));
    auto& g = children[static_cast<std::size_t>(index)];
    if (!g) {
      Options o = options_;
      // Inside a node every rank is on one node; across nodes, each on its own.
      o.ranks_per_node = node ? 0 : 1;
      g = std::make_unique<LocalGroup>(ranks, o);
      g->label_ = node ? " (node communicator)" : " (across-nodes communicator)";
      g->first_ = global(first);
      g->stride_ = stride_ * stride;
    }
    return *g;
  }

  int ranks_;
  Options options_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
  bool aborted_ = false;
  std::string abort_message_;
  int left_rank_ = -1;  // the first rank whose fn returned or threw, or -1
  bool left_threw_ = false;
  std::string left_how_;
  std::atomic<std::size_t> next_piece_{0};  // see Local::share_pieces
  std::vector<const void*> send_;
  std::vector<void*> recv_;
  std::vector<Call> calls_;
  std::vector<const char*> api_calls_;  // the library call (ApiCall) each rank posted its call from
  std::vector<const Purpose*> purposes_;  // what the optimizer made each rank's call for (Purpose::current())
  std::vector<std::uint64_t> purpose_codes_;  // and their Purpose::code_of()
  Topology topology_;
  const char* label_ = "";  // which communicator of a split, in messages
  int first_ = 0, stride_ = 1;  // a split's rank r is rank first_ + r * stride_ of the whole group
  // Made on first use (node_group, across_group); indexed by node and by place in a node.
  std::vector<std::unique_ptr<LocalGroup>> node_groups_, across_groups_;
};

// One rank's handle. Host memory only; all calls are collective.
class Local {
 public:
  Local(LocalGroup& group, int rank) : group_(&group), rank_(rank) {}

  int rank() const { return rank_; }
  int size() const { return group_->ranks_; }
  const Topology& topology() const { return group_->topology_; }
  const ByteCounters& counters() const { return counters_; }
  void reset_counters() { counters_ = {}; }

  // The ranks of this rank's node (its rank there: topology().local_rank),
  // and the ranks at its place on every node (its rank there: its node).
  // Made on the first call, which every rank makes (they are shared).
  Local& node() {
    if (!node_)
      node_ = std::make_unique<Local>(group_->node_group(topology().node_of(rank_)), topology().local_rank(rank_));
    return *node_;
  }
  Local& across() {
    if (!across_)
      across_ = std::make_unique<Local>(group_->across_group(topology().local_rank(rank_)), topology().node_of(rank_));
    return *across_;
  }

  void barrier() {
    publish({Call::Kind::barrier}, nullptr, nullptr, "barrier");
    // Like every collective, a second rendezvous: no rank posts its next call
    // while another still checks this one.
    group_->arrive_and_wait(rank_, "barrier");
  }

  void all_reduce(void* buf, std::size_t count, DType t, ReduceOp op = ReduceOp::sum, bool control = false) {
    require(t != DType::u8, "comm::Local: ", detail::reduce_bytes_refused);
    publish({Call::Kind::all_reduce, count, t, op}, buf, buf, "all_reduce");
    // Each piece of elements is reduced over every rank's buffer and written
    // into all of them: each byte is read once and written once.
    const int n = size();
    const bool stream = detail::streaming_pays(footprint(count, t));
    share_pieces(1, count, piece_elements(count, t), [&](std::size_t, std::size_t begin, std::size_t end) {
      detail::reduce(t, detail::ReduceArgs{group_->recv_.data(), n, group_->send_.data(), n, begin, end, stream}, op);
    });
    group_->arrive_and_wait(rank_, "all_reduce");
    counters_.count_all_reduce(count * dtype_bytes(t), n, control, crosses());
  }

  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType t) {
    require(t != DType::u8, "comm::Local: ", detail::reduce_bytes_refused);
    const std::size_t bytes = dtype_bytes(t);
    publish({Call::Kind::reduce_scatter, recv_count, t}, send, recv, "reduce_scatter");
    const int n = size();
    const bool stream = detail::streaming_pays(footprint(recv_count * static_cast<std::size_t>(n), t));
    std::vector<const void*>& inputs = scratch_;
    inputs.resize(static_cast<std::size_t>(n));
    // Block b of every send buffer, reduced into rank b's recv. A piece reads
    // its elements of all inputs before it writes them, so recv may be that
    // very block of rank b's own send buffer.
    share_pieces(static_cast<std::size_t>(n), recv_count, piece_elements(recv_count, t),
                 [&](std::size_t b, std::size_t begin, std::size_t end) {
                   for (int s = 0; s < n; ++s)
                     inputs[s] = static_cast<const char*>(group_->send_[s]) + b * recv_count * bytes;
                   void* const out[1] = {group_->recv_[b]};
                   detail::reduce(t, detail::ReduceArgs{out, 1, inputs.data(), n, begin, end, stream}, ReduceOp::sum);
                 });
    group_->arrive_and_wait(rank_, "reduce_scatter");
    counters_.count_reduce_scatter(recv_count * static_cast<std::size_t>(n) * bytes, n, crosses());
  }

  void all_gather(const void* send, void* recv, std::size_t send_count, DType t, bool control = false) {
    const std::size_t bytes = dtype_bytes(t);
    publish({Call::Kind::all_gather, send_count, t}, send, recv, "all_gather");
    const int n = size();
    const bool stream = detail::streaming_pays(footprint(send_count * static_cast<std::size_t>(n), t));
    // Rank s's block goes into block s of every receive buffer: each block is
    // read once, and nobody reads what others write (in place, a rank's send
    // block is its own receive block, which is skipped).
    const std::size_t block_bytes = send_count * bytes;
    std::vector<void*>& dsts = destinations_;
    dsts.reserve(static_cast<std::size_t>(n));  // on the first call, whether or not this rank gets a piece
    share_pieces(static_cast<std::size_t>(n), block_bytes, piece_bytes(block_bytes),
                 [&](std::size_t s, std::size_t begin, std::size_t end) {
                   const char* src = static_cast<const char*>(group_->send_[s]);
                   dsts.clear();
                   for (int r = 0; r < n; ++r) {
                     char* dst = static_cast<char*>(group_->recv_[r]) + s * block_bytes;
                     if (dst != src) dsts.push_back(dst + begin);
                   }
                   detail::copy(dsts.data(), static_cast<int>(dsts.size()), src + begin, end - begin, stream);
                 });
    group_->arrive_and_wait(rank_, "all_gather");
    counters_.count_all_gather(send_count * static_cast<std::size_t>(n) * bytes, n, control, crosses());
  }

  void broadcast(void* buf, std::size_t count, DType t, int root) {
    require(root >= 0 && root < size(), "broadcast root ", root, " is not a rank of this group of ", size());
    const std::size_t bytes = dtype_bytes(t);
    publish({Call::Kind::broadcast, count, t, ReduceOp::sum, root}, buf, buf, "broadcast");
    // Each piece of the root's buffer is copied into every other buffer: the
    // root's buffer is read once, by all ranks at once.
    const std::size_t total = count * bytes;
    const int n = size();
    const bool stream = detail::streaming_pays(footprint(count, t));
    std::vector<void*>& dsts = destinations_;
    dsts.reserve(static_cast<std::size_t>(n));  // on the first call, whether or not this rank gets a piece
    share_pieces(1, total, piece_bytes(total), [&](std::size_t, std::size_t begin, std::size_t end) {
      dsts.clear();
      for (int s = 0; s < n; ++s)
        if (s != root) dsts.push_back(static_cast<char*>(group_->recv_[s]) + begin);
      detail::copy(dsts.data(), static_cast<int>(dsts.size()), static_cast<const char*>(group_->send_[root]) + begin,
                   end - begin, stream);
    });
    group_->arrive_and_wait(rank_, "broadcast");
    counters_.count_broadcast(count * bytes, size(), crosses());
  }

  // Block j of rank s's send goes into block s of rank j's recv (its own
  // block too, copied). Any DType: bytes are moved, never added.
  void all_to_all(const void* send, void* recv, std::size_t count, DType t) {
    const std::size_t bytes = dtype_bytes(t);
    const int n = size();
    const std::size_t block_bytes = count * bytes;
    detail::require_apart("comm::Local", send, recv, block_bytes * static_cast<std::size_t>(n));
    publish({Call::Kind::all_to_all, count, t}, send, recv, "all_to_all");
    const bool stream = detail::streaming_pays(footprint(count * static_cast<std::size_t>(n), t));
    // The n * n blocks (sender s, receiver j), each read once and written
    // once, shared in pieces like all_gather's: no rank waits for a late one
    // to copy its blocks, and no buffer is both read and written.
    share_pieces(static_cast<std::size_t>(n) * static_cast<std::size_t>(n), block_bytes, piece_bytes(block_bytes),
                 [&](std::size_t b, std::size_t begin, std::size_t end) {
                   const std::size_t s = b / static_cast<std::size_t>(n), j = b % static_cast<std::size_t>(n);
                   void* const dst[1] = {static_cast<char*>(group_->recv_[j]) + s * block_bytes + begin};
                   detail::copy(dst, 1, static_cast<const char*>(group_->send_[s]) + j * block_bytes + begin,
                                end - begin, stream);
                 });
    group_->arrive_and_wait(rank_, "all_to_all");
    counters_.count_all_to_all(block_bytes, topology(), rank_);
  }

 private:
  friend class LocalDevice;  // builds on this rank's group and rank
  using Call = LocalGroup::Call;

  bool crosses() const { return topology().ring_send_crosses(rank_); }

  // Bytes of all ranks' buffers of `count` elements: what decides whether
  // the outputs are better streamed past the cache.
  std::size_t footprint(std::size_t count, DType t) const {
    return count * dtype_bytes(t) * static_cast<std::size_t>(size());
  }
  // Runs work(block, begin, end) over [0, per_block) of each of `blocks`
  // blocks, in pieces of `piece` that the group's running threads take from
  // one counter (reset at every rendezvous), until none is left.
  template <class Work>
  void share_pieces(std::size_t blocks, std::size_t per_block, std::size_t piece, Work&& work) {
    const std::size_t per = (per_block + piece - 1) / piece;
    for (;;) {
      const std::size_t p = group_->next_piece_.fetch_add(1, std::memory_order_relaxed);
      if (p >= blocks * per) return;
      const std::size_t begin = p % per * piece;
      work(p / per, begin, std::min(per_block, begin + piece));
    }
  }
  // A piece: a rank's equal share when that is small (every rank works on a
  // small collective), at most 256 KiB of one buffer (a few pieces per
  // thread time slice, and a late thread holds up the rest for that long),
  // in whole cache lines.
  std::size_t piece_bytes(std::size_t total) const {
    constexpr std::size_t line = 64, most = std::size_t{256} << 10;
    const std::size_t share = (total + static_cast<std::size_t>(size()) - 1) / static_cast<std::size_t>(size());
    return std::max(line, (std::min(share, most) + line - 1) / line * line);
  }
  std::size_t piece_elements(std::size_t count, DType t) const {
    return piece_bytes(count * dtype_bytes(t)) / dtype_bytes(t);
  }
  // Posts this rank's call and pointers, waits until every rank has posted,
  // and checks that all made the same call.
  void publish(const Call& call, const void* send, void* recv, const char* what) {
    // The previous collective's last rendezvous guarantees nobody still reads the slots.
    group_->post_call(rank_, call);
    group_->send_[rank_] = send;
    group_->recv_[rank_] = recv;
    group_->arrive_and_wait(rank_, what);
    group_->check_same_call(rank_);
  }

  LocalGroup* group_;
  int rank_;
  ByteCounters counters_;
  // Reused: collectives allocate nothing after the first call.
  std::vector<const void*> scratch_;
  std::vector<void*> destinations_;
  std::unique_ptr<Local> node_, across_;  // node(), across()
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
      leave(r, "returned");
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
      leave(r, zero::detail::concat("left (threw: ", what, ")"), true);
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(ranks_));
  for (int r = 0; r < ranks_; ++r) threads.emplace_back(body, r);
  for (auto& t : threads) t.join();
  if (!failed_first.empty()) std::rethrow_exception(errors[failed_first.front()]);
}

}  // namespace zero::comm
