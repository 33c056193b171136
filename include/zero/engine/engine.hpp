// Why: this is the engine every optimizer runs on, compiled once per
// precision, optimizer and backend: the ZeRO stage and the offload tier are
// values it takes (and describes with the rest of the run as a RunShape,
// engine/run_shape.hpp), so a program that picks them at run time compiles
// one engine, not one per combination. zero::ZeroOptimizer
// (zero_optimizer.hpp) is the typed layer users name; zero::make_optimizer
// (zero/runtime/make_optimizer.hpp) picks the engine from a zero::Config.
//
// It owns one rank's partitioned model state and reads like the protocol.
// Per micro-batch, per unit (a layer), the caller:
//   const auto* w = opt.acquire_unit(u);   // stage 3: gathers the unit
//   ... forward with w ...; opt.release_unit(u);
// and in backward, in reverse unit order:
//   opt.acquire_unit(u); auto* g = opt.grad_buffer(u); ... write dL/dw into g ...
//   opt.grad_ready(u); opt.release_unit(u);
// then opt.step(), which steps the optimizer every grad_accumulation_steps
// micro-batches. Collective calls (finalize, set_param, acquire_unit at
// stage 3, grad_ready, step, gather_*) must be made by every rank in the same
// order; each names itself (comm::ApiCall), so that a communicator's error
// says which call each rank was in.
//
// The parts, each in its own header with what it owns and which collectives
// it issues (docs/design.md draws them):
//   CommChannel      the communicator, and on a GPU the lane and events of overlap
//   GradientReducer  gradient staging, buckets, reduce-scatter/all-reduce, accumulation
//   ParamGatherer    stage 3: the gather arena, prefetch, lifetimes
//   StepControl      gradient statistics' all-reduce, loss scaler, clipping, fingerprints
//   UpdatePipeline   the tier's state store, host staging, the delayed update
// All buffers are allocated once at finalize() from the sizes the planner
// shares (buffer_sizes.hpp); the steady-state step allocates nothing.
//
// Ranks never silently disagree. finalize() compares the layout, precision,
// optimizer, stage, tier and every Options field that ranks must share (not
// the rank-local offload threads, pinned-memory and disk settings) across
// ranks; set_param()
// compares a fingerprint of the values (detection moves 8 bytes per rank
// instead of broadcasting the parameter, and a rank-dependent
// initialisation is a bug worth hearing about); step() re-validates hyper()
// and compares a fingerprint of the update rule with this step's
// hyper-parameters across ranks, in the step's control all-reduce.
#pragma once

// The class and its members (engine_class.hpp); then the calls defined
// outside it: construction and finalize() (engine_setup.hpp), the step
// (engine_step.hpp), values in and out (engine_values.hpp).
#include "zero/engine/engine_class.hpp"
#include "zero/engine/detail/engine_setup.hpp"
#include "zero/engine/detail/engine_step.hpp"
#include "zero/engine/detail/engine_values.hpp"

#if defined(ZERO_PRECOMPILED_ENGINES)  // compiled once elsewhere (zero/runtime/precompiled.hpp)
#include "zero/engine/detail/builtin_engines.hpp"
ZERO_EXTERN_ENGINES(::zero::backend::Host)
#endif
