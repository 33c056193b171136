// A small stage-2 training run over comm::Mpi in which rank 1 misbehaves as
// a real program can; check_mpi_failure.py runs it under mpirun with a hard
// timeout and checks that the job ends (and how) instead of hanging.
//
//   mpi_failure_program SCENARIO TIMEOUT_MS
//
// Scenarios (rank 1 is the one that misbehaves; every other rank trains normally):
//   none                  nobody misbehaves: rank 0 prints "trained 3 steps" and every rank exits 0
//   throw                 rank 1 throws before finalize(); the exception reaches main's catch path,
//                         which ends the job with zero::comm::abort_mpi_job (the documented way)
//   throw_no_abort        the same, but main's catch path only prints and returns 1 (no abort_mpi_job):
//                         MpiRuntime's atexit handler ends the job, naming the rank
//   throw_caught          rank 1 throws before finalize() but its own code catches the exception and
//                         goes on to return from main normally: its MpiRuntime tells the others, which
//                         wait in finalize()'s layout all-gather, and they end the job at once
//   skip_grad_ready       rank 1 does not call grad_ready() for unit 0 (the last of its backward) in one
//                         micro-batch: its step() throws, main's catch path ends the job
//   skip_step             rank 1 skips its last micro-batch and step() and returns normally: the others,
//                         waiting in that step's collectives, learn it from its MpiRuntime and end the job
//   hang                  rank 1 stops (sleeps) before finalize() without leaving: the others wait in
//                         finalize()'s all-gather until comm::Mpi's timeout ends the job
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "zero/comm/mpi.hpp"
#include "zero/zero.hpp"

namespace {

using Opt = zero::ZeroOptimizer<zero::precision::Full<float>, zero::optim::Sgd, zero::stage<2>, zero::offload::None,
                                zero::backend::Host>;

constexpr int steps = 3, micro_batches = 2;

void train(zero::comm::Mpi& comm, const std::string& scenario) {
  const bool misbehaves = comm.rank() == 1;
  zero::optim::Sgd::Hyper hyper;
  hyper.lr = 0.1;
  zero::Options options;
  options.grad_accumulation_steps = micro_batches;
  options.bucket_bytes = 1;  // every grad_ready reduces its unit at once
  Opt opt(comm, hyper, options);
  const std::size_t sizes[2] = {1000, 300};
  zero::UnitId units[2];
  for (int u = 0; u < 2; ++u) {
    units[u] = opt.add_unit("layer" + std::to_string(u));
    opt.add_param(units[u], "layer" + std::to_string(u) + ".weight", sizes[u]);
  }
  if (misbehaves && (scenario == "throw" || scenario == "throw_no_abort")) throw zero::InvalidArgument("rank 1 failed before finalize() (scenario throw)");
  if (misbehaves && scenario == "throw_caught") {
    try {
      throw zero::InvalidArgument("rank 1 failed before finalize() (scenario throw_caught)");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank 1 caught: %s; carrying on without the optimizer\n", e.what());
      return;
    }
  }
  if (misbehaves && scenario == "hang") std::this_thread::sleep_for(std::chrono::minutes(10));
  opt.finalize();
  for (int s = 0; s < steps; ++s)
    for (int m = 0; m < micro_batches; ++m) {
      if (misbehaves && scenario == "skip_step" && s == steps - 1 && m == micro_batches - 1) return;
      for (int u = 1; u >= 0; --u) {  // backward: last layer first
        float* g = opt.grad_buffer(units[u]);
        for (std::size_t i = 0; i < sizes[u]; ++i) g[i] = 0.001f * static_cast<float>((i + u + m) % 7);
        if (misbehaves && scenario == "skip_grad_ready" && s == 1 && m == 1 && u == 0) continue;
        opt.grad_ready(units[u]);
      }
      opt.step();
    }
  if (comm.rank() == 0) std::printf("trained %d steps\n", steps);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    // Inside the try, as in the example trainer: an exception unwinds past
    // it before the catch path runs, and it must not finalise MPI then.
    zero::comm::MpiRuntime mpi(&argc, &argv);
    if (argc != 3) throw zero::InvalidArgument("usage: mpi_failure_program SCENARIO TIMEOUT_MS");
    zero::comm::Mpi::Options options;
    options.timeout = std::chrono::milliseconds(std::atol(argv[2]));
    zero::comm::Mpi comm(MPI_COMM_WORLD, options);
    train(comm, argv[1]);
    return 0;
  } catch (const std::exception& e) {
    // (scenario throw_no_abort: a catch path that forgets abort_mpi_job)
    if (argc == 3 && std::string(argv[1]) != "throw_no_abort") zero::comm::abort_mpi_job(e.what());  // ends every rank: none waits for this one
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
