// Why: the trainers run one function on every data-parallel rank, whether
// the ranks are threads of this process (--comm local) or the processes of
// mpirun (--comm mpi), and each had its own copy of the code that starts
// them. Here it is once: the communicator of each kind, the share of the
// cores each rank's OpenMP threads get, MPI kept up until the program's end,
// and rank 0's result handed back.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "common/choices.hpp"
#include "common/cli.hpp"
#include "common/rank_errors.hpp"
#include "zero/comm/any_communicator.hpp"
#include "zero/comm/local.hpp"

#if defined(ZERO_EXAMPLE_HAVE_MPI)
#include <algorithm>
#include <thread>

#include "zero/comm/mpi.hpp"
#if ZERO_HAS_OPENMP
#include <omp.h>
#endif
#endif

namespace zero::examples {

// One rank's run: its result (a loss, an accuracy) counts on rank 0.
using RankRun = std::function<double(comm::AnyCommunicator& comm)>;

// Starts the ranks that LaunchChoices name. Made in main() after the command
// line is parsed, and kept to its end: MPI, once started, stays up as long as
// this object (MpiRuntime: every rank leaves together).
class Launch {
 public:
  // argc and argv are main()'s (MPI may take its own arguments from them).
  // --comm mpi in a build without MPI ends the program here, as a bad option
  // (`app`'s message, exit 2).
  Launch(CLI::App& app, LaunchChoices& choices, int& argc, char**& argv) : choices_(choices) {
#if defined(ZERO_EXAMPLE_HAVE_MPI)
    (void)app;
    argc_ = &argc;
    argv_ = &argv;
#else
    (void)argc;
    (void)argv;
    if (choices.comm == "mpi")
      fail_option(app, "--comm", "mpi: this build has no MPI support (install libopenmpi-dev and reconfigure)");
#endif
  }

  // Runs `rank_run` on every rank: --ranks threads (comm::Local, each
  // thread's OpenMP threads a share of the cores: LocalGroup), or this
  // process as its rank of the MPI job (comm::Mpi; the processes share the
  // machine's cores, and choices.ranks becomes the world size). Both take
  // --ranks-per-node. Returns rank 0's result, and nothing on the other MPI
  // ranks: rank 0 prints the outcome, the others end quietly.
  std::optional<double> run(const RankRun& rank_run) {
    if (choices_.comm == "local") {
      double result = 0;
      comm::LocalGroup group(choices_.ranks, {.ranks_per_node = choices_.ranks_per_node});
      run_local_ranks(group, [&](comm::Local& comm) {
        const double mine = rank_run(*comm::AnyCommunicator::wrap(comm));
        if (comm.rank() == 0) result = mine;
      });
      return result;
    }
#if defined(ZERO_EXAMPLE_HAVE_MPI)
    start_mpi();
    comm::Mpi comm(MPI_COMM_WORLD, {.ranks_per_node = choices_.ranks_per_node});
    choices_.ranks = comm.size();
#if ZERO_HAS_OPENMP
    // Processes on one machine share its cores: split them, as LocalGroup does for threads.
    omp_set_num_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / comm.size()));
#endif
    const double result = rank_run(*comm::AnyCommunicator::wrap(comm));
    if (comm.rank() != 0) return std::nullopt;
    return result;
#else
    throw InvalidArgument("--comm " + choices_.comm + ": not built (the constructor refuses it first)");
#endif
  }

#if defined(ZERO_EXAMPLE_HAVE_MPI)
  // Starts MPI unless this object has (run() does; a program may need MPI
  // before, as the GPT trainer does to share NCCL's unique id).
  void start_mpi() {
    if (!mpi_) mpi_ = std::make_unique<comm::MpiRuntime>(argc_, argv_);
  }
#endif

 private:
  LaunchChoices& choices_;
#if defined(ZERO_EXAMPLE_HAVE_MPI)
  int* argc_ = nullptr;
  char*** argv_ = nullptr;
  std::unique_ptr<comm::MpiRuntime> mpi_;
#endif
};

}  // namespace zero::examples
