// Why: the run-time way in. zero::make_optimizer(comm, config) reads a
// zero::Config (runtime/config.hpp; from JSON with runtime/config_json.hpp,
// or from the trainers' flags) and returns the engine it names behind
// AnyOptimizer, so a program that lets its user pick the precision,
// optimizer, stage and offload tier compiles one engine per precision and
// optimizer (twelve for the built-in ones), instead of one type per
// combination. A bad config is an error naming the setting and the fix, in
// the words of ZeroOptimizer's static_asserts.
//
//   zero::Config config = zero::load_config("zero.json");
//   auto opt = zero::make_optimizer<zero::backend::Host>(comm, config);
//   opt->add_unit(...); ... opt->finalize(); ... opt->step();
//
// The template arguments after the backend add what the program was built
// with: zero::offload::Nvme (after #include
// "zero/offload/disk_state_store.hpp", liburing) makes offload "nvme"
// available, as it does for ZeroOptimizer, and any user optimizer policy
// becomes selectable by its name (examples/lion_optimizer.cpp registers Lion
// this way):
//   zero::make_optimizer<zero::backend::Host, zero::offload::Nvme, Lion>(comm, config)
#pragma once

#include "zero/compiler.hpp"

#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "zero/backend/host.hpp"
#include "zero/engine/engine.hpp"
#include "zero/optim/adam.hpp"
#include "zero/optim/sgd.hpp"
#include "zero/policies.hpp"
#include "zero/runtime/any_optimizer.hpp"
#include "zero/runtime/config.hpp"
#include "zero/runtime/hyper_fields.hpp"

namespace zero {

namespace detail {

// The engine of precision P, optimizer O and backend B behind AnyOptimizer.
template <PrecisionPolicy P, optim::Policy O, BackendPolicy B>
class EngineHandle final : public AnyOptimizer {
  using E = Engine<P, O, B>;
  using Ops = backend::Ops<B>;
  using T = typename P::param_type;
  using G = typename P::grad_type;
  static constexpr bool widen = !std::is_same_v<T, float>;

 public:
  template <comm::Communicator Comm>
  EngineHandle(Comm& comm, const Config& config, typename E::DiskMaker disk)
      : engine_(comm, config.stage, config.offload, hyper_from<O>(config.hyper), config.options, disk) {}

  const RunShape& shape() const override { return engine_.shape(); }
  DType param_dtype() const override { return dtype_traits<T>::dtype; }
  const char* optimizer_name() const override { return O::name; }
  const char* backend_name() const override { return B::name; }

  // The calls as ZeroOptimizer has them, each passed on as it is (the list: any_optimizer.hpp).
#define ZERO_DETAIL_FORWARD_CALL(result, name, parameters, arguments, qualifier) \
  result name parameters qualifier override { return engine_.name arguments; }
  ZERO_DETAIL_FORWARDED_CALLS(ZERO_DETAIL_FORWARD_CALL)
#undef ZERO_DETAIL_FORWARD_CALL

  void use_memory(ParamId p, void* values, void* grads) override {
    engine_.use_memory(p, static_cast<T*>(values), static_cast<G*>(grads));
  }
  void finalize() override {
    engine_.finalize();
    if constexpr (widen) {
      wide_params_ = typename Ops::template Buffer<float>(engine_.layout().max_unit());
      wide_grads_ = typename Ops::template Buffer<float>(engine_.layout().max_unit());
      check_wide_ = engine_.options().grad_writes == GradWrites::overwrite;
    }
  }
  void gather_params(void* out) override { engine_.gather_params(static_cast<T*>(out)); }
  void gather_params_fp32(float* out) override {
    if constexpr (widen) {
      // Gathered in the storage type (half the bytes of fp32), widened on the host.
      std::vector<T> low(engine_.layout().padded_total());
      engine_.gather_params(low.data());
      backend::Ops<backend::Host>::convert(out, low.data(), low.size());
    } else {
      engine_.gather_params(out);
    }
  }

  void release_unit(UnitId u) override {
    engine_.release_unit(u);
    if (fp32_unit_ == u.index) fp32_unit_ = npos;
  }
  void* grad_buffer(UnitId u) override {
    wide_grad_of_ = npos;
    return engine_.grad_buffer(u);
  }
  // (Parameters and their alignment gaps: the engine zeroes the gaps and
  // the tail of every gradient it is handed.)
  void grad_ready(UnitId u) override {
    if constexpr (widen)
      if (wide_grad_of_ == u.index) {
        // The engine's own check cannot see through the conversion: this
        // buffer is checked as it would check its own.
        if (check_wide_) unwritten_.check(engine_.layout(), engine_.layout().units()[u.index], wide_grads_.data());
        Ops::convert(wide_grad_target_, wide_grads_.data(), engine_.layout().units()[u.index].numel);
        wide_grad_of_ = npos;
      }
    engine_.grad_ready(u);
  }
  const float* acquire_fp32(UnitId u) override {
    const T* p = engine_.acquire_unit(u);
    if constexpr (widen) {
      Ops::convert(wide_params_.data(), p, engine_.layout().units()[u.index].numel);
      fp32_params_ = wide_params_.data();
    } else {
      fp32_params_ = p;
    }
    fp32_unit_ = u.index;
    return fp32_params_;
  }
  const float* param_data_fp32(ParamId p) const override {
    const Layout& layout = engine_.layout();
    require(p.index < layout.params().size(), "param_data_fp32: parameter id ", p.index, " does not exist (",
            layout.params().size(), " parameters)");
    const ParamInfo& info = layout.param(p);
    require(fp32_unit_ == info.unit.index, "param_data_fp32('", info.name, "'): acquire_fp32('",
            layout.unit(info.unit).name, "') first: the fp32 values are the copy acquire_fp32 makes of the unit, "
            "valid until the next acquire_fp32 or release_unit (param_data has the stored values)");
    return fp32_params_ + info.offset;
  }
  float* grad_buffer_fp32(UnitId u) override {
    // The engine's buffer is handed out all the same: that is where it
    // flushes or waits for the previous bucket.
    G* g = engine_.grad_buffer(u);
    if constexpr (widen) {
      require(engine_.options().grad_writes == GradWrites::overwrite, "grad_buffer_fp32('",
              engine_.layout().units()[u.index].name, "'): with ", dtype_name(dtype_traits<T>::dtype),
              " storage the fp32 gradient is one unit's, converted at grad_ready(), so it needs Options::grad_writes "
              "= overwrite; with accumulate, add into grad_buffer_as<", dtype_name(dtype_traits<T>::dtype),
              ">() or use fp32 precision");
      wide_grad_of_ = u.index;
      wide_grad_target_ = g;
      if (check_wide_)
        unwritten_.fill(wide_grads_.data(), engine_.layout().units()[u.index].padded, P::loss_scaling);
      return wide_grads_.data();
    } else {
      return g;
    }
  }

  StepResult step() override {
    if constexpr (widen)
      if (check_wide_) {  // the first micro-batch was checked
        check_wide_ = false;
        unwritten_.release();
      }
    return engine_.step();
  }
  double hyper_value(const std::string& name) const override {
    const auto values = hyper_to_map<O>(engine_.hyper());
    const auto it = values.find(name);
    require(it != values.end(), "optimizer '", O::name, "' has no hyper-parameter '", name, "'");
    return it->second;
  }
  void set_hyper(const std::string& name, double value) override {
    auto values = hyper_to_map<O>(engine_.hyper());
    values[name] = value;
    engine_.hyper() = hyper_from<O>(values);
  }

  void save(const std::string& dir, checkpoint::OptimizerSaveOptions options) override {
    Io::save(engine_, dir, std::move(options));
  }
  std::filesystem::path save_step(const std::string& root, checkpoint::OptimizerSaveOptions options) override {
    return Io::save_step(engine_, root, std::move(options));
  }
  checkpoint::LoadResult load(const std::string& path) override { return Io::load(engine_, path); }
  void load_hf(const std::string& path) override { Io::load_hf(engine_, path); }

 private:
  using Io = checkpoint::OptimizerIo<E>;
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);
  E engine_;
  // 16-bit storage: one unit in fp32, in backend memory, for acquire_fp32
  // and grad_buffer_fp32.
  typename Ops::template Buffer<float> wide_params_, wide_grads_;
  // What acquire_fp32 handed out last (wide_params_, or with fp32 storage the
  // engine's unit), for param_data_fp32; npos once released.
  std::size_t fp32_unit_ = npos;
  const float* fp32_params_ = nullptr;
  std::size_t wide_grad_of_ = npos;  // the unit whose gradient is in wide_grads_
  G* wide_grad_target_ = nullptr;    // and the engine's buffer it goes to
  bool check_wide_ = false;          // overwrite, the first micro-batch: the fp32 gradient is checked
  detail::UnwrittenCheck<Ops, float> unwritten_;
};

template <class X>
constexpr bool is_disk_tier = std::is_same_v<X, offload::Nvme>;
// The disk tier's maker where make_optimizer's With... names offload::Nvme
// (DiskTierOf, as ZeroOptimizer finds it: a static_assert names the include
// when it is missing), or NoDiskTier.
template <class... W>
struct DiskTierIn {
  using type = NoDiskTier;
};
template <class W, class... Rest>
struct DiskTierIn<W, Rest...> {
  using type = std::conditional_t<is_disk_tier<W>, typename DiskTierOf<W>::type, typename DiskTierIn<Rest...>::type>;
};

}  // namespace detail

// The optimizer `config` names, on backend Backend, over `comm` (collective
// at finalize(), as ZeroOptimizer). `With...`: zero::offload::Nvme and
// user optimizer policies (see the top of this file).
template <BackendPolicy Backend = backend::Host, class... With, comm::Communicator Comm>
std::unique_ptr<AnyOptimizer> make_optimizer(Comm& comm, const Config& config) {
  static_assert(((detail::is_disk_tier<With> || optim::Policy<With>) && ...),
                "zero::make_optimizer<Backend, With...>: each argument after the backend is zero::offload::Nvme "
                "(the disk tier, after #include \"zero/offload/disk_state_store.hpp\") or an optimizer policy");
  constexpr bool disk = (detail::is_disk_tier<With> || ...);
  config.validate(Backend::device);
  if (config.offload == OffloadTier::nvme)
    require(disk, "zero::make_optimizer: offload nvme needs its store: #include "
                  "\"zero/offload/disk_state_store.hpp\" (liburing, xxhash.h) and pass zero::offload::Nvme: "
                  "make_optimizer<Backend, zero::offload::Nvme>(comm, config)");
  std::unique_ptr<AnyOptimizer> made;
  std::vector<std::string> known;
  auto with_precision = [&]<class O>(std::type_identity<O>) {
    known.push_back(O::name);
    if (made || config.optimizer != O::name) return;
    auto make = [&]<class P>(std::type_identity<P>) {
      using Grad = typename P::grad_type;
      using Param = typename P::param_type;
      using Disk = typename detail::DiskTierIn<With...>::type;
      made = std::make_unique<detail::EngineHandle<P, O, Backend>>(comm, config,
                                                                   Disk::template maker<O, Grad, Param>());
    };
    switch (config.precision) {
      case PrecisionChoice::fp32: make(std::type_identity<precision::Full<float>>{}); break;
      case PrecisionChoice::bf16: make(std::type_identity<precision::Mixed<bf16>>{}); break;
      case PrecisionChoice::fp16: make(std::type_identity<precision::Mixed<fp16>>{}); break;
    }
  };
  with_precision(std::type_identity<optim::AdamW>{});
  with_precision(std::type_identity<optim::Adam>{});
  // "sgd" made with momentum 0 keeps no momentum buffer, as torch.optim.SGD
  // (optim::PlainSgd); with momentum it keeps one (optim::Sgd).
  if (const auto momentum = config.hyper.find("momentum"); momentum != config.hyper.end() && momentum->second != 0.0)
    with_precision(std::type_identity<optim::Sgd>{});
  else
    with_precision(std::type_identity<optim::PlainSgd>{});
  (
      [&] {
        if constexpr (!detail::is_disk_tier<With>) with_precision(std::type_identity<With>{});
      }(),
      ...);
  if (!made) {
    std::string list;
    for (const auto& k : known) list += (list.empty() ? "" : ", ") + k;
    throw InvalidArgument(detail::concat("zero::make_optimizer: optimizer '", config.optimizer,
                                         "' is not one this program knows (", list,
                                         "); a policy of your own is passed as a template argument: "
                                         "make_optimizer<Backend, MyPolicy>(comm, config)"));
  }
  return made;
}

}  // namespace zero

#if defined(ZERO_PRECOMPILED_ENGINES)  // compiled once elsewhere (zero/runtime/precompiled.hpp)
#include "zero/runtime/precompiled.hpp"
ZERO_EXTERN_HANDLES(::zero::backend::Host)
#endif
