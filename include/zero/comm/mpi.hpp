// Why: real multi-process runs on CPUs (mpirun -np 4), with the same engine
// and the same byte accounting as NCCL. MPI has no bf16/fp16 sum, so 16-bit
// buffers travel as 2-byte elements with a user-defined reduction that sums
// in fp32 (zero/comm/reduce.hpp). Errors come back as zero::CommError with
// MPI's own message, never as an abort without explanation.
//
// A rank that fails or makes different calls must not leave the others
// waiting forever in a collective, and MPI cannot cancel one. So every
// collective is non-blocking (MPI_Iallreduce, MPI_Ireduce_scatter_block,
// MPI_Iallgather, MPI_Ibcast, MPI_Ibarrier), awaited by polling MPI_Test
// with a back-off that leaves the cores to ranks still computing; one not
// complete after Options::timeout ends the job as PyTorch's NCCL watchdog
// does: the collective (kind, call number, element count and type), the rank
// and the time waited go to stderr, then MPI_Abort. A rank that fails with an
// exception ends the job itself, from its catch path, with abort_mpi_job();
// MpiRuntime does not finalise MPI while an exception unwinds past it, since
// MPI_Finalize would wait for ranks that wait for this one.
#pragma once

#include "zero/config.hpp"

#include "zero/comm/mpi_c_api.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <string_view>
#include <thread>

#include "zero/comm/communicator.hpp"
#include "zero/comm/reduce.hpp"
#include "zero/error.hpp"

namespace zero::comm {

// Initialises MPI for the process lifetime of this object (if the program
// has not already), and finalises it at destruction if it initialised it,
// except while an exception unwinds past it: MPI_Finalize waits for every
// rank (Open MPI synchronises them there), and the others may be waiting in a
// collective for this one. MPI stays up for the catch path's abort_mpi_job();
// a catch path without it that returns a non-zero status still ends an Open
// MPI job (mpirun aborts the others when a process exits with one), without
// the message.
class MpiRuntime {
 public:
  MpiRuntime(int* argc, char*** argv) : unwinding_at_start_(std::uncaught_exceptions()) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
      owns_ = true;
    }
  }
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;
  ~MpiRuntime() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owns_ && !finalized && std::uncaught_exceptions() <= unwinding_at_start_) MPI_Finalize();
  }

 private:
  bool owns_ = false;
  int unwinding_at_start_;  // exceptions in flight when constructed (inside a destructor run by unwinding)
};

// Ends every process of the MPI job: prints "comm::Mpi: rank r of n ends the
// job (MPI_Abort): <reason>" to stderr and calls MPI_Abort(MPI_COMM_WORLD,
// exit_code). Call it from the catch path of an MPI program, so that the
// other ranks, which may be waiting in a collective for this one, end too
// instead of waiting for comm::Mpi's timeout (or forever, in code that does
// not go through comm::Mpi):
//
//   } catch (const std::exception& e) {
//     zero::comm::abort_mpi_job(e.what());   // does not return in an MPI run
//     std::fprintf(stderr, "error: %s\n", e.what());
//     return 1;
//   }
//
// Returns without doing anything when MPI is not running (never initialised,
// or already finalised), so one catch path serves runs with and without MPI.
inline void abort_mpi_job(std::string_view reason, int exit_code = 1) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  if (initialized) MPI_Finalized(&finalized);
  if (!initialized || finalized) return;
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::fprintf(stderr, "comm::Mpi: rank %d of %d ends the job (MPI_Abort): %.*s\n", rank, size,
               static_cast<int>(reason.size()), reason.data());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::_Exit(exit_code);  // MPI_Abort does not return; this is for an implementation whose does
}

// comm::Mpi::Options (declared outside the class so that it can be a default
// argument of the constructor).
struct MpiOptions {
  // A collective not complete this long after this rank started it is taken
  // as hung (a peer failed, stopped, or made a different sequence of calls):
  // the job is ended with MPI_Abort after printing which collective on which
  // rank. The default is comm::LocalGroup's.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
};

class Mpi {
 public:
  using Options = MpiOptions;

  // Uses (does not own) `comm`; MPI must be initialised (see MpiRuntime).
  // The timeout: zero::comm::Mpi comm(MPI_COMM_WORLD, {.timeout = std::chrono::seconds(30)});
  explicit Mpi(MPI_Comm comm = MPI_COMM_WORLD, Options options = {}) : options_(options) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    require(initialized != 0, "comm::Mpi: MPI is not initialised; create a zero::comm::MpiRuntime (or call MPI_Init) "
            "first");
    require(options.timeout.count() > 0, "comm::Mpi::Options::timeout is ", options.timeout.count(),
            " ms; it must be positive (5 minutes is the default)");
    check(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    check(MPI_Type_contiguous(2, MPI_BYTE, &half_type_), "MPI_Type_contiguous");
    check(MPI_Type_commit(&half_type_), "MPI_Type_commit");
    check(MPI_Op_create(&sum_fp16, 1, &fp16_sum_), "MPI_Op_create");
    check(MPI_Op_create(&sum_bf16, 1, &bf16_sum_), "MPI_Op_create");
    check(MPI_Op_create(&max_fp16, 1, &fp16_max_), "MPI_Op_create");
    check(MPI_Op_create(&max_bf16, 1, &bf16_max_), "MPI_Op_create");
  }
  Mpi(const Mpi&) = delete;
  Mpi& operator=(const Mpi&) = delete;
  ~Mpi() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    MPI_Op_free(&fp16_sum_);
    MPI_Op_free(&bf16_sum_);
    MPI_Op_free(&fp16_max_);
    MPI_Op_free(&bf16_max_);
    MPI_Type_free(&half_type_);
    MPI_Comm_free(&comm_);
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  MPI_Comm native() const { return comm_; }
  const Options& options() const { return options_; }
  const ByteCounters& counters() const { return counters_; }
  void reset_counters() { counters_ = {}; }

  void barrier() {
    Call call = start("barrier", 0, DType::f32);
    complete(call, MPI_Ibarrier(comm_, &call.request), "MPI_Ibarrier");
  }

  void all_reduce(void* buf, std::size_t count, DType t, ReduceOp op = ReduceOp::sum, bool control = false) {
    Call call = start("all_reduce", count, t);
    complete(call, MPI_Iallreduce(MPI_IN_PLACE, buf, to_int(count), type(t), mpi_op(t, op), comm_, &call.request),
             "MPI_Iallreduce");
    counters_.count_all_reduce(count * dtype_bytes(t), size_, control);
  }

  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType t) {
    const std::size_t bytes = dtype_bytes(t);
    const char* own_block = static_cast<const char*>(send) + static_cast<std::size_t>(rank_) * recv_count * bytes;
    // In place, MPI leaves the result at the start of the buffer.
    const bool in_place = recv == own_block;
    void* result = in_place ? const_cast<void*>(send) : recv;
    Call call = start("reduce_scatter", recv_count, t);
    complete(call,
             MPI_Ireduce_scatter_block(in_place ? MPI_IN_PLACE : send, result, to_int(recv_count), type(t),
                                       mpi_op(t, ReduceOp::sum), comm_, &call.request),
             "MPI_Ireduce_scatter_block");
    if (in_place && rank_ != 0) std::memmove(recv, result, recv_count * bytes);
    counters_.count_reduce_scatter(recv_count * static_cast<std::size_t>(size_) * bytes, size_);
  }

  void all_gather(const void* send, void* recv, std::size_t send_count, DType t, bool control = false) {
    const std::size_t bytes = dtype_bytes(t);
    const char* own_block = static_cast<const char*>(recv) + static_cast<std::size_t>(rank_) * send_count * bytes;
    const void* src = send == own_block ? MPI_IN_PLACE : send;
    Call call = start("all_gather", send_count, t);
    complete(call,
             MPI_Iallgather(src, to_int(send_count), type(t), recv, to_int(send_count), type(t), comm_, &call.request),
             "MPI_Iallgather");
    counters_.count_all_gather(send_count * static_cast<std::size_t>(size_) * bytes, size_, control);
  }

  void broadcast(void* buf, std::size_t count, DType t, int root) {
    require(root >= 0 && root < size_, "broadcast root ", root, " is not a rank of this communicator of ", size_);
    Call call = start("broadcast", count, t);
    complete(call, MPI_Ibcast(buf, to_int(count), type(t), root, comm_, &call.request), "MPI_Ibcast");
    counters_.count_broadcast(count * dtype_bytes(t), size_);
  }

 private:
  static int to_int(std::size_t n) {
    require(n <= static_cast<std::size_t>(INT32_MAX), "comm::Mpi: a collective of ", n,
            " elements exceeds MPI's int count; use smaller units (layers) or Options::bucket_bytes");
    return static_cast<int>(n);
  }

  using clock = std::chrono::steady_clock;

  // One collective in flight: what it is (for messages), when it started,
  // and its request.
  struct Call {
    const char* kind;
    std::size_t count;
    DType dtype;
    std::uint64_t number;
    clock::time_point started;
    MPI_Request request = MPI_REQUEST_NULL;

    std::string describe() const { return describe_collective(kind, number, count, dtype); }
  };

  Call start(const char* kind, std::size_t count, DType t) { return Call{kind, count, t, ++calls_, clock::now()}; }

  // Waits for the call that an MPI_I* function (which returned `issued`)
  // started. MPI_Test also drives MPI's progress: a large collective moves
  // one fragment per call, so sleeping between polls while it streams would
  // cap it at a fragment per sleep (tens of MB/s). The polls therefore only
  // yield between them for as long as the data could take to move at a
  // modest 0.1 GB/s (at least 50 us: ranks that arrive together finish a
  // small collective within microseconds); a longer wait means a peer is
  // still computing, and the rank sleeps between polls (a 16th of the time
  // waited, at most 1 ms) so as not to take a core from it. Past the timeout
  // the job ends (time_out).
  void complete(Call& call, int issued, const char* function) {
    check(issued, function, &call);
    const auto streaming = std::chrono::microseconds(50) +
                           std::chrono::nanoseconds(10 * call.count * dtype_bytes(call.dtype));
    for (;;) {
      int done = 0;
      check(MPI_Test(&call.request, &done, MPI_STATUS_IGNORE), "MPI_Test", &call);
      if (done) return;
      const auto waited = clock::now() - call.started;
      if (waited >= options_.timeout) time_out(call, waited);
      if (waited < streaming)
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::min<clock::duration>(waited / 16, std::chrono::milliseconds(1)));
    }
  }

  // MPI cannot cancel a collective, and a rank that returned from this one
  // would wait in the next: as NCCL's watchdog in PyTorch, say what hung and
  // end the job.
  [[noreturn]] void time_out(const Call& call, clock::duration waited) const {
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(waited).count();
    std::fprintf(stderr,
                 "comm::Mpi rank %d of %d: %s did not complete within %lld ms (waited %lld ms). A peer rank has "
                 "probably failed, stopped, or made a different sequence of collective calls: check the other ranks' "
                 "output; if it legitimately takes longer, raise comm::Mpi::Options::timeout. Ending the job with "
                 "MPI_Abort.\n",
                 rank_, size_, call.describe().c_str(), static_cast<long long>(options_.timeout.count()),
                 static_cast<long long>(ms));
    std::fflush(stderr);
    MPI_Abort(comm_, 1);
    std::_Exit(1);  // MPI_Abort does not return; this is for an implementation whose does
  }

  void check(int code, const char* function, const Call* call = nullptr) const {
    if (code == MPI_SUCCESS) return;
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(code, text, &len);
    throw CommError(zero::detail::concat("comm::Mpi rank ", rank_, ": ", function,
                                         call != nullptr ? " for " + call->describe() : std::string(), " failed: ",
                                         std::string(text, len)));
  }

  MPI_Datatype type(DType t) const {
    switch (t) {
      case DType::f32: return MPI_FLOAT;
      case DType::f64: return MPI_DOUBLE;
      case DType::u64: return MPI_UINT64_T;
      case DType::f16:
      case DType::bf16: return half_type_;
    }
    return MPI_BYTE;
  }
  MPI_Op mpi_op(DType t, ReduceOp op) const {
    if (t == DType::f16) return op == ReduceOp::sum ? fp16_sum_ : fp16_max_;
    if (t == DType::bf16) return op == ReduceOp::sum ? bf16_sum_ : bf16_max_;
    return op == ReduceOp::sum ? MPI_SUM : MPI_MAX;
  }

  template <class T, ReduceOp Op>
  static void reduce16(void* in, void* inout, int* len, MPI_Datatype*) {
    const void* inputs[2] = {inout, in};
    detail::reduce_typed<T>(inout, inputs, 2, 0, static_cast<std::size_t>(*len), Op);
  }
  static void sum_fp16(void* in, void* inout, int* len, MPI_Datatype* t) { reduce16<fp16, ReduceOp::sum>(in, inout, len, t); }
  static void sum_bf16(void* in, void* inout, int* len, MPI_Datatype* t) { reduce16<bf16, ReduceOp::sum>(in, inout, len, t); }
  static void max_fp16(void* in, void* inout, int* len, MPI_Datatype* t) { reduce16<fp16, ReduceOp::max>(in, inout, len, t); }
  static void max_bf16(void* in, void* inout, int* len, MPI_Datatype* t) { reduce16<bf16, ReduceOp::max>(in, inout, len, t); }

  Options options_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  std::uint64_t calls_ = 0;  // collectives started, numbering them in messages
  MPI_Datatype half_type_ = MPI_DATATYPE_NULL;
  MPI_Op fp16_sum_ = MPI_OP_NULL, bf16_sum_ = MPI_OP_NULL, fp16_max_ = MPI_OP_NULL, bf16_max_ = MPI_OP_NULL;
  ByteCounters counters_;
};

}  // namespace zero::comm
