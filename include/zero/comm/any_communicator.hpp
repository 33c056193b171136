// Why: the optimizer's type names five policies and no communicator, so one
// compiled optimizer can run over NCCL, MPI or in-process ranks. A virtual
// call per collective is nothing next to the collective itself.
#pragma once

#include "zero/compiler.hpp"

#include <memory>

#include "zero/comm/communicator.hpp"
#include "zero/error.hpp"

namespace zero::comm {

class AnyCommunicator {
 public:
  virtual ~AnyCommunicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual void all_reduce(void* buf, std::size_t count, DType t, ReduceOp op, bool control) = 0;
  virtual void reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType t) = 0;
  virtual void all_gather(const void* send, void* recv, std::size_t send_count, DType t, bool control) = 0;
  virtual void broadcast(void* buf, std::size_t count, DType t, int root) = 0;
  // Optional in the contract (comm/communicator.hpp): a communicator without
  // it throws InvalidArgument here, when a feature that needs it (Options::qgz)
  // first exchanges, not when it is wrapped.
  virtual void all_to_all(const void* send, void* recv, std::size_t count, DType t) = 0;
  virtual void barrier() = 0;
  virtual const ByteCounters& counters() const = 0;
  virtual void reset_counters() = 0;
  // Collectives between group_begin() and group_end() may be launched together
  // (NCCL groups); communicators without groups run them one by one.
  virtual void group_begin() {}
  virtual void group_end() {}
  // The device stream the communicator enqueues on (a cudaStream_t), or
  // nullptr for host communicators. A stream other than the backend's lets
  // the engine overlap communication with compute (Ops<Cuda>::Overlap).
  virtual void* stream_handle() const { return nullptr; }
  // How the ranks sit on nodes (comm/topology.hpp); one node unless the
  // communicator says otherwise.
  virtual Topology topology() const { return Topology::one_node(size()); }
  // The communicators of this rank's node and of the ranks at its place on
  // every node (collective on the first call), for hierarchical collectives.
  // A communicator that cannot split says so.
  virtual AnyCommunicator& node() = 0;
  virtual AnyCommunicator& across() = 0;
  // counters() with those of node() and across() added, where made (no
  // collective: what the optimizer reports), and their reset.
  virtual ByteCounters counters_with_splits() const = 0;
  virtual void reset_counters_with_splits() = 0;

  // Wraps a communicator the caller keeps alive for the optimizer's lifetime.
  template <Communicator C>
  static std::unique_ptr<AnyCommunicator> wrap(C& c);
};

namespace detail {

template <Communicator C>
class CommunicatorRef final : public AnyCommunicator {
 public:
  explicit CommunicatorRef(C& c) : c_(c) {}
  int rank() const override { return c_.rank(); }
  int size() const override { return c_.size(); }
  void all_reduce(void* buf, std::size_t count, DType t, ReduceOp op, bool control) override {
    c_.all_reduce(buf, count, t, op, control);
  }
  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType t) override {
    c_.reduce_scatter(send, recv, recv_count, t);
  }
  void all_gather(const void* send, void* recv, std::size_t send_count, DType t, bool control) override {
    c_.all_gather(send, recv, send_count, t, control);
  }
  void broadcast(void* buf, std::size_t count, DType t, int root) override { c_.broadcast(buf, count, t, root); }
  void all_to_all(const void* send, void* recv, std::size_t count, DType t) override {
    if constexpr (requires { c_.all_to_all(send, recv, count, t); })
      c_.all_to_all(send, recv, count, t);
    else
      throw InvalidArgument(
          "this communicator type does not provide all_to_all(send, recv, count, dtype), which Options::qgz (ZeRO++'s "
          "quantized gradient reduce-scatter) needs; use comm::Local, comm::LocalDevice, comm::Mpi or comm::Nccl, add "
          "all_to_all to the communicator (comm/communicator.hpp: the contract), or turn Options::qgz off");
  }
  void barrier() override { c_.barrier(); }
  const ByteCounters& counters() const override { return c_.counters(); }
  void reset_counters() override { c_.reset_counters(); }
  void group_begin() override {
    if constexpr (requires { c_.group_begin(); }) c_.group_begin();
  }
  void group_end() override {
    if constexpr (requires { c_.group_end(); }) c_.group_end();
  }
  void* stream_handle() const override {
    if constexpr (requires { c_.stream(); })
      return static_cast<void*>(c_.stream());
    else if constexpr (requires { c_.stream_handle(); })  // an AnyCommunicator wrapped again
      return c_.stream_handle();
    else
      return nullptr;
  }
  Topology topology() const override {
    if constexpr (requires { c_.topology(); })
      return c_.topology();
    else
      return Topology::one_node(c_.size());
  }
  AnyCommunicator& node() override { return split<true>(node_); }
  AnyCommunicator& across() override { return split<false>(across_); }
  ByteCounters counters_with_splits() const override {
    ByteCounters all = c_.counters();
    for (const auto* part : {&node_, &across_})
      if (*part) all += (*part)->counters_with_splits();
    return all;
  }
  void reset_counters_with_splits() override {
    c_.reset_counters();
    for (auto* part : {&node_, &across_})
      if (*part) (*part)->reset_counters_with_splits();
  }

 private:
  template <bool Node>
  AnyCommunicator& split(std::unique_ptr<AnyCommunicator>& made) {
    if (!made) {
      if constexpr (requires { c_.node(); c_.across(); }) {
        if constexpr (Node)
          made = wrap_part(c_.node());
        else
          made = wrap_part(c_.across());
      } else {
        throw Error("this communicator has no node() and across(): it cannot split into nodes for a hierarchical "
                    "collective; use comm::Local, comm::Mpi or comm::Nccl, or turn the hierarchical option off");
      }
    }
    return *made;
  }
  // node() and across() of an AnyCommunicator wrapped again return references to AnyCommunicator.
  template <class Part>
  static std::unique_ptr<AnyCommunicator> wrap_part(Part& part) {
    return std::make_unique<CommunicatorRef<Part>>(part);
  }

  C& c_;
  std::unique_ptr<AnyCommunicator> node_, across_;
};

}  // namespace detail

template <Communicator C>
std::unique_ptr<AnyCommunicator> AnyCommunicator::wrap(C& c) {
  return std::make_unique<detail::CommunicatorRef<C>>(c);
}

}  // namespace zero::comm
