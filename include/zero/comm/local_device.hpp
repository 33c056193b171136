// Why: NCCL cannot put two ranks of one communicator on the same GPU, yet the
// engine on backend::Cuda must be tested with N ranks on a one-GPU machine.
// comm::LocalDevice runs N ranks as threads of one process sharing one GPU,
// over device memory: the rendezvous, abort and timeout of comm::LocalGroup
// (a rank that throws or stops calling collectives releases the others with a
// CommError), device-to-device copies, and a reduction kernel that sums in
// rank order in fp32 and rounds once, so results are the bits of the host
// comm::Local (zero/comm/reduce.cuh, the twin of zero/comm/reduce.hpp) and
// independent of thread timing.
//
// Ordering: each rank enqueues on its own stream, after the work on the
// caller's current stream when that is another one (as comm::Nccl does; the
// engine then overlaps, see Ops<Cuda>::Overlap). Before other ranks read a
// rank's buffers it records a "ready" event on its stream after everything
// that wrote them, and readers make their streams wait for it
// (cudaStreamWaitEvent), so the writes need no host wait. Before a collective
// returns, each rank waits on the host for its own stream (its reads of the
// others' buffers are done) and meets the others: after that nobody reads a
// peer's buffers, events or handle, so a rank may overwrite its buffers, or
// leave, at once.
//
//   zero::comm::LocalGroup group(4);
//   zero::comm::LocalDevice::run(group, [&](zero::comm::LocalDevice& comm) {
//     // this thread's Ops<Cuda>::stream() is the rank's own stream
//     ZeroOptimizer<..., zero::backend::Cuda> opt(comm, hyper);
//   });
#pragma once

#include "zero/compiler.hpp"

#include "zero/cuda/runtime.hpp"

#include <cstddef>
#include <cstdint>
#include <utility>

#include "zero/comm/communicator.hpp"
#include "zero/comm/local.hpp"
#include "zero/cuda/check.hpp"
#include "zero/cuda/stream.hpp"
#include "zero/error.hpp"
#include "zero/kernels/cuda_launchers.hpp"
#include "zero/precision/types.hpp"

namespace zero::comm {
namespace detail {

// out[i] = inputs[0][i] op ... op inputs[k-1][i] for i < n, in that order
// (the bits of reduce() in zero/comm/reduce.hpp; the kernel is
// zero/comm/reduce.cuh), enqueued on `stream`. `out` may alias an input. All
// pointers must be device-accessible from the current device; at most
// cuda_reduce_max_inputs inputs.
inline void cuda_reduce(DType t, void* out, const void* const* inputs, int k, std::size_t n, ReduceOp op,
                        cudaStream_t stream) {
  require(k >= 1 && k <= cuda_reduce_max_inputs, "cuda_reduce: ", k, " inputs; it sums 1 to ",
          cuda_reduce_max_inputs, " buffers per call");
  if (n == 0) return;
  ReduceInputs in{};
  for (int i = 0; i < k; ++i) in.at[i] = inputs[i];
  const bool sum = op == ReduceOp::sum;
  switch (t) {
    case DType::f32: launch_reduce<float>(out, in, k, n, sum, stream); break;
    case DType::f16: launch_reduce<fp16>(out, in, k, n, sum, stream); break;
    case DType::bf16: launch_reduce<bf16>(out, in, k, n, sum, stream); break;
    case DType::f64: launch_reduce<double>(out, in, k, n, sum, stream); break;
    case DType::u64: launch_reduce<std::uint64_t>(out, in, k, n, sum, stream); break;
    case DType::u8: throw InvalidArgument(reduce_bytes_refused);
  }
  cuda::check_launch("zero::comm::detail::cuda_reduce<", dtype_name(t), "> (", k, " inputs, ", n, " elements)");
}

}  // namespace detail

// One rank's handle. Device memory only (all ranks' buffers on one device, or
// on devices with peer access); all calls are collective, and every rank of a
// group uses LocalDevice (not a mix of Local and LocalDevice).
class LocalDevice {
 public:
  // Rank `host.rank()` of host's group; collectives are enqueued on `stream`
  // (default: this thread's current stream, zero::cuda::current_stream(),
  // which is Ops<Cuda>::stream()).
  LocalDevice(Local& host, cudaStream_t stream) : group_(host.group_), rank_(host.rank_), stream_(stream) {
    require(group_->ranks_ <= detail::cuda_reduce_max_inputs, "comm::LocalDevice: ", group_->ranks_,
            " ranks on one device; it supports at most ", detail::cuda_reduce_max_inputs,
            " (use comm::Nccl across GPUs)");
    try {
      ZERO_CUDA_CHECK(cudaEventCreateWithFlags(&slot_.ready, cudaEventDisableTiming));
      ZERO_CUDA_CHECK(cudaEventCreateWithFlags(&slot_.mid, cudaEventDisableTiming));
    } catch (...) {
      destroy_events();
      throw;
    }
  }
  explicit LocalDevice(Local& host) : LocalDevice(host, zero::cuda::current_stream()) {}
  LocalDevice(const LocalDevice&) = delete;
  LocalDevice& operator=(const LocalDevice&) = delete;
  ~LocalDevice() { destroy_events(); }

  // Runs fn(LocalDevice&) on group.size() threads, one per rank, and waits
  // for all (exceptions as LocalGroup::run). Each thread selects `device`,
  // creates its own non-blocking stream, makes it the thread's current stream
  // (so Ops<Cuda>::stream() and the rank's collectives agree), and waits for
  // it at the end so asynchronous errors surface in that rank.
  template <class Fn>
  static void run(LocalGroup& group, Fn&& fn, int device = 0);

  int rank() const { return rank_; }
  int size() const { return group_->ranks_; }
  const Topology& topology() const { return group_->topology_; }
  cudaStream_t stream() const { return stream_; }
  const ByteCounters& counters() const { return counters_; }
  void reset_counters() { counters_ = {}; }

  // Every rank has arrived and the work each enqueued before has finished.
  void barrier() {
    const cudaStream_t caller = zero::cuda::current_stream();
    if (caller != stream_) zero::cuda::wait_stream(caller);
    zero::cuda::wait_stream(stream_);
    group_->arrive_and_wait(rank_, "barrier");
  }

  void all_reduce(void* buf, std::size_t count, DType t, ReduceOp op = ReduceOp::sum, bool control = false) {
    require(t != DType::u8, "comm::LocalDevice: ", detail::reduce_bytes_refused);
    const std::size_t bytes = dtype_bytes(t);
    const int n = size();
    publish({Call::Kind::all_reduce, count, t, op}, buf, buf, "all_reduce");
    // Rank r reduces chunk r of every buffer into its own buffer, then every
    // rank copies the other chunks from their owners.
    const std::size_t begin = chunk_begin(count, rank_, n), end = chunk_begin(count, rank_ + 1, n);
    for (int s = 0; s < n; ++s) inputs_[s] = static_cast<const char*>(peer(s).send) + begin * bytes;
    detail::cuda_reduce(t, static_cast<char*>(buf) + begin * bytes, inputs_, n, end - begin, op, stream_);
    phase(&Slot::mid, "all_reduce");
    for (int s = 0; s < n; ++s) {
      if (s == rank_) continue;
      const std::size_t b = chunk_begin(count, s, n), e = chunk_begin(count, s + 1, n);
      copy(static_cast<char*>(buf) + b * bytes, static_cast<const char*>(peer(s).recv) + b * bytes, (e - b) * bytes);
    }
    finish("all_reduce");
    counters_.count_all_reduce(count * bytes, n, control, crosses());
  }

  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType t) {
    require(t != DType::u8, "comm::LocalDevice: ", detail::reduce_bytes_refused);
    const std::size_t bytes = dtype_bytes(t);
    const int n = size();
    publish({Call::Kind::reduce_scatter, recv_count, t}, send, recv, "reduce_scatter");
    for (int s = 0; s < n; ++s)
      inputs_[s] = static_cast<const char*>(peer(s).send) + static_cast<std::size_t>(rank_) * recv_count * bytes;
    // Only this rank reads block `rank` of any buffer, so writing recv (which
    // may be that very block of our own send buffer) is safe.
    detail::cuda_reduce(t, recv, inputs_, n, recv_count, ReduceOp::sum, stream_);
    finish("reduce_scatter");
    counters_.count_reduce_scatter(recv_count * static_cast<std::size_t>(n) * bytes, n, crosses());
  }

  void all_gather(const void* send, void* recv, std::size_t send_count, DType t, bool control = false) {
    const std::size_t bytes = dtype_bytes(t);
    const int n = size();
    publish({Call::Kind::all_gather, send_count, t}, send, recv, "all_gather");
    for (int s = 0; s < n; ++s)
      copy(static_cast<char*>(recv) + static_cast<std::size_t>(s) * send_count * bytes, peer(s).send,
           send_count * bytes);
    finish("all_gather");
    counters_.count_all_gather(send_count * static_cast<std::size_t>(n) * bytes, n, control, crosses());
  }

  void broadcast(void* buf, std::size_t count, DType t, int root) {
    require(root >= 0 && root < size(), "broadcast root ", root, " is not a rank of this group of ", size());
    const std::size_t bytes = dtype_bytes(t);
    publish({Call::Kind::broadcast, count, t, ReduceOp::sum, root}, buf, buf, "broadcast");
    if (rank_ != root) copy(buf, peer(root).send, count * bytes);
    finish("broadcast");
    counters_.count_broadcast(count * bytes, size(), crosses());
  }

  // Block j of rank s's send goes into block s of rank j's recv: each rank
  // copies block `rank` of every peer's send (its own too) into its recv, as
  // all_gather copies whole peers' blocks. Any DType: bytes are moved.
  void all_to_all(const void* send, void* recv, std::size_t count, DType t) {
    const std::size_t block_bytes = count * dtype_bytes(t);
    const int n = size();
    detail::require_apart("comm::LocalDevice", send, recv, block_bytes * static_cast<std::size_t>(n));
    publish({Call::Kind::all_to_all, count, t}, send, recv, "all_to_all");
    for (int s = 0; s < n; ++s)
      copy(static_cast<char*>(recv) + static_cast<std::size_t>(s) * block_bytes,
           static_cast<const char*>(peer(s).send) + static_cast<std::size_t>(rank_) * block_bytes, block_bytes);
    finish("all_to_all");
    counters_.count_all_to_all(block_bytes, topology(), rank_);
  }

 private:
  // The host group's topology (LocalGroup::Options::ranks_per_node) decides what crosses nodes.
  bool crosses() const { return group_->topology_.ring_send_crosses(rank_); }

  // What a rank shows the others during a collective (published through the
  // group's per-rank pointer table).
  struct Slot {
    const void* send = nullptr;
    void* recv = nullptr;
    cudaEvent_t ready = nullptr;  // its buffers are written (recorded before the rendezvous)
    cudaEvent_t mid = nullptr;    // all_reduce: its chunk is reduced
  };

  static std::size_t chunk_begin(std::size_t count, int part, int parts) {
    return count * static_cast<std::size_t>(part) / static_cast<std::size_t>(parts);
  }

  const Slot& peer(int s) const { return *peers_[s]; }

  void copy(void* dst, const void* src, std::size_t bytes) {
    if (bytes != 0 && dst != src) ZERO_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
  }

  using Call = LocalGroup::Call;

  // Posts this rank's call and buffers, waits until every rank has, checks
  // that all made the same call for the same purpose (as comm::Local does),
  // and orders this stream after every peer's writes to its buffers.
  void publish(const Call& call, const void* send, void* recv, const char* what) {
    slot_.send = send;
    slot_.recv = recv;
    const cudaStream_t caller = zero::cuda::current_stream();
    // The buffers may have been written on the caller's stream.
    if (caller != stream_) zero::cuda::order_after(stream_, caller, slot_.ready);
    ZERO_CUDA_CHECK(cudaEventRecord(slot_.ready, stream_));
    // The previous collective's last rendezvous guarantees nobody still reads the table.
    group_->send_[static_cast<std::size_t>(rank_)] = &slot_;
    group_->post_call(rank_, call);
    group_->arrive_and_wait(rank_, what);
    group_->check_same_call(rank_);
    // Read the table now: nobody writes it again before this collective ends.
    for (int s = 0; s < size(); ++s) peers_[s] = static_cast<const Slot*>(group_->send_[static_cast<std::size_t>(s)]);
    wait_peers(&Slot::ready);
  }

  // Records this rank's `event`, meets the others, and orders this stream
  // after theirs. (A peer re-records an event only after the next rendezvous,
  // which needs this rank, so each wait sees the record of this collective.)
  void phase(cudaEvent_t Slot::*event, const char* what) {
    ZERO_CUDA_CHECK(cudaEventRecord(slot_.*event, stream_));
    group_->arrive_and_wait(rank_, what);
    wait_peers(event);
  }

  // End of a collective: this rank's reads of the others' buffers are done
  // (host wait on its stream), then every rank's are (rendezvous).
  void finish(const char* what) {
    zero::cuda::wait_stream(stream_);
    group_->arrive_and_wait(rank_, what);
  }

  void wait_peers(cudaEvent_t Slot::*event) {
    for (int s = 0; s < size(); ++s)
      if (s != rank_) ZERO_CUDA_CHECK(cudaStreamWaitEvent(stream_, peer(s).*event, 0));
  }

  void destroy_events() noexcept {
    for (cudaEvent_t* e : {&slot_.ready, &slot_.mid}) {
      if (*e != nullptr) cudaEventDestroy(*e);
      *e = nullptr;
    }
  }

  LocalGroup* group_;
  int rank_;
  cudaStream_t stream_;
  Slot slot_;
  ByteCounters counters_;
  const Slot* peers_[detail::cuda_reduce_max_inputs] = {};  // every rank's slot, this collective
  const void* inputs_[detail::cuda_reduce_max_inputs] = {};
};

template <class Fn>
void LocalDevice::run(LocalGroup& group, Fn&& fn, int device) {
  group.run([&](Local& host) {
    ZERO_CUDA_CHECK(cudaSetDevice(device));
    cudaStream_t stream = nullptr;
    ZERO_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    struct StreamGuard {
      cudaStream_t s;
      ~StreamGuard() {
        zero::cuda::reset_current_stream();
        cudaStreamDestroy(s);  // pending work still completes; errors here have nothing to protect
      }
    } guard{stream};
    zero::cuda::set_current_stream(stream);
    LocalDevice comm(host, stream);
    fn(comm);
    zero::cuda::wait_stream(stream);
  });
}

}  // namespace zero::comm
