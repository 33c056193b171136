// Why: a program that reads its precision, optimizer, stage and offload tier
// from a config file or a command line cannot name one ZeroOptimizer type.
// AnyOptimizer is the engine behind an interface with ZeroOptimizer's calls,
// made by zero::make_optimizer (make_optimizer.hpp) for whichever engine the
// config names; a training loop written against it is compiled once. A
// virtual call per unit or per step is nothing next to the work it starts.
//
// The element type of the parameters and gradients is a run-time value here
// (param_dtype()): acquire_unit, grad_buffer, param_data, gather_params and
// use_memory take or return untyped pointers, typed with the _as<T>() calls
// (checked: acquire_unit_as<T>(), grad_buffer_as<T>(), ...). A model that
// computes in fp32 whatever the storage (both example trainers) uses the
// fp32 calls instead: acquire_fp32 converts the unit into a float copy on
// the backend (the CUDA conversion kernel on a GPU), param_data_fp32 points
// into that copy, grad_buffer_fp32 hands out a float buffer that grad_ready
// converts back, and gather_params_fp32 widens the gathered parameters; the
// model holds at most one unit's copy at a time, and with fp32 storage the
// calls hand out the engine's own buffers.
//
// Where the calls differ from ZeroOptimizer's (README.md says the same):
// the hyper-parameters are set by name (hyper_value, set_hyper, lr, set_lr)
// instead of through the typed hyper(), whose struct is the optimizer's;
// the stage is stage() and shape(), not the constant `stage`; save_step(root)
// is a call here, where a ZeroOptimizer program calls
// checkpoint::OptimizerIo<Opt>::save_step(opt, root). (The checkpoint
// layer's view of the state, ownership(), read_state() and the rest, is
// private to the engine, whose friend checkpoint::EngineIo calls it: on
// neither face.)
#pragma once

#include "zero/compiler.hpp"

#include <cstdint>
#include <filesystem>
#include <string>

#include "zero/checkpoint/optimizer_io.hpp"
#include "zero/engine/engine.hpp"
#include "zero/error.hpp"
#include "zero/precision/types.hpp"

namespace zero {

// The calls the run-time face takes from ZeroOptimizer as they are, each
// written once: AnyOptimizer declares them and EngineHandle
// (make_optimizer.hpp) forwards them to the engine, so that a call the
// engine gains reaches both faces with one line here. X(result, name,
// (parameters), (arguments), qualifier). The calls that convert (the
// element type, the fp32 copies, hyper-parameters by name, checkpoints)
// are written out in both.
#define ZERO_DETAIL_FORWARDED_CALLS(X)                                                                                 \
  /* ---- Registration and values ---- */                                                                              \
  X(UnitId, add_unit, (std::string name), (std::move(name)), )                                                         \
  X(ParamId, add_param, (UnitId unit, std::string name, std::size_t numel, Shape shape = {}),                          \
    (unit, std::move(name), numel, std::move(shape)), )                                                                \
  X(const Layout&, layout, (), (), const)                                                                              \
  X(int, rank, (), (), const)                                                                                          \
  X(int, ranks, (), (), const)                                                                                         \
  X(void, set_param, (ParamId p, const float* values), (p, values), )                                                  \
  X(void, gather_masters, (float* out), (out), )                                                                       \
  X(std::vector<float>, master_values, (ParamId p), (p), )                                                             \
  /* ---- Forward / backward, in the engine's element type (param_dtype()) ---- */                                     \
  X(const void*, acquire_unit, (UnitId u), (u), )                                                                      \
  /* Parameter p inside its unit's parameters, as ZeroOptimizer::param_data (stage 3: the unit acquired). */           \
  X(const void*, param_data, (ParamId p), (p), const)                                                                  \
  /* ---- Step ---- */                                                                                                 \
  /* Collective at stage 3: the parameters whole until the scope ends (ZeroOptimizer::hold_whole). */                  \
  X(HeldWhole, hold_whole, (), (), )                                                                                   \
  X(void, synchronize, (), (), )                                                                                       \
  X(void, wait_update, (), (), )                                                                                       \
  X(double, loss_scale, (), (), const)                                                                                 \
  /* Collective: the mean over the ranks of a value each passes (a loss). */                                           \
  X(double, mean_over_ranks, (double value), (value), )                                                                \
  X(const Options&, options, (), (), const)                                                                            \
  X(std::int64_t, step_count, (), (), const)                                                                           \
  /* ---- Reports ---- */                                                                                              \
  X(MemoryReport, memory_report, (), (), const)                                                                        \
  X(CommReport, comm_report, (), (), const)                                                                            \
  X(void, reset_comm_counters, (), (), )                                                                               \
  X(OffloadTimes, offload_times, (), (), const)                                                                        \
  X(void, reset_offload_times, (), (), )                                                                               \
  /* ---- Checkpoints (zero/checkpoint/optimizer_io.hpp) ---- */                                                       \
  X(void, wait_save, (), (), )

class AnyOptimizer {
 public:
  virtual ~AnyOptimizer() = default;

  // What was made: the run's shape (engine/run_shape.hpp) and names (as in
  // checkpoints and reports).
  virtual const RunShape& shape() const = 0;
  int stage() const { return shape().stage.stage; }
  virtual DType param_dtype() const = 0;
  virtual const char* optimizer_name() const = 0;
  virtual const char* backend_name() const = 0;

  // The calls as ZeroOptimizer has them (ZERO_DETAIL_FORWARDED_CALLS above).
#define ZERO_DETAIL_DECLARE_CALL(result, name, parameters, arguments, qualifier) \
  virtual result name parameters qualifier = 0;
  ZERO_DETAIL_FORWARDED_CALLS(ZERO_DETAIL_DECLARE_CALL)
#undef ZERO_DETAIL_DECLARE_CALL

  // ---- Registration and values ----------------------------------------------
  // Your own memory (ZeroOptimizer::use_memory), in param_dtype() elements.
  virtual void use_memory(ParamId p, void* values, void* grads) = 0;
  virtual void finalize() = 0;
  // Collective: the whole parameters, padded (Layout::padded_total()
  // elements), into host memory, as ZeroOptimizer::gather_params: in
  // param_dtype() elements, typed with gather_params_as<T>() (checked), or
  // widened to fp32 (the parameters' own values, exactly: with 16-bit
  // storage those are the rounded copies, and gather_masters has the fp32
  // masters).
  virtual void gather_params(void* out) = 0;
  template <class T>
  void gather_params_as(T* out) {
    require_dtype(dtype_traits<T>::dtype, "gather_params_as");
    gather_params(out);
  }
  virtual void gather_params_fp32(float* out) = 0;

  // ---- Forward / backward ---------------------------------------------------
  // In the engine's element type (param_dtype()), as acquire_unit and param_data.
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
  template <class T>
  const T* param_data_as(ParamId p) const {
    require_dtype(dtype_traits<T>::dtype, "param_data_as");
    return static_cast<const T*>(param_data(p));
  }
  // In fp32, whatever the storage: the unit's parameters (valid until the
  // next acquire_fp32 or release_unit), parameter p inside them (its unit
  // must be the one acquire_fp32 holds, at every precision, so that a loop
  // tried with fp32 storage runs with 16-bit storage too), and where
  // backward writes its fp32 gradient; grad_ready(u) then takes it.
  virtual const float* acquire_fp32(UnitId u) = 0;
  virtual const float* param_data_fp32(ParamId p) const = 0;
  virtual float* grad_buffer_fp32(UnitId u) = 0;

  // ---- Step -----------------------------------------------------------------
  virtual StepResult step() = 0;
  // Hyper-parameters by name (the optimizer's fields: lr, beta1, ...;
  // zero/runtime/hyper_fields.hpp); set_hyper validates at the next step.
  virtual double hyper_value(const std::string& name) const = 0;
  virtual void set_hyper(const std::string& name, double value) = 0;
  double lr() const { return hyper_value("lr"); }
  void set_lr(double lr) { set_hyper("lr", lr); }

  // ---- Checkpoints (zero/checkpoint/optimizer_io.hpp) ---------------------------
  virtual void save(const std::string& dir, checkpoint::OptimizerSaveOptions options = {}) = 0;
  virtual std::filesystem::path save_step(const std::string& root, checkpoint::OptimizerSaveOptions options = {}) = 0;
  virtual checkpoint::LoadResult load(const std::string& path) = 0;
  virtual void load_hf(const std::string& path) = 0;

 private:
  void require_dtype(DType wanted, const char* call) const {
    require(wanted == param_dtype(), call, "<", dtype_name(wanted), ">: this optimizer keeps its parameters and "
            "gradients in ", dtype_name(param_dtype()), "; use that type, or the fp32 calls (acquire_fp32, "
            "param_data_fp32, grad_buffer_fp32, gather_params_fp32)");
  }
};

}  // namespace zero
