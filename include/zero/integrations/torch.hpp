// Why: users of PyTorch's C++ frontend (LibTorch) have a torch::nn::Module
// whose parameters and gradients live in tensors the module allocated, and a
// backward that autograd runs and that adds (+=) into each parameter's
// .grad. This adapter fits such a model to the optimizer without touching
// its model code at stages 0-2, and with one wrapper per unit call at
// stage 3, the places FSDP wraps in Python:
//
//   auto opt = zero::make_optimizer<zero::backend::Host>(comm, config);  // fp32, grad_writes accumulate
//   zero::integrations::TorchModule zt(*opt, *model);   // units by submodule; finalizes; values from the model
//   ... loss = model->forward(x); loss.backward(); zt.step();
//   // stage 3: inside forward, x = zt.run(unit, x, [&](torch::Tensor x) { return block->forward(x); });
//
// What it does:
//   - registers the module's parameters by submodule as units (each direct
//     child; a child that is only a container, such as a ModuleList, gives
//     one unit per child of its own; or the submodules you name), a tied
//     parameter (the same tensor in two modules) once, a frozen one
//     (requires_grad false when the adapter is made) not at all: it stays
//     the module's, whole on every rank, never updated;
//   - parameters: at stages 0-2 each parameter tensor becomes a view of the
//     optimizer's own parameters (which the step updates in place: nothing
//     copied, nothing held twice); at stage 3 the tensor is the optimizer's
//     "your own memory" (use_memory): a unit's values are written into it
//     when the unit is gathered;
//   - gradients: each .grad, allocated here as zeros, is where autograd adds
//     and where the optimizer takes the gradient (use_memory; zeroing it
//     after);
//   - it holds a reference to every tensor whose memory the optimizer reads
//     or writes (each .grad; at stage 3 each parameter's storage), so
//     nothing the module does (zero_grad(true), set_data, torch::load) frees
//     memory the optimizer still points at, and checks before each use that
//     the module still reads and writes there: a .grad set to none, a
//     parameter's storage replaced, a parameter registered after the adapter
//     was made, and a step without new gradients are each refused with the
//     fix in the message;
//   - at stage 3, run(u, x, f) gathers unit u before f (the unit's forward),
//     releases it after, gathers it again when backward reaches the unit's
//     output (an autograd function at each end of the unit, as FSDP's
//     pre- and post-backward hooks) and, after the unit's backward, releases
//     it and marks its gradient final once every use of the unit in the
//     pass is done (a tied unit used twice is final after its second).
//
// Costs, per rank (docs/tutorial.md, "LibTorch"): each unit's gradient is
// copied out of .grad once per micro-batch (the .grad tensors are full size
// at every stage); the parameters cost nothing more at stages 0-2 (views),
// and at stage 3 a copy into the tensors at each gather: a tensor holds its
// values only while its unit is gathered, and with
// Options::release_memory_pages its pages (and those of a taken gradient) go
// back to the operating system. step() walks the module's parameter list
// (about 0.4 us per parameter).
//
// Precision: the module's tensors have the optimizer's storage type: fp32,
// or bf16/fp16 with the fp32 master weights in the optimizer (fp16: scale
// the loss by loss_scale() before backward). Limits, each checked with the
// fix in the message: CPU tensors with backend::Host; contiguous
// parameters; the gradient mode GradWrites::accumulate (what autograd does);
// every parameter registered (and unfrozen) before the adapter is made. The
// module must outlive the adapter (step() reads its parameter list).
#pragma once

#include "zero/compiler.hpp"

#include <torch/autograd.h>
#include <torch/nn/module.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "zero/engine/engine.hpp"  // StepResult
#include "zero/engine/held_whole.hpp"
#include "zero/engine/layout.hpp"
#include "zero/engine/options.hpp"
#include "zero/error.hpp"
#include "zero/precision/types.hpp"
#include "zero/runtime/name_list.hpp"
#include "zero/shape.hpp"

namespace zero::integrations {

struct TorchModuleOptions {
  // Submodule paths (as named_modules() names them: "blocks.0") that become
  // units, in the order forward uses them. Empty: each direct child of the
  // module, a child without parameters of its own but with children (a
  // ModuleList, a Sequential of blocks) giving one unit per child, and the
  // module's own parameters, if any, the unit "(root)".
  std::vector<std::string> units;
};

namespace detail {

// What the autograd functions at a unit's two ends call back into (the
// adapter is a template over the optimizer type; the functions are not).
class TorchUnitEvents {
 public:
  virtual void entered(std::size_t unit) = 0;                      // forward reaches the unit
  virtual void left(std::size_t unit) = 0;                         // its forward is done
  virtual void backward_reached(std::size_t unit) = 0;             // backward reaches its output
  virtual void backward_done(std::size_t unit) = 0;                // and is through its input

 protected:
  ~TorchUnitEvents() = default;
};

inline std::int64_t events_key(TorchUnitEvents* events) {
  return static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(events));
}
inline TorchUnitEvents* events_of(torch::autograd::AutogradContext* ctx) {
  return reinterpret_cast<TorchUnitEvents*>(static_cast<std::intptr_t>(ctx->saved_data["events"].toInt()));
}

// The input end of a unit: forward gathers it; backward (which autograd runs
// after the unit's own backward nodes, created later) releases it.
struct UnitInput : torch::autograd::Function<UnitInput> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, std::int64_t events,
                               std::int64_t unit) {
    ctx->saved_data["events"] = events;
    ctx->saved_data["unit"] = unit;
    events_of(ctx)->entered(static_cast<std::size_t>(unit));
    return x;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    events_of(ctx)->backward_done(static_cast<std::size_t>(ctx->saved_data["unit"].toInt()));
    return {grads[0], torch::Tensor(), torch::Tensor()};
  }
};

// The output end: forward releases the unit; backward gathers it again
// before the unit's backward reads its parameters (unless it needs none).
struct UnitOutput : torch::autograd::Function<UnitOutput> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor y, std::int64_t events,
                               std::int64_t unit, bool backward_reads_params) {
    ctx->saved_data["events"] = events;
    ctx->saved_data["unit"] = unit;
    ctx->saved_data["reads"] = backward_reads_params;
    events_of(ctx)->left(static_cast<std::size_t>(unit));
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (ctx->saved_data["reads"].toBool())
      events_of(ctx)->backward_reached(static_cast<std::size_t>(ctx->saved_data["unit"].toInt()));
    return {grads[0], torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace detail

// Fits a torch::nn::Module to `Optimizer` (zero::AnyOptimizer from
// make_optimizer, or a ZeroOptimizer). Construct
// it on every rank, over a replica of the model with the same initial values
// on every rank (the optimizer keeps the ranks' values equal from there),
// after every parameter is registered; the module must outlive it.
// Collective: the constructor (it finalizes the optimizer), step(), and at
// stage 3 run() and the backward through it.
template <class Optimizer>
class TorchModule final : private detail::TorchUnitEvents {
 public:
  TorchModule(Optimizer& opt, torch::nn::Module& module, TorchModuleOptions options = {})
      : opt_(opt), module_(module), stage_(opt.shape().stage.stage) {
    check_optimizer();
    register_units(module, options);
    opt_.finalize();
    // Every rank's replica starts from its own values: the same on every
    // rank (set_param's contract), as a same-seeded model is.
    for (std::size_t p = 0; p < params_.size(); ++p) {
      const torch::Tensor values = params_[p].tensor.detach().to(torch::kFloat32).contiguous();  // fp32, as it takes
      opt_.set_param(params_[p].id, values.data_ptr<float>());
    }
    if (views()) view_resident_params();
    held_.assign(units_.size(), 0);
    uses_.assign(units_.size(), 0);
  }
  // The parameter tensors get storage of their own again, holding the
  // values they last had (at stages 0-2 they were views of the optimizer's
  // memory, which may be freed after this).
  ~TorchModule() {
    if (!views()) return;
    for (Param& p : params_) p.tensor.set_data(p.tensor.detach().clone());
  }
  TorchModule(const TorchModule&) = delete;
  TorchModule& operator=(const TorchModule&) = delete;

  Optimizer& optimizer() { return opt_; }
  // The units, in registration order, and a unit by its name.
  const std::vector<std::string>& unit_names() const { return unit_names_; }
  UnitId unit(const std::string& name) const {
    for (std::size_t u = 0; u < unit_names_.size(); ++u)
      if (unit_names_[u] == name) return units_[u];
    for (const auto& frozen : frozen_units_)
      require(frozen != name, "TorchModule: unit '", name, "' has only frozen parameters (requires_grad false), "
              "which the optimizer does not hold: call it through run(name, x, f), which runs it as it is");
    throw Error("TorchModule: no unit named '" + name + "'; the units are " + listed(unit_names_));
  }
  // How many parameter tensors were registered (tied ones once; frozen ones
  // not), and the frozen ones' names.
  std::size_t param_count() const { return params_.size(); }
  const std::vector<std::string>& frozen_params() const { return frozen_params_; }

  // Runs f(x), the forward of unit u (any code that reads only u's
  // parameters), with u gathered (stage 3); through autograd, backward
  // gathers u again for f's backward, releases it after, and marks u's
  // gradient final after its last use in the pass. At stages 0-2 it only
  // marks the gradient final as backward leaves the unit. Pass
  // backward_reads_params = false where f's backward needs no parameter
  // values (an embedding lookup): no gather for it.
  template <class F>
  torch::Tensor run(UnitId u, torch::Tensor x, F&& f, bool backward_reads_params = true) {
    require(u.index < uses_.size(), "TorchModule::run: unit id ", u.index, " is not one of this adapter's (",
            uses_.size(), " units): take it from unit(name)");
    const std::int64_t events = detail::events_key(this);
    const auto unit = static_cast<std::int64_t>(u.index);
    // Every use autograd records; its input end counts it down after its
    // backward, except where x carries no gradient (an embedding's token
    // ids): autograd then gives that end no backward, and the unit's
    // gradient is made final by step() instead.
    if (torch::GradMode::is_enabled()) ++uses_[u.index];
    torch::Tensor entered = detail::UnitInput::apply(std::move(x), events, unit);
    torch::Tensor y = std::forward<F>(f)(entered);
    return detail::UnitOutput::apply(std::move(y), events, unit, backward_reads_params);
  }

  // run() by the unit's name; a unit whose parameters are all frozen is
  // the module's own and needs nothing: f(x).
  template <class F>
  torch::Tensor run(const std::string& unit_name, torch::Tensor x, F&& f, bool backward_reads_params = true) {
    for (const auto& frozen : frozen_units_)
      if (frozen == unit_name) return std::forward<F>(f)(std::move(x));
    return run(unit(unit_name), std::move(x), std::forward<F>(f), backward_reads_params);
  }

  // The optimizer's step for this micro-batch: units still gathered are
  // released; the module is checked to still have the parameters the
  // adapter registered, each reading the memory the optimizer writes and
  // each .grad the tensor the optimizer reads, and some .grad to have been
  // added into since the last step; every gradient not yet final becomes
  // final.
  StepResult step() {
    for (std::size_t u = 0; u < units_.size(); ++u) {
      while (held_[u] > 0) {
        opt_.release_unit(units_[u]);
        --held_[u];
      }
      uses_[u] = 0;
    }
    check_module_params();
    for (std::size_t u = 0; u < units_.size(); ++u) {
      check_values(u);
      check_grads(u);
    }
    check_new_grads();
    require(stage_ != 3 || entered_, "TorchModule: at stage 3 every unit's forward must run "
            "inside run(unit, x, f), which gathers its parameters; no unit was entered this micro-batch");
    entered_ = false;
    note_grad_versions();
    return opt_.step();
  }

  // Collective: the parameters whole in the module's tensors until the
  // scope ends (evaluation or generation on one rank; no-op at stages 0-2).
  [[nodiscard]] HeldWhole hold_whole() { return opt_.hold_whole(); }

 private:
  struct Param {
    ParamId id;
    std::string name;
    torch::Tensor tensor;  // the module's parameter (this TensorImpl: set_data keeps it the module's)
    // Where the optimizer reads the gradient: the .grad allocated at
    // registration, held here so that nothing the module does frees it
    // while the optimizer points at it (zero_grad(true) drops the module's
    // reference only); the module's .grad must stay this tensor's memory.
    torch::Tensor grad;
    // Where the module must read the values: at stage 3 an alias of the
    // tensor's storage at registration (held, as grad: the optimizer writes
    // each gather there), at stages 0-2 the view of the optimizer's own
    // parameters the tensor was pointed at.
    torch::Tensor values;
    // grad's version counter at the last step (autograd's += into a .grad
    // bumps it; the optimizer's zeroing does not): unchanged everywhere
    // means no backward since.
    std::int64_t grad_version = 0;
  };

  // The module's tensors are the optimizer's parameters and gradients, so
  // they have its storage type: fp32 (precision fp32), or bf16/fp16 (the
  // optimizer keeps the fp32 master weights; the module computes in 16 bits).
  void check_optimizer() {
    if constexpr (requires { opt_.param_dtype(); }) {
      dtype_ = opt_.param_dtype();  // AnyOptimizer
    } else {
      dtype_ = dtype_traits<typename Optimizer::param_type>::dtype;  // ZeroOptimizer
    }
    torch_dtype_ = dtype_ == DType::bf16 ? torch::kBFloat16 : dtype_ == DType::f16 ? torch::kFloat16 : torch::kFloat32;
    require(opt_.options().grad_writes == GradWrites::accumulate, "TorchModule: autograd adds into .grad; set "
            "options.grad_writes = zero::GradWrites::accumulate (JSON \"grad_writes\": \"accumulate\")");
  }

  void register_units(torch::nn::Module& module, const TorchModuleOptions& options) {
    std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> chosen;
    const auto all = module.named_modules("", /*include_self=*/false);
    if (!options.units.empty()) {
      for (const std::string& name : options.units) {
        const auto* found = all.find(name);
        require(found != nullptr, "TorchModule: no submodule named '", name, "' (TorchModuleOptions::units); the "
                "module's direct children are ", listed(module.named_children().keys()));
        chosen.emplace_back(name, *found);
      }
    } else {
      for (const auto& child : module.named_children()) {
        const bool container = child.value()->named_parameters(false).is_empty() &&
                               !child.value()->named_children().is_empty();
        if (!container) {
          chosen.emplace_back(child.key(), child.value());
          continue;
        }
        for (const auto& grandchild : child.value()->named_children())
          chosen.emplace_back(child.key() + "." + grandchild.key(), grandchild.value());
      }
    }
    std::map<const void*, std::string> owner;  // tensor -> name it was registered under
    // `path`: the submodule's ("" for the root's own parameters).
    auto add_unit = [&](const std::string& path, const torch::OrderedDict<std::string, torch::Tensor>& params) {
      const std::string unit_name = path.empty() ? "(root)" : path;
      std::vector<std::pair<std::string, torch::Tensor>> fresh;
      bool frozen_only = !params.is_empty();
      for (const auto& p : params) {
        const std::string name = path.empty() ? p.key() : path + "." + p.key();
        if (!owner.emplace(p.value().unsafeGetTensorImpl(), name).second) continue;  // tied: registered before
        known_.emplace(p.value().unsafeGetTensorImpl(), p.value().requires_grad());  // (step() checks the module)
        // A frozen parameter (requires_grad false, as fine-tuning leaves
        // it) stays the module's own, whole on every rank, never updated:
        // what a torch optimizer does with a parameter that gets no .grad.
        if (!p.value().requires_grad()) {
          frozen_params_.push_back(name);
          continue;
        }
        frozen_only = false;
        fresh.emplace_back(name, p.value());
      }
      if (fresh.empty()) {
        if (frozen_only) frozen_units_.push_back(unit_name);
        return;  // nothing to train: frozen, or only tied parameters registered with their first module
      }
      const UnitId u = opt_.add_unit(unit_name);
      units_.push_back(u);
      unit_names_.push_back(unit_name);
      for (auto& [name, tensor] : fresh) add_param(u, name, tensor);
    };
    if (options.units.empty()) add_unit("", module.named_parameters(false));
    for (const auto& [name, sub] : chosen) add_unit(name, sub->named_parameters(true));
    for (const auto& p : module.named_parameters(true))
      require(owner.contains(p.value().unsafeGetTensorImpl()), "TorchModule: parameter '", p.key(), "' is in none "
              "of the units (TorchModuleOptions::units): name its module, or leave the list empty");
  }

  void add_param(UnitId u, const std::string& name, torch::Tensor tensor) {
    require(tensor.scalar_type() == torch_dtype_, "TorchModule: parameter '", name, "' is ",
            std::string(c10::toString(tensor.scalar_type())), "; the optimizer stores ", dtype_name(dtype_),
            " parameters and gradients, which are the module's tensors: convert the module with module->to(torch::k",
            std::string(c10::toString(torch_dtype_)), "), or choose the precision of its tensors");
    require(tensor.device().is_cpu(), "TorchModule: parameter '", name, "' is on ", tensor.device().str(),
            "; this adapter runs backend::Host on CPU tensors");
    require(tensor.is_contiguous(), "TorchModule: parameter '", name, "' is not contiguous; the optimizer reads "
            "it as one array: make it contiguous before constructing the adapter");
    Shape shape;
    for (const auto d : tensor.sizes()) shape.push_back(static_cast<std::uint64_t>(d));
    const ParamId id = opt_.add_param(u, name, static_cast<std::size_t>(tensor.numel()), shape);
    // Autograd adds into a defined .grad in place (AccumulateGrad without
    // create_graph), so this tensor stays where the optimizer reads.
    tensor.mutable_grad() = torch::zeros_like(tensor);
    Param p{id, name, tensor, tensor.grad(), torch::Tensor(), tensor.grad()._version()};
    // Stage 3 writes a unit's values into the tensor at each gather; at
    // stages 0-2 the tensor becomes a view of the optimizer's own parameters
    // after finalize() (view_resident_params), which need no copy.
    if (stage_ == 3) p.values = tensor.detach();  // shares (and holds) the storage
    void* values = stage_ == 3 ? p.values.data_ptr() : nullptr;
    void* grads = p.grad.data_ptr();
    if constexpr (requires { opt_.param_dtype(); }) {
      opt_.use_memory(id, values, grads);  // AnyOptimizer: untyped
    } else {
      opt_.use_memory(id, static_cast<typename Optimizer::param_type*>(values),
                      static_cast<typename Optimizer::grad_type*>(grads));
    }
    unit_params_.resize(units_.size());
    unit_params_[u.index].push_back(params_.size());
    params_.push_back(std::move(p));
  }

  // Stages 0-2 keep every unit's parameters resident in the optimizer, in
  // place across steps (fp32: they are the master weights): each tensor is
  // pointed at its slice (set_data keeps the Parameter, its .grad and the
  // module's registration; the module's own storage is freed). No copy per
  // step, and no second copy of the parameters.
  void view_resident_params() {
    for (Param& p : params_) {
      const ParamInfo& info = opt_.layout().param(p.id);
      const UnitId u = units_[info.unit.index];
      const auto* base = static_cast<const std::byte*>(static_cast<const void*>(opt_.acquire_unit(u)));  // resident
      opt_.release_unit(u);
      auto* slice = const_cast<std::byte*>(base + info.offset * p.tensor.element_size());
      p.values = torch::from_blob(slice, p.tensor.sizes().vec(), p.tensor.options());
      p.tensor.set_data(p.values);
    }
  }
  // Stages 0-2: the tensors are views of the optimizer's parameters.
  bool views() const { return stage_ < 3; }

  // Unit u's parameters still read the memory the optimizer writes: after
  // set_data, torch::load (which set_()s each tensor) or module->to(), the
  // module would read values the optimizer never updates (stages 0-2) or
  // never gathers into (stage 3). Before each gather, and at step().
  void check_values(std::size_t u) const {
    for (const std::size_t i : unit_params_[u]) {
      const Param& p = params_[i];
      require(p.tensor.data_ptr() == p.values.data_ptr(), "TorchModule: parameter '", p.name, "' no longer "
              "has the memory the optimizer ", views() ? "updates" : "gathers its values into", " (its data was "
              "replaced after the adapter was made: set_data, set_, torch::load or module->to()), so the module "
              "would compute with values the optimizer never sets: load or convert the module before "
              "constructing the adapter, and after it set values through the optimizer (set_param, or load a "
              "checkpoint)");
    }
  }

  // Unit u's .grads are still the tensors the optimizer reads, checked
  // before it takes them (grad_ready, step): a .grad set to none
  // (zero_grad(true)) and made again by backward holds this micro-batch's
  // gradient where the optimizer does not read.
  void check_grads(std::size_t u) const {
    for (const std::size_t i : unit_params_[u]) {
      const Param& p = params_[i];
      const torch::Tensor& g = p.tensor.grad();
      require(g.defined() && g.data_ptr() == p.grad.data_ptr(), "TorchModule: the .grad of parameter '", p.name,
              "' is no longer the tensor the optimizer reads: it was set to none (model->zero_grad(true); in "
              "LibTorch 2.x zero_grad() does that by default) or assigned, so backward put the gradient "
              "elsewhere; the optimizer zeroes each .grad itself after taking it: call no zero_grad() and "
              "assign no .grad");
    }
  }

  // Some .grad was added into since the last step (each micro-batch's
  // backward adds into every parameter it reaches): a second step() in one
  // micro-batch would step again on zero gradients, moving the parameters
  // by the optimizer's state alone (momentum, Adam's moments).
  void check_new_grads() const {
    bool any = params_.empty();  // (nothing to train: nothing to check)
    for (const Param& p : params_) any = any || p.grad._version() != p.grad_version;
    require(any, "TorchModule::step(): no parameter's .grad was added into since the last step (a second step() "
            "in one micro-batch, or a step() before any backward): call step() once per micro-batch, after its "
            "loss.backward()");
  }
  // The step takes these gradients: the next one needs new ones.
  void note_grad_versions() {
    for (Param& p : params_) p.grad_version = p.grad._version();
  }

  // Every parameter the module has now is one the adapter registered or
  // left frozen: one registered later (or a parameter replaced under its
  // name), or one unfrozen later, is not the optimizer's and would never
  // be trained.
  void check_module_params() const {
    for (const auto& p : module_.named_parameters(/*recurse=*/true)) {
      const auto found = known_.find(p.value().unsafeGetTensorImpl());
      require(found != known_.end(), "TorchModule: parameter '", p.key(), "' was registered on the module after "
              "the adapter was made (or replaced a parameter of that name), so the optimizer does not hold it "
              "and would never update it: register every parameter before constructing the adapter");
      require(found->second || !p.value().requires_grad(), "TorchModule: parameter '", p.key(), "' was frozen "
              "(requires_grad false) when the adapter was made, so the optimizer does not hold it, and now "
              "requires a gradient that nothing would apply: set requires_grad before constructing the adapter");
    }
  }

  // Forward: gather (a collective at stage 3; nothing at 0-2), into the
  // memory the module still reads.
  void entered(std::size_t u) override {
    check_values(u);
    acquire_one(u);
    entered_ = true;
  }
  void left(std::size_t u) override { release_one(u); }
  void backward_reached(std::size_t u) override {
    check_values(u);
    acquire_one(u);
  }
  void backward_done(std::size_t u) override {
    check_grads(u);  // before grad_ready takes (reads and zeroes) them
    release_one(u);
    if (uses_[u] > 0 && --uses_[u] == 0) opt_.grad_ready(units_[u]);
  }
  // Stage 3 gathers and releases; stages 0-2 hold every unit resident.
  void acquire_one(std::size_t u) {
    if (stage_ != 3) return;
    opt_.acquire_unit(units_[u]);
    ++held_[u];
  }
  void release_one(std::size_t u) {
    if (stage_ != 3 || held_[u] == 0) return;
    opt_.release_unit(units_[u]);
    --held_[u];
  }

  template <class Names>
  static std::string listed(const Names& names) {
    return names.empty() ? std::string("(none)") : zero::detail::join_names(names);
  }

  Optimizer& opt_;
  const torch::nn::Module& module_;
  int stage_;
  // The adapter registers every unit, so units_[k] is UnitId{k}: the
  // per-unit vectors below and the layout's unit numbers index alike.
  std::vector<UnitId> units_;
  std::vector<std::string> unit_names_;
  std::vector<Param> params_;
  std::vector<std::vector<std::size_t>> unit_params_;  // per unit: its indices in params_
  // Every parameter the module had when the adapter was made (its
  // TensorImpl; held by params_ where trained, so never another's address):
  // true where registered, false where frozen.
  std::unordered_map<const void*, bool> known_;
  std::vector<std::string> frozen_params_, frozen_units_;  // not registered (requires_grad false)
  std::vector<int> held_;  // gathers not yet released, per unit
  std::vector<int> uses_;  // forward uses whose backward has not finished, per unit
  DType dtype_ = DType::f32;                   // the optimizer's storage type
  torch::ScalarType torch_dtype_ = torch::kFloat32;  // the same, as LibTorch names it
  bool entered_ = false;  // a unit was entered since the last step (stage 3 needs that)
};

}  // namespace zero::integrations
