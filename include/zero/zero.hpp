// The umbrella header: everything that compiles with a plain C++20 host
// compiler. CUDA pieces (zero/zero_cuda.hpp, host code on the CUDA runtime,
// with zero/zero_cuda.cuh, its kernels; zero/comm/nccl.hpp, which needs
// -lnccl) and MPI (zero/comm/mpi.hpp) are included separately, so this header
// needs neither nvcc nor mpi.h.
//
// What each include defines, the user's types first. Included separately,
// each with what it needs:
//   zero/runtime/make_optimizer.hpp     make_optimizer, AnyOptimizer (nlohmann-json, xxhash.h)
//   zero/runtime/config_json.hpp        load_config, Config from JSON (nlohmann-json)
//   zero/checkpoint/optimizer_io.hpp    opt.save / load / load_hf, checkpoint::OptimizerIo (nlohmann-json, xxhash.h)
//   zero/offload/disk_state_store.hpp   offload::Nvme's store, the disk tier (liburing, xxhash.h)
//   zero/comm/mpi.hpp                   comm::Mpi (mpi.h, -lmpi)
//   zero/comm/nccl.hpp                  comm::Nccl (nccl.h, -lnccl, the library's CUDA kernels)
//   zero/zero_cuda.hpp, zero_cuda.cuh   backend::Cuda, comm::LocalDevice; the CUDA kernels (nvcc)
//   zero/integrations/torch.hpp         integrations::TorchModule: a LibTorch module on the optimizer
//   zero/runtime/precompiled.hpp        ZERO_INSTANTIATE_ENGINES and the rest: compile the engines once
#pragma once

#include "zero/compiler.hpp"  // defines: ZERO_HOST_DEVICE, ZERO_FORCE_INLINE and the other compiler macros

// The user's types.
#include "zero/engine/zero_optimizer.hpp"  // defines: ZeroOptimizer (on detail::Engine, engine/engine.hpp)
#include "zero/policies.hpp"               // defines: precision::Full/Mixed, stage<N>, offload::*, backend::Host
#include "zero/engine/options.hpp"         // defines: Options (and its enums: StateFormat, MasterWeights, ...)
#include "zero/engine/layout.hpp"          // defines: Layout, UnitId, ParamId, UnitInfo, ParamInfo
#include "zero/engine/reports.hpp"         // defines: MemoryReport, CommReport, PlacedBytes, OffloadTimes
#include "zero/engine/loss_scaler.hpp"     // defines: DynamicLossScaler
#include "zero/optim/adam.hpp"             // defines: optim::Adam, optim::AdamW
#include "zero/optim/sgd.hpp"              // defines: optim::Sgd, optim::PlainSgd (SGD made with momentum 0)
#include "zero/optim/policy.hpp"           // defines: optim::Policy (an optimizer of your own), HyperField
#include "zero/comm/local.hpp"             // defines: comm::LocalGroup, comm::Local (ranks as threads)
#include "zero/comm/communicator.hpp"      // defines: comm::Communicator (the concept), ByteCounters, Purpose
#include "zero/comm/any_communicator.hpp"  // defines: comm::AnyCommunicator (any communicator behind virtual calls)
#include "zero/runtime/config.hpp"         // defines: Config (a run chosen at run time), PrecisionChoice, OffloadTier
#include "zero/runtime/hyper_fields.hpp"   // defines: hyper_from, hyper_to_map (hyper-parameters by name)
#include "zero/engine/plan.hpp"            // defines: plan::Scenario, plan::Plan (memory and traffic before a run)
#include "zero/error.hpp"                  // defines: Error and its kinds (InvalidArgument, CommError, ...)

// Lower layers a program may use directly.
#include "zero/backend/host.hpp"             // defines: backend::Host's operations (Ops<Host>)
#include "zero/engine/run_shape.hpp"         // defines: RunShape (what of a run decides its buffers, collectives, rules)
#include "zero/engine/detail/run_rules.hpp"         // defines: RunRule, run_problem, require_run (which runs are refused, why)
#include "zero/engine/detail/buffer_sizes.hpp"      // defines: BufferSizes (the buffers a run allocates, by size)
#include "zero/engine/detail/schedule.hpp"          // defines: Schedule, schedule(): every part's rows (BufferRow, CollectiveRow)
#include "zero/kernels/fused_step.hpp"       // defines: kernels::FusedStepArgs, the per-element fused update
#include "zero/kernels/host_convert.hpp"     // defines: kernels::host_convert, host_accumulate (SIMD casts)
#include "zero/kernels/host_step.hpp"        // defines: kernels::host_fused_step (the SIMD optimizer step)
#include "zero/math.hpp"                     // defines: math::mul, fma, div, sqrt (exactly rounded, host and device)
#include "zero/precision/convert.hpp"        // defines: to_float, from_float
#include "zero/precision/stochastic.hpp"     // defines: StochasticRounding, stochastic_round
#include "zero/precision/types.hpp"          // defines: fp16, bf16, DType, ReduceOp, dtype_traits
