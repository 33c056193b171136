// Why: a trainer that takes --stage, --precision and --optimizer at run time
// names one ZeroOptimizer type per combination (common/optimizer_type.hpp);
// if its training loop were a template over that type, the loop would be
// compiled once per type (36 to 72 times), which is most of an example's
// compile time. The loop instead calls the optimizer through this interface,
// and only the thin adapter below is compiled per type. A virtual call per
// unit or per step is nothing next to the work it starts.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "zero/zero.hpp"

#if defined(ZERO_EXAMPLE_HAVE_CHECKPOINTS)
#include "zero/checkpoint/optimizer_io.hpp"
#endif

namespace zero::examples {

// The optimizer as a training loop uses it; the model's units are numbered
// 0, 1, ... in the order the trainer registered them.
class TrainingOptimizer {
 public:
  virtual ~TrainingOptimizer() = default;
  // Unit u's parameters as fp32 (stage 3: all-gathered) / done with them.
  virtual const float* acquire(int u) = 0;
  virtual void release(int u) = 0;
  // Where backward writes unit u's fp32 gradient / it is written.
  virtual float* grad_buffer(int u) = 0;
  virtual void grad_ready(int u) = 0;

  virtual void set_lr(double lr) = 0;
  virtual double lr() = 0;
  virtual double loss_scale() const = 0;
  virtual void step() = 0;
  virtual std::int64_t step_count() const = 0;
  virtual void reset_comm_counters() = 0;
  virtual CommReport comm_report() const = 0;
  virtual MemoryReport memory_report() const = 0;
#if defined(ZERO_EXAMPLE_HAVE_CHECKPOINTS)
  virtual checkpoint::LoadResult load(const std::string& path) = 0;
  virtual std::filesystem::path save_step(const std::string& root, checkpoint::OptimizerSaveOptions options) = 0;
  virtual void wait_save() = 0;
#endif
};

// The calls that only forward to the ZeroOptimizer of type Opt it owns; a
// trainer derives from it, registers its model's units with opt_ and
// implements the four unit calls.
template <class Opt>
class OptimizerAdapter : public TrainingOptimizer {
 public:
  OptimizerAdapter(comm::AnyCommunicator& comm, const typename Opt::Hyper& hyper, const Options& options)
      : opt_(comm, hyper, options) {}

  void set_lr(double lr) override { opt_.hyper().lr = lr; }
  double lr() override { return opt_.hyper().lr; }
  double loss_scale() const override { return opt_.loss_scale(); }
  void step() override { opt_.step(); }
  std::int64_t step_count() const override { return opt_.step_count(); }
  void reset_comm_counters() override { opt_.reset_comm_counters(); }
  CommReport comm_report() const override { return opt_.comm_report(); }
  MemoryReport memory_report() const override { return opt_.memory_report(); }
#if defined(ZERO_EXAMPLE_HAVE_CHECKPOINTS)
  checkpoint::LoadResult load(const std::string& path) override { return checkpoint::OptimizerIo<Opt>::load(opt_, path); }
  std::filesystem::path save_step(const std::string& root, checkpoint::OptimizerSaveOptions options) override {
    return checkpoint::OptimizerIo<Opt>::save_step(opt_, root, std::move(options));
  }
  void wait_save() override { opt_.wait_save(); }
#endif

 protected:
  Opt opt_;
};

// The example programs' hyperparameters for Opt: learning rate `lr`, and
// SGD with momentum 0.9.
template <class Opt>
typename Opt::Hyper example_hyper(double lr) {
  typename Opt::Hyper h;
  h.lr = lr;
  if constexpr (std::is_same_v<typename Opt::optimizer_policy, optim::Sgd>) h.momentum = 0.9;
  return h;
}

}  // namespace zero::examples
