// Why: a training library nobody can resume from is not usable. This header
// connects a ZeroOptimizer to the checkpoint format (checkpoint.hpp): the
// optimizer's state is exposed as a StateSource in coordinates no rank count
// or stage changes (unit, element range of the unpadded unit), read and
// written only through the model-state store (so every offload tier saves
// the same way, the disk tier included), and the run's scalars (step, loss
// scaler, seed, hyper-parameters) travel in the manifest. A checkpoint saved
// by N ranks at stage s loads on M ranks at stage t.
//
//   #include "zero/checkpoint/optimizer_io.hpp"
//   opt.save("ckpt/step-100");                     // collective
//   opt.save("ckpt/step-200", {.async = true});    // returns once the state is in host memory
//   opt.wait_save();                               // (or the next save or load, or the destructor)
//   opt.load("ckpt");            // collective: the newest complete checkpoint under ckpt/
//   opt.load_hf("hf/");          // collective: parameters from Hugging Face safetensors, by name
//
// Slots: "master" (fp32; the parameters themselves in fp32 training), the
// optimizer's fp32 state by its state_names ("exp_avg", "exp_avg_sq";
// "momentum"; "state0".."stateK-1" for a policy without names, which is
// also what checkpoints before names say, and still load), and "param" (the
// 16-bit copy, so stochastic rounding resumes bit for bit; optional: a run
// in another precision derives it from the master).
#pragma once

#include "zero/compiler.hpp"

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "zero/checkpoint/checkpoint.hpp"
#include "zero/checkpoint/hugging_face.hpp"
#include "zero/engine/zero_optimizer.hpp"
#include "zero/optim/policy.hpp"

namespace zero::checkpoint {

namespace detail {
// The optimizer's hyper-parameters by name, as its Hyper::fields() lists
// them (recorded for the reader; loading keeps the running program's, which
// a schedule sets per step): a policy of the user's is saved as the
// built-in ones are. A Hyper without fields() records its `lr` where it
// has one (docs/custom-optimizer.md: list the fields to have them saved).
template <class Hyper>
nlohmann::json hyper_json(const Hyper& h) {
  nlohmann::json j = nlohmann::json::object();
  if constexpr (optim::DescribesHyperFields<Hyper>) {
    for (const auto& field : Hyper::fields()) {
      if (field.number != nullptr)
        j[field.name] = h.*field.number;
      else
        j[field.name] = h.*field.flag;
    }
  } else if constexpr (requires { h.lr; }) {
    j["lr"] = h.lr;
  }
  return j;
}
// State slot k of the optimizer policy P: P::state_names[k] when it has
// names, else "state<k>" (the name every checkpoint had before names).
inline std::string numbered_state_name(int k) { return "state" + std::to_string(k); }
template <class P>
std::string state_name(int k) {
  if constexpr (requires { P::state_names[0]; }) {
    static_assert(std::size(P::state_names) == static_cast<std::size_t>(P::state_slots),
                  "an optimizer's state_names must name each of its state_slots slots, in order");
    return P::state_names[k];
  } else {
    return numbered_state_name(k);
  }
}
// The layout's units and parameters as the checkpoint layer describes them
// (plain functions: one copy for every optimizer type, not one each).
inline std::vector<UnitDesc> unit_descs(const Layout& layout) {
  std::vector<UnitDesc> out;
  for (const UnitInfo& u : layout.units()) {
    UnitDesc d{u.name, u.numel, {}};
    for (const std::size_t p : u.params) {
      const ParamInfo& info = layout.params()[p];
      d.params.push_back({info.name, info.offset, info.numel, info.shape});
    }
    out.push_back(std::move(d));
  }
  return out;
}
// Each unit's part (within its unpadded data) that rank `rank` holds: its
// shard when `sharded`, else all of it.
inline std::vector<OwnedRange> owned_ranges(const Layout& layout, std::size_t rank, bool sharded) {
  std::vector<OwnedRange> out;
  for (std::size_t i = 0; i < layout.units().size(); ++i) {
    const UnitInfo& u = layout.units()[i];
    const std::size_t begin = sharded ? rank * u.shard : 0;
    const std::size_t end = sharded ? std::min(u.numel, (rank + 1) * u.shard) : u.numel;
    if (begin < end) out.push_back({i, begin, end - begin});
  }
  return out;
}
}  // namespace detail

// The line a load prints when the optimizer state changes format on the
// way in (empty when it does not): the files hold the saved state's exact
// values in fp32, which a bf16 or 8-bit run rounds or quantizes; 8-bit
// states also requantize where another rank count or stage cuts their
// blocks elsewhere (engine/detail/state_blocks.hpp).
inline std::string state_conversion_line(const RunState& run, const Options& o, int ranks, int stage) {
  auto describe = [](const std::string& format, std::uint64_t block, std::uint64_t below) {
    return format == name(StateFormat::blockwise8)
               ? zero::detail::concat(format, " (blocks of ", block, ", fp32 below ", below, " elements)")
               : format;
  };
  const std::string saved = describe(run.state_format.empty() ? "fp32" : run.state_format, run.state_block,
                                     run.state_fp32_below);
  const std::string here = describe(name(o.states), o.state_block, o.state_fp32_below);
  const bool blocks_moved = o.states == StateFormat::blockwise8 && saved == here &&
                            block_cuts(run.world_size, run.stage) !=
                                block_cuts(static_cast<std::uint64_t>(ranks), static_cast<std::uint64_t>(stage));
  if (saved == here && !blocks_moved) return {};
  if (o.states == StateFormat::fp32) return {};  // fp32 holds any saved state's values exactly
  auto is_bf16 = [](const std::string& f) { return f.rfind("bf16", 0) == 0; };
  if (is_bf16(saved) && is_bf16(here)) return {};  // bf16 values either way (the rounding is the only difference)
  return zero::detail::concat("zero: load: the optimizer state was saved as ", saved, " by ", run.world_size,
                        " rank(s) at stage ", run.stage, "; this run keeps it as ", here, " on ", ranks,
                        " rank(s) at stage ", stage, ": converted on load (",
                        o.states == StateFormat::blockwise8 ? "each block quantized afresh"
                                                            : "each value rounded to bf16",
                        ")");
}

// How ZeroOptimizer::save writes: opt.save(dir, {.async = true}).
struct OptimizerSaveOptions {
  // Return once this rank's state is copied to host memory; a background
  // thread writes the rank file, and the checkpoint becomes complete (its
  // manifest written) at the optimizer's wait_save(), next save or load, or
  // destruction. A crash before that leaves the previous checkpoint intact.
  bool async = false;
  nlohmann::json extra = nlohmann::json::object();  // the caller's own state (epoch, data order), in the manifest
  SaveOptions io = {};  // checksum chunks, I/O buffer, keep_last (save_step)
};

// The checkpoint layer of one engine (detail::Engine<P, O, B>), through its
// public view: the owned ranges (ownership()), the owned values of the
// parameters and of each state slot (read_/write_params, read_/write_state),
// the progress (step count, loss scaler) and the control all-gather.
template <class Opt>
struct EngineIo {
  using SaveOptions = OptimizerSaveOptions;
  using param_type = typename Opt::param_type;
  static constexpr bool mixed = Opt::precision_policy::mixed;
  static constexpr int state_slots = Opt::state_slots;

  // The optimizer as the checkpoint layer sees it.
  class Source final : public StateSource {
   public:
    explicit Source(Opt& opt, nlohmann::json extra = nlohmann::json::object())
        : opt_(opt), extra_(std::move(extra)) {}

    std::vector<UnitDesc> units() const override { return detail::unit_descs(opt_.layout()); }
    std::vector<SlotDesc> slots() const override {
      std::vector<SlotDesc> s{{"master", DType::f32, true}};
      for (int k = 0; k < state_slots; ++k)
        s.push_back({detail::state_name<typename Opt::optimizer_policy>(k), DType::f32, true,
                     detail::numbered_state_name(k)});
      if constexpr (mixed) s.push_back({"param", dtype_traits<param_type>::dtype, false});
      return s;
    }
    // Stages 1-3: this rank's shard of each unit (within its unpadded data);
    // stage 0: all of it.
    std::vector<OwnedRange> owned() const override { return ranges(opt_.shape().stage.states_sharded); }
    // Saved: the shards at every stage (at stage 0 each rank writes a part).
    std::vector<OwnedRange> save_ranges() const override { return ranges(true); }

    void read(std::size_t slot, const OwnedRange& r, void* dst) const override {
      auto& opt = const_cast<Opt&>(opt_);
      const std::size_t local = r.begin - opt.ownership().update_begin(opt.layout().units()[r.unit]);
      if (is_param(slot))
        opt.read_params(r.unit, local, r.count, static_cast<param_type*>(dst));
      else
        opt.read_state(store_slot(slot), r.unit, local, r.count, static_cast<float*>(dst));
    }
    void write(std::size_t slot, const OwnedRange& r, const void* src) override {
      const std::size_t local = r.begin - opt_.ownership().update_begin(opt_.layout().units()[r.unit]);
      // A remainder master wrote these parameters with the master (slot 0,
      // read first): they are its upper halves, rounded half away from zero,
      // and the file's copy (rounded to even by an fp32-master run) would
      // not fit the remainders on exact ties.
      if (is_param(slot)) {
        if (!opt_.remainder_master()) opt_.write_params(r.unit, local, r.count, static_cast<const param_type*>(src));
      } else
        opt_.write_state(store_slot(slot), r.unit, local, r.count, static_cast<const float*>(src));
    }

    RunState run_state() const override {
      RunState s;
      s.world_size = static_cast<std::uint64_t>(opt_.ranks());
      s.stage = static_cast<std::uint64_t>(opt_.stage());
      s.precision = mixed ? dtype_name(dtype_traits<param_type>::dtype) : "fp32";
      s.optimizer = Opt::optimizer_policy::name;
      s.hyper = detail::hyper_json(opt_.hyper());
      s.step = static_cast<std::uint64_t>(opt_.step_count());
      const auto scaler = opt_.loss_scaler_state();
      s.loss_scaler = {scaler.scale, static_cast<std::uint64_t>(scaler.clean_steps),
                       static_cast<std::uint64_t>(scaler.hysteresis_left)};
      if (opt_.options().stochastic_rounding) s.rounding_seed = opt_.options().seed;
      const Options& o = opt_.options();
      s.state_format = name(o.states);
      if (o.states == StateFormat::blockwise8) {
        s.state_block = o.state_block;
        s.state_fp32_below = o.state_fp32_below;
      }
      s.extra = extra_;
      return s;
    }

   private:
    static bool is_param(std::size_t slot) { return mixed && slot == 1 + static_cast<std::size_t>(state_slots); }
    static StateSlot store_slot(std::size_t slot) {
      return slot == 0 ? StateSlot{} : StateSlot{static_cast<int>(slot) - 1};
    }
    std::vector<OwnedRange> ranges(bool sharded) const {
      return detail::owned_ranges(opt_.layout(), static_cast<std::size_t>(opt_.rank()), sharded);
    }

    Opt& opt_;
    nlohmann::json extra_;
  };

  // The optimizer's control all-gather (counted as control traffic).
  static Collective collective(Opt& opt) {
    Collective c;
    c.rank = static_cast<std::uint64_t>(opt.rank());
    c.size = static_cast<std::uint64_t>(opt.ranks());
    c.all_gather_u64 = [&opt](std::uint64_t v) { return opt.all_gather_control({v}); };
    return c;
  }

  // Collective: the optimizer's state into `dir`; `extra` (the trainer's
  // epoch, data order, ...) is kept in the manifest for its resume: pass it
  // as {.extra = j} or as the json itself. (The json overloads are templates
  // taking exactly nlohmann::json, so that `{}` and `{.async = true}` mean
  // the options, not an empty json: unambiguous.)
  static void save(Opt& opt, const std::string& dir, SaveOptions options = {}) {
    const comm::ApiCall api_call("save");  // names this call in communicator errors (zero/comm/communicator.hpp)
    write(opt, dir, std::nullopt, std::move(options));
  }
  template <std::same_as<nlohmann::json> Json>
  static void save(Opt& opt, const std::string& dir, Json extra) {
    save(opt, dir, SaveOptions{.extra = std::move(extra)});
  }

  // Collective: root/step-<step count>/, then root/latest points at it and,
  // with options.io.keep_last = K, only the K newest complete checkpoints
  // under root remain. A later load(root) finds the newest complete one.
  static std::filesystem::path save_step(Opt& opt, const std::string& root, SaveOptions options = {}) {
    const comm::ApiCall api_call("save_step");
    const auto dir = step_directory(root, static_cast<std::uint64_t>(opt.step_count()));
    write(opt, dir, root, std::move(options));
    return dir;
  }
  template <std::same_as<nlohmann::json> Json>
  static std::filesystem::path save_step(Opt& opt, const std::string& root, Json extra) {
    return save_step(opt, root, SaveOptions{.extra = std::move(extra)});
  }

  // Collective: the state of the checkpoint at (or newest under) `path`.
  // Parameters it lacks (a run in another precision, or fp32) are derived
  // from the master; stages 1-2 then all-gather them. Returns the manifest (step,
  // `extra`) and what was read.
  static LoadResult load(Opt& opt, const std::string& path) {
    const comm::ApiCall api_call("load");
    settle(opt, "load");
    refuse_acquired(opt, "load");
    Source source(opt);
    LoadResult result = load_checkpoint(path, source, collective(opt));
    // Where the store keeps the master apart from the parameters forward
    // reads (mixed precision; fp32 with offload, whose parameters are a
    // working copy of the master in the backend's memory), the parameters
    // follow the master: rounded from it when the checkpoint has no 16-bit
    // copy (a run in another precision), and always in fp32, which saves no
    // "param" slot. (Without this an fp32 offloaded resume trained on the
    // fresh optimizer's values while gather_masters() looked right.)
    const bool derive =
        mixed ? !result.slots_not_loaded.empty() && !opt.remainder_master() : opt.separate_master();
    if (derive) params_from_master(opt, source);
    const RunState& run = result.manifest.run;
    if (opt.rank() == 0)
      if (const std::string line = state_conversion_line(run, opt.options(), opt.ranks(), opt.stage()); !line.empty())
        std::fprintf(stderr, "%s\n", line.c_str());
    opt.restore_progress(static_cast<std::int64_t>(run.step),
                         {run.loss_scaler.scale, static_cast<int>(run.loss_scaler.growth_counter),
                          static_cast<int>(run.loss_scaler.hysteresis_left)});
    return result;
  }

  // Collective: every parameter from a Hugging Face file set, by name (see
  // ZeroOptimizer::load_hf). Every rank opens the files and checks every
  // name and shape before the first set_param, so a bad file set is an
  // error on every rank with nothing changed; then one parameter at a time
  // (memory: one parameter in fp32) goes through set_param.
  static void load_hf(Opt& opt, const std::string& path) {
    const comm::ApiCall api_call("load_hf");
    settle(opt, "load_hf");
    refuse_acquired(opt, "load_hf");
    const Collective c = collective(opt);
    const auto& params = opt.layout().params();
    std::optional<HfReader> reader;
    detail::on_every_rank(c, path, "checking the Hugging Face files", [&] {
      reader.emplace(path);
      std::vector<HfTensor> wanted;
      for (const ParamInfo& p : params) {
        HfTensor t{p.name, p.shape.empty() ? Shape{p.numel} : p.shape, DType::f32};
        // Registered flat: any shape of its element count (a PyTorch
        // state dict's [out, in] into a flat parameter).
        if (p.shape.empty() && reader->contains(p.name)) {
          const TensorEntry& e = reader->tensor(p.name);
          if (e.numel() == p.numel) t.shape = e.shape;
        }
        wanted.push_back(std::move(t));
      }
      checkpoint::detail::check_hf_tensors(*reader, wanted);
      for (const ParamInfo& p : params)
        require(reader->tensor(p.name).dtype != TensorType::I64, reader->file_of(p.name).path().string(),
                ": tensor '", p.name, "' is I64: parameters are imported from F32, F16 or BF16 tensors");
    });
    std::vector<float> values;
    for (std::size_t p = 0; p < params.size(); ++p) {
      detail::on_every_rank(c, path, "reading parameter '" + params[p].name + "'", [&] {
        values.resize(params[p].numel);
        reader->read(params[p].name, 0, params[p].numel, DType::f32, values.data());
      });
      opt.set_param(ParamId{p}, values.data());
    }
  }

 private:
  // Between optimizer steps, with nothing in flight (a background save
  // completed first).
  static void settle(Opt& opt, const char* what) { opt.settle(what); }

  // Stage 3: a load replaces the values an acquired unit's gathered copy
  // holds, and would leave the caller computing with the old ones (and its
  // release_unit() failing): every unit is released first. Every rank reaches
  // this check with the same acquisitions (acquire_unit is collective).
  static void refuse_acquired(Opt& opt, const char* what) {
    if (const auto held = opt.acquired_unit())
      throw InvalidArgument(zero::detail::concat(
          what, ": unit '", opt.layout().units()[*held].name,
          "' is acquired; release_unit() every unit before loading (the load replaces the parameters its gathered "
          "copy holds)"));
  }

  // This rank's owned ranges of the parameters from the (loaded) master.
  static void params_from_master(Opt& opt, Source& source) {
    std::vector<float> master;
    std::vector<param_type> low;
    for (const OwnedRange& r : source.owned()) {
      master.resize(r.count);
      low.resize(r.count);
      source.read(0, r, master.data());
      for (std::size_t i = 0; i < r.count; ++i) low[i] = opt.rounded_copy(master[i]);
      opt.write_params(r.unit, r.begin - opt.ownership().update_begin(opt.layout().units()[r.unit]), r.count,
                       low.data());
    }
  }

  // The Checkpointer of an asynchronous save, kept by the optimizer until
  // it completes.
  class Background final : public BackgroundSave {
   public:
    Background(Opt& opt, const checkpoint::SaveOptions& io) : checkpointer(collective(opt), io) {}
    void finish() override { checkpointer.finish(); }
    Checkpointer checkpointer;
  };

  // `dir` (a step directory of `root` when root is given).
  static void write(Opt& opt, const std::filesystem::path& dir, std::optional<std::filesystem::path> root,
                    SaveOptions options) {
    settle(opt, "save");
    auto background = std::make_unique<Background>(opt, options.io);
    Source source(opt, std::move(options.extra));
    background->checkpointer.write(dir, std::move(root), source, options.async);
    if (options.async) opt.adopt_background_save(std::move(background));
  }
};

// The checkpoint layer of an optimizer type (a ZeroOptimizer, or the engine
// itself): the engine's, compiled once per engine.
template <class Opt>
struct OptimizerIo : EngineIo<typename Opt::engine_type> {};

}  // namespace zero::checkpoint
