// Why: real multi-process runs on CPUs (mpirun -np 4), with the same engine
// and the same byte accounting as NCCL. MPI has no bf16/fp16 sum, so 16-bit
// buffers travel as 2-byte elements with a user-defined reduction that sums
// in fp32 (zero/comm/reduce.hpp). Errors come back as zero::CommError with
// MPI's own message, never as an abort without explanation.
//
// The all-gather, reduce-scatter and all-reduce are rings in rank order,
// each step an MPI_Isend to the next rank and an MPI_Irecv from the previous
// one (a reduce-scatter adds each block as it passes, MPI_Reduce_local):
// what comm_report() counts (comm/topology.hpp: a ring crosses nodes once
// per node) is then what crosses, to the byte. Open MPI's non-blocking
// collectives (libnbc) gather and scatter linearly or through a root, so on
// two namespaces joined by a rate-limited veth (bench/netns_link.sh) the
// link carried other bytes than the report said. Broadcast, all-to-all and
// barrier stay MPI's (a direct exchange is what all_to_all counts).
//
// Ranks that make different calls, or the same calls for different
// purposes (comm::Purpose: another unit or bucket of the optimizer), all get
// a CommError naming each rank's call before any data moves: every
// collective starts with a 16-byte all-reduce of a fingerprint of the call
// (check_same_call).
//
// A rank that fails or stops calling must not leave the others
// waiting forever in a collective, and MPI cannot cancel one. So every
// collective is non-blocking (MPI_Isend/MPI_Irecv ring steps, MPI_Ibcast,
// MPI_Ialltoall, MPI_Ibarrier), awaited by
// polling MPI_Test with a back-off that leaves the cores to ranks still
// computing; one not complete after Options::timeout ends the job as
// PyTorch's NCCL watchdog does: the collective (kind, call number, element
// count and type), the library call it was made in (comm::ApiCall), the rank
// and the time waited go to stderr, then MPI_Abort. The timeout is for a
// rank that hangs; the common cases end the job at once:
//   - a rank that fails with an exception ends the job itself, from its catch
//     path, with abort_mpi_job(); one whose catch path forgets to is ended at
//     exit by MpiRuntime's atexit handler (MpiRuntime does not finalise MPI
//     while an exception unwinds past it: MPI_Finalize waits for every rank);
//   - a rank that returns from main while others still wait in a collective
//     (a skipped micro-batch or step) tells them so as it leaves (MpiRuntime's
//     destructor): a rank that waits on a communicator of every rank and finds
//     such a notice ends the job naming the rank that left.
// No rank enters MPI_Finalize before every rank is leaving (MpiRuntime meets
// them in a polled barrier first): Open MPI 4.1's mpirun, aborting a job while
// a rank waits inside MPI_Finalize, often hangs with its children unreaped or
// crashes in PMIx_server_finalize (seen with 3 ranks, one in MPI_Finalize and
// one or two calling MPI_Abort); a rank polling in MPI_Test is killed cleanly.
#pragma once

#include "zero/compiler.hpp"

#include "zero/comm/mpi_c_api.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "zero/comm/communicator.hpp"
#include "zero/comm/reduce.hpp"
#include "zero/error.hpp"

namespace zero::comm {

inline void abort_mpi_job(std::string_view reason, int exit_code = 1);

namespace detail {
// The duplicate of MPI_COMM_WORLD on which ranks tell each other that they
// leave (MpiRuntime), or MPI_COMM_NULL where no MpiRuntime runs.
inline MPI_Comm leave_comm = MPI_COMM_NULL;
inline constexpr int leave_tag = 0x2e0;
// Set when an exception unwound past an MpiRuntime: if the program then exits
// with MPI still up (its catch path did not call abort_mpi_job), the atexit
// handler ends the job instead of leaving the others waiting for this rank.
inline std::atomic<bool> unwound_past_runtime{false};
inline void abort_if_unwound_at_exit() {
  if (unwound_past_runtime.load())
    abort_mpi_job("this rank exits after an exception unwound past zero::comm::MpiRuntime, and its catch path did not "
                  "end the job; call zero::comm::abort_mpi_job(e.what()) there to see the exception here");
}
}  // namespace detail

// Initialises MPI for the process lifetime of this object (if the program
// has not already), and finalises it at destruction if it initialised it.
// At destruction the rank leaves: it tells every other rank (a zero-byte
// message each, which comm::Mpi looks for while it waits: a rank still
// waiting in a collective then ends the job at once, naming this one), and
// waits, polling, until every rank leaves before MPI_Finalize (see the top of
// this file for why not in MPI_Finalize). Not while an exception unwinds past
// it: the others may be waiting in a collective for this one, and MPI stays up
// for the catch path's abort_mpi_job(); a program that exits without calling
// it has the job ended by an atexit handler. Collective: every rank of
// MPI_COMM_WORLD constructs one (it duplicates MPI_COMM_WORLD for the notices).
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
    if (detail::leave_comm == MPI_COMM_NULL && MPI_Comm_dup(MPI_COMM_WORLD, &leave_comm_) == MPI_SUCCESS)
      detail::leave_comm = leave_comm_;
    static const bool registered = std::atexit(detail::abort_if_unwound_at_exit) == 0;
    (void)registered;
  }
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;
  ~MpiRuntime() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    if (std::uncaught_exceptions() > unwinding_at_start_) {
      detail::unwound_past_runtime = true;
      return;
    }
    leave();
    if (owns_) MPI_Finalize();
  }

 private:
  // Tells every other rank that this one leaves, then waits until all have.
  // N(N-1) zero-byte messages once per job: nothing next to a training run.
  void leave() {
    if (leave_comm_ == MPI_COMM_NULL) return;
    int rank = 0, size = 1;
    MPI_Comm_rank(leave_comm_, &rank);
    MPI_Comm_size(leave_comm_, &size);
    std::vector<MPI_Request> sends;
    for (int r = 0; r < size; ++r) {
      if (r == rank) continue;
      sends.emplace_back();
      MPI_Isend(nullptr, 0, MPI_BYTE, r, detail::leave_tag, leave_comm_, &sends.back());
    }
    MPI_Request all_left = MPI_REQUEST_NULL;
    MPI_Ibarrier(leave_comm_, &all_left);
    for (int done = 0; !done;) {
      MPI_Test(&all_left, &done, MPI_STATUS_IGNORE);
      if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    // Every rank sent its notices before it entered the barrier.
    for (int r = 0; r < size; ++r)
      if (r != rank) MPI_Recv(nullptr, 0, MPI_BYTE, r, detail::leave_tag, leave_comm_, MPI_STATUS_IGNORE);
    MPI_Waitall(static_cast<int>(sends.size()), sends.data(), MPI_STATUSES_IGNORE);
    detail::leave_comm = MPI_COMM_NULL;
    MPI_Comm_free(&leave_comm_);
  }

  bool owns_ = false;
  int unwinding_at_start_;  // exceptions in flight when constructed (inside a destructor run by unwinding)
  MPI_Comm leave_comm_ = MPI_COMM_NULL;
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
inline void abort_mpi_job(std::string_view reason, int exit_code) {
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
  // Ranks per node, ranks filling nodes in order (comm/topology.hpp). 0:
  // Open MPI's own count (OMPI_COMM_WORLD_LOCAL_SIZE) on a communicator of
  // every rank placed by slot (mpirun's default), else one node of every
  // rank. What the byte counters count as crossing nodes, and what node()
  // and across() split the communicator into.
  int ranks_per_node = 0;
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
    // A notice from a rank that left (MpiRuntime) means a collective of
    // every rank cannot complete; on a smaller communicator it may not be in it.
    int same = MPI_UNEQUAL;
    MPI_Comm_compare(comm, MPI_COMM_WORLD, &same);
    every_rank_ = same == MPI_IDENT || same == MPI_CONGRUENT;
    check(MPI_Type_contiguous(2, MPI_BYTE, &half_type_), "MPI_Type_contiguous");
    check(MPI_Type_commit(&half_type_), "MPI_Type_commit");
    check(MPI_Op_create(&sum_fp16, 1, &fp16_sum_), "MPI_Op_create");
    check(MPI_Op_create(&sum_bf16, 1, &bf16_sum_), "MPI_Op_create");
    check(MPI_Op_create(&max_fp16, 1, &fp16_max_), "MPI_Op_create");
    check(MPI_Op_create(&max_bf16, 1, &bf16_max_), "MPI_Op_create");
    const int per_node = options.ranks_per_node != 0 ? options.ranks_per_node : launcher_ranks_per_node();
    topology_ = Topology::checked(size_, per_node, "comm::Mpi::Options::ranks_per_node");
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
  const Topology& topology() const { return topology_; }
  MPI_Comm native() const { return comm_; }
  const Options& options() const { return options_; }
  const ByteCounters& counters() const { return counters_; }
  void reset_counters() { counters_ = {}; }

  // The ranks of this rank's node (its rank there: topology().local_rank),
  // and the ranks at its place on every node (its rank there: its node):
  // MPI_Comm_split on the first call, which every rank makes.
  Mpi& node() { return split(node_, topology_.node_of(rank_), topology_.local_rank(rank_), 0); }
  Mpi& across() { return split(across_, topology_.local_rank(rank_), topology_.node_of(rank_), 1); }

  void barrier() {
    Call call = start("barrier", 0, DType::f32);
    complete(call, MPI_Ibarrier(comm_, &call.request), "MPI_Ibarrier");
  }

  void all_reduce(void* buf, std::size_t count, DType t, ReduceOp op = ReduceOp::sum, bool control = false) {
    require(t != DType::u8, "comm::Mpi: ", detail::reduce_bytes_refused);
    Call call = start("all_reduce", count, t, static_cast<int>(op));
    (void)to_int(count);  // (refuses a count beyond MPI's int)
    // A reduce-scatter of nearly equal blocks, then an all-gather of them.
    const std::size_t n = static_cast<std::size_t>(size_), base = count / n, extra = count % n;
    auto first = [&](int k) { return static_cast<std::size_t>(k) * base + std::min<std::size_t>(k, extra); };
    char* b = static_cast<char*>(buf);
    const std::size_t bytes = dtype_bytes(t);
    ring_reduce_scatter(call, b, b + first(rank_) * bytes, first, t, mpi_op(t, op));
    ring_all_gather(call, b, first, t);
    counters_.count_all_reduce(count * bytes, size_, control, crosses());
  }

  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType t) {
    require(t != DType::u8, "comm::Mpi: ", detail::reduce_bytes_refused);
    const std::size_t bytes = dtype_bytes(t);
    Call call = start("reduce_scatter", recv_count, t);
    (void)to_int(recv_count);  // (refuses a count beyond MPI's int)
    // (In place, recv is send's block of this rank: read for the last time
    // before the result is written.)
    ring_reduce_scatter(call, static_cast<const char*>(send), static_cast<char*>(recv),
                        [recv_count](int k) { return static_cast<std::size_t>(k) * recv_count; }, t,
                        mpi_op(t, ReduceOp::sum));
    counters_.count_reduce_scatter(recv_count * static_cast<std::size_t>(size_) * bytes, size_, crosses());
  }

  void all_gather(const void* send, void* recv, std::size_t send_count, DType t, bool control = false) {
    const std::size_t bytes = dtype_bytes(t);
    char* all = static_cast<char*>(recv);
    char* own_block = all + static_cast<std::size_t>(rank_) * send_count * bytes;
    Call call = start("all_gather", send_count, t);
    (void)to_int(send_count);  // (refuses a count beyond MPI's int)
    if (send != own_block) std::memcpy(own_block, send, send_count * bytes);
    ring_all_gather(call, all, [send_count](int k) { return static_cast<std::size_t>(k) * send_count; }, t);
    counters_.count_all_gather(send_count * static_cast<std::size_t>(size_) * bytes, size_, control, crosses());
  }

  void broadcast(void* buf, std::size_t count, DType t, int root) {
    require(root >= 0 && root < size_, "broadcast root ", root, " is not a rank of this communicator of ", size_);
    Call call = start("broadcast", count, t, root);
    complete(call, MPI_Ibcast(buf, to_int(count), type(t), root, comm_, &call.request), "MPI_Ibcast");
    counters_.count_broadcast(count * dtype_bytes(t), size_, crosses());
  }

  // Block j of send to rank j, block i of recv from rank i. Any DType: the
  // bytes are moved (16-bit types as 2-byte elements, u8 as MPI_UINT8_T).
  void all_to_all(const void* send, void* recv, std::size_t count, DType t) {
    const std::size_t bytes = dtype_bytes(t);
    detail::require_apart("comm::Mpi", send, recv, count * static_cast<std::size_t>(size_) * bytes);
    Call call = start("all_to_all", count, t);
    complete(call,
             MPI_Ialltoall(send, to_int(count), type(t), recv, to_int(count), type(t), comm_, &call.request),
             "MPI_Ialltoall");
    counters_.count_all_to_all(count * bytes, topology_, rank_);
  }

 private:
  bool crosses() const { return topology_.ring_send_crosses(rank_); }

  // Open MPI's ranks per node when this communicator holds every rank and
  // every rank's node holds ranks_per_node consecutive ranks (mpirun's
  // placement by slot); 0 (one node) otherwise. Every rank agrees: one
  // MPI_Allreduce at construction.
  int launcher_ranks_per_node() const {
    const char* size_env = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    const char* rank_env = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
    int local_size = 0;
    if (every_rank_ && size_env != nullptr && rank_env != nullptr) {
      local_size = std::atoi(size_env);
      const int local_rank = std::atoi(rank_env);
      if (local_size < 1 || size_ % local_size != 0 || rank_ % local_size != local_rank) local_size = 0;
    }
    // Every rank the same count, or none.
    int range[2] = {local_size, -local_size};
    check(MPI_Allreduce(MPI_IN_PLACE, range, 2, MPI_INT, MPI_MIN, comm_), "MPI_Allreduce");
    return range[0] == -range[1] ? local_size : 0;
  }

  // node() (across = 0) or across() (1): the ranks of one colour, ordered by key.
  Mpi& split(std::unique_ptr<Mpi>& made, int color, int key, int across) {
    if (made) return *made;
    MPI_Comm part = MPI_COMM_NULL;
    check(MPI_Comm_split(comm_, color, key, &part), "MPI_Comm_split");
    Options o = options_;
    o.ranks_per_node = across ? 1 : topology_.ranks_per_node;  // across: each rank on a node of its own
    try {
      made = std::make_unique<Mpi>(part, o);
    } catch (...) {
      MPI_Comm_free(&part);
      throw;
    }
    MPI_Comm_free(&part);  // the Mpi holds a duplicate
    return *made;
  }

  static int to_int(std::size_t n) {
    require(n <= static_cast<std::size_t>(INT32_MAX), "comm::Mpi: a collective of ", n,
            " elements exceeds MPI's int count; use smaller units (layers) or Options::bucket_bytes");
    return static_cast<int>(n);
  }

  using clock = std::chrono::steady_clock;

  // One collective in flight: what it is (for messages), what the optimizer
  // made it for (comm::Purpose), when it started, and its request.
  struct Call {
    const char* kind;
    std::size_t count;
    DType dtype;
    std::uint64_t number;
    clock::time_point started;
    const char* api;          // the library call it is made in (ApiCall), or nullptr
    const Purpose* purpose;  // what for, or nullptr (a caller's own collective)
    MPI_Request request = MPI_REQUEST_NULL;

    std::string describe() const { return describe_collective(kind, number, count, dtype) + ApiCall::where(api); }
    // With its purpose, for the message of ranks that disagree.
    std::string describe_with_purpose() const {
      return Purpose::describe_call(purpose, describe_collective(kind, number, count, dtype)) + ApiCall::where(api);
    }
  };

  // `detail`: what else must agree (all_reduce's operation, broadcast's root).
  Call start(const char* kind, std::size_t count, DType t, int detail = 0) {
    Call call{kind, count, t, ++calls_, clock::now(), ApiCall::current(), Purpose::current()};
    if (size_ > 1) check_same_call(call, detail);
    return call;
  }

  // Before any data moves: every rank's fingerprint of its call and purpose
  // in one all-reduce of 16 bytes (the minimum of h and of ~h: equal to h and
  // ~h on every rank exactly when every rank's h is the same, so every rank
  // learns the answer at once). Ranks that differ exchange their calls'
  // descriptions and all throw the same CommError, instead of pairing ring
  // steps of different units or sizes (mixed values, a truncation, or a
  // wait until the timeout). Not counted in counters(): a check, as Nccl's
  // barrier is. Every collective of this communicator starts with it, so
  // ranks whose collectives differ in kind still meet here.
  void check_same_call(Call& call, int detail) {
    const std::uint64_t h =
        detail::call_code(call.kind, call.count, call.dtype, static_cast<std::uint64_t>(detail), call.purpose);
    std::uint64_t least[2] = {h, ~h};
    complete(call, MPI_Iallreduce(MPI_IN_PLACE, least, 2, MPI_UINT64_T, MPI_MIN, comm_, &call.request),
             "MPI_Iallreduce (the check that every rank makes the same call)", sizeof least);
    if (least[0] == h && least[1] == ~h) return;
    // Every rank is here (each saw a minimum other than its own h or ~h).
    constexpr std::size_t width = 400;
    std::string mine = call.describe_with_purpose();
    mine.resize(width, '\0');
    std::vector<char> all(width * static_cast<std::size_t>(size_));
    complete(call, MPI_Iallgather(mine.data(), static_cast<int>(width), MPI_CHAR, all.data(), static_cast<int>(width),
                                  MPI_CHAR, comm_, &call.request),
             "MPI_Iallgather (the calls of ranks that differ)", all.size());
    auto text = [&](int r) {
      const char* at = all.data() + static_cast<std::size_t>(r) * width;
      return std::string(at, strnlen(at, width));
    };
    // The ranks whose call reads differently from rank 0's; every other rank
    // when only what the descriptions leave out differs (all_reduce's
    // operation, broadcast's root).
    std::vector<int> shown;
    for (int r = 1; r < size_; ++r)
      if (text(r) != text(0)) shown.push_back(r);
    if (shown.empty())
      for (int r = 1; r < size_; ++r) shown.push_back(r);
    std::string differ;
    for (int r : shown) differ += zero::detail::concat(differ.empty() ? "" : ", ", "rank ", r, " ", text(r));
    throw CommError(zero::detail::concat(
        "comm::Mpi: ", differ, " while rank 0 ", text(0), " (seen by rank ", rank_, "); every rank must make the "
        "same collective calls (kind, element count, type, operation or root), for the same units and buckets, in "
        "the same order (ranks that acquire units in different orders, or one more than the others, pair the wrong "
        "exchanges)"));
  }

  // Waits for the call that an MPI_I* function (which returned `issued`)
  // started, moving `bytes` (the call's own elements, or the check's).
  void complete(Call& call, int issued, const char* function) {
    complete(call, issued, function, call.count * dtype_bytes(call.dtype));
  }
  void complete(Call& call, int issued, const char* function, std::size_t bytes) {
    check(issued, function, &call);
    await(call, call.started, bytes, [&] {
      int done = 0;
      check(MPI_Test(&call.request, &done, MPI_STATUS_IGNORE), "MPI_Test", &call);
      return done != 0;
    });
  }

  // Polls done() until it says so. MPI_Test also drives MPI's progress: a
  // large transfer moves one fragment per call, so sleeping between polls
  // while it streams would cap it at a fragment per sleep (tens of MB/s).
  // The polls therefore only yield between them for as long as `bytes`
  // could take to move at a modest 0.1 GB/s from `since` (at least 50 us:
  // ranks that arrive together finish a small exchange within
  // microseconds); a longer wait means a peer is still computing, and the
  // rank sleeps between polls (a 16th of the time waited, at most 1 ms) so
  // as not to take a core from it. Past the timeout, counted from the
  // collective's start, the job ends (time_out).
  template <class Done>
  void await(const Call& call, clock::time_point since, std::size_t bytes, Done&& done) {
    const auto streaming = std::chrono::microseconds(50) + std::chrono::nanoseconds(10 * bytes);
    for (;;) {
      if (done()) return;
      const auto now = clock::now();
      const auto waited = now - call.started;
      if (waited >= options_.timeout) time_out(call, waited);
      if (now - since < streaming) {
        std::this_thread::yield();
      } else {
        watch_for_leaves(call);
        std::this_thread::sleep_for(std::min<clock::duration>((now - since) / 16, std::chrono::milliseconds(1)));
      }
    }
  }

  // One step of a ring: `send_count` elements at `send` to the next rank,
  // `recv_count` into `recv` from the previous one. The tag is the call's
  // number, so that no step pairs with another collective's (ranks whose
  // collectives differ are stopped before, by check_same_call).
  void ring_step(Call& call, const char* send, std::size_t send_count, char* recv, std::size_t recv_count, DType t) {
    const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
    const int tag = static_cast<int>(call.number % 32000);
    MPI_Request requests[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    check(MPI_Irecv(recv, static_cast<int>(recv_count), type(t), prev, tag, comm_, &requests[1]), "MPI_Irecv", &call);
    check(MPI_Isend(send, static_cast<int>(send_count), type(t), next, tag, comm_, &requests[0]), "MPI_Isend", &call);
    await(call, clock::now(), std::max(send_count, recv_count) * dtype_bytes(t), [&] {
      int done = 0;
      check(MPI_Testall(2, requests, &done, MPI_STATUSES_IGNORE), "MPI_Testall", &call);
      return done != 0;
    });
  }

  // Blocks k = 0..size-1 of a buffer: block k is elements [first(k), first(k + 1)).
  template <class First>
  static std::size_t block_count(const First& first, int k) {
    return first(k + 1) - first(k);
  }
  int ring_block(int k) const { return ((k % size_) + size_) % size_; }

  // The ring reduce-scatter: in step s each rank sends the partial sum of
  // block r - s - 1 (its own part of it, at s = 0) to the next rank and adds
  // its own part of block r - s - 2 to the partial sum it receives; after
  // size - 1 steps it holds the whole sum of its own block r, written to
  // `out`. `in` is read only (out may be in's block r: it is read for the
  // last time in the last step).
  template <class First>
  void ring_reduce_scatter(Call& call, const char* in, char* out, const First& first, DType t, MPI_Op op) {
    const std::size_t bytes = dtype_bytes(t);
    if (size_ == 1) {
      std::memmove(out, in + first(0) * bytes, block_count(first, 0) * bytes);
      return;
    }
    std::size_t most = 0;
    for (int k = 0; k < size_; ++k) most = std::max(most, block_count(first, k));
    if (scratch_.size() < 2 * most * bytes) scratch_.resize(2 * most * bytes);
    char* sum = scratch_.data();  // the partial sum this rank sends next
    char* incoming = sum + most * bytes;
    const char* sending = in + first(ring_block(rank_ - 1)) * bytes;
    std::size_t sending_count = block_count(first, ring_block(rank_ - 1));
    for (int step = 0; step < size_ - 1; ++step) {
      const int k = ring_block(rank_ - step - 2);
      const std::size_t count = block_count(first, k);
      ring_step(call, sending, sending_count, incoming, count, t);
      check(MPI_Reduce_local(in + first(k) * bytes, incoming, static_cast<int>(count), type(t), op),
            "MPI_Reduce_local", &call);
      std::swap(sum, incoming);
      sending = sum;
      sending_count = count;
    }
    std::memmove(out, sum, block_count(first, rank_) * bytes);
  }

  // The ring all-gather in place: rank r's block is in `all`; in step s each
  // rank sends block r - s to the next rank and receives block r - s - 1.
  template <class First>
  void ring_all_gather(Call& call, char* all, const First& first, DType t) {
    const std::size_t bytes = dtype_bytes(t);
    for (int step = 0; step < size_ - 1; ++step) {
      const int sent = ring_block(rank_ - step), received = ring_block(rank_ - step - 1);
      ring_step(call, all + first(sent) * bytes, block_count(first, sent), all + first(received) * bytes,
                block_count(first, received), t);
    }
  }

  // A rank that left (MpiRuntime's notice) takes part in no collective any
  // more: once its notice is here, a collective of every rank that is still
  // not complete after `leave_grace` (its last collective may have finished
  // on its side a moment before this one's data arrives) never will. Not a
  // broadcast: a receiver may complete and leave before the root has sent to
  // a slower rank, which does not need the one that left.
  void watch_for_leaves(const Call& call) {
    if (!every_rank_ || detail::leave_comm == MPI_COMM_NULL || std::strcmp(call.kind, "broadcast") == 0) return;
    if (left_rank_ < 0) {
      int found = 0;
      MPI_Status status;
      MPI_Iprobe(MPI_ANY_SOURCE, detail::leave_tag, detail::leave_comm, &found, &status);
      if (found) {
        left_rank_ = status.MPI_SOURCE;
        left_seen_ = clock::now();
      }
      return;
    }
    if (clock::now() - left_seen_ < leave_grace) return;
    std::fprintf(stderr,
                 "comm::Mpi rank %d of %d: rank %d left (returned from main: its zero::comm::MpiRuntime was "
                 "destroyed) while this rank waits in %s, which cannot complete without it. Every rank must make "
                 "the same collective calls in the same order (a rank that skips a micro-batch, step() or save(), or "
                 "returns early, leaves the others waiting). Ending the job with MPI_Abort.\n",
                 rank_, size_, left_rank_, call.describe().c_str());
    std::fflush(stderr);
    MPI_Abort(comm_, 1);
    std::_Exit(1);  // MPI_Abort does not return; this is for an implementation whose does
  }
  static constexpr auto leave_grace = std::chrono::seconds(1);

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
      case DType::u8: return MPI_UINT8_T;
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
  bool every_rank_ = false;    // holds every rank of MPI_COMM_WORLD: notices of leaving ranks concern it,
                               // and Open MPI's ranks per node describe it
  int left_rank_ = -1;         // a rank whose notice of leaving arrived, and when
  clock::time_point left_seen_{};
  MPI_Datatype half_type_ = MPI_DATATYPE_NULL;
  MPI_Op fp16_sum_ = MPI_OP_NULL, bf16_sum_ = MPI_OP_NULL, fp16_max_ = MPI_OP_NULL, bf16_max_ = MPI_OP_NULL;
  Topology topology_;
  ByteCounters counters_;
  std::unique_ptr<Mpi> node_, across_;  // node(), across(): communicators of their own (duplicates)
  std::vector<char> scratch_;            // the ring reduce-scatter's two partial sums (grown, kept)
};

}  // namespace zero::comm
