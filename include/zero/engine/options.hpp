// Why: everything about a run that is not a type choice lives in one plain
// struct, validated once at construction, so the same compiled optimizer
// serves any bucket size, accumulation count or loss-scale schedule.
#pragma once

#include "zero/compiler.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>

#include "zero/backend/pieced_buffer.hpp"
#include "zero/engine/stage_rules.hpp"
#include "zero/error.hpp"
#include "zero/engine/detail/disk_window.hpp"
#include "zero/simd/dispatch.hpp"

namespace zero {

// Options::bucket_bytes = 0 (automatic) is at most this.
inline constexpr std::size_t default_bucket_bytes = std::size_t{32} << 20;

// In which type gradients travel and are summed across ranks.
enum class ReduceDType { same_as_grad, fp32 };

constexpr const char* name(ReduceDType d) {
  switch (d) {
    case ReduceDType::same_as_grad: return "same_as_grad";
    case ReduceDType::fp32: return "fp32";
  }
  return "?";
}

// How the caller's backward writes a unit's gradient into grad_buffer()
// (Options::grad_writes; docs/tutorial.md, "How your backward writes gradients").
enum class GradWrites { overwrite, accumulate };

constexpr const char* name(GradWrites w) {
  switch (w) {
    case GradWrites::overwrite: return "overwrite";
    case GradWrites::accumulate: return "accumulate";
  }
  return "?";
}

// How the fp32 master weights of bf16 parameters are kept (docs/lean-states.md).
// fp32: an array of their own, 4 bytes per parameter. remainder: the bf16
// parameters the engine keeps anyway plus a 16-bit remainder, 2 bytes per
// parameter and the same fp32 values bit for bit (zero/precision/
// remainder.hpp); the bf16 copies are then rounded half away from zero.
enum class MasterWeights { fp32, remainder };

constexpr const char* name(MasterWeights m) {
  switch (m) {
    case MasterWeights::fp32: return "fp32";
    case MasterWeights::remainder: return "remainder";
  }
  return "?";
}

// How the optimizer's state slots (Adam's m and v, SGD's momentum) are
// stored (docs/lean-states.md). fp32: 4 bytes per element. bf16: 2 bytes,
// read as fp32 by the step and written back rounded to nearest even;
// bf16_stochastic: rounded stochastically (zero in expectation, from
// (Options::seed, step, element, slot) as the copies' stochastic rounding).
// blockwise8: 1 byte, block-wise 8-bit (Dettmers et al. 2022): each block of
// Options::state_block elements of a parameter is a code per element into a
// 256-value dynamic table (signed, or unsigned for a slot the optimizer
// declares non-negative: optim::StateValues) times the block's largest
// magnitude, kept in fp32; parameters under Options::state_fp32_below
// elements keep fp32 states.
enum class StateFormat { fp32, bf16, bf16_stochastic, blockwise8 };

constexpr const char* name(StateFormat f) {
  switch (f) {
    case StateFormat::fp32: return "fp32";
    case StateFormat::bf16: return "bf16";
    case StateFormat::bf16_stochastic: return "bf16_stochastic";
    case StateFormat::blockwise8: return "blockwise8";
  }
  return "?";
}
// Where stage 3 keeps this rank's parameter and gradient shards between
// their uses (docs/offload.md). device: in the backend's memory (device
// memory on a GPU, host memory with backend::Host), all of them, as the
// engine always did. disk: in a file each under Options::nvme.directory,
// read into a few pages of the backend's memory ahead of each use (in the
// order of the last step's uses) and written back when changed, so a rank
// keeps pages for a few units instead of its whole shards (ZeRO-Infinity's
// parameter offload); it needs the disk tier's store in the program
// (offload::Nvme).
enum class ParamPlace { device, disk };

constexpr const char* name(ParamPlace p) {
  switch (p) {
    case ParamPlace::device: return "device";
    case ParamPlace::disk: return "disk";
  }
  return "?";
}

// Bytes of one stored master element (the remainder's; its other half is
// the parameter) and of one stored state element.
constexpr std::size_t master_element_bytes(MasterWeights m) { return m == MasterWeights::remainder ? 2 : 4; }
// (blockwise8: the code; each block adds its fp32 absmax, and parameters
// under Options::state_fp32_below stay fp32: engine/detail/state_blocks.hpp counts
// them exactly.)
constexpr std::size_t state_element_bytes(StateFormat f) {
  return f == StateFormat::fp32 ? 4 : f == StateFormat::blockwise8 ? 1 : 2;
}
// Options::state_block's rule, which a checkpoint manifest's
// state_format.block meets too (checkpoint/manifest.hpp): the manifest says
// how the saving run's blocks fell, and no run had blocks outside it.
inline constexpr const char* state_block_rule = "a multiple of 64 in [64, 4096]";
constexpr bool allowed_state_block(std::uint64_t block) { return block >= 64 && block <= 4096 && block % 64 == 0; }

struct Options;

// ---- The field table ------------------------------------------------------
// Each options struct lists its fields once, in a static fields(): the key a
// configuration file spells (runtime/config_json.hpp) and a command line
// selects (examples/common/cli.hpp), and when ranks must agree on it
// (checked at finalize(): rank_checks.hpp). A field left out of the table
// would be silently neither read, written, given a flag nor checked across
// ranks, so tests/runtime/test_config.cpp counts the rows against the members.

// When every rank must hold the same value of a field, given the whole
// Options; rank_own (nullptr) for what is a rank's own (its threads, locked
// memory, disk), in which ranks may differ. Ranks exchange such a value as
// 64 bits, so it is a number, a flag or an enum.
using AgreedWhen = bool (*)(const Options&);
constexpr bool on_every_rank(const Options&) { return true; }
inline constexpr AgreedWhen rank_own = nullptr;

// A row: the field's key, its member, and when ranks agree on it.
template <class S, class M>
struct OptionField {
  static constexpr bool group = false;
  const char* key;
  M S::*member;
  AgreedWhen agreed;
};
// A nested options struct with a fields() of its own, its keys under `key`.
template <class S, class M>
struct OptionGroup {
  static constexpr bool group = true;
  const char* key;
  M S::*member;
};
template <class S, class M>
constexpr OptionField<S, M> option_field(const char* key, M S::*member, AgreedWhen agreed) {
  return {key, member, agreed};
}
template <class S, class M>
constexpr OptionGroup<S, M> option_group(const char* key, M S::*member) {
  return {key, member};
}

namespace detail {
// f(row, s.*row.member) for each row of S::fields(), in order (`s` may be const).
template <class S, class F>
constexpr void for_each_option_row(S& s, F&& f) {
  std::apply([&](const auto&... row) { (f(row, s.*row.member), ...); }, std::remove_const_t<S>::fields());
}
// f(key path, value, agreed) for every field, one of a group under its
// group's key ("loss_scale.initial_scale").
template <class S, class F>
void for_each_option(S& s, F&& f, const std::string& prefix = "") {
  for_each_option_row(s, [&](const auto& row, auto& value) {
    if constexpr (std::remove_cvref_t<decltype(row)>::group) for_each_option(value, f, prefix + row.key + ".");
    else f(prefix + row.key, value, row.agreed);
  });
}
// Whether every field ranks agree on fits the 64 bits they exchange.
template <class S>
constexpr bool agreed_fields_exchangeable() {
  return std::apply(
      [](const auto&... row) {
        auto fits = [](const auto& r) {
          using M = std::remove_cvref_t<decltype(std::declval<S&>().*r.member)>;
          if constexpr (std::remove_cvref_t<decltype(r)>::group) return agreed_fields_exchangeable<M>();
          else return r.agreed == rank_own || std::is_arithmetic_v<M> || std::is_enum_v<M>;
        };
        return (fits(row) && ...);
      },
      S::fields());
}
}  // namespace detail

struct LossScaleOptions {
  double initial_scale = 65536.0;  // 2^16, as torch.cuda.amp.GradScaler
  int growth_interval = 2000;      // steps without overflow before the scale grows
  double growth_factor = 2.0;
  double backoff_factor = 0.5;     // on overflow
  int hysteresis = 1;              // overflows tolerated before backing off (DeepSpeed's "hysteresis")
  double min_scale = 1.0;

  bool operator==(const LossScaleOptions&) const = default;

  // The field table (see OptionField); every rank steps with one scale.
  static constexpr auto fields() {
    using L = LossScaleOptions;
    return std::tuple{option_field("initial_scale", &L::initial_scale, on_every_rank),
                      option_field("growth_interval", &L::growth_interval, on_every_rank),
                      option_field("growth_factor", &L::growth_factor, on_every_rank),
                      option_field("backoff_factor", &L::backoff_factor, on_every_rank),
                      option_field("hysteresis", &L::hysteresis, on_every_rank),
                      option_field("min_scale", &L::min_scale, on_every_rank)};
  }
};

// offload::Nvme (zero/offload/disk_state_store.hpp): where the swap files of
// the master and optimizer state go, and how they stream.
struct NvmeOptions {
  std::string directory;                             // on a fast local disk; files are removed at destruction
  std::size_t window_bytes = std::size_t{64} << 20;  // host memory the state passes through (three chunks)
  std::size_t block_bytes = std::size_t{1} << 20;    // bytes per disk request (a multiple of 4096)
  unsigned queue_depth = 16;                         // disk requests in flight
  bool direct = true;                                // O_DIRECT (buffered, with a notice, where refused)

  bool operator==(const NvmeOptions&) const = default;

  // The field table (see OptionField): each rank streams its own shard
  // through its own disk, so ranks may differ in all of it.
  static constexpr auto fields() {
    using N = NvmeOptions;
    return std::tuple{option_field("directory", &N::directory, rank_own),
                      option_field("window_bytes", &N::window_bytes, rank_own),
                      option_field("block_bytes", &N::block_bytes, rank_own),
                      option_field("queue_depth", &N::queue_depth, rank_own),
                      option_field("direct", &N::direct, rank_own)};
  }
};

// The ZeRO++ options a stage cannot take, or "": what each does and why
// the stage has nothing for it, for every place that checks (the engine,
// zero::Config, the planner's schedule), each naming itself first.
inline std::string zeropp_stage_problem(bool hpz, bool qwz, bool qgz, int stage) {
  if (hpz && stage != 3)
    return detail::concat("hpz keeps a secondary copy of stage 3's gathered parameters inside each node; at stage ", stage,
                  " the parameters are whole on every rank: use stage 3, or turn hpz off");
  if (qwz && stage != 3)
    return detail::concat("qwz quantizes stage 3's parameter gathers; stage ", stage,
                  " gathers no parameters before use: use stage 3, or turn qwz off");
  if (qgz && stage == 0)
    return "qgz quantizes the gradient reduce-scatter of stages 1-3; stage 0 all-reduces whole gradients: use a "
           "stage of 1 or more, or turn qgz off";
  return "";
}

struct Options {
  // Gradient bucket: consecutive units whose gradients fit in this many
  // bytes (a larger unit is a bucket of its own) are staged until the last
  // of them is ready, then their reductions are launched together (one NCCL
  // group), as DeepSpeed's reduce_bucket_size. The staging holds the largest
  // bucket (engine/detail/buffer_sizes.hpp). Stages 0 and 1 without accumulation
  // take gradients in place and stage nothing. 0 (the default): automatic,
  // 32 MiB, and at stages 2-3 at most a quarter of the model's gradient per
  // staging set, so that the staging never holds a small model whole and
  // the shard plus the staging stays below stage 0's gradient wherever the
  // largest unit allows (effective_bucket_bytes).
  std::size_t bucket_bytes = 0;
  // How backward writes gradients.
  // overwrite: grad_buffer(u) hands out a buffer whose contents are
  //   undefined, and backward assigns (=) every element of one unit at a time
  //   (grad_buffer, write, grad_ready, then the next unit). Nothing is
  //   zeroed. In the run's first micro-batch each buffer is filled with a
  //   marker that grad_ready() checks is gone, so a backward that adds (+=)
  //   or skips elements is an error there, never stale gradients.
  // accumulate: grad_buffer(u) hands out a zeroed buffer, for any unit, in
  //   any order, as often as backward needs it (a tied weight used at both
  //   ends of the model), and backward may add into it (+=); grad_ready(u)
  //   says the unit's gradient is final for this micro-batch, and step()
  //   makes the rest final (a unit never handed out has a zero gradient).
  //   Stages 0-1 hand out the gradient accumulator itself (no staging, with
  //   accumulation steps too); stages 2-3 keep a bucket's staging until its
  //   last unit is final, `live_buckets` buckets at once (plus one to overlap
  //   communication on a GPU).
  GradWrites grad_writes = GradWrites::overwrite;
  int live_buckets = 2;
  // Parameters registered over your own memory (use_memory), on the host:
  // the pages wholly inside a stage-3 unit's parameter slices go back to
  // the operating system when the unit is released, and those of a unit's
  // gradient slices once the engine has taken the gradient (they read as
  // zeros again), so resident memory follows the stage's share. Your arrays
  // must be anonymous memory (malloc, new, mmap without a file).
  bool release_memory_pages = false;
  // Stage 3: units gathered ahead of the one in use (the gather arena holds
  // the prefetch_units + 1 largest units).
  int prefetch_units = 1;
  // Stage 3: where the parameter and gradient shards live between uses
  // (ParamPlace); disk keeps prefetch_units + 2 units' shards of each in
  // memory (read ahead).
  ParamPlace param_place = ParamPlace::device;
  // Micro-batches summed before each optimizer step.
  int grad_accumulation_steps = 1;
  // Global L2 norm clipping of the (unscaled, averaged) gradient; 0 turns it off.
  double clip_norm = 0.0;
  // Summed gradients are multiplied by 1/divisor in the fused step. 0 means
  // ranks x grad_accumulation_steps (each rank's gradient is the mean over its
  // micro-batch, as with a mean loss).
  double gradient_divisor = 0.0;
  LossScaleOptions loss_scale{};
  ReduceDType reduce_dtype = ReduceDType::same_as_grad;
  // Seed for anything random the optimizer does (stochastic rounding).
  std::uint64_t seed = 0x5eed;
  // bf16 parameter copies written with stochastic rounding (refused with
  // another precision, whose copies it would not change).
  bool stochastic_rounding = false;
  // The fp32 master of bf16 parameters as the parameters plus a 16-bit
  // remainder (MasterWeights::remainder): 2 bytes per parameter less.
  MasterWeights master = MasterWeights::fp32;
  // bf16 parameter copies rounded to nearest with ties away from zero, not
  // to even: what MasterWeights::remainder implies; set it with an fp32
  // master to compare a run with a remainder run bit for bit.
  bool round_ties_away = false;
  // The optimizer state's storage (StateFormat): bf16 halves it, blockwise8
  // takes about a quarter.
  StateFormat states = StateFormat::fp32;
  // StateFormat::blockwise8: elements per block (one fp32 absmax each; the
  // paper's 2048), counted from each parameter's first element, and the
  // size below which a parameter keeps fp32 states (bitsandbytes' 4096:
  // biases and norms are few elements and sensitive).
  std::size_t state_block = 2048;
  std::size_t state_fp32_below = 4096;
  // Stage 3, ZeRO++'s hpZ: the first gather of a unit after a step (forward)
  // leaves each rank a secondary copy of a 1/ranks_per_node part of the
  // unit, so every later gather of it until the next step (backward, and
  // the further micro-batches) is an all-gather inside the node
  // (comm::Topology; the communicator must split: node()). The same values
  // bit for bit; costs the parameters / ranks_per_node more memory. Never
  // saved: rebuilt after a load.
  bool hpz = false;
  // hpZ's secondary copy as int8 blocks of qwz_block elements (one fp32
  // scale each) instead of parameters: about half the copy's memory for
  // 16-bit parameters (a quarter for fp32) and half of the gathers inside the
  // node; backward then computes with parameters within half a step of their
  // block's scale (forward's are exact without qwz). Needs hpz.
  bool hpz_int8 = false;
  // Stage 3, ZeRO++'s qwZ: every gather over all ranks (forward's, and
  // backward's without hpz) sends the shards as int8 codes with one fp32
  // scale per block of qwz_block elements (quant/symmetric.hpp): a little
  // over half the bytes of 16-bit parameters, a quarter of fp32 ones (256:
  // 0.508 and 0.254; the GPT trainer's loss moves by 0.001 where blocks of
  // 2048 moved it by 0.018, docs/zeropp.md). Not
  // exact: forward (and backward without hpz) computes with parameters
  // moved by up to half a step of their block's scale (absmax / 127); the
  // shards, master and update stay exact.
  bool qwz = false;
  std::size_t qwz_block = 256;
  // Stages 1-3, ZeRO++'s qgZ: each gradient reduce-scatter becomes two
  // all-to-alls of block-quantized gradients (qgz_bits: 4 or 8, one fp32
  // scale per qgz_block elements): inside the node every rank sends each
  // node-mate the shards it will reduce, which sums them in fp32 and
  // quantizes the node's partial sums again; across nodes each rank then
  // sends every other node the partial sum of its shard, and sums what comes
  // back (engine/detail/quantized_reducer.hpp). The bytes that cross nodes fall from
  // about the unit's 16-bit size to 1/ranks_per_node of its int4 size.
  // Not exact: each gradient moves by up to half a step of its block's scale
  // twice. qgz_error_feedback keeps what each quantization dropped (an fp32
  // residual per gradient element and node partial, per rank: 4 bytes x
  // (1 + 1/ranks_per_node) per parameter) and adds it to the next call's
  // gradient, so that errors do not add up over steps; not saved in
  // checkpoints (a resumed run starts with none). Needs qgz.
  bool qgz = false;
  int qgz_bits = 4;
  std::size_t qgz_block = 256;
  bool qgz_error_feedback = false;
  // Offload (cpu or nvme): CPU threads of the host update (0: OpenMP's
  // default, OMP_NUM_THREADS), and whether host buffers that could not be
  // page-locked are an error (true) or a warning and pageable memory (false).
  int offload_threads = 0;
  bool require_pinned_memory = false;
  // Offload: page-locked host buffers are locked in pieces of at most this
  // many bytes, cut between units (1 GiB; see backend/pieced_buffer.hpp).
  std::size_t pinned_piece_bytes = backend::default_pinned_piece_bytes;
  // Offload: the delayed parameter update of the ZeRO-Offload paper. After
  // `delayed_update_warmup` steps, step t's CPU update runs in the
  // background while step t+1's micro-batches use the parameters of step
  // t-1; it lands (parameters copied to the device, gathered at stages 1-2)
  // at the next step(), wait_update(), or any call that reads the state.
  bool delayed_update = false;
  int delayed_update_warmup = 10;
  // Each step compares a fingerprint of every rank's copy of the parameters
  // (stages 0-2: after the update; stage 3: each unit as acquire_unit()
  // gathered it) and names a rank whose bytes differ, with the unit, before
  // anything is updated: silent data corruption (a bit flipped in memory, a
  // core or a link) found at the next step instead of weeks later as a slow
  // divergence. One double per rank more in the step's control all-reduce,
  // and a pass over what is fingerprinted (engine/detail/replica_check.hpp).
  bool check_replicas = false;
  NvmeOptions nvme{};

  // (zero::Config compares whole configurations.)
  bool operator==(const Options&) const = default;

  // The field table (see OptionField), in the order of the members: a
  // member added above gets its row here.
  static constexpr auto fields() {
    using O = Options;
    constexpr AgreedWhen all = on_every_rank;
    // Read by 8-bit states alone: ranks may differ in them otherwise.
    constexpr AgreedWhen with_blockwise8 = [](const Options& o) { return o.states == StateFormat::blockwise8; };
    return std::tuple{option_field("bucket_bytes", &O::bucket_bytes, all),
                      option_field("grad_writes", &O::grad_writes, all),
                      option_field("live_buckets", &O::live_buckets, all),
                      option_field("release_memory_pages", &O::release_memory_pages, all),
                      option_field("prefetch_units", &O::prefetch_units, all),
                      option_field("param_place", &O::param_place, rank_own),
                      option_field("grad_accumulation_steps", &O::grad_accumulation_steps, all),
                      option_field("clip_norm", &O::clip_norm, all),
                      option_field("gradient_divisor", &O::gradient_divisor, all),
                      option_group("loss_scale", &O::loss_scale),
                      option_field("reduce_dtype", &O::reduce_dtype, all),
                      option_field("seed", &O::seed, all),
                      option_field("stochastic_rounding", &O::stochastic_rounding, all),
                      option_field("master", &O::master, all),
                      option_field("round_ties_away", &O::round_ties_away, all),
                      option_field("states", &O::states, all),
                      option_field("state_block", &O::state_block, with_blockwise8),
                      option_field("state_fp32_below", &O::state_fp32_below, with_blockwise8),
                      option_field("hpz", &O::hpz, all),
                      option_field("hpz_int8", &O::hpz_int8, all),
                      option_field("qwz", &O::qwz, all),
                      option_field("qwz_block", &O::qwz_block, all),
                      option_field("qgz", &O::qgz, all),
                      option_field("qgz_bits", &O::qgz_bits, all),
                      option_field("qgz_block", &O::qgz_block, all),
                      option_field("qgz_error_feedback", &O::qgz_error_feedback, all),
                      option_field("offload_threads", &O::offload_threads, rank_own),
                      option_field("require_pinned_memory", &O::require_pinned_memory, rank_own),
                      option_field("pinned_piece_bytes", &O::pinned_piece_bytes, rank_own),
                      option_field("delayed_update", &O::delayed_update, all),
                      option_field("delayed_update_warmup", &O::delayed_update_warmup, all),
                      option_field("check_replicas", &O::check_replicas, all),
                      option_group("nvme", &O::nvme)};
  }

  // The bf16 copies' rounding: half away from zero (remainder master or
  // round_ties_away), or to even.
  bool copies_round_ties_away() const { return round_ties_away || master == MasterWeights::remainder; }

  void validate() const {
    require(!(stochastic_rounding && copies_round_ties_away()),
            master == MasterWeights::remainder
                ? "Options::master is remainder and Options::stochastic_rounding is on: a remainder master's bf16 "
                  "copy must be the master rounded half away from zero (the remainder then holds the rest); "
                  "stochastic rounding needs an fp32 master: set one of them off"
                : "Options::round_ties_away and Options::stochastic_rounding are both on: the bf16 copies are "
                  "rounded one way; set one of them off");
    // Read by blockwise8 alone (engine/detail/state_blocks.hpp, which checks it
    // again), so other formats leave it unchecked, as the docs present it.
    if (states == StateFormat::blockwise8)
      require(allowed_state_block(state_block), "Options::state_block is ", state_block, "; it must be ",
              state_block_rule, " (elements per 8-bit state block: 2048 is the paper's, 256 bitsandbytes' today)");
    require(qwz_block >= 32 && qwz_block <= (std::size_t{1} << 20), "Options::qwz_block is ", qwz_block,
            "; it must be in [32, 1048576] (elements per int8 block of qwZ's gathers, each with one fp32 scale; "
            "256 is the default)");
    require(!hpz_int8 || hpz, "Options::hpz_int8 keeps hpZ's secondary copy as int8 blocks, but Options::hpz is off: "
            "turn hpz on, or hpz_int8 off");
    require(qgz_bits == 4 || qgz_bits == 8, "Options::qgz_bits is ", qgz_bits,
            "; qgZ's gradient codes are 4 bits (int4, the default) or 8 (int8)");
    require(qgz_block >= 32 && qgz_block <= (std::size_t{1} << 20) && qgz_block % 2 == 0, "Options::qgz_block is ",
            qgz_block, "; it must be even and in [32, 1048576] (elements per block of qgZ's gradient codes, each "
            "with one fp32 scale; int4 codes are two to a byte; 256 is the default)");
    require(!qgz_error_feedback || qgz, "Options::qgz_error_feedback carries what qgZ's gradient quantization "
            "dropped into the next step, but Options::qgz is off: turn qgz on, or qgz_error_feedback off");
    require(prefetch_units >= 0 && prefetch_units <= 16, "Options::prefetch_units is ", prefetch_units,
            "; it must be in [0, 16]");
    require(live_buckets >= 1 && live_buckets <= 64, "Options::live_buckets is ", live_buckets,
            "; it must be in [1, 64] (gradient buckets whose staging may be live at once with "
            "Options::grad_writes = accumulate; 2 lets one bucket, a tied embedding's, stay live through backward)");
    require(grad_accumulation_steps >= 1, "Options::grad_accumulation_steps is ", grad_accumulation_steps,
            "; it must be >= 1");
    require(std::isfinite(clip_norm) && clip_norm >= 0, "Options::clip_norm is ", clip_norm,
            "; it must be >= 0 (0 turns clipping off)");
    require(std::isfinite(gradient_divisor) && gradient_divisor >= 0, "Options::gradient_divisor is ",
            gradient_divisor, "; it must be > 0, or 0 for ranks x accumulation steps");
    require(offload_threads >= 0 && offload_threads <= simd::max_host_threads, "Options::offload_threads is ",
            offload_threads, "; it must be in [0, ", simd::max_host_threads, "] (0: OpenMP's default)");
    require(pinned_piece_bytes >= 4096, "Options::pinned_piece_bytes is ", pinned_piece_bytes,
            "; page-locked host memory is locked in pieces of at least one 4 KiB page: use 1 GiB (the default)");
    require(delayed_update_warmup >= 0, "Options::delayed_update_warmup is ", delayed_update_warmup,
            "; it must be >= 0 (steps updated in place before the update is delayed)");
    // The least any optimizer needs with these formats (no state slots);
    // offload::Nvme checks its own optimizer's at finalize().
    const std::size_t master_bytes = master_element_bytes(master), state_bytes = state_element_bytes(states);
    const std::string window = offload::disk_window_problem(nvme.window_bytes, std::nullopt, master_bytes,
                                                            state_bytes, name(master), name(states));
    require(window.empty(), window, offload::disk_window_advice);
    const auto& ls = loss_scale;
    require(std::isfinite(ls.initial_scale) && ls.initial_scale >= 1, "Options::loss_scale.initial_scale is ",
            ls.initial_scale, "; it must be >= 1");
    require(ls.growth_interval >= 1, "Options::loss_scale.growth_interval is ", ls.growth_interval,
            "; it must be >= 1");
    require(std::isfinite(ls.growth_factor) && ls.growth_factor > 1, "Options::loss_scale.growth_factor is ",
            ls.growth_factor, "; it must be a finite number > 1");
    require(ls.backoff_factor > 0 && ls.backoff_factor < 1, "Options::loss_scale.backoff_factor is ",
            ls.backoff_factor, "; it must be in (0, 1)");
    require(ls.hysteresis >= 1, "Options::loss_scale.hysteresis is ", ls.hysteresis, "; it must be >= 1");
    require(ls.min_scale >= 1 && ls.min_scale <= ls.initial_scale, "Options::loss_scale.min_scale is ",
            ls.min_scale, "; it must be in [1, initial_scale]");
  }
};

static_assert(detail::agreed_fields_exchangeable<Options>(),
              "a field of Options::fields() that ranks agree on is a number, a flag or an enum: ranks exchange it "
              "as 64 bits (text, such as a directory, is a rank's own)");

// An option of the bf16 parameter copies set where there are none, or "":
// fp16 copies are always rounded to nearest even and fp32 training keeps no
// copy, so the option would silently change nothing. For every place that
// checks (the engine, zero::Config, the planner), each naming itself first.
inline std::string bf16_copy_option_problem(const Options& options, PrecisionChoice precision) {
  if (precision == PrecisionChoice::bf16) return "";
  const char* option = options.stochastic_rounding ? "stochastic_rounding"
                       : options.round_ties_away   ? "round_ties_away"
                                                   : nullptr;
  if (option == nullptr) return "";
  return detail::concat(option, " is on, but the precision is ", name(precision), ": it rounds bf16 parameter copies, ",
                        precision == PrecisionChoice::fp16 ? "and fp16 copies are always rounded to nearest even"
                                                           : "and fp32 training keeps no 16-bit copy",
                        ", so it would change nothing: turn ", option, " off, or use precision bf16");
}

}  // namespace zero
