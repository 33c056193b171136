// Why: every part of the engine that communicates (the gradient reduction,
// the stage-3 gatherer, the step's control all-reduce, the checkpoints'
// control exchange) goes through one channel: the communicator the optimizer
// was built with and, on a GPU whose communicator has a stream of its own,
// the lane its collectives run on and the events that make compute wait only
// where it reads their results (Ops<Cuda>::Overlap). One owner keeps that
// rule, and the check that the communicator was not swapped under the
// optimizer, in one place instead of in each part.
//
// `channel->all_gather(...)` calls the communicator; `channel.lane()`,
// `mark`, `wait`, `join` and `communicate` order the work around it;
// `channel.exchange(...)` names what the collectives are for, so that the
// communicator can check that every rank makes them for the same purpose.
#pragma once

#include "zero/compiler.hpp"

#include <cstddef>
#include <memory>
#include <string_view>
#include <utility>

#include "zero/comm/any_communicator.hpp"
#include "zero/comm/communicator.hpp"
#include "zero/error.hpp"

namespace zero::detail {

template <class Ops>
class CommChannel {
 public:
  using Overlap = typename Ops::Overlap;
  using Lane = typename Overlap::Lane;

  CommChannel() = default;
  template <comm::Communicator Comm>
  explicit CommChannel(Comm& communicator) : comm_(comm::AnyCommunicator::wrap(communicator)) {}

  comm::AnyCommunicator* operator->() const { return comm_.get(); }
  int rank() const { return comm_->rank(); }
  int size() const { return comm_->size(); }

  // At finalize(): the lane runs on the communicator's stream as it is now,
  // with `events` events for the parts to mark and wait on.
  void open(std::size_t events) {
    stream_ = comm_->stream_handle();
    overlap_ = Overlap(stream_, events);
  }
  // The collectives made while the returned scope lives are for this
  // exchange (comm::Purpose: "gathers unit 'a'"), numbered in the order this
  // optimizer makes its exchanges; the communicator compares every rank's.
  [[nodiscard]] comm::PurposeScope exchange(const char* verb, const char* subject = nullptr,
                                            std::string_view name = {}, std::uint64_t index = 0) {
    return comm::PurposeScope(comm::Purpose{verb, subject, name, index, ++exchanges_});
  }

  // Whether communication runs beside compute (a GPU with a communicator stream).
  bool overlaps() const { return overlap_.active(); }

  // Work enqueued while the returned guard lives runs on the communication
  // lane, ordered after the compute work so far.
  [[nodiscard]] Lane lane() {
    require(comm_->stream_handle() == stream_,
            "ZeroOptimizer: the communicator's stream changed after finalize() (was the communicator reassigned?); "
            "keep the communicator the optimizer was built with alive and unchanged while the optimizer is used");
    return overlap_.lane();
  }
  // Runs f on the lane; the compute stream then waits for it (f's results
  // are read next).
  template <class F>
  void communicate(F&& f) {
    {
      auto on_lane = lane();
      std::forward<F>(f)();
    }
    overlap_.join();
  }
  // Event `e` marks the lane's work so far; wait(e) makes compute wait for it.
  void mark(std::size_t e) { overlap_.mark(e); }
  void wait(std::size_t e) { overlap_.wait(e); }
  // Compute waits for everything enqueued on the lane.
  void join() { overlap_.join(); }

 private:
  std::unique_ptr<comm::AnyCommunicator> comm_;
  Overlap overlap_;
  void* stream_ = nullptr;  // the communicator's stream at open()
  std::uint64_t exchanges_ = 0;  // exchange() calls so far: the sequence number of each purpose
};

}  // namespace zero::detail
