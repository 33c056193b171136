// Why: ZeRO's promise is a number (bytes of model state per rank, bytes on
// the wire per step). The engine measures both from its own buffers and the
// communicator's counters, so a user can check the promise on their model and
// tests can hold the code to the paper's formulas.
#pragma once

#include "zero/compiler.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>

#include "zero/comm/communicator.hpp"

namespace zero {

// Bytes of one kind of buffer by where they live: device memory, host memory
// (page-locked where the backend can), disk.
struct PlacedBytes {
  std::uint64_t device = 0, host = 0, disk = 0;
  std::uint64_t total() const { return device + host + disk; }
  PlacedBytes& operator+=(const PlacedBytes& o) {
    device += o.device;
    host += o.host;
    disk += o.disk;
    return *this;
  }
  bool operator==(const PlacedBytes&) const = default;
  std::string to_json() const {
    std::ostringstream o;
    o << "{\"device\":" << device << ",\"host\":" << host << ",\"disk\":" << disk << "}";
    return o.str();
  }
};

// Where an offloaded step's time goes, on the host's clock, summed over the
// steps since reset_offload_times() (offload from a device backend: with
// backend::Host nothing waits or moves). device_wait: the one wait for the
// device before the CPU can start (backward's last work and the copies of
// the owned gradient to the host that backward did not hide). cpu_update:
// the CPU's work, the norm pass over the host gradient and the fused step
// unit by unit (each unit's upload enqueued as it finishes; with
// Options::delayed_update on the background thread, so read the times after
// synchronize() or wait_update()). The rest of a step's time is the control
// all-reduce, the uploads the update did not hide and the parameters'
// all-gather. bench/gpu_check.sh prints the split.
struct OffloadTimes {
  std::uint64_t steps = 0;  // optimizer steps timed (not skipped, not accumulating)
  double device_wait_seconds = 0;
  double cpu_update_seconds = 0;
};

struct MemoryReport {
  int rank = 0, ranks = 1, stage = 0;
  std::uint64_t padded_elements = 0;  // Φ
  std::uint64_t param_elements = 0;   // Φ without padding
  // Model states, bytes held by this rank.
  std::uint64_t params = 0;            // low-precision (or fp32) parameters
  std::uint64_t grads = 0;             // gradient accumulators
  std::uint64_t master = 0;            // fp32 master, or its 16-bit remainders (Options::master); 0 when fp32
                                       // params are their own master
  std::uint64_t optimizer_states = 0;  // e.g. Adam's m and v
  // Of the four lines above, the bytes that are padding (not additional).
  std::uint64_t padding = 0;
  // Not model state: staging for reductions, the stage-3 gather arena, and with
  // offload the host staging of the parameters on their way to the device.
  std::uint64_t communication_buffers = 0;
  // Each line above split by where it lives (totals equal the lines). With
  // offload the master and state are on the host or disk, and the gradient
  // line holds the device accumulator and its host copy.
  struct Placement {
    PlacedBytes params, grads, master, optimizer_states, communication_buffers;
    PlacedBytes model_states() const {
      PlacedBytes m = params;
      m += grads;
      m += master;
      m += optimizer_states;
      return m;
    }
    PlacedBytes total() const {
      PlacedBytes t = model_states();
      t += communication_buffers;
      return t;
    }
  } placed;

  std::uint64_t model_states() const { return params + grads + master + optimizer_states; }

  // The padding share of `bytes` of model-state buffers: the fraction of the
  // padded elements that belong to no parameter (the same in each buffer).
  static std::uint64_t padding_share(std::uint64_t param_elements, std::uint64_t padded_elements,
                                     std::uint64_t bytes) {
    const double fraction =
        1.0 - static_cast<double>(param_elements) / static_cast<double>(std::max<std::uint64_t>(1, padded_elements));
    return static_cast<std::uint64_t>(std::llround(fraction * static_cast<double>(bytes)));
  }
  std::uint64_t total() const { return model_states() + communication_buffers; }

  std::string to_json() const {
    std::ostringstream o;
    o << "{\"report\":\"memory\",\"rank\":" << rank << ",\"ranks\":" << ranks << ",\"stage\":" << stage
      << ",\"padded_elements\":" << padded_elements << ",\"param_elements\":" << param_elements
      << ",\"params_bytes\":" << params << ",\"grads_bytes\":" << grads << ",\"master_bytes\":" << master
      << ",\"optimizer_states_bytes\":" << optimizer_states << ",\"model_states_bytes\":" << model_states()
      << ",\"padding_bytes\":" << padding << ",\"communication_buffers_bytes\":" << communication_buffers
      << ",\"total_bytes\":" << total() << ",\"placed\":{\"params\":" << placed.params.to_json()
      << ",\"grads\":" << placed.grads.to_json() << ",\"master\":" << placed.master.to_json()
      << ",\"optimizer_states\":" << placed.optimizer_states.to_json()
      << ",\"communication_buffers\":" << placed.communication_buffers.to_json() << "}}";
    return o.str();
  }
};

struct CommReport {
  int rank = 0, ranks = 1, stage = 0;
  int ranks_per_node = 1;   // the communicator's topology (comm/topology.hpp)
  std::uint64_t steps = 0;  // optimizer steps the counters cover
  comm::ByteCounters counters{};

  // Model traffic (everything but control messages) per step, per direction.
  double sent_per_step() const { return per_step(counters.total_sent() - control_sent()); }
  double received_per_step() const { return per_step(counters.total_received() - control_received()); }
  // Of sent_per_step(), the bytes this rank sent to another node.
  double across_per_step() const { return per_step(counters.total_across() - control_across()); }
  std::uint64_t control_across() const { return counters.across[static_cast<std::size_t>(comm::Collective::control)]; }
  std::uint64_t control_sent() const { return counters.sent[static_cast<std::size_t>(comm::Collective::control)]; }
  std::uint64_t control_received() const {
    return counters.received[static_cast<std::size_t>(comm::Collective::control)];
  }

  std::string to_json() const {
    std::ostringstream o;
    o << "{\"report\":\"communication\",\"rank\":" << rank << ",\"ranks\":" << ranks << ",\"stage\":" << stage
      << ",\"steps\":" << steps << ",\"sent_bytes_per_step\":" << sent_per_step()
      << ",\"received_bytes_per_step\":" << received_per_step() << ",\"ranks_per_node\":" << ranks_per_node
      << ",\"across_nodes_sent_bytes_per_step\":" << across_per_step();
    for (std::size_t k = 0; k < comm::collective_kinds; ++k) {
      const char* name = comm::collective_name(static_cast<comm::Collective>(k));
      o << ",\"" << name << "_sent_bytes\":" << counters.sent[k] << ",\"" << name << "_calls\":" << counters.calls[k];
    }
    o << "}";
    return o.str();
  }

 private:
  double per_step(std::uint64_t bytes) const {
    return steps == 0 ? 0.0 : static_cast<double>(bytes) / static_cast<double>(steps);
  }
};

}  // namespace zero
