// Why: the engine is written once against a small set of buffer operations,
// and each backend (host, CUDA, the test backends that model a GPU's
// streams on the host) provides them as a specialisation of Ops<B>. The
// contract is this concept, kept apart from any one backend so that every
// backend, the library's and the tests', is checked against the same list
// (a backend missing an operation is one compile error naming the concept,
// not a page of template errors from deep inside the engine).
#pragma once

#include "zero/compiler.hpp"

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "zero/kernels/fused_step.hpp"
#include "zero/optim/adam.hpp"
#include "zero/precision/types.hpp"
#include "zero/quant/symmetric.hpp"

namespace zero::backend {

template <class B>
struct Ops;  // one specialisation per backend tag (backend::Host, backend::Cuda, test backends)

// An owning array in the backend's memory: allocated zero-filled by
// Buffer(n), move-only, with its element count and bytes.
template <class Buf, class T>
concept BackendBuffer = std::default_initializable<Buf> && std::constructible_from<Buf, std::size_t> &&
                        std::movable<Buf> && !std::copyable<Buf> && requires(Buf b, const Buf cb) {
                          { b.data() } -> std::same_as<T*>;
                          { cb.data() } -> std::same_as<const T*>;
                          { cb.size() } -> std::same_as<std::size_t>;
                          { cb.bytes() } -> std::same_as<std::size_t>;
                        };

// Compute/communication ordering: a lane runs communication work after the
// compute so far; numbered events mark it; wait/join order compute after it.
template <class Overlap>
concept BackendOverlap = std::default_initializable<Overlap> && std::constructible_from<Overlap, void*, std::size_t> &&
                         std::movable<Overlap> && requires(Overlap o, const Overlap co, std::size_t k) {
                           { co.active() } -> std::same_as<bool>;
                           o.lane();
                           o.mark(k);
                           o.wait(k);
                           o.join();
                         };

// What the engine calls, checked on the element types it uses. The
// operations are stream-ordered on a device: copy, zero, convert, accumulate,
// fused_step and ZeRO++'s quantize, dequantize and dequantize_sum are
// enqueued; upload returns when the host source may be reused; download,
// grad_stats and grad_stats_pieces (several ranges, one result) return when
// the result is on the host.
template <class O>
concept BackendOps =
    BackendBuffer<typename O::template Buffer<float>, float> &&
    BackendBuffer<typename O::template Buffer<bf16>, bf16> && BackendOverlap<typename O::Overlap> &&
    requires(float* f, const float* cf, bf16* h, const bf16* ch, double* d, const double* cd, std::size_t n, bool b,
             const kernels::FusedStepArgs<optim::AdamW, bf16, bf16>& args,
             std::pair<const bf16*, std::size_t> (*pieces)(std::size_t), const quant::Pieces& parts,
             const quant::Format& format, void* payload, const void* cpayload) {
      { O::allocation_count() } -> std::convertible_to<std::uint64_t>;
      O::copy(f, cf, n);
      O::zero(h, n);
      O::upload(d, cd, n);
      O::download(d, cd, n);
      O::convert(f, ch, n);
      O::convert(h, cf, n);
      O::accumulate(h, ch, n, b);
      O::accumulate(h, cf, n, b);
      O::fused_step(args);
      O::quantize(ch, f, parts, format, payload);
      O::dequantize(cpayload, parts, format, h);
      O::dequantize_sum(cpayload, n, n, n, format, f);
      { O::grad_stats(ch, n) } -> std::same_as<kernels::GradStats>;
      { O::grad_stats_pieces(n, pieces) } -> std::same_as<kernels::GradStats>;
      O::synchronize();
    };

// What offloading the model state to the host adds (offload::Cpu/Nvme):
// host memory the backend's copies reach at full speed (page-locked on a
// GPU; it reports whether it got that), and copies between it and backend
// memory that are enqueued in stream order and return at once. The host may
// read a download_async destination, or reuse an upload_async source, only
// after synchronize() (or a later blocking call on the same stream).
template <class O>
concept OffloadOps = BackendOps<O> && BackendBuffer<typename O::template PinnedBuffer<float>, float> &&
                     BackendBuffer<typename O::template PinnedBuffer<bf16>, bf16> &&
                     requires(float* f, const float* cf, const typename O::template PinnedBuffer<float>& pinned,
                              std::size_t n) {
                       { pinned.page_locked() } -> std::same_as<bool>;
                       O::upload_async(f, cf, n);
                       O::download_async(f, cf, n);
                     };

}  // namespace zero::backend
