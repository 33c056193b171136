// Why: one GPU holds one rank of an NCCL communicator, so the CUDA tests run
// comm::Nccl with a communicator of one rank on device 0. Shared by them.
#pragma once

#include <nccl.h>

#include <string>

#include "zero/error.hpp"

namespace zero::test {

inline ncclComm_t one_rank_comm() {
  ncclComm_t comm = nullptr;
  const int device = 0;
  const ncclResult_t r = ncclCommInitAll(&comm, 1, &device);
  if (r != ncclSuccess) throw zero::BackendError(std::string("ncclCommInitAll: ") + ncclGetErrorString(r));
  return comm;
}

}  // namespace zero::test
