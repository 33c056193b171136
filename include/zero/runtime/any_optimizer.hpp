// Why: a program that reads its precision, optimizer, stage and offload tier
// from a config file or a command line cannot name one ZeroOptimizer type.
// AnyOptimizer is the engine behind an interface with ZeroOptimizer's calls,
// made by zero::make_optimizer (make_optimizer.hpp) for whichever engine the
// config names; a training loop written against it is compiled once. A
// virtual call per unit or per step is nothing next to the work it starts.
//
// The element type of the parameters and gradients is a run-time value here
// (param_dtype()): acquire_unit and grad_buffer return untyped pointers,
// typed with acquire_unit_as<T>() / grad_buffer_as<T>() (checked). A model
// that computes in fp32 whatever the storage (both example trainers) uses
// the fp32 calls instead: acquire_fp32 converts the unit into a float copy
// on the backend (the CUDA conversion kernel on a GPU), grad_buffer_fp32
// hands out a float buffer that grad_ready converts back; the model holds
// at most one unit's copy at a time, and with fp32 storage the calls hand
// out the engine's own buffers.
#pragma once

#include "zero/config.hpp"

#include <cstdint>
#include <filesystem>
#include <string>

#include "zero/checkpoint/optimizer_io.hpp"
#include "zero/engine/engine.hpp"
#include "zero/error.hpp"
#include "zero/precision/types.hpp"

namespace zero {

class AnyOptimizer {
 public:
  virtual ~AnyOptimizer() = default;

  // What was made: the run's plan and names (as in checkpoints and reports).
  virtual const EnginePlan& plan() const = 0;
  int stage() const { return plan().rules.stage; }
  virtual DType param_dtype() const = 0;
  virtual const char* optimizer_name() const = 0;
  virtual const char* backend_name() const = 0;

  // ---- Registration and values (as ZeroOptimizer) -------------------------
  virtual UnitId add_unit(std::string name) = 0;
  virtual ParamId add_param(UnitId unit, std::string name, std::size_t numel, Shape shape = {}) = 0;
  // Your own memory (ZeroOptimizer::use_memory), in param_dtype() elements.
  virtual void use_memory(ParamId p, void* values, void* grads) = 0;
  virtual void finalize() = 0;
  virtual const Layout& layout() const = 0;
  virtual int rank() const = 0;
  virtual int ranks() const = 0;
  virtual void set_param(ParamId p, const float* values) = 0;
  virtual void gather_masters(float* out) = 0;
  virtual std::vector<float> master_values(ParamId p) = 0;

  // ---- Forward / backward ---------------------------------------------------
  // In the engine's element type (param_dtype()).
  virtual const void* acquire_unit(UnitId u) = 0;
  virtual void release_unit(UnitId u) = 0;
  virtual void* grad_buffer(UnitId u) = 0;
  virtual void grad_ready(UnitId u) = 0;
  template <class T>
  const T* acquire_unit_as(UnitId u) {
    require_dtype(dtype_traits<T>::dtype, "acquire_unit_as");
    return static_cast<const T*>(acquire_unit(u));
  }
  template <class T>
  T* grad_buffer_as(UnitId u) {
    require_dtype(dtype_traits<T>::dtype, "grad_buffer_as");
    return static_cast<T*>(grad_buffer(u));
  }
  // In fp32, whatever the storage: the unit's parameters (valid until the
  // next acquire_fp32 or release_unit) and where backward writes its fp32
  // gradient; grad_ready(u) then takes it.
  virtual const float* acquire_fp32(UnitId u) = 0;
  virtual float* grad_buffer_fp32(UnitId u) = 0;

  // ---- Step -----------------------------------------------------------------
  virtual StepResult step() = 0;
  // Collective at stage 3: the parameters whole until the scope ends (ZeroOptimizer::hold_whole).
  [[nodiscard]] virtual HeldWhole hold_whole() = 0;
  virtual void synchronize() = 0;
  virtual void wait_update() = 0;
  // Hyper-parameters by name (the optimizer's fields: lr, beta1, ...;
  // zero/runtime/hyper_fields.hpp); set_hyper validates at the next step.
  virtual double hyper_value(const std::string& name) const = 0;
  virtual void set_hyper(const std::string& name, double value) = 0;
  double lr() const { return hyper_value("lr"); }
  void set_lr(double lr) { set_hyper("lr", lr); }
  virtual double loss_scale() const = 0;
  // Collective: the mean over the ranks of a value each passes (a loss).
  virtual double mean_over_ranks(double value) = 0;
  virtual const Options& options() const = 0;
  virtual std::int64_t step_count() const = 0;

  // ---- Reports ----------------------------------------------------------------
  virtual MemoryReport memory_report() const = 0;
  virtual CommReport comm_report() const = 0;
  virtual void reset_comm_counters() = 0;
  virtual OffloadTimes offload_times() const = 0;
  virtual void reset_offload_times() = 0;

  // ---- Checkpoints (zero/checkpoint/optimizer_io.hpp) ---------------------------
  virtual void save(const std::string& dir, checkpoint::OptimizerSaveOptions options = {}) = 0;
  virtual std::filesystem::path save_step(const std::string& root, checkpoint::OptimizerSaveOptions options = {}) = 0;
  virtual void wait_save() = 0;
  virtual checkpoint::LoadResult load(const std::string& path) = 0;
  virtual void load_hf(const std::string& path) = 0;

 private:
  void require_dtype(DType wanted, const char* call) const {
    require(wanted == param_dtype(), call, "<", dtype_name(wanted), ">: this optimizer keeps its parameters and "
            "gradients in ", dtype_name(param_dtype()), "; use that type, or the fp32 calls (acquire_fp32, "
            "grad_buffer_fp32)");
  }
};

}  // namespace zero
