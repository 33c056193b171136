// Why: real multi-process runs on CPUs (mpirun -np 4), with the same engine
// and the same byte accounting as NCCL. MPI has no bf16/fp16 sum, so 16-bit
// buffers travel as 2-byte elements with a user-defined reduction that sums
// in fp32 (zero/comm/reduce.hpp). Errors come back as zero::CommError with
// MPI's own message, never as an abort without explanation.
#pragma once

#include "zero/config.hpp"

#include "zero/comm/mpi_c_api.hpp"

#include <cstring>
#include <string>

#include "zero/comm/communicator.hpp"
#include "zero/comm/reduce.hpp"
#include "zero/error.hpp"

namespace zero::comm {

// Initialises MPI for the process lifetime of this object (if the program
// has not already), and finalises it at destruction if it initialised it.
class MpiRuntime {
 public:
  MpiRuntime(int* argc, char*** argv) {
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
    if (owns_ && !finalized) MPI_Finalize();
  }

 private:
  bool owns_ = false;
};

class Mpi {
 public:
  // Uses (does not own) `comm`; MPI must be initialised (see MpiRuntime).
  explicit Mpi(MPI_Comm comm = MPI_COMM_WORLD) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    require(initialized != 0, "comm::Mpi: MPI is not initialised; create a zero::comm::MpiRuntime (or call MPI_Init) "
            "first");
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
  const ByteCounters& counters() const { return counters_; }
  void reset_counters() { counters_ = {}; }

  void barrier() { check(MPI_Barrier(comm_), "MPI_Barrier"); }

  void all_reduce(void* buf, std::size_t count, DType t, ReduceOp op = ReduceOp::sum, bool control = false) {
    check(MPI_Allreduce(MPI_IN_PLACE, buf, to_int(count), type(t), mpi_op(t, op), comm_), "MPI_Allreduce");
    counters_.count_all_reduce(count * dtype_bytes(t), size_, control);
  }

  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType t) {
    const std::size_t bytes = dtype_bytes(t);
    const char* own_block = static_cast<const char*>(send) + static_cast<std::size_t>(rank_) * recv_count * bytes;
    if (recv == own_block) {
      // In place: MPI leaves the result at the start of the buffer.
      void* full = const_cast<void*>(send);
      check(MPI_Reduce_scatter_block(MPI_IN_PLACE, full, to_int(recv_count), type(t), mpi_op(t, ReduceOp::sum), comm_),
            "MPI_Reduce_scatter_block");
      if (rank_ != 0) std::memmove(recv, full, recv_count * bytes);
    } else {
      check(MPI_Reduce_scatter_block(send, recv, to_int(recv_count), type(t), mpi_op(t, ReduceOp::sum), comm_),
            "MPI_Reduce_scatter_block");
    }
    counters_.count_reduce_scatter(recv_count * static_cast<std::size_t>(size_) * bytes, size_);
  }

  void all_gather(const void* send, void* recv, std::size_t send_count, DType t, bool control = false) {
    const std::size_t bytes = dtype_bytes(t);
    const char* own_block = static_cast<const char*>(recv) + static_cast<std::size_t>(rank_) * send_count * bytes;
    const void* src = send == own_block ? MPI_IN_PLACE : send;
    check(MPI_Allgather(src, to_int(send_count), type(t), recv, to_int(send_count), type(t), comm_), "MPI_Allgather");
    counters_.count_all_gather(send_count * static_cast<std::size_t>(size_) * bytes, size_, control);
  }

  void broadcast(void* buf, std::size_t count, DType t, int root) {
    require(root >= 0 && root < size_, "broadcast root ", root, " is not a rank of this communicator of ", size_);
    check(MPI_Bcast(buf, to_int(count), type(t), root, comm_), "MPI_Bcast");
    counters_.count_broadcast(count * dtype_bytes(t), size_);
  }

 private:
  static int to_int(std::size_t n) {
    require(n <= static_cast<std::size_t>(INT32_MAX), "comm::Mpi: a collective of ", n,
            " elements exceeds MPI's int count; use smaller units (layers) or Options::bucket_bytes");
    return static_cast<int>(n);
  }

  void check(int code, const char* call) const {
    if (code == MPI_SUCCESS) return;
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(code, text, &len);
    throw CommError(zero::detail::concat("comm::Mpi rank ", rank_, ": ", call, " failed: ", std::string(text, len)));
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

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  MPI_Datatype half_type_ = MPI_DATATYPE_NULL;
  MPI_Op fp16_sum_ = MPI_OP_NULL, bf16_sum_ = MPI_OP_NULL, fp16_max_ = MPI_OP_NULL, bf16_max_ = MPI_OP_NULL;
  ByteCounters counters_;
};

}  // namespace zero::comm
