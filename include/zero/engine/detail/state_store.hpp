// Why: the fp32 master weights and the optimizer state are most of a model's
// training memory (12 of the 16 bytes per parameter with Adam in mixed
// precision), and the offload policy decides where they live: in the
// backend's memory, in host memory updated by the CPU (ZeRO-Offload), or on
// disk behind a host window (ZeRO-Infinity). Everything else in the engine,
// initialisation, the step, gathering the master and checkpoints, goes
// through this one owner, so a tier is one class here and not a condition in
// every function that touches state.
//
// Coordinates: the store holds this rank's owned range of every unit, laid
// end to end (unit u's range starts at the engine's state offset of u), and
// every operation names a range of those "owned elements". Values cross the
// store's boundary in host memory (import/export) or as the fused step's
// arguments (update), so no caller needs to know where the state is.
#pragma once

#include "zero/compiler.hpp"

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "zero/backend/host.hpp"
#include "zero/engine/detail/part_rows.hpp"
#include "zero/engine/detail/disk_window.hpp"
#include "zero/engine/options.hpp"
#include "zero/engine/detail/ownership.hpp"
#include "zero/engine/reports.hpp"
#include "zero/engine/detail/state_blocks.hpp"
#include "zero/error.hpp"
#include "zero/kernels/fused_step.hpp"
#include "zero/optim/policy.hpp"
#include "zero/policies.hpp"
#include "zero/precision/remainder.hpp"
#include "zero/quant/dynamic_code.hpp"

namespace zero {

// Which array of the store an import/export addresses: the fp32 master, or
// optimizer-state slot k (Adam: 0 = first moment, 1 = second moment).
struct StateSlot {
  static constexpr int master = -1;
  int index = master;
  bool is_master() const { return index == master; }
};

// The master's and the state slots' buffers for a run, in whichever tier
// holds them (engine/detail/part_rows.hpp), sized by buffer_sizes(): the stores
// in memory allocate these rows; the disk tier's store (its records on disk,
// its window and the 8-bit state's absmax and fp32 runs in host memory)
// lays out the same ones itself.
struct StateRows {
  BufferRow master;  // fp32, or a remainder master's 16-bit remainders
  // One slot's (every slot's are alike): its values in fp32 or bf16, or as
  // 8-bit codes with their blocks' absmax, the fp32 runs of small
  // parameters and, on a device, the code table.
  BufferRow values, codes, absmax, fp32_runs, code_table;
  int slots = 0;
  // offload::Nvme: the host window the state streams through, and what the
  // swap file's whole records add on disk.
  BufferRow disk_window, swap_padding;
  // 8-bit block-wise states: this rank's runs of owned elements
  // (engine/detail/state_blocks.hpp), by which the rows above are sized and the
  // stores lay the state out; empty otherwise.
  StateBlocks blocks;

  BufferRows list() const {
    BufferRows l{master};
    for (int k = 0; k < slots; ++k)
      for (const BufferRow* r : {&values, &codes, &absmax, &fp32_runs, &code_table}) l.push_back(*r);
    l.push_back(disk_window);
    l.push_back(swap_padding);
    return l;
  }
};

inline StateRows state_rows(const RunShape& run, const Options& options, const Layout& layout, const BufferSizes& z) {
  const Place store = store_place(run);
  const std::size_t master_bytes = master_element_bytes(options.master);
  const std::size_t state_bytes = state_element_bytes(options.states);
  const std::string smaller = smaller_owned(run);
  constexpr auto states = ReportedAs::optimizer_states;
  const bool disk = run.offload == OffloadTier::nvme;
  StateRows r;
  r.slots = run.state_slots;
  r.master = {master_bytes == 2 ? "fp32 master remainders" : "fp32 master weights", "master", ReportedAs::master, store,
              z.master, master_bytes, smaller};
  if (options.states == StateFormat::blockwise8 && run.state_slots > 0) {
    // This rank's runs (engine/detail/state_blocks.hpp): another rank's differ by
    // the blocks its shard boundaries cut and the small parameters it owns.
    // The disk tier keeps a code for every owned element in its records
    // (those of fp32 runs unused) and the absmax and fp32 runs in host memory.
    r.blocks = StateBlocks::build(Ownership{run.stage, run.rank, &layout}, options.state_block,
                                  options.state_fp32_below);
    const StateBlocks& blocks = r.blocks;
    const Place beside = disk ? Place::host : store;
    r.codes = {"optimizer state (8-bit codes)", "optimizer_states", states, store,
               disk ? z.state_per_slot : blocks.coded_elements(), 1, smaller};
    r.absmax = {"optimizer state (block absmax)", "optimizer_states", states, beside, blocks.blocks(), 4, smaller};
    r.fp32_runs = {"optimizer state (fp32, small parameters)", "optimizer_states", states, beside,
                   blocks.fp32_elements(), 4, smaller};
    // A device's step reads the slot's code table from device memory.
    if (store == Place::device)
      r.code_table = {"optimizer state (8-bit code table)", "optimizer_states", states, store, quant::code_size, 4,
                      smaller};
  } else {
    r.values = {state_bytes == 2 ? "optimizer state (bf16)" : "optimizer state", "optimizer_states", states, store,
                z.state_per_slot, state_bytes, smaller};
  }
  if (disk) {
    r.disk_window = {"offload::Nvme host window", "nvme_window", ReportedAs::communication_buffers, Place::host,
                     z.disk_window, 4, "lower Options::nvme.window_bytes"};
    // The swap file holds whole records: what the owned master and state
    // leave of the last one is on disk too.
    const std::uint64_t held = static_cast<std::uint64_t>(z.state_per_slot) *
                               offload::disk_record_element_bytes(run.state_slots, master_bytes, state_bytes);
    r.swap_padding = {"swap file (rounded to whole records)", "swap_padding", ReportedAs::not_reported, Place::disk,
                      z.swap_file_bytes - held, 1, ""};
  }
  return r;
}

// Master and state as arrays in memory the host or the backend can address.
// Two tiers share it:
// - offload::None: in the backend's memory (device memory on a GPU), updated
//   by the backend's fused step (Ops = Ops<Backend>);
// - offload::Cpu (ZeRO-Offload): in page-locked host memory, updated by the
//   host fused step on the CPU (Ops = Ops<Host>) while the GPU computes.
// Buf<T> is the tier's buffer type. `allocate(std::type_identity<Buf<T>>,
// row)` is the engine's allocator: it returns a Buf<T> of the row's
// elements or throws an error naming the buffer.
//
// The master is an fp32 array, or (MasterWeights::remainder) 16-bit
// remainders beside the bf16 parameter copy that the update reads and
// writes where the engine keeps it (zero/precision/remainder.hpp): the
// master's imports, exports and update then take that copy, in memory Ops
// reaches.
template <optim::Policy Optimizer, class Ops, template <class> class Buf, bool OnDevice>
class ArrayStateStore {
 public:
  static constexpr int state_slots = Optimizer::state_slots;

  // `rows` (state_rows) size every array and, with StateFormat::blockwise8,
  // carry this rank's runs (rows.blocks); a master row of no elements: fp32
  // training without offload, where the parameters are their own master and
  // update() receives them as such.
  template <class Allocate>
  void allocate(std::size_t owned, MasterWeights format, StateFormat states, const StateRows& rows,
                Allocate&& allocate) {
    owned_ = owned;
    if (rows.master.elements != 0 && format == MasterWeights::remainder)
      remainders_ = allocate(std::type_identity<Buf<std::uint16_t>>{}, rows.master);
    else if (rows.master.elements != 0)
      master_ = allocate(std::type_identity<Buf<float>>{}, rows.master);
    if (states == StateFormat::blockwise8 && state_slots > 0) {
      blocks_ = rows.blocks;
      const std::size_t covered = blocks_.runs().empty() ? 0 : blocks_.runs().back().end();
      require(covered == owned, "model-state store: the 8-bit state's runs cover ", covered, " of ", owned,
              " owned elements");
      for (int k = 0; k < state_slots; ++k) {
        codes_[k] = allocate(std::type_identity<Buf<std::uint8_t>>{}, rows.codes);
        absmax_[k] = allocate(std::type_identity<Buf<float>>{}, rows.absmax);
        states_[k] = allocate(std::type_identity<Buf<float>>{}, rows.fp32_runs);
        host_code_[k] = quant::code_for(optim::state_values<Optimizer>(k) == optim::StateValues::non_negative);
        // Zero states: every code the table's 0.0 (absmax 0).
        const std::vector<std::uint8_t> zeros(blocks_.coded_elements(), quant::quantize(0.0f, host_code_[k]));
        Ops::upload(codes_[k].data(), zeros.data(), zeros.size());
        if constexpr (OnDevice) {
          code_tables_[k] = allocate(std::type_identity<Buf<float>>{}, rows.code_table);
          require(code_tables_[k].size() == quant::code_size, "model-state store: the 8-bit code table's row has ",
                  code_tables_[k].size(), " elements, not ", quant::code_size);
          Ops::upload(code_tables_[k].data(), host_code_[k], quant::code_size);
        }
      }
      return;
    }
    for (int k = 0; k < state_slots; ++k) {
      if (states == StateFormat::fp32)
        states_[k] = allocate(std::type_identity<Buf<float>>{}, rows.values);
      else
        states16_[k] = allocate(std::type_identity<Buf<bf16>>{}, rows.values);
    }
  }
  bool owns_master() const { return master_.size() != 0 || remainders_.size() != 0; }

  // Host values into owned elements [offset, offset + n) of a slot, and
  // back; a remainder master also writes (reads) its bf16 copy at `copy`.
  template <class Param>
  void import_values(StateSlot slot, std::size_t offset, const float* host, std::size_t n, Param* copy) {
    if (slot.is_master() && remainders_.size() != 0) {
      check(offset, n);
      if constexpr (std::is_same_v<Param, bf16>) {
        std::vector<bf16> copies(n);
        std::vector<std::uint16_t> rest(n);
        for (std::size_t i = 0; i < n; ++i) split_master(host[i], copies[i], rest[i]);
        Ops::upload(remainders_.data() + offset, rest.data(), n);
        Ops::upload(copy, copies.data(), n);
      }
      return;
    }
    if (!slot.is_master() && blockwise_states()) {
      blockwise_values(slot, offset, host, nullptr, n);
      return;
    }
    if (!slot.is_master() && bf16_states()) {
      std::vector<bf16> low(n);  // rounded to nearest even: a bf16 state's own value comes back unchanged
      for (std::size_t i = 0; i < n; ++i) low[i] = from_float<bf16>(host[i]);
      Ops::upload(state16(slot, offset, n), low.data(), n);
      return;
    }
    Ops::upload(array(slot, offset, n), host, n);
  }
  template <class Param>
  void export_values(StateSlot slot, std::size_t offset, float* host, std::size_t n, const Param* copy) {
    if (slot.is_master() && remainders_.size() != 0) {
      check(offset, n);
      if constexpr (std::is_same_v<Param, bf16>) {
        std::vector<bf16> copies(n);
        std::vector<std::uint16_t> rest(n);
        Ops::download(rest.data(), remainders_.data() + offset, n);
        Ops::download(copies.data(), copy, n);
        for (std::size_t i = 0; i < n; ++i) host[i] = join_master(copies[i], rest[i]);
      }
      return;
    }
    if (!slot.is_master() && blockwise_states()) {
      blockwise_values(slot, offset, nullptr, host, n);
      return;
    }
    if (!slot.is_master() && bf16_states()) {
      std::vector<bf16> low(n);
      Ops::download(low.data(), state16(slot, offset, n), n);
      for (std::size_t i = 0; i < n; ++i) host[i] = to_float(low[i]);
      return;
    }
    Ops::download(host, array(slot, offset, n), n);
  }

  // The fused step over owned elements [offset, offset + args.n): the
  // caller fills the gradient, the parameter copy, scalars and rounding
  // (in memory Ops reaches); the store points the step at its master and
  // state. Without a master of its own (fp32) args.master must already point
  // at the parameters. Afterwards args.master holds the updated master
  // (null for a remainder master: the copy and the remainders hold it).
  template <class Grad, class Param>
  void update(std::size_t offset, kernels::FusedStepArgs<Optimizer, Grad, Param>& args) {
    require(offset <= owned_ && args.n <= owned_ - offset, "model-state store: update of owned elements [", offset,
            ", ", offset + args.n, ") outside this rank's ", owned_);
    if constexpr (kernels::FusedStepArgs<Optimizer, Grad, Param>::can_split_master) {
      if (remainders_.size() != 0) {
        args.master = nullptr;
        args.remainder = remainders_.data() + offset;
      }
    }
    if (master_.size() != 0) args.master = master_.data() + offset;
    if (blockwise_states()) {
      update_runs(offset, args);
      return;
    }
    for (int k = 0; k < state_slots; ++k) {
      if (bf16_states())
        args.state16[k] = states16_[k].data() + offset;
      else
        args.state[k] = states_[k].data() + offset;
    }
    Ops::fused_step(args);
  }

  PlacedBytes master_bytes() const { return place(master_.bytes() + remainders_.bytes()); }
  PlacedBytes state_bytes() const {
    std::uint64_t b = 0;
    for (int k = 0; k < state_slots; ++k)
      b += states_[k].bytes() + states16_[k].bytes() + codes_[k].bytes() + absmax_[k].bytes() +
           code_tables_[k].bytes();
    return place(b);
  }

 private:
  bool blockwise_states() const { return !blocks_.runs().empty(); }

  // The 8-bit step: one fused step per run of owned elements [offset,
  // offset + args.n), each pointed at its part of every array.
  template <class Grad, class Param>
  void update_runs(std::size_t offset, kernels::FusedStepArgs<Optimizer, Grad, Param>& args) {
    blocks_.step_pieces("model-state store", offset, args, [&](auto& part, const StateBlocks::Piece& piece) {
      for (int k = 0; k < state_slots; ++k) {
        if (piece.blockwise) {
          part.state8[k] = codes_[k].data() + piece.at;
          part.absmax[k] = absmax_[k].data() + piece.first_block;
          part.code[k] = OnDevice ? code_tables_[k].data() : host_code_[k];
        } else {
          part.state[k] = states_[k].data() + piece.at;
        }
      }
      Ops::fused_step(part);
    });
  }

  // 8-bit state slot values of owned elements [offset, offset + n) from
  // `in` (an import) or to `out`, through the host (blockwise_run_values:
  // any range may be imported, a block read back comes back bit for bit).
  void blockwise_values(StateSlot slot, std::size_t offset, const float* in, float* out, std::size_t n) {
    const bool import = in != nullptr;
    check(offset, n);
    require(slot.index >= 0 && slot.index < state_slots, "model-state store: the optimizer has ", state_slots,
            " state slot(s), not slot ", slot.index);
    const int k = slot.index;
    blocks_.each_run(offset, n, [&](const StateRun& run) {
      const std::size_t lo = std::max(run.begin, offset), hi = std::min(run.end(), offset + n);
      if (!run.blockwise) {
        float* packed = states_[k].data() + run.at + (lo - run.begin);
        if (import)
          Ops::upload(packed, in + (lo - offset), hi - lo);
        else
          Ops::download(out + (lo - offset), packed, hi - lo);
        return;
      }
      const quant::PhasedBlocks geometry = blocks_.blocks_of(run);
      const TouchedBlocks touched(geometry, run.begin, lo, hi);
      std::vector<std::uint8_t> codes(touched.to - touched.from);
      std::vector<float> scale(touched.last - touched.first + 1);
      std::uint8_t* stored_codes = codes_[k].data() + run.at + touched.from;
      float* stored_scale = absmax_[k].data() + run.first_block + touched.first;
      Ops::download(codes.data(), stored_codes, codes.size());
      Ops::download(scale.data(), stored_scale, scale.size());
      blockwise_run_values(run, geometry, touched, lo, hi, host_code_[k], codes.data(), scale.data(),
                           import ? in + (lo - offset) : nullptr, import ? nullptr : out + (lo - offset));
      if (!import) return;
      Ops::upload(stored_codes, codes.data(), codes.size());
      Ops::upload(stored_scale, scale.data(), scale.size());
    });
  }

  static PlacedBytes place(std::uint64_t bytes) {
    PlacedBytes p;
    (OnDevice ? p.device : p.host) = bytes;
    return p;
  }
  void check(std::size_t offset, std::size_t n) const {
    require(offset <= owned_ && n <= owned_ - offset, "model-state store: owned elements [", offset, ", ", offset + n,
            ") are outside this rank's ", owned_);
  }
  bool bf16_states() const { return state_slots > 0 && states16_[0].size() != 0; }
  bf16* state16(StateSlot slot, std::size_t offset, std::size_t n) {
    check(offset, n);
    require(slot.index >= 0 && slot.index < state_slots, "model-state store: the optimizer has ", state_slots,
            " state slot(s), not slot ", slot.index);
    return states16_[slot.index].data() + offset;
  }
  float* array(StateSlot slot, std::size_t offset, std::size_t n) {
    check(offset, n);
    if (slot.is_master()) {
      require(owns_master(), "model-state store: fp32 training keeps no separate master (the parameters are it)");
      return master_.data() + offset;
    }
    require(slot.index >= 0 && slot.index < state_slots, "model-state store: the optimizer has ", state_slots,
            " state slot(s), not slot ", slot.index);
    return states_[slot.index].data() + offset;
  }

  std::size_t owned_ = 0;
  Buf<float> master_;
  Buf<std::uint16_t> remainders_;  // MasterWeights::remainder: the master's lower halves
  Buf<float> states_[state_slots > 0 ? state_slots : 1];
  Buf<bf16> states16_[state_slots > 0 ? state_slots : 1];  // StateFormat::bf16*: instead of states_
  // StateFormat::blockwise8: the runs, each slot's codes and block absmax
  // (states_ then holds the fp32 runs' values only), the code tables (on
  // the host: the built-in constants; on a device: copies there).
  StateBlocks blocks_;
  Buf<std::uint8_t> codes_[state_slots > 0 ? state_slots : 1];
  Buf<float> absmax_[state_slots > 0 ? state_slots : 1];
  Buf<float> code_tables_[state_slots > 0 ? state_slots : 1];
  const float* host_code_[state_slots > 0 ? state_slots : 1] = {};
};

// What every tier's store does (ArrayStateStore here, offload::DiskStateStore
// in zero/offload/disk_state_store.hpp), in the owned-element coordinates
// above. allocate() takes the engine's allocator, which a store may ignore
// when it owns its memory in its own way (the disk store's aligned window).
// `copy`: the owned bf16 parameters a remainder master is split with (null
// for a state slot or an fp32 master).
template <class S, class Optimizer, class Grad, class Param>
concept StateStoreFor = requires(S& s, const S& cs, StateSlot slot, std::size_t offset, float* out, const float* in,
                                 Param* copy, kernels::FusedStepArgs<Optimizer, Grad, Param>& args) {
  { cs.owns_master() } -> std::same_as<bool>;
  s.import_values(slot, offset, in, offset, copy);
  s.export_values(slot, offset, out, offset, static_cast<const Param*>(copy));
  s.update(offset, args);
  { cs.master_bytes() } -> std::same_as<PlacedBytes>;
  { cs.state_bytes() } -> std::same_as<PlacedBytes>;
};

// The engine holds its store through this interface, so that the tier is a
// value chosen at run time and the engine is compiled once per precision,
// optimizer and backend, not once per tier. A virtual call per unit and
// step is nothing next to the update it starts.
template <optim::Policy Optimizer, class Grad, class Param>
class AnyStateStore {
 public:
  using StepArgs = kernels::FusedStepArgs<Optimizer, Grad, Param>;
  virtual ~AnyStateStore() = default;
  virtual bool owns_master() const = 0;
  virtual void import_values(StateSlot slot, std::size_t offset, const float* host, std::size_t n, Param* copy) = 0;
  virtual void export_values(StateSlot slot, std::size_t offset, float* host, std::size_t n,
                             const Param* copy) = 0;
  virtual void update(std::size_t offset, StepArgs& args) = 0;
  virtual PlacedBytes master_bytes() const = 0;
  virtual PlacedBytes state_bytes() const = 0;
  // Host memory the state passes through without being kept (the disk
  // tier's window), counted as a communication buffer.
  virtual std::uint64_t window_bytes() const = 0;
};

// A concrete store behind AnyStateStore.
template <class Store, optim::Policy Optimizer, class Grad, class Param>
  requires StateStoreFor<Store, Optimizer, Grad, Param>
class StoreModel final : public AnyStateStore<Optimizer, Grad, Param> {
 public:
  using StepArgs = kernels::FusedStepArgs<Optimizer, Grad, Param>;
  Store store;

  bool owns_master() const override { return store.owns_master(); }
  void import_values(StateSlot slot, std::size_t offset, const float* host, std::size_t n, Param* copy) override {
    store.import_values(slot, offset, host, n, copy);
  }
  void export_values(StateSlot slot, std::size_t offset, float* host, std::size_t n, const Param* copy) override {
    store.export_values(slot, offset, host, n, copy);
  }
  void update(std::size_t offset, StepArgs& args) override { store.update(offset, args); }
  PlacedBytes master_bytes() const override { return store.master_bytes(); }
  PlacedBytes state_bytes() const override { return store.state_bytes(); }
  std::uint64_t window_bytes() const override {
    if constexpr (requires { store.window_bytes(); })
      return store.window_bytes();
    else
      return 0;
  }
};

namespace detail {
template <class T>
class ShardPages;  // stage 3's shards on disk (engine/detail/shard_pages.hpp)
}

// The disk tier's stores, made by zero/offload/disk_state_store.hpp (which
// needs liburing, so the engine cannot include it). `state`: the master and
// state configured from the run's Options (nvme, master, states) for this
// rank, with `owned` elements (and 8-bit states' runs of them,
// engine/detail/state_blocks.hpp). `params` and `grads`: stage 3's parameter
// and gradient shards (Options::param_place = disk) under Options::nvme, for
// this rank's shards of `layout`. The engine is handed all three where that
// header is included, and refuses the tier and the placement without them.
template <optim::Policy Optimizer, class Grad, class Param>
struct DiskStoreMaker {
  std::unique_ptr<AnyStateStore<Optimizer, Grad, Param>> (*state)(const Options& options, int rank,
                                                                   std::size_t owned,
                                                                   const StateBlocks& blocks) = nullptr;
  std::unique_ptr<detail::ShardPages<Param>> (*params)(const Options& options, int rank, const Layout& layout) = nullptr;
  std::unique_ptr<detail::ShardPages<Grad>> (*grads)(const Options& options, int rank, const Layout& layout) = nullptr;
};

namespace offload {
struct DiskTier;  // the disk tier's maker (zero/offload/disk_state_store.hpp)
}

namespace detail {
// A program without the disk tier: no maker.
struct NoDiskTier {
  template <optim::Policy Optimizer, class Grad, class Param>
  static constexpr DiskStoreMaker<Optimizer, Grad, Param> maker() {
    return {};
  }
};
// The disk tier an offload policy needs: specialised for offload::Nvme by
// zero/offload/disk_state_store.hpp.
template <class Offload>
struct DiskTierOf {
  static_assert(!std::is_same_v<Offload, offload::Nvme>,
                "zero: offload::Nvme needs its store: #include \"zero/offload/disk_state_store.hpp\" (liburing, "
                "xxhash.h) before naming the optimizer type");
  using type = NoDiskTier;
};
}  // namespace detail

}  // namespace zero
