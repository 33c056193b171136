// Why: the GPU part's optimizer, on backend::Cuda, for every precision,
// optimizer, stage and offload tier (zero::make_optimizer: nine engines,
// each with its fused CUDA step and the host step of offload). They are
// most of the GPU part's compile time; in a translation unit of their own
// they compile beside the model and the loop (gpt_train_cuda.cu) on another
// core, and a change to the model does not recompile them.
#include "gpt/gpt_train_cuda.hpp"
#include "zero/zero_cuda.cuh"

namespace gpt {

std::unique_ptr<zero::AnyOptimizer> make_cuda_optimizer(zero::comm::AnyCommunicator& comm, const TrainArgs& args) {
  return zero::examples::make_example_optimizer<zero::backend::Cuda>(comm, optimizer_config(args));
}

}  // namespace gpt
