// Why: the engine is written once against this concept and runs unchanged on
// NCCL (GPUs, multi-node), Open MPI (CPU processes) and in-process threads
// (tests, single-node demos). Every implementation counts the bytes it sends
// and receives, per kind of collective, so that the communication report is
// measured, not computed from formulas.
//
// Byte accounting: each collective is counted as a bandwidth-optimal ring
// implementation moves it (what NCCL's "bus bandwidth" measures): for N ranks
// and a full buffer of B bytes, reduce-scatter and all-gather each send and
// receive B(N-1)/N per rank, all-reduce 2B(N-1)/N, broadcast B(N-1)/N
// (pipelined). The same rule for every backend keeps reports comparable.
// all_to_all is the exception, counted as the direct exchange it is (every
// implementation sends each block straight to its rank; a ring would forward
// blocks through the ranks between): for blocks of b bytes each rank sends
// and receives b(N-1), and of that sends b(N - ranks_per_node) across nodes,
// the blocks addressed to ranks on other nodes (not the ring rule of
// comm/topology.hpp).
#pragma once

#include "zero/compiler.hpp"

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "zero/comm/topology.hpp"
#include "zero/error.hpp"
#include "zero/precision/types.hpp"

namespace zero::comm {

// Declared beside DType (zero/precision/types.hpp); its name here too.
using zero::ReduceOp;

namespace detail {
// 64-bit FNV-1a, for the fingerprints that tell calls and purposes apart
// (not a cryptographic hash): bytes of a string, or one 64-bit word.
inline constexpr std::uint64_t fnv_basis = 0xcbf29ce484222325ull;
inline std::uint64_t fnv_add(std::uint64_t h, const char* text) {
  for (const char* c = text; *c != '\0'; ++c) h = (h ^ static_cast<unsigned char>(*c)) * 0x100000001b3ull;
  return h;
}
inline std::uint64_t fnv_add(std::uint64_t h, std::uint64_t word) { return (h ^ word) * 0x100000001b3ull; }

// all_to_all has no in-place form (rank j reads block j of this rank's send
// while this rank writes block j of its recv from rank j's, in no order
// between them): its buffers of `bytes` each must be apart. `who` names the
// communicator.
inline void require_apart(const char* who, const void* send, const void* recv, std::size_t bytes) {
  const auto s = reinterpret_cast<std::uintptr_t>(send), r = reinterpret_cast<std::uintptr_t>(recv);
  require(bytes == 0 || s + bytes <= r || r + bytes <= s, who, ": all_to_all's send and recv buffers overlap (",
          bytes, " bytes each, ", s < r ? "recv starts " : "send starts ", s < r ? r - s : s - r,
          " bytes after the other); all_to_all has no in-place form: pass a recv buffer apart from send");
}

// DType::u8 is for payloads that collectives move (gathers, broadcasts):
// bytes of codes and scales have no sum.
inline constexpr const char* reduce_bytes_refused =
    "a reduction (all_reduce or reduce_scatter) of DType::u8: u8 is for payloads collectives move and never add "
    "(quantized codes and their scales); reduce a numeric type";
}  // namespace detail

// What the engine sends, by purpose: bulk gradient and parameter traffic is
// what the ZeRO paper's formulas describe; control traffic (norms, overflow
// flags, layout hashes) is a few bytes per step, reported on its own line.
enum class Collective : std::uint8_t { all_reduce, reduce_scatter, all_gather, broadcast, all_to_all, control };
inline constexpr std::size_t collective_kinds = 6;

inline const char* collective_name(Collective c) {
  switch (c) {
    case Collective::all_reduce: return "all_reduce";
    case Collective::reduce_scatter: return "reduce_scatter";
    case Collective::all_gather: return "all_gather";
    case Collective::broadcast: return "broadcast";
    case Collective::all_to_all: return "all_to_all";
    case Collective::control: return "control";
  }
  return "?";
}

// How error messages name one collective call: "all_gather #3 (1 element of
// u64 per rank)". `call` numbers the communicator's collectives from 1, so two
// ranks' messages show whether they were at the same call; reduce_scatter,
// all_gather and all_to_all count one rank's block.
inline std::string describe_collective(const char* kind, std::uint64_t call, std::size_t count, DType t) {
  const std::string k = kind;
  if (k == "barrier") return zero::detail::concat("barrier #", call);
  const bool per_rank = k == "reduce_scatter" || k == "all_gather" || k == "all_to_all";
  return zero::detail::concat(k, " #", call, " (", count, count == 1 ? " element of " : " elements of ", dtype_name(t),
                              per_rank ? " per rank" : "", ")");
}

// The library call (ZeroOptimizer::step, save, ...) this thread is in, so
// that a communicator's error can say where each rank was: "all_gather #3
// (...) in save()". A name in a scope: a thread-local pointer set and put
// back, no allocation, nothing per collective. The outermost scope names the
// call, i.e. the one the user made (load_hf() runs set_param(): "in load_hf()").
class ApiCall {
 public:
  explicit ApiCall(const char* name) noexcept : outer_(current_) {
    if (current_ == nullptr) current_ = name;
  }
  ApiCall(const ApiCall&) = delete;
  ApiCall& operator=(const ApiCall&) = delete;
  ~ApiCall() { current_ = outer_; }
  // The call this thread is in, or nullptr outside every library call.
  static const char* current() noexcept { return current_; }
  // " in step()", or "" outside every library call: appended to a collective's description.
  static std::string where(const char* name) {
    return name != nullptr ? zero::detail::concat(" in ", name, "()") : std::string();
  }

 private:
  const char* outer_;
  static inline thread_local const char* current_ = nullptr;
};

// What one of the optimizer's exchanges is for, so that ranks whose calls
// agree in kind and size but not in purpose are caught before any value is
// handed out: two ranks acquiring two equal-sized units in different orders
// make the same all_gathers, and a communicator that pairs calls by size and
// order alone would hand each rank half of one unit and half of the other.
// The engine names each exchange in a comm::PurposeScope around its
// collectives (a thread-local pointer, as ApiCall: nothing allocated);
// comm::Local, comm::LocalDevice and comm::Mpi compare every rank's
// fingerprint of the call and its purpose with each collective and throw the
// same CommError on every rank, naming each rank's exchange, when they
// differ; comm::Nccl compares it on the device right after the collective
// and throws on every rank, each naming its own exchange
// (docs/communicators.md, "What each exchange is for").
//
//   "gathers unit 'a' (exchange #12 of the optimizer)"
struct Purpose {
  const char* verb = "";         // "gathers", "reduce-scatters the gradient of", ...
  const char* subject = nullptr;  // "unit", "bucket", or nullptr when the verb says it all
  std::string_view name;          // the subject's name ("fc1"), or empty for a bucket's number
  std::uint64_t index = 0;        // the unit's or bucket's number
  std::uint64_t sequence = 0;     // the optimizer's count of its exchanges, from 1

  // Equal on every rank for the same exchange at the same point; the name is
  // not hashed (ranks agree on the units' names at finalize(), and the index
  // tells them apart).
  std::uint64_t code() const {
    const std::uint64_t h = detail::fnv_add(detail::fnv_add(detail::fnv_basis, verb), subject != nullptr ? subject : "");
    return detail::fnv_add(detail::fnv_add(h, index), sequence);
  }
  std::string describe() const {
    std::string s = verb;
    if (subject != nullptr) {
      s += zero::detail::concat(" ", subject, " ");
      s += name.empty() ? zero::detail::concat(index) : zero::detail::concat("'", name, "'");
    }
    return s + zero::detail::concat(" (exchange #", sequence, " of the optimizer)");
  }

  // The purpose of this thread's collectives now, or nullptr (a caller's own
  // collective, outside the optimizer).
  static const Purpose* current() noexcept { return current_; }
  // How messages name a rank's collective: "gathers unit 'a' (exchange #3 of
  // the optimizer) with all_gather(4 x f32)", or "called all_gather(4 x f32)"
  // outside the optimizer; `call` is the communicator's own description.
  static std::string describe_call(const Purpose* purpose, const std::string& call) {
    return purpose != nullptr ? purpose->describe() + " with " + call : "called " + call;
  }
  static std::uint64_t code_of(const Purpose* purpose) { return purpose != nullptr ? purpose->code() : 0; }

 private:
  friend class PurposeScope;
  static inline thread_local const Purpose* current_ = nullptr;
};

namespace detail {
// One rank's fingerprint of a collective call: its kind, element count,
// type, what else must agree (all_reduce's operation, broadcast's root) and
// its purpose. comm::Mpi and comm::Nccl compare it across ranks with each
// collective; equal on every rank for the same exchange at the same point.
inline std::uint64_t call_code(const char* kind, std::size_t count, DType t, std::uint64_t detail,
                               const Purpose* purpose) {
  std::uint64_t h = fnv_add(fnv_basis, kind);
  for (std::uint64_t v : {std::uint64_t{count}, std::uint64_t{static_cast<std::uint8_t>(t)}, detail,
                          Purpose::code_of(purpose)})
    h = fnv_add(h, v);
  return h;
}
}  // namespace detail

// The purpose of the collectives this thread makes while it lives (nested
// scopes: the innermost).
class PurposeScope {
 public:
  explicit PurposeScope(const Purpose& purpose) noexcept : purpose_(purpose), outer_(Purpose::current_) {
    Purpose::current_ = &purpose_;
  }
  PurposeScope(const PurposeScope&) = delete;
  PurposeScope& operator=(const PurposeScope&) = delete;
  ~PurposeScope() { Purpose::current_ = outer_; }

 private:
  Purpose purpose_;
  const Purpose* outer_;
};

struct ByteCounters {
  std::array<std::uint64_t, collective_kinds> sent{};
  std::array<std::uint64_t, collective_kinds> received{};
  std::array<std::uint64_t, collective_kinds> calls{};
  // Of `sent`, the bytes that went to a rank on another node
  // (comm/topology.hpp: the counting rule).
  std::array<std::uint64_t, collective_kinds> across{};

  // `crosses`: this rank's sends in this collective leave its node (all of
  // them or none, as in a ring).
  void add(Collective c, std::uint64_t send, std::uint64_t recv, bool crosses = false) {
    add_with_across(c, send, recv, crosses ? send : 0);
  }
  // `across_bytes` of `send` leave the node: for collectives that send parts
  // of their data to other nodes and the rest inside (all_to_all).
  void add_with_across(Collective c, std::uint64_t send, std::uint64_t recv, std::uint64_t across_bytes) {
    sent[static_cast<std::size_t>(c)] += send;
    received[static_cast<std::size_t>(c)] += recv;
    calls[static_cast<std::size_t>(c)] += 1;
    across[static_cast<std::size_t>(c)] += across_bytes;
  }
  std::uint64_t total_sent() const { return sum(sent); }
  std::uint64_t total_received() const { return sum(received); }
  std::uint64_t total_across() const { return sum(across); }
  // Another communicator's counts added to these (a hierarchical
  // collective's node and across communicators, reported as one).
  ByteCounters& operator+=(const ByteCounters& o) {
    for (std::size_t k = 0; k < collective_kinds; ++k) {
      sent[k] += o.sent[k];
      received[k] += o.received[k];
      calls[k] += o.calls[k];
      across[k] += o.across[k];
    }
    return *this;
  }
  // Ring-model volume per rank for a buffer of `bytes` over `ranks` ranks.
  static std::uint64_t ring_share(std::uint64_t bytes, int ranks) {
    return ranks <= 1 ? 0 : bytes * static_cast<std::uint64_t>(ranks - 1) / static_cast<std::uint64_t>(ranks);
  }
  void count_all_reduce(std::uint64_t bytes, int ranks, bool control = false, bool crosses = false) {
    const auto v = 2 * ring_share(bytes, ranks);
    add(control ? Collective::control : Collective::all_reduce, v, v, crosses);
  }
  void count_reduce_scatter(std::uint64_t full_bytes, int ranks, bool crosses = false) {
    const auto v = ring_share(full_bytes, ranks);
    add(Collective::reduce_scatter, v, v, crosses);
  }
  void count_all_gather(std::uint64_t full_bytes, int ranks, bool control = false, bool crosses = false) {
    const auto v = ring_share(full_bytes, ranks);
    add(control ? Collective::control : Collective::all_gather, v, v, crosses);
  }
  void count_broadcast(std::uint64_t bytes, int ranks, bool crosses = false) {
    const auto v = ring_share(bytes, ranks);
    add(Collective::broadcast, v, v, crosses);
  }
  // A direct exchange, not a ring (the top of this file): `rank` sends its
  // block of `block_bytes` to each other rank and receives one from each;
  // the blocks for ranks on other nodes cross. Every node holds
  // ranks_per_node ranks, so that count is the same for every rank.
  void count_all_to_all(std::uint64_t block_bytes, const Topology& topology, int rank) {
    static_cast<void>(rank);
    const auto others = static_cast<std::uint64_t>(topology.ranks - 1);
    const auto off_node = static_cast<std::uint64_t>(topology.ranks - topology.ranks_per_node);
    add_with_across(Collective::all_to_all, block_bytes * others, block_bytes * others, block_bytes * off_node);
  }

 private:
  static std::uint64_t sum(const std::array<std::uint64_t, collective_kinds>& a) {
    std::uint64_t s = 0;
    for (auto v : a) s += v;
    return s;
  }
};

// The contract. Buffers live where the communicator expects them (host memory
// for Local/Mpi, device memory for Nccl and LocalDevice). All
// calls are collective: every rank makes the same calls in the same order.
//   all_reduce(buf, count, dtype, op)          in place
//   reduce_scatter(send, recv, recv_count, dtype)  send holds size()*recv_count
//       elements; rank r receives the sum of block r; recv may be send + r*recv_count
//   all_gather(send, recv, send_count, dtype)  recv holds size()*send_count;
//       send may be recv + rank()*send_count (in place)
//   broadcast(buf, count, dtype, root)
//   barrier()
// Control messages (a few doubles or hashes) go through all_reduce/all_gather
// with `control = true` so they are counted apart from model traffic.
// Optional, for hierarchical collectives (comm/topology.hpp): topology(),
// and node() / across(), the communicators of this rank's node and of the
// ranks at its place on every node (collective calls: every rank makes them,
// the first time, in the same order). Without them a communicator is one node.
// Optional too, and what ZeRO++'s qgZ (Options::qgz) exchanges its quantized
// gradient blocks with (AnyCommunicator says so when it is missing):
//   all_to_all(send, recv, count, dtype)  send holds size()*count elements,
//       block j going to rank j; recv holds size()*count, block i from rank i
//       (a rank's own block is copied). No in-place form: send and recv must
//       not overlap. Any DType, u8 included (it moves, never adds).
// (Not in the concept: communicators written before it, wrappers in tests
// and users' own, satisfy the contract without it.)
template <class C>
concept Communicator = requires(C& c, const C& cc, void* buf, const void* cbuf, std::size_t n, DType t, int root) {
  { cc.rank() } -> std::convertible_to<int>;
  { cc.size() } -> std::convertible_to<int>;
  c.all_reduce(buf, n, t, ReduceOp::sum, false);
  c.reduce_scatter(cbuf, buf, n, t);
  c.all_gather(cbuf, buf, n, t, false);
  c.broadcast(buf, n, t, root);
  c.barrier();
  { cc.counters() } -> std::convertible_to<const ByteCounters&>;
  c.reset_counters();
};

}  // namespace zero::comm
