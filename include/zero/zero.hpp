// The umbrella header: everything that compiles with a plain C++20 host
// compiler. CUDA pieces (zero/zero_cuda.hpp, host code on the CUDA runtime,
// with zero/zero_cuda.cuh, its kernels; zero/comm/nccl.hpp, which needs
// -lnccl) and MPI (zero/comm/mpi.hpp) are included separately, so this header
// needs neither nvcc nor mpi.h.
#pragma once

#include "zero/config.hpp"

#include "zero/backend/host.hpp"
#include "zero/comm/any_communicator.hpp"
#include "zero/comm/communicator.hpp"
#include "zero/comm/local.hpp"
#include "zero/engine/buffer_sizes.hpp"
#include "zero/engine/layout.hpp"
#include "zero/engine/loss_scaler.hpp"
#include "zero/engine/options.hpp"
#include "zero/engine/plan.hpp"
#include "zero/engine/reports.hpp"
#include "zero/engine/zero_optimizer.hpp"
#include "zero/error.hpp"
#include "zero/kernels/fused_step.hpp"
#include "zero/kernels/host_convert.hpp"
#include "zero/kernels/host_step.hpp"
#include "zero/math.hpp"
#include "zero/optim/adam.hpp"
#include "zero/optim/policy.hpp"
#include "zero/optim/sgd.hpp"
#include "zero/policies.hpp"
#include "zero/precision/convert.hpp"
#include "zero/precision/stochastic.hpp"
#include "zero/precision/types.hpp"
#include "zero/runtime/config.hpp"
#include "zero/runtime/hyper_fields.hpp"
