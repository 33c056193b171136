// Why: gpt_train is one program for the host and the GPU, but its GPU part
// needs the CUDA toolkit (gpt_train_cuda.cpp with the model's kernels in
// gpt_cuda.cu, built in when the build has CUDA). This is the plain C++ face
// of that part, which gpt_train.cpp calls in any build.
#pragma once

#include <memory>
#include <vector>

#include "gpt/gpt_trainer.hpp"
#include "gpt/text_corpus.hpp"

namespace gpt {

// The training run on GPUs, as args say: --comm local runs args.launch.ranks
// ranks as threads on device 0 (comm::LocalDevice); --comm nccl makes this
// process one rank of an NCCL communicator on its GPU, bootstrapped through
// args.nccl_id_file, or through `nccl_id` (from new_nccl_unique_id() on rank
// 0, handed to every rank by the caller, e.g. over MPI) with
// args.nccl_rank/nccl_world, or else alone (one rank). Throws
// zero::BackendError when there is no CUDA device. Returns the final
// validation loss (every rank has it).
double train_on_cuda(const TrainArgs& args, const TextCorpus& corpus, const std::vector<unsigned char>& nccl_id);

// Rank 0's part of an NCCL bootstrap over the caller's channel: the unique id's bytes.
std::vector<unsigned char> new_nccl_unique_id();

}  // namespace gpt
