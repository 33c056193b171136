// The C-style trainer (c_style_trainer.h) fitted to ZeroOptimizer as its
// author would: its model code untouched, its arrays registered per layer
// with use_memory (each parameter a slice of a stacked array), its three
// hooks calling acquire_unit, release_unit and grad_ready. Shared by the
// in-process test (test_engine_c_trainer.cpp) and the MPI suite.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <new>
#include <string>
#include <vector>

#include "c_style_trainer.h"
#include "zero/zero.hpp"

namespace zero::test {

// An anonymous mapping of `floats` floats: page-aligned, zero, and its pages
// resident only once written (what the trainer's malloc would give for
// arrays this size).
class Mapped {
 public:
  explicit Mapped(std::size_t floats) : bytes_(std::max<std::size_t>(4096, floats * sizeof(float))) {
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    data_ = static_cast<float*>(p);
  }
  Mapped(const Mapped&) = delete;
  Mapped& operator=(const Mapped&) = delete;
  ~Mapped() { munmap(data_, bytes_); }
  float* data() const { return data_; }
  // Bytes of the mapping in memory now (mincore).
  std::uint64_t resident_bytes() const {
    const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    std::vector<unsigned char> in((bytes_ + page - 1) / page);
    if (mincore(data_, bytes_, in.data()) != 0) return bytes_;
    std::uint64_t n = 0;
    for (unsigned char c : in) n += (c & 1u) ? page : 0;
    return n;
  }

 private:
  std::size_t bytes_;
  float* data_ = nullptr;
};

struct CTrainerRun {
  std::vector<double> losses;       // per step: the mean over ranks (mean_over_ranks)
  std::vector<float> masters;       // the trained parameters, padded layout
  MemoryReport memory;              // the optimizer's buffers
  std::uint64_t peak_resident = 0;  // the trainer's parameter and gradient arrays, at their fullest after step 1
  CommReport comm;                  // over the training steps
  // Rank 0 alone, the parameters held whole (hold_whole): the loss of an
  // unseen batch, and the collectives its forward made (none).
  double eval_loss = 0;
  std::uint64_t eval_collectives = 0;
};

// A small model whose layer slices are whole pages: V 256, C 64 (a 16 KiB
// matrix), L 24 blocks; `batch` examples per step over all ranks.
inline CtConfig c_trainer_model(int batch) { return CtConfig{256, 64, 24, batch}; }

inline Options c_trainer_options() {
  Options o;
  o.bucket_bytes = 64 * 64 * 4 * 2 + 64 * 4 * 2;  // a block's gradient: a bucket per unit
  o.release_memory_pages = true;
  return o;
}

// Trains `steps` steps of `global.B` examples split over the ranks.
template <int Stage, class Comm>
CTrainerRun run_c_trainer(Comm& comm, const CtConfig& global, int steps, const Options& options) {
  using Opt = ZeroOptimizer<precision::Full<float>, optim::AdamW, stage<Stage>, offload::None, backend::Host>;
  const int ranks = comm.size(), rank = comm.rank();
  CtConfig local = global;
  local.B = global.B / ranks;
  std::size_t sizes[5];
  const std::size_t total = ct_sizes(&local, sizes);
  // The trainer's own memory, as it allocates it.
  Mapped param_memory(total), grad_memory(total);
  CtTensors params, grads;
  ct_point(&local, param_memory.data(), &params);
  ct_point(&local, grad_memory.data(), &grads);
  std::vector<float> act_memory(ct_act_floats(&local));
  std::vector<int> act_ints(2 * static_cast<std::size_t>(local.B));
  CtActs acts;
  ct_point_acts(&local, act_memory.data(), act_ints.data(), &acts);
  ct_init(&local, &params, 1234);

  // The fit: a unit per layer, each parameter a slice of its stacked array.
  Opt opt(comm, optim::AdamW::Hyper{.lr = 3e-3, .weight_decay = 0.0}, options);
  std::vector<ParamId> ids;
  std::vector<const float*> initial;  // where each parameter's initial values are
  auto add = [&](UnitId unit, const std::string& name, std::size_t numel, float* values, float* grad) {
    ids.push_back(opt.add_param(unit, name, numel));
    initial.push_back(values);
    opt.use_memory(ids.back(), values, grad);
  };
  const std::size_t C = static_cast<std::size_t>(local.C);
  add(opt.add_unit("embedding"), "wte", sizes[0], params.wte, grads.wte);
  for (std::size_t l = 0; l < static_cast<std::size_t>(local.L); ++l) {
    const UnitId u = opt.add_unit("block" + std::to_string(l));
    const std::string p = "block" + std::to_string(l) + ".";
    add(u, p + "w1", C * C, params.w1 + l * C * C, grads.w1 + l * C * C);
    add(u, p + "b1", C, params.b1 + l * C, grads.b1 + l * C);
    add(u, p + "w2", C * C, params.w2 + l * C * C, grads.w2 + l * C * C);
    add(u, p + "b2", C, params.b2 + l * C, grads.b2 + l * C);
  }
  opt.finalize();
  // The trainer initialised its arrays; the optimizer takes the values from
  // there (stage 3 then keeps a shard, and fills the slices when acquired).
  for (std::size_t k = 0; k < ids.size(); ++k) opt.set_param(ids[k], initial[k]);

  CTrainerRun run;
  bool steady = false;  // from the second step: the first still holds the trainer's initialisation
  auto sample = [&] {
    if (steady) run.peak_resident = std::max(run.peak_resident, param_memory.resident_bytes() + grad_memory.resident_bytes());
  };
  struct Context {
    Opt* opt;
    decltype(sample)* sampler;
  } context{&opt, &sample};
  CtHooks hooks;
  hooks.ctx = &context;
  hooks.acquire = [](void* c, int u) {
    auto* x = static_cast<Context*>(c);
    x->opt->acquire_unit(UnitId{static_cast<std::size_t>(u)});
    (*x->sampler)();
  };
  hooks.release = [](void* c, int u) { static_cast<Context*>(c)->opt->release_unit(UnitId{static_cast<std::size_t>(u)}); };
  hooks.grad_done = [](void* c, int u) {
    auto* x = static_cast<Context*>(c);
    (*x->sampler)();  // before the optimizer takes (and clears) the gradient
    x->opt->grad_ready(UnitId{static_cast<std::size_t>(u)});
  };
  opt.reset_comm_counters();
  for (int step = 0; step < steps; ++step) {
    steady = step >= 1;
    ct_batch(&local, step, rank * local.B, &acts);
    const float loss = ct_forward_backward(&local, &params, &grads, &acts, &hooks);
    opt.step();
    sample();
    run.losses.push_back(opt.mean_over_ranks(loss));
  }
  run.comm = opt.comm_report();
  run.memory = opt.memory_report();
  steady = false;  // (the evaluation holds every parameter whole, by design)
  {
    HeldWhole whole = opt.hold_whole();  // collective: every rank
    if (rank == 0) {
      auto calls = [&] {
        std::uint64_t n = 0;
        for (const auto c : opt.comm_report().counters.calls) n += c;
        return n;
      };
      const std::uint64_t before = calls();
      ct_batch(&local, 1000, 0, &acts);
      run.eval_loss = ct_forward(&local, &params, &acts, &hooks);
      hooks.release(hooks.ctx, 0);
      run.eval_collectives = calls() - before;
    }
  }
  run.masters.resize(opt.layout().padded_total());
  opt.gather_masters(run.masters.data());
  return run;
}

}  // namespace zero::test
