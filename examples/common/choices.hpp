// Why: the launch and checkpoint choices of the example programs, apart from
// the command line that fills them (common/cli.hpp), so code compiled
// without CLI11 (the GPT trainer's CUDA part, built by nvcc) can take them
// too. The ZeRO choices are a zero::Config (zero/runtime/config.hpp).
#pragma once

#include <cstddef>
#include <string>

namespace zero::examples {

// --nvme-window-mib as Options::nvme.window_bytes (the trainers and the planner alike).
inline std::size_t nvme_window_bytes(double mib) { return static_cast<std::size_t>(mib * 1048576.0); }

// How the data-parallel ranks run.
struct LaunchChoices {
  int ranks = 4;
  std::string comm = "local";
  // Ranks per node (comm::Topology): simulated nodes of the local ranks; for
  // mpi, 0 takes Open MPI's own count.
  int ranks_per_node = 0;
};

// Checkpoints (zero/checkpoint/optimizer_io.hpp; common/checkpoints.hpp saves them).
struct CheckpointChoices {
  std::string save_dir, resume_dir;  // empty: none
  int save_every = 0;                // also every this many optimizer steps (0: only where the program saves anyway)
  bool save_async = false;           // write checkpoints in the background
  int keep_last = 0;                 // keep only this many newest checkpoints (0: all)
};

}  // namespace zero::examples
