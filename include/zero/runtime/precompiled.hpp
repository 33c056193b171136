// Why: an engine is a large template (the step, the checkpoint I/O, the
// offload stores, the host SIMD step in three instruction sets), and every
// translation unit that makes one compiles it again: a program of ten files
// that each call make_optimizer pays ten times for the same twelve engines.
// This header names the engines make_optimizer makes without being told
// more (three precisions x four optimizer policies: Adam, AdamW, SGD with
// its momentum buffer and SGD without, on backend::Host), so that a
// program compiles each of them once:
//
//   // One file of your build per precision (they compile in parallel):
//   #include "zero/runtime/make_optimizer.hpp"
//   #include "zero/offload/disk_state_store.hpp"  // where the program has the disk tier
//   #include "zero/runtime/precompiled.hpp"
//   ZERO_INSTANTIATE_ENGINES(zero::precision::Mixed<zero::bf16>, zero::backend::Host)
//   ZERO_INSTANTIATE_HANDLES(zero::precision::Mixed<zero::bf16>, zero::backend::Host)
//   ZERO_INSTANTIATE_DISK_STORES(zero::precision::Mixed<zero::bf16>)  // with the disk tier
//
// and every file of the program compiled with -DZERO_PRECOMPILED_ENGINES,
// which makes engine.hpp, make_optimizer.hpp and disk_state_store.hpp
// declare these engines (and, where the file includes the disk tier, its
// stores) `extern template`: those files then call the
// engines compiled once instead of compiling their own. Nothing else
// changes (the same code runs), and a file compiled without the macro still
// works: it compiles its own copy, which the linker merges. A missing
// instantiation is a link error naming the engine's function.
//
// What is compiled once, per precision P and optimizer O of the twelve:
//   detail::Engine<P, O, backend::Host>        every ZeroOptimizer<P, O, stage, offload, Host>
//   detail::EngineHandle<P, O, backend::Host>  make_optimizer's handle, with its checkpoint I/O
//                                              (needs nlohmann-json and xxhash.h)
//   offload::DiskTier::make<O, G, P>           the disk tier's store (offload::Nvme), where the
//                                              program has it (needs liburing)
// Meson builds them as `engines_dep` (meson.build; `zero-engines` for a
// project that takes zero as a subproject), which adds the macros; the tests
// and example programs of this repository use it. Another backend's twelve
// are compiled the same way with ZERO_EXTERN_ENGINES(Backend) after its
// header (backend::Cuda: src/zero_engines_cuda.cpp; the late-copies test
// backend: tests/engine/late_copies_engines.cpp). User policies (Lion) are
// compiled where they are used.
#pragma once

#include "zero/compiler.hpp"

#include "zero/engine/detail/builtin_engines.hpp"  // the lists, and the engines' own macros

// One instance of each template: KEYWORD is `extern` to declare it, nothing
// to compile it. (The disk store does not depend on the backend.) The
// engines' own are in engine/detail/builtin_engines.hpp.
#define ZERO_DETAIL_HANDLE_INSTANCE(KEYWORD, Optimizer, Precision, Backend) \
  KEYWORD template class ::zero::detail::EngineHandle<Precision, Optimizer, Backend>;
#define ZERO_DETAIL_DISK_STORE_INSTANCE(KEYWORD, Optimizer, Precision)                                    \
  KEYWORD template auto                                                                                    \
  ::zero::offload::DiskTier::make<Optimizer, typename Precision::grad_type, typename Precision::param_type>( \
      const ::zero::Options&, int, std::size_t, const ::zero::StateBlocks&)                                 \
      ->std::unique_ptr<                                                                                   \
          ::zero::AnyStateStore<Optimizer, typename Precision::grad_type, typename Precision::param_type>>;

#define ZERO_DETAIL_EXTERN_HANDLE(O, P, B) ZERO_DETAIL_HANDLE_INSTANCE(extern, O, P, B)
#define ZERO_DETAIL_EXTERN_DISK_STORE(O, P, B) ZERO_DETAIL_DISK_STORE_INSTANCE(extern, O, P)
#define ZERO_DETAIL_HANDLE(O, P, B) ZERO_DETAIL_HANDLE_INSTANCE(, O, P, B)
#define ZERO_DETAIL_DISK_STORE(O, P, B) ZERO_DETAIL_DISK_STORE_INSTANCE(, O, P)

// The handles and the disk stores declared compiled elsewhere (at the end of
// make_optimizer.hpp and disk_state_store.hpp under the macros above).
#define ZERO_EXTERN_HANDLES(Backend) ZERO_FOR_EACH_BUILTIN_ENGINE(ZERO_DETAIL_EXTERN_HANDLE, Backend)
#define ZERO_EXTERN_DISK_STORES() ZERO_FOR_EACH_BUILTIN_ENGINE(ZERO_DETAIL_EXTERN_DISK_STORE, )

// What the file that compiles one precision's engines writes: the engines
// (ZERO_INSTANTIATE_ENGINES, engine/detail/builtin_engines.hpp); make_optimizer's
// handles, after including zero/runtime/make_optimizer.hpp (nlohmann-json,
// xxhash.h); the disk tier's stores, after including
// zero/offload/disk_state_store.hpp (liburing).
#define ZERO_INSTANTIATE_HANDLES(Precision, Backend) \
  ZERO_FOR_EACH_BUILTIN_OPTIMIZER(ZERO_DETAIL_HANDLE, Precision, Backend)
#define ZERO_INSTANTIATE_DISK_STORES(Precision) ZERO_FOR_EACH_BUILTIN_OPTIMIZER(ZERO_DETAIL_DISK_STORE, Precision, )
