// Why: across GPUs and nodes the collectives are NCCL's. comm::Nccl adapts a
// communicator to zero::comm::Communicator: it adopts a user's ncclComm_t or
// bootstraps one (MPI, or a unique-id file on a shared filesystem for
// multi-node runs without MPI), and counts bytes with the same ring model as
// Local and Mpi.
//
// Streams: collectives run on the communicator's own stream (created with
// the highest priority, or one the caller gives), ordered after the work
// already enqueued on the calling thread's current stream, which in turn
// waits for them: a call behaves as if it ran on the current stream. The
// engine (ZeroOptimizer on backend::Cuda) instead issues its communication
// with the communicator's stream current, so gradient buckets and stage-3
// gathers run beside its compute (Ops<Cuda>::Overlap). A communicator built
// on the compute stream itself overlaps nothing. Its own stream also means
// its collectives may run concurrently with those of other NCCL
// communicators the program drives; NCCL warns that this can deadlock, so
// such programs give every communicator the same stream.
//
// A dead or diverging peer makes NCCL wait forever. comm::Nccl does not: each
// collective records an event after it, and the communicator polls those
// events and ncclCommGetAsyncError
//   - at every call (without blocking),
//   - in wait(), and before returning from barrier() and from control
//     collectives (all_reduce/all_gather with control = true: the engine reads
//     their results on the host right after),
//   - whenever anything waits for a stream through zero::cuda::wait_stream
//     (Ops<Cuda>::download, ::upload, ::grad_stats, ::synchronize: the other
//     points where the engine blocks on the host), as a StreamWatcher.
// When the oldest unfinished collective is older than Options::timeout, or
// NCCL reports an asynchronous error, it calls ncclCommAbort and throws
// zero::CommError naming the collective (kind, call number, element count,
// element type) and the rank. The communicator is then unusable: every later
// call throws. An adopted ncclComm_t is aborted too (NCCL frees it): do not
// destroy it afterwards.
//
// NCCL sums fp16/bf16 pairwise in the 16-bit type, so with more than two
// ranks the result can differ from an fp32 sum by rounding; use
// Options::reduce_dtype = ReduceDType::fp32 in the engine for sums that match
// the reference bit for bit. NCCL cannot place two ranks of one communicator
// on the same GPU: for N ranks on one GPU use comm::LocalDevice.
//
// Ranks that make different calls (another unit, another bucket, one
// collective more) are caught without the host waiting: with each
// collective (each group, as one) the communicator all-reduces 16 bytes,
// the minimum of the call's fingerprint h and of ~h (comm::Purpose, as
// comm::Mpi), and a kernel on its stream compares the result with this
// rank's own pair. On a mismatch the kernel overwrites what the exchange
// received with NaN bytes (so no mixed values reach the caller's kernels,
// which wait for the communicator's stream) and flags the call in
// host-mapped memory; the host sees the flag at its next call or poll,
// aborts, and throws CommError naming this rank's exchange on every rank.
// Options::check_calls = false leaves the check out. The kernel is one of
// the library's (comm/reduce.cuh): a program using comm::Nccl links the
// kernels object (src/zero_kernels_cuda.cu) or includes zero/zero_cuda.cuh
// in a .cu file.
//
// One host thread uses a Nccl object at a time (as NCCL requires).
#pragma once

#include "zero/compiler.hpp"

#include "zero/cuda/runtime.hpp"
#include <nccl.h>

#if defined(ZERO_NCCL_WITH_MPI)
#include "zero/comm/mpi_c_api.hpp"
#endif

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <unistd.h>

#include "zero/comm/communicator.hpp"
#include "zero/cuda/check.hpp"
#include "zero/cuda/stream.hpp"
#include "zero/error.hpp"
#include "zero/kernels/cuda_launchers.hpp"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "zero/comm/nccl.hpp needs NCCL 2.14 or newer (bf16, ncclCommInitRankConfig, non-blocking communicators)"
#endif

namespace zero::comm {

// comm::Nccl::Options (declared outside the class so that it can be a
// default argument of the class's own functions).
struct NcclOptions {
  // A collective not finished this long after it was enqueued is taken as
  // hung (a peer died or made different calls): the communicator is aborted
  // and CommError thrown. Also bounds from_mpi's ncclCommInitRank.
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
  // GPUs per node, ranks filling nodes in order (comm/topology.hpp; 0: one
  // node of every rank): what the byte counters count as crossing nodes.
  int ranks_per_node = 0;
  // Compare every rank's call and purpose with each collective (see the
  // top of this file): a 16-byte all-reduce and one small kernel on the
  // communicator's stream, no host wait. False leaves it out.
  bool check_calls = true;
};

class Nccl {
 public:
  using Options = NcclOptions;

  // Adopts `comm` (not owned: the caller destroys it after this object,
  // unless an error aborted it). Collectives go on `stream` (not owned).
  Nccl(ncclComm_t comm, cudaStream_t stream, Options options = {})
      : s_(std::make_unique<State>(comm, stream, options, false, false)) {}
  // As above, on a stream of its own: communication overlaps compute. If
  // the program drives other NCCL communicators too (tensor parallelism,
  // metrics), their collectives may now run concurrently with this one's,
  // which NCCL warns can deadlock (its kernels block, and some CUDA calls
  // synchronise the device): then pass the stream those use instead.
  explicit Nccl(ncclComm_t comm, Options options = {})
      : s_(std::make_unique<State>(comm, nullptr, options, false, true)) {}

  // Bootstraps a communicator of `nranks` processes through a file on a
  // filesystem every rank sees: rank 0 creates the NCCL unique id and writes
  // it to `path` (through path + ".tmp" and an atomic rename); the others
  // wait up to `wait` for it to appear. Rank 0 removes the file once every
  // rank has joined. Use a path unique to the job: a stale file from an
  // earlier run would make ranks join the wrong communicator (they then time
  // out with an error that says so). Collectives go on a stream of the
  // communicator's own; the current device must be the rank's GPU.
  static Nccl from_unique_id_file(const std::string& path, int rank, int nranks,
                                  std::chrono::milliseconds wait = std::chrono::minutes(5), Options options = {});

#if defined(ZERO_NCCL_WITH_MPI)
  // Bootstraps over MPI: rank 0 of `comm` creates the unique id and
  // broadcasts it. NCCL ranks are the MPI ranks of `comm`.
  static Nccl from_mpi(MPI_Comm comm, Options options = {});
#endif

  // Bootstraps through a channel of the caller's (a launcher's key-value
  // store, its own MPI): rank 0 calls new_unique_id(), the caller hands the
  // id to every rank, and each joins with it. Initialisation waits up to
  // options.timeout for every rank; collectives go on a stream of the
  // communicator's own; the current device must be the rank's GPU.
  static ncclUniqueId new_unique_id();
  static Nccl from_unique_id(const ncclUniqueId& id, int rank, int nranks, Options options = {});

  Nccl(Nccl&&) noexcept = default;
  Nccl& operator=(Nccl&&) noexcept = default;
  Nccl(const Nccl&) = delete;
  Nccl& operator=(const Nccl&) = delete;
  // Waits (up to the timeout) for enqueued collectives, then destroys an
  // owned communicator. Never throws.
  ~Nccl() = default;

  int rank() const { return s_->rank; }
  int size() const { return s_->size; }
  const Topology& topology() const { return s_->topology; }
  int device() const { return s_->device; }
  cudaStream_t stream() const { return s_->stream; }
  ncclComm_t native() const { return s_->comm; }
  bool aborted() const { return s_->aborted; }
  const ByteCounters& counters() const { return s_->counters; }
  void reset_counters() { s_->counters = {}; }

  // The GPUs of this rank's node (its rank there: topology().local_rank)
  // and those at its place on every node (its rank there: its node), for
  // hierarchical collectives (ZeRO++'s hpZ and qgZ): ncclCommSplit on the
  // first call, which every rank makes, outside a group. They enqueue on
  // this communicator's stream, so their collectives and this one's run in
  // the order the engine calls them, and share its timeout.
  Nccl& node() { return split(node_, s_->topology.node_of(s_->rank), s_->topology.local_rank(s_->rank), false); }
  Nccl& across() { return split(across_, s_->topology.local_rank(s_->rank), s_->topology.node_of(s_->rank), true); }

  void all_reduce(void* buf, std::size_t count, DType t, ReduceOp op = ReduceOp::sum, bool control = false) {
    require(t != DType::u8, "comm::Nccl: ", detail::reduce_bytes_refused);
    const State::Call call(*s_, "all_reduce", count, t, static_cast<std::uint64_t>(op));
    if (count != 0)
      s_->check(ncclAllReduce(buf, buf, count, nccl_type(t), nccl_op(op), s_->comm, s_->stream), "ncclAllReduce");
    s_->counters.count_all_reduce(count * dtype_bytes(t), s_->size, control, crosses());
    s_->enqueued(control, buf, count * dtype_bytes(t));
  }

  // In place when recv == send + rank() * recv_count (NCCL's own rule).
  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType t) {
    require(t != DType::u8, "comm::Nccl: ", detail::reduce_bytes_refused);
    const State::Call call(*s_, "reduce_scatter", recv_count, t);
    if (recv_count != 0)
      s_->check(ncclReduceScatter(send, recv, recv_count, nccl_type(t), ncclSum, s_->comm, s_->stream),
                "ncclReduceScatter");
    s_->counters.count_reduce_scatter(recv_count * static_cast<std::size_t>(s_->size) * dtype_bytes(t), s_->size,
                                      crosses());
    s_->enqueued(false, recv, recv_count * dtype_bytes(t));
  }

  // In place when send == recv + rank() * send_count (NCCL's own rule).
  void all_gather(const void* send, void* recv, std::size_t send_count, DType t, bool control = false) {
    const State::Call call(*s_, "all_gather", send_count, t);
    if (send_count != 0)
      s_->check(ncclAllGather(send, recv, send_count, nccl_type(t), s_->comm, s_->stream), "ncclAllGather");
    s_->counters.count_all_gather(send_count * static_cast<std::size_t>(s_->size) * dtype_bytes(t), s_->size,
                                  control, crosses());
    s_->enqueued(control, recv, send_count * static_cast<std::size_t>(s_->size) * dtype_bytes(t));
  }

  void broadcast(void* buf, std::size_t count, DType t, int root) {
    const State::Call call(*s_, "broadcast", count, t, static_cast<std::uint64_t>(root));
    require(root >= 0 && root < size(), "broadcast root ", root, " is not a rank of this communicator of ", size());
    if (count != 0)
      s_->check(ncclBroadcast(buf, buf, count, nccl_type(t), root, s_->comm, s_->stream), "ncclBroadcast");
    s_->counters.count_broadcast(count * dtype_bytes(t), s_->size, crosses());
    s_->enqueued(false, buf, count * dtype_bytes(t));
  }

  // Block j of send to rank j, block i of recv from rank i: an ncclSend and
  // an ncclRecv per other rank in one NCCL group (NCCL has no all-to-all of
  // its own; grouped, they run at once), and this rank's own block by a
  // device copy on the communicator's stream. Any DType: the bytes are moved.
  // Inside an open group_begin() the copy is enqueued at once while NCCL's
  // transfers wait for group_end(): as for any collectives of one group, no
  // other collective of the group may write this one's buffers.
  void all_to_all(const void* send, void* recv, std::size_t count, DType t) {
    const State::Call call(*s_, "all_to_all", count, t);
    const std::size_t block = count * dtype_bytes(t);
    detail::require_apart("comm::Nccl", send, recv, block * static_cast<std::size_t>(s_->size));
    if (count != 0) {
      // Counted as a group of the communicator's, so that an error inside
      // ends it before the abort (State::fail, State::Call).
      s_->check(ncclGroupStart(), "ncclGroupStart");
      if (s_->group_depth++ == 0) s_->group_owner = std::this_thread::get_id();
      for (int peer = 0; peer < s_->size; ++peer) {
        if (peer == s_->rank) continue;
        const std::size_t at = static_cast<std::size_t>(peer) * block;
        s_->check(ncclSend(static_cast<const char*>(send) + at, count, nccl_type(t), peer, s_->comm, s_->stream),
                  "ncclSend");
        s_->check(ncclRecv(static_cast<char*>(recv) + at, count, nccl_type(t), peer, s_->comm, s_->stream),
                  "ncclRecv");
      }
      --s_->group_depth;
      s_->check(ncclGroupEnd(), "ncclGroupEnd");
      const std::size_t own = static_cast<std::size_t>(s_->rank) * block;
      ZERO_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(recv) + own, static_cast<const char*>(send) + own, block,
                                      cudaMemcpyDeviceToDevice, s_->stream));
    }
    s_->counters.count_all_to_all(block, s_->topology, s_->rank);
    s_->enqueued(false, recv, block * static_cast<std::size_t>(s_->size));
  }

  // Returns when every rank has reached it and this rank's collectives
  // enqueued before it have finished (a one-element all-reduce, not counted).
  void barrier() {
    const State::Call call(*s_, "barrier", 1, DType::f32);
    require(s_->group_depth == 0, "comm::Nccl::barrier() inside group_begin()/group_end(): end the group first");
    s_->check(ncclAllReduce(s_->scratch, s_->scratch, 1, ncclFloat32, ncclSum, s_->comm, s_->stream),
              "ncclAllReduce (barrier)");
    s_->enqueued(true, nullptr, 0);
  }

  // Several collectives issued together (ncclGroupStart/End): NCCL launches
  // them as one. Nestable; control collectives inside a group are waited for
  // at the outermost group_end(). An exception from any call inside a group
  // (a timeout, an asynchronous error, a bad argument) ends the whole group
  // before it leaves the call, launching what the group holds so far: an
  // open NCCL group would swallow the communicator's abort and every later
  // NCCL call of this thread. Do not call group_end() for it.
  void group_begin() {
    const State::Call call(*s_, nullptr, 0, DType::f32);
    s_->check(ncclGroupStart(), "ncclGroupStart");
    if (s_->group_depth++ == 0) s_->group_owner = std::this_thread::get_id();
  }
  void group_end() {
    const State::Call call(*s_, nullptr, 0, DType::f32);
    require(s_->group_depth > 0, "comm::Nccl::group_end() without an open group_begin() (an exception inside a "
                                 "group ends the group itself)");
    --s_->group_depth;
    s_->check(ncclGroupEnd(), "ncclGroupEnd");
    if (s_->group_depth == 0) s_->close_group();
  }

  // Blocks until every collective enqueued so far has finished; throws
  // CommError (after aborting) on a timeout or an asynchronous NCCL error.
  void wait() {
    const State::Call call(*s_, nullptr, 0, DType::f32);
    s_->wait_all();
  }

 private:
  static ncclDataType_t nccl_type(DType t) {
    switch (t) {
      case DType::f32: return ncclFloat32;
      case DType::f16: return ncclFloat16;
      case DType::bf16: return ncclBfloat16;
      case DType::f64: return ncclFloat64;
      case DType::u64: return ncclUint64;
      case DType::u8: return ncclUint8;
    }
    return ncclFloat32;
  }
  static ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::sum ? ncclSum : ncclMax; }

  using clock = std::chrono::steady_clock;

  // NCCL's asynchronous state of `comm`: ncclSuccess, ncclInProgress (a
  // non-blocking initialisation or enqueue still under way), or the error it hit.
  static ncclResult_t async_state(ncclComm_t comm) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t queried = ncclCommGetAsyncError(comm, &state);
    return queried != ncclSuccess ? queried : state;
  }
  // Polls async_state until it is no longer ncclInProgress, or `timeout`
  // passes (and then returns ncclInProgress).
  static ncclResult_t settle(ncclComm_t comm, std::chrono::milliseconds timeout) {
    const auto start = clock::now();
    for (int spin = 0;; ++spin) {
      const ncclResult_t state = async_state(comm);
      if (state != ncclInProgress || clock::now() - start > timeout) return state;
      backoff(spin);
    }
  }
  static void backoff(int spin) {
    if (spin < 64)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(spin < 1024 ? 20 : 200));
  }

  bool crosses() const { return s_->topology.ring_send_crosses(s_->rank); }

  static ncclComm_t init_rank(const ncclUniqueId& id, int rank, int nranks, std::chrono::milliseconds timeout,
                              const char* how);
  // Wraps a communicator the bootstrap created (owned), destroying it if that fails.
  static Nccl own(ncclComm_t comm, const Options& options);

  // Everything lives here, at a fixed address (registered as a watcher), so
  // the Nccl handle can move.
  class State final : public zero::cuda::StreamWatcher {
   public:
    static constexpr std::size_t ring_capacity = 128;  // collectives in flight before a call waits for the oldest

    // One enqueued collective (or group of them), until its event completes.
    struct Record {
      cudaEvent_t event = nullptr;
      const char* kind = "";
      std::size_t count = 0;
      DType dtype = DType::f32;
      std::uint64_t call = 0;
      int group_size = 1;  // > 1: a group, described by its first collective
      clock::time_point enqueued{};
      const char* api = nullptr;  // the library call it was made in (ApiCall), or nullptr
      Purpose purpose{};          // what the optimizer made it for, where has_purpose
      bool has_purpose = false;
      std::uint64_t code = 0;     // this rank's fingerprint of the call (detail::call_code)
    };

    // `s`: the stream to use, unless `create_stream`; `own`: destroy `c` at the end.
    State(ncclComm_t c, cudaStream_t s, Options o, bool own, bool create_stream)
        : comm(c), owned(own), stream(s), options(o) {
      require(c != nullptr, "comm::Nccl: the ncclComm_t is null; create it with ncclCommInitRank (or use "
                            "Nccl::from_unique_id_file / from_mpi)");
      require(o.timeout.count() > 0, "comm::Nccl::Options::timeout is ", o.timeout.count(),
              " ms; it must be positive (10 minutes is the default)");
      check_plain(ncclCommUserRank(c, &rank), "ncclCommUserRank");
      check_plain(ncclCommCount(c, &size), "ncclCommCount");
      topology = Topology::checked(size, o.ranks_per_node, "comm::Nccl::Options::ranks_per_node");
      check_plain(ncclCommCuDevice(c, &device), "ncclCommCuDevice");
      int current = -1;
      ZERO_CUDA_CHECK(cudaGetDevice(&current));
      require(current == device, "comm::Nccl rank ", rank, ": the current device is ", current,
              " but the communicator's is ", device, "; call cudaSetDevice(", device, ") on this thread first");
      ring.resize(ring_capacity);
      try {
        if (create_stream) {
          // The highest priority, so NCCL's kernels are scheduled ahead of
          // the compute they overlap with (numerically lowest is highest).
          int least = 0, greatest = 0;
          ZERO_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
          ZERO_CUDA_CHECK(cudaStreamCreateWithPriority(&owned_stream, cudaStreamNonBlocking, greatest));
          stream = owned_stream;
        }
        for (Record& r : ring) ZERO_CUDA_CHECK(cudaEventCreateWithFlags(&r.event, cudaEventDisableTiming));
        ZERO_CUDA_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
        group_callers.reserve(8);
        ZERO_CUDA_CHECK(cudaMalloc(&scratch, sizeof(float)));
        // The call check: per ring slot, {h, ~h} staged on the host and
        // all-reduced on the device; the mismatch flag, mapped.
        ZERO_CUDA_CHECK(cudaHostAlloc(&check_staged, 2 * ring_capacity * sizeof(std::uint64_t), cudaHostAllocDefault));
        ZERO_CUDA_CHECK(cudaMalloc(&check_reduced, 2 * ring_capacity * sizeof(std::uint64_t)));
        ZERO_CUDA_CHECK(cudaHostAlloc(&mismatch, sizeof(std::uint64_t), cudaHostAllocMapped));
        *mismatch = 0;
        ZERO_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&mismatch_on_device), mismatch, 0));
        group_outputs.reserve(64);
        // On the communicator's stream, where barrier() reads it: a plain
        // cudaMemset runs on the legacy default stream, which does not order
        // a non-blocking stream.
        ZERO_CUDA_CHECK(cudaMemsetAsync(scratch, 0, sizeof(float), stream));
      } catch (...) {
        release_cuda();
        throw;
      }
      zero::cuda::register_watcher(this);
    }
    State(const State&) = delete;
    State& operator=(const State&) = delete;

    ~State() {
      zero::cuda::unregister_watcher(this);
      {
        const std::lock_guard<std::mutex> lock(mutex);
        end_groups(true);  // else the destroy below would only join an open group
        if (!aborted) {
          try {
            wait_all();  // aborts on timeout: never hangs
          } catch (...) {
          }
        }
        if (owned && !aborted) ncclCommDestroy(comm);
      }
      release_cuda();
    }

    // One public call, start to end: holds the lock, enters (see enter()),
    // and if an exception leaves the call inside a group, ends the group
    // first (the guard on every error path; see group_begin()).
    class Call {
     public:
      Call(State& s, const char* kind, std::size_t count, DType t, std::uint64_t detail = 0) : s_(s), lock_(s.mutex) {
        try {
          s.enter(kind, count, t, detail);
        } catch (...) {
          s.end_groups(true);
          throw;
        }
      }
      Call(const Call&) = delete;
      Call& operator=(const Call&) = delete;
      ~Call() {
        if (std::uncaught_exceptions() > uncaught_) s_.end_groups(true);
      }

     private:
      State& s_;
      std::unique_lock<std::mutex> lock_;  // released after the destructor's body
      int uncaught_ = std::uncaught_exceptions();
    };

    // Start of every call: no call after an abort, the right device, a
    // non-blocking poll, and room in the ring.
    void enter(const char* kind, std::size_t count, DType t, std::uint64_t detail) {
      if (aborted) throw CommError(abort_message);
      int current = -1;
      ZERO_CUDA_CHECK(cudaGetDevice(&current));
      require(current == device, "comm::Nccl rank ", rank, ": the current device is ", current,
              " but the communicator's is ", device, "; call cudaSetDevice(", device, ") on this thread first");
      poll_locked();
      while (pending == ring_capacity) {
        backoff(0);
        poll_locked();
      }
      if (kind != nullptr) {
        now.kind = kind;
        now.count = count;
        now.dtype = t;
        now.call = ++calls;
        now.api = ApiCall::current();
        const Purpose* purpose = Purpose::current();
        now.has_purpose = purpose != nullptr;
        now.purpose = purpose != nullptr ? *purpose : Purpose{};
        now.code = detail::call_code(kind, count, t, detail, purpose);
        follow_caller();
      }
    }

    // The collective about to be enqueued starts after the work on the
    // caller's current stream (when that is not the communicator's own).
    // (A stream handle may be nullptr: the legacy default stream, which a
    // non-blocking stream does not synchronise with. So "another stream" is
    // a flag, never a null handle.)
    void follow_caller() {
      const cudaStream_t current = zero::cuda::current_stream();
      caller_is_other = current != stream;
      if (!caller_is_other) return;
      caller = current;
      zero::cuda::order_after(stream, caller, fork);
      if (group_depth > 0 &&
          std::find(group_callers.begin(), group_callers.end(), caller) == group_callers.end())
        group_callers.push_back(caller);
    }
    // ... and the caller's stream waits for it (the event push() just recorded).
    void caller_waits(cudaStream_t c) {
      const Record& last = ring[(head + pending + ring_capacity - 1) % ring_capacity];
      ZERO_CUDA_CHECK(cudaStreamWaitEvent(c, last.event, 0));
    }

    // After a collective's NCCL call: check it and record its event (or
    // join the open group) and, for results the host reads next, wait for
    // it. `out`: what it wrote, `bytes` long.
    void enqueued(bool wait, void* out, std::size_t bytes) {
      if (group_depth > 0) {
        if (group_count == 0) {
          group = now;
          group_code = detail::fnv_basis;
        }
        ++group_count;
        group_wait = group_wait || wait;
        group_code = detail::fnv_add(group_code, now.code);
        group_outputs.push_back({out, bytes});
        return;
      }
      const Output output{out, bytes};
      check_same_call(now.code, now.call, &output, 1);
      push(now);
      if (caller_is_other) caller_waits(caller);
      if (wait) wait_all();
    }

    // After the outermost ncclGroupEnd: the group's collectives are tracked
    // as one record, and waited for if one of them was a control collective.
    void close_group() {
      const bool wait = group_wait;
      record_group();
      if (wait) wait_all();
    }

    // Ends every open group at NCCL, on the way out of an error or before an
    // abort or destroy (which an open group would only queue); NCCL's results
    // are ignored, the error under way is the one to report. With `track`,
    // what the group launched is tracked like any collective (so wait() and
    // the timeout still cover it), unless the communicator was aborted.
    void end_groups(bool track) noexcept {
      const bool open = group_depth > 0;
      while (group_depth > 0) {
        --group_depth;
        ncclGroupEnd();
      }
      try {
        if (open && track && !aborted) record_group(false);
      } catch (...) {  // it aborted: nothing left to track
      }
      group_count = 0;
      group_wait = false;
      group_callers.clear();
      group_outputs.clear();
    }

    void wait_all() {
      for (int spin = 0;; ++spin) {
        poll_locked();
        if (pending == 0) return;
        backoff(spin);
      }
    }

    // StreamWatcher: called by zero::cuda::wait_stream from any thread; skips
    // the poll when the owner is inside a call (it polls there itself), or
    // has a group open on another thread (NCCL groups belong to a thread:
    // only that one can end the group before an abort, at its next call).
    void poll() override {
      std::unique_lock<std::mutex> lock(mutex, std::try_to_lock);
      if (!lock.owns_lock()) return;
      if (aborted) throw CommError(abort_message);
      if (group_depth > 0 && group_owner != std::this_thread::get_id()) return;
      poll_locked();
    }

    // `call` is the NCCL function; what it was for is the collective being
    // issued, or nothing for ncclGroupStart/End.
    void check(ncclResult_t result, const char* call) {
      if (result == ncclSuccess) return;
      const bool group_call = std::strncmp(call, "ncclGroup", 9) == 0;
      const std::string what = group_call ? std::string(call) : zero::detail::concat(call, " for ", describe(now));
      if (result == ncclInProgress) {  // a non-blocking communicator: wait until it is enqueued
        result = settle(comm, options.timeout);
        if (result == ncclSuccess) return;
        if (result == ncclInProgress)
          fail(zero::detail::concat(what, " was not enqueued within ", options.timeout.count(), " ms"));
      }
      fail(zero::detail::concat(what, " failed: ", nccl_error(result)));
    }

    ncclComm_t comm;
    bool owned;
    cudaStream_t stream;
    Options options;
    int rank = 0, size = 1, device = 0;
    Topology topology;
    ByteCounters counters;
    int group_depth = 0;
    std::thread::id group_owner{};  // the thread whose NCCL group is open (NCCL's group state is per thread)
    bool aborted = false;
    std::string abort_message;
    std::mutex mutex;  // held through every public call (Call), and Nccl::split
    float* scratch = nullptr;  // barrier()'s one element
    cudaEvent_t fork = nullptr;  // the caller's stream, before a collective
    bool caller_is_other = false;  // the collective being issued comes from another current stream,
    cudaStream_t caller = nullptr;  // ... this one
    std::vector<cudaStream_t> group_callers;  // the open group's other current streams (capacity reserved)
    cudaStream_t owned_stream = nullptr;  // created by the communicator

   private:
    static void check_plain(ncclResult_t r, const char* call) {
      if (r != ncclSuccess)
        throw CommError(zero::detail::concat("comm::Nccl: ", call, " failed: ", ncclGetErrorString(r),
                                             "; is the ncclComm_t initialised (ncclCommInitRank returned success)?"));
    }

    std::string nccl_error(ncclResult_t r) const {
      const char* last = ncclGetLastError(comm);
      return zero::detail::concat(ncclGetErrorString(r), last != nullptr && *last != '\0' ? " (" : "",
                                  last != nullptr ? last : "", last != nullptr && *last != '\0' ? ")" : "");
    }

    static std::string describe(const Record& r) {
      std::string d = describe_collective(r.kind, r.call, r.count, r.dtype);
      if (r.has_purpose) d = r.purpose.describe() + " with " + d;
      if (r.group_size > 1)
        d = zero::detail::concat("a group of ", r.group_size, " collectives starting with ", d);
      return d + ApiCall::where(r.api);
    }

    void push(const Record& r) {
      Record& slot = ring[(head + pending) % ring_capacity];
      slot.kind = r.kind;
      slot.count = r.count;
      slot.dtype = r.dtype;
      slot.call = r.call;
      slot.api = r.api;
      slot.purpose = r.purpose;
      slot.has_purpose = r.has_purpose;
      slot.code = r.code;
      slot.group_size = r.group_size < 1 ? 1 : r.group_size;
      slot.enqueued = clock::now();
      const cudaError_t recorded = cudaEventRecord(slot.event, stream);
      if (recorded != cudaSuccess)
        fail(zero::detail::concat("cudaEventRecord after ", describe(slot), " failed: ", cudaGetErrorString(recorded)));
      ++pending;
    }

    // Retires finished collectives; aborts and throws on an asynchronous NCCL
    // error, a CUDA error, or an oldest collective past the timeout.
    void poll_locked() {
      check_mismatch();
      const ncclResult_t state = async_state(comm);
      if (state != ncclSuccess && state != ncclInProgress)
        fail(zero::detail::concat("NCCL reported an asynchronous error: ", nccl_error(state),
                                  pending > 0 ? " with " + describe(ring[head]) + " unfinished" : std::string()));
      while (pending > 0) {
        const cudaError_t q = cudaEventQuery(ring[head].event);
        if (q == cudaErrorNotReady) break;
        if (q != cudaSuccess)
          fail(zero::detail::concat(describe(ring[head]), " failed on the device: ", cudaGetErrorName(q), " (",
                                    cudaGetErrorString(q), ")"));
        head = (head + 1) % ring_capacity;
        --pending;
      }
      check_mismatch();
      if (pending > 0 && clock::now() - ring[head].enqueued > options.timeout)
        fail(zero::detail::concat(
            describe(ring[head]), " did not finish within ", options.timeout.count(),
            " ms of being enqueued. A peer rank has probably failed, stopped, or made a different sequence of "
            "collective calls: check the other ranks' output; if it legitimately takes longer, raise "
            "comm::Nccl::Options::timeout"));
    }

    [[noreturn]] void fail(const std::string& what) {
      if (!aborted) {
        end_groups(false);  // inside an open group, the abort would only be queued
        aborted = true;
        abort_message = zero::detail::concat("comm::Nccl rank ", rank, " of ", size, " (device ", device, "): ", what,
                                             ". The NCCL communicator was aborted; every later call on it fails");
        ncclCommAbort(comm);  // frees it, and releases kernels stuck in it
      }
      throw CommError(abort_message);
    }

    void release_cuda() noexcept {
      for (Record& r : ring)
        if (r.event != nullptr) cudaEventDestroy(r.event);
      ring.clear();
      if (fork != nullptr) cudaEventDestroy(fork);
      fork = nullptr;
      if (scratch != nullptr) cudaFree(scratch);
      scratch = nullptr;
      if (check_staged != nullptr) cudaFreeHost(check_staged);
      check_staged = nullptr;
      if (check_reduced != nullptr) cudaFree(check_reduced);
      check_reduced = nullptr;
      if (mismatch != nullptr) cudaFreeHost(mismatch);
      mismatch = nullptr;
      if (owned_stream != nullptr) cudaStreamDestroy(owned_stream);  // after its work, which the destructor awaited
      owned_stream = nullptr;
    }

    // The closed group's collectives, as one record in the ring, checked as
    // one unless `check` is false (ending groups on the way out of an error).
    void record_group(bool check = true) {
      const int n = group_count;
      group_count = 0;
      group_wait = false;
      if (n > 0) {
        group.group_size = n;
        group.code = group_code;
        if (check) check_same_call(group_code, group.call, group_outputs.data(), group_outputs.size());
        group_outputs.clear();
        push(group);
        for (cudaStream_t c : group_callers) caller_waits(c);
      }
      group_callers.clear();
    }

    std::vector<Record> ring;
    std::size_t head = 0, pending = 0;
    std::uint64_t calls = 0;
    Record now{};    // the collective being issued
    Record group{};       // the open group's first collective
    int group_count = 0;  // collectives in the open group so far
    bool group_wait = false;

    // The call check (see the top of this file).
    struct Output {
      void* at;
      std::size_t bytes;
    };
    std::uint64_t group_code = 0;        // the open group's calls' fingerprints, chained
    std::vector<Output> group_outputs;   // and what they write (capacity reserved)
    std::uint64_t* check_staged = nullptr;   // pinned: {h, ~h} per ring slot, copied to ...
    std::uint64_t* check_reduced = nullptr;  // ... the device, all-reduced (minimum) in place
    std::uint64_t* mismatch = nullptr;       // host-mapped: the first mismatched call's number, or 0
    std::uint64_t* mismatch_on_device = nullptr;

    // Enqueues the check of the collective (or group) numbered `call`, whose
    // fingerprint is `code`, after it on the stream: nothing when every rank
    // made the same call; else `outputs` overwritten and the call flagged.
    // Uses the ring slot its record is about to take (free: enter() waited
    // for room, so that slot's earlier copy has finished).
    void check_same_call(std::uint64_t code, std::uint64_t call, const Output* outputs, std::size_t count) {
      if (!options.check_calls || size == 1) return;
      const std::size_t slot = (head + pending) % ring_capacity;
      std::uint64_t* staged = check_staged + 2 * slot;
      std::uint64_t* reduced = check_reduced + 2 * slot;
      staged[0] = code;
      staged[1] = ~code;
      ZERO_CUDA_CHECK(cudaMemcpyAsync(reduced, staged, 2 * sizeof(std::uint64_t), cudaMemcpyHostToDevice, stream));
      check(ncclAllReduce(reduced, reduced, 2, ncclUint64, ncclMin, comm, stream),
            "ncclAllReduce (the check that every rank makes the same call)");
      if (count == 0) kernels_check(reduced, code, nullptr, 0, call);
      for (std::size_t k = 0; k < count; ++k) kernels_check(reduced, code, outputs[k].at, outputs[k].bytes, call);
    }
    void kernels_check(const std::uint64_t* reduced, std::uint64_t code, void* out, std::size_t bytes,
                       std::uint64_t call) {
      comm::detail::launch_check_call<std::uint64_t>(reduced, code, out, out != nullptr ? bytes : 0, call,
                                                     mismatch_on_device, stream);
      const cudaError_t launched = cudaGetLastError();
      if (launched != cudaSuccess)
        fail(zero::detail::concat("the call check's kernel after ", describe(now), " failed to launch: ",
                                  cudaGetErrorString(launched)));
    }

    // A mismatch the device flagged: every rank sees its own (each compared
    // the same minimum with its own pair), and throws naming its own call.
    void check_mismatch() {
      if (mismatch == nullptr) return;
      const std::uint64_t bad = *static_cast<volatile std::uint64_t*>(mismatch);
      if (bad == 0) return;
      std::string mine = zero::detail::concat("collective call #", bad, " (no longer in the record)");
      for (const Record& r : ring)
        if (r.call == bad) mine = r.has_purpose ? describe(r) : "called " + describe(r);
      fail(zero::detail::concat(
          "another rank made a different collective call at the point where this rank ", mine,
          "; every rank must make the same collective calls (kind, element count, type, operation or root), for the "
          "same units and buckets, in the same order (ranks that acquire units in different orders, or one more "
          "than the others, pair the wrong exchanges). What this exchange received was overwritten with NaN bytes, "
          "not handed on mixed; each rank's error names its own call"));
    }
  };

  explicit Nccl(std::unique_ptr<State> s) : s_(std::move(s)) {}

  // node() (across = false) or across(): the ranks of one colour, ordered by
  // key. Non-blocking, as every initialisation here: a rank that never makes
  // the call is an error after Options::timeout, not a hang.
  Nccl& split(std::unique_ptr<Nccl>& made, int color, int key, bool across) {
    if (made) return *made;
    ncclComm_t part = nullptr;
    {
      const std::lock_guard<std::mutex> lock(s_->mutex);
      if (s_->aborted) throw CommError(s_->abort_message);
      require(s_->group_depth == 0, "comm::Nccl::", across ? "across" : "node",
              "() inside group_begin()/group_end(): split the communicator before the group");
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;
      ncclResult_t r = ncclCommSplit(s_->comm, color, key, &part, &config);
      if ((r == ncclSuccess || r == ncclInProgress) && part != nullptr) r = settle(part, s_->options.timeout);
      if (r != ncclSuccess || part == nullptr) {
        const char* last = part != nullptr ? ncclGetLastError(part) : "";
        if (part != nullptr) ncclCommAbort(part);
        throw CommError(zero::detail::concat(
            "comm::Nccl rank ", s_->rank, " of ", s_->size, ": ncclCommSplit (", across ? "across()" : "node()",
            ") ", r == ncclInProgress ? "did not complete within the timeout: every rank must call it" : "failed: ",
            r == ncclInProgress ? "" : ncclGetErrorString(r), " ", last != nullptr ? last : ""));
      }
    }
    Options o = s_->options;
    o.ranks_per_node = across ? 1 : 0;  // across: each rank on a node of its own; node(): one node
    try {
      made.reset(new Nccl(std::make_unique<State>(part, s_->stream, o, true, false)));
    } catch (...) {
      ncclCommDestroy(part);
      throw;
    }
    return *made;
  }

  std::unique_ptr<State> s_;
  std::unique_ptr<Nccl> node_, across_;  // node(), across(): destroyed first, on the shared stream
};

// ---- bootstrap -----------------------------------------------------------------

inline ncclComm_t Nccl::init_rank(const ncclUniqueId& id, int rank, int nranks, std::chrono::milliseconds timeout,
                                  const char* how) {
  // Non-blocking initialisation, so that a rank that never joins becomes an
  // error after `timeout` instead of a hang.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&comm, nranks, id, rank, &config);
  if (r == ncclSuccess || r == ncclInProgress) r = settle(comm, timeout);
  if (r == ncclSuccess) return comm;
  if (r == ncclInProgress) {
    ncclCommAbort(comm);
    throw CommError(zero::detail::concat(
        "comm::Nccl rank ", rank, " of ", nranks, ": ncclCommInitRank (", how, ") did not complete within ",
        timeout.count(), " ms: some rank did not join (not started, a different nranks, or a stale unique id); "
        "start every rank with the same arguments"));
  }
  const char* last = comm != nullptr ? ncclGetLastError(comm) : "";
  if (comm != nullptr) ncclCommAbort(comm);
  throw CommError(zero::detail::concat("comm::Nccl rank ", rank, " of ", nranks, ": ncclCommInitRank (", how,
                                       ") failed: ", ncclGetErrorString(r), " ", last != nullptr ? last : ""));
}

inline ncclUniqueId Nccl::new_unique_id() {
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess)
    throw CommError(zero::detail::concat("comm::Nccl rank 0: ncclGetUniqueId failed: ", ncclGetErrorString(r)));
  return id;
}

inline Nccl Nccl::own(ncclComm_t comm, const Options& options) {
  try {
    return Nccl(std::make_unique<State>(comm, nullptr, options, true, true));
  } catch (...) {
    ncclCommDestroy(comm);
    throw;
  }
}

inline Nccl Nccl::from_unique_id_file(const std::string& path, int rank, int nranks, std::chrono::milliseconds wait,
                                      Options options) {
  require(nranks >= 1 && rank >= 0 && rank < nranks, "comm::Nccl::from_unique_id_file: rank ", rank, " of ", nranks,
          " ranks; rank must be in [0, nranks)");
  require(!path.empty(), "comm::Nccl::from_unique_id_file: the path is empty; pass a file on a filesystem every rank "
                         "sees, unique to this job");
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  if (rank == 0) {
    id = new_unique_id();
    const std::string tmp = path + ".tmp";
    std::FILE* f = std::fopen(tmp.c_str(), "wb");
    bool ok = f != nullptr && std::fwrite(&id, sizeof id, 1, f) == 1 && std::fflush(f) == 0 && ::fsync(fileno(f)) == 0;
    const int error = errno;
    if (f != nullptr) ok = std::fclose(f) == 0 && ok;
    if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0)
      throw CommError(zero::detail::concat("comm::Nccl rank 0: cannot write the NCCL unique id to '", tmp,
                                           "' and rename it to '", path, "': ", std::strerror(ok ? errno : error),
                                           "; pass a path in a writable directory that every rank sees"));
  } else {
    const auto start = clock::now();
    for (;;) {
      if (std::FILE* f = std::fopen(path.c_str(), "rb")) {
        const bool read = std::fread(&id, sizeof id, 1, f) == 1;
        std::fclose(f);
        if (read) break;
      }
      if (clock::now() - start > wait)
        throw CommError(zero::detail::concat(
            "comm::Nccl rank ", rank, " of ", nranks, ": waited ", wait.count(), " ms for the NCCL unique-id file '",
            path, "', which rank 0 writes; start rank 0 with the same path, on a filesystem every rank sees, or "
            "raise the wait"));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  const ncclComm_t comm = init_rank(id, rank, nranks, wait, "unique-id file");
  // Every rank has joined, so every rank has read the file: remove it so a
  // later run cannot pick up this id.
  if (rank == 0) std::remove(path.c_str());
  return own(comm, options);
}

#if defined(ZERO_NCCL_WITH_MPI)
inline Nccl Nccl::from_mpi(MPI_Comm mpi, Options options) {
  int rank = 0, nranks = 1;
  MPI_Comm_rank(mpi, &rank);
  MPI_Comm_size(mpi, &nranks);
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  if (rank == 0) id = new_unique_id();
  if (MPI_Bcast(&id, static_cast<int>(sizeof id), MPI_BYTE, 0, mpi) != MPI_SUCCESS)
    throw CommError(zero::detail::concat("comm::Nccl rank ", rank, ": MPI_Bcast of the NCCL unique id failed"));
  const ncclComm_t comm = init_rank(id, rank, nranks, options.timeout, "MPI bootstrap");
  return own(comm, options);
}
#endif

inline Nccl Nccl::from_unique_id(const ncclUniqueId& id, int rank, int nranks, Options options) {
  require(nranks >= 1 && rank >= 0 && rank < nranks, "comm::Nccl::from_unique_id: rank ", rank, " of ", nranks,
          " ranks; rank must be in [0, nranks)");
  return own(init_rank(id, rank, nranks, options.timeout, "caller's bootstrap"), options);
}

}  // namespace zero::comm
