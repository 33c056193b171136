// Why: the GPT's arithmetic on the CPU. GptModel (gpt_model.hpp) says what
// to compute in which order; this says how on the host: OpenBLAS sgemm for
// the matrix products, and OpenMP loops over rows or elements that call the
// math of gpt_ops.hpp, which the CUDA kernels (gpt_cuda.cu) call too.
//
// One threading system: OpenMP. OpenBLAS runs single-threaded, inside OpenMP
// loops that split a large product into tiles or run the attention's small
// per-head products side by side. With OpenBLAS's own threads beside
// OpenMP's, each system's waiting threads spun on the cores the other needed,
// and a 128 x 128 x 32 head product was too small for OpenBLAS to split.
//
// Every result is independent of the number of threads: a product is cut
// into tiles by its shape alone, a linear layer's weight and bias gradients
// are sums of per-block partials (blocks of rows cut by shape) added in
// block order, and each other sum over rows (LayerNorm and embedding
// gradients) runs over the rows in order, one column block per iteration.
#pragma once

#include <cblas.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <utility>
#include <vector>

#include "gpt/gpt_model.hpp"
#include "gpt/gpt_ops.hpp"
#include "zero/simd/dispatch.hpp"

namespace gpt {

class HostCompute {
 public:
  HostCompute() {
#if defined(OPENBLAS_VERSION)
    openblas_set_num_threads(1);  // the threads are OpenMP's (see the top of this file)
#endif
  }

  // The activation arena (gpt_model.hpp), on 2 MiB pages where the kernel
  // gives them on request (transparent huge pages in "madvise" mode): a
  // step streams some hundred MiB of activations through the products, read
  // with strides, and on 4 KiB pages the TLB covers a few MiB of them. On
  // the developer VM (no cycle counters to confirm the misses) the trainer
  // gained about 2-4% (bench/results/2026-12-01-gpt-host.md).
  template <class T>
  struct HugePageAllocator {
    using value_type = T;
    HugePageAllocator() = default;
    template <class U>
    HugePageAllocator(const HugePageAllocator<U>&) {}
    static constexpr std::size_t kPage = std::size_t{2} << 20;
    T* allocate(std::size_t n) {
      const std::size_t bytes = (n * sizeof(T) + kPage - 1) / kPage * kPage;
      void* p = std::aligned_alloc(kPage, bytes);
      if (p == nullptr) throw std::bad_alloc();
#if defined(MADV_HUGEPAGE)
      madvise(p, bytes, MADV_HUGEPAGE);  // a hint: without huge pages the arena works as before
#endif
      return static_cast<T*>(p);
    }
    void deallocate(T* p, std::size_t) { std::free(p); }
    template <class U>
    bool operator==(const HugePageAllocator<U>&) const { return true; }
  };
  using Buffer = std::vector<float, HugePageAllocator<float>>;
  static Buffer allocate(std::size_t floats) { return Buffer(floats, 0.0f); }

  // Token ids are read where the caller keeps them.
  const std::uint8_t* stage_tokens(const std::uint8_t* ids, std::size_t, int) { return ids; }
  // Results the caller reads (logits) are already on the host.
  void download(float* host, const float* src, std::size_t n) { std::copy(src, src + n, host); }

  void fill(float* p, std::size_t n, float value) { std::fill(p, p + n, value); }
  void copy(float* dst, const float* src, std::size_t n) { std::copy(src, src + n, dst); }

  // C (M x N) = op(A) op(B), row-major; op(A) is M x K; with `accumulate`,
  // C += op(A) op(B). A large product is cut along the longer of M and N
  // into tiles of at least kMinTile rows or columns (at most kMaxTiles), one
  // sgemm each; the cut depends on the shape only, so the bits do not depend
  // on the threads.
  void gemm(bool trans_a, bool trans_b, int M, int N, int K, const float* A, int lda, const float* B, int ldb,
            float* C, int ldc, bool accumulate = false) {
    const bool split_rows = M >= N;
    const int extent = split_rows ? M : N;
    const bool large = static_cast<double>(M) * N * K >= kMinSplitWork;
    const int tiles = large ? std::clamp(extent / kMinTile, 1, kMaxTiles) : 1;
    const float beta = accumulate ? 1.0f : 0.0f;
#pragma omp parallel for schedule(dynamic, 1) if (tiles > 1)
    for (int t = 0; t < tiles; ++t) {
      const int begin = static_cast<int>(static_cast<long>(extent) * t / tiles);
      const int end = static_cast<int>(static_cast<long>(extent) * (t + 1) / tiles);
      if (split_rows) {  // rows [begin, end) of C: rows of op(A)
        const float* a = A + (trans_a ? begin : static_cast<std::size_t>(begin) * lda);
        sgemm(trans_a, trans_b, end - begin, N, K, a, lda, B, ldb, beta, C + static_cast<std::size_t>(begin) * ldc,
              ldc);
      } else {  // columns [begin, end) of C: columns of op(B)
        const float* b = B + (trans_b ? static_cast<std::size_t>(begin) * ldb : begin);
        sgemm(trans_a, trans_b, M, end - begin, K, A, lda, b, ldb, beta, C + begin, ldc);
      }
    }
  }

  // Query rows per block of causal attention (gpt_model.hpp): the per-head
  // products skip the blocks above the diagonal, and each softmax row ends
  // with its block (key_end), not the context.
  static constexpr int causal_block() { return kCausalBlock; }

  // body(i) for i in [0, n), side by side: attention's heads
  // (GptModel::attention_heads), whose products are too small to split.
  template <class Body>
  void parallel_for(int n, const Body& body) {
#pragma omp parallel for schedule(static)
    for (int i = 0; i < n; ++i) body(i);
  }

  // x[n] = wte[token n] + wpe[n mod T].
  void embed_forward(const std::uint8_t* tokens, const float* wte, const float* wpe, std::size_t N, int T, int C,
                     float* x) {
    vector_ranges(N, kRowGrain, [&](std::size_t n0, std::size_t n1) ZERO_FLATTEN {
      for (std::size_t n = n0; n < n1; ++n)
        for (int c = 0; c < C; ++c)
          x[n * C + c] = ops::add(wte[static_cast<std::size_t>(tokens[n]) * C + c], wpe[(n % T) * C + c]);
    });
  }
  // dwte[token n] += d[n], dwpe[n mod T] += d[n] (rows in order: deterministic).
  void embed_backward(const std::uint8_t* tokens, const float* d, std::size_t N, int T, int C, float* dwte,
                      float* dwpe) {
    by_column_block(C, [&](int c0, int c1) ZERO_FLATTEN {
      for (std::size_t n = 0; n < N; ++n)
        for (int c = c0; c < c1; ++c) {
          dwte[static_cast<std::size_t>(tokens[n]) * C + c] += d[n * C + c];
          dwpe[(n % T) * C + c] += d[n * C + c];
        }
    });
  }

  void layernorm_forward(const float* x, const float* w, const float* b, std::size_t N, int C, float* out,
                         float* mean, float* rstd) {
    vector_ranges(N, kRowGrain, [&](std::size_t n0, std::size_t n1) ZERO_FLATTEN {
      for (std::size_t n = n0; n < n1; ++n) {
        const ops::RowStats s = ops::layernorm_forward_row(x + n * C, w, b, out + n * C, C);
        mean[n] = s.mean;
        rstd[n] = s.rstd;
      }
    });
  }
  // dx += d(loss)/d(x); dw, db overwritten.
  void layernorm_backward(const float* dout, const float* x, const float* w, const float* mean, const float* rstd,
                          std::size_t N, int C, float* dx, float* dw, float* db) {
    vector_ranges(N, kRowGrain, [&](std::size_t n0, std::size_t n1) ZERO_FLATTEN {
      for (std::size_t n = n0; n < n1; ++n)
        ops::layernorm_backward_row(dout + n * C, x + n * C, w, ops::RowStats{mean[n], rstd[n]}, dx + n * C, C);
    });
    by_column_block(C, [&](int c0, int c1) ZERO_FLATTEN {
      const float* d = dout + c0;
      sum_rows(N, c1 - c0, dw + c0, [&](std::size_t n, int c) ZERO_FLATTEN {
        return d[n * C + c] * ops::layernorm_normalized(x[n * C + c0 + c], ops::RowStats{mean[n], rstd[n]});
      });
      sum_rows(N, c1 - c0, db + c0, [&](std::size_t n, int c) ZERO_FLATTEN { return d[n * C + c]; });
    });
  }

  // out (N x O) = in (N x I) W^T + b (W: O x I, nn.Linear's layout), plus
  // residual (N x O) unless it is null; with gelu_out, gelu_out = gelu(out).
  // One parallel loop over blocks of rows (the product's tiles, cut as gemm
  // cuts it): each block lays down its bias and residual rows, adds the
  // product to them and applies GELU while its rows are in cache. Separate
  // passes over the whole output (bias, product, GELU) each woke the threads
  // and went through memory again.
  void linear_forward(const float* in, const float* w, const float* b, const float* residual, std::size_t N, int I,
                      int O, float* out, float* gelu_out) {
    const int blocks = row_blocks(N, I, O);
    const zero::simd::IsaLevel level = zero::simd::active_isa();
    const auto o = static_cast<std::size_t>(O);
#pragma omp parallel for schedule(dynamic, 1) if (blocks > 1)
    for (int t = 0; t < blocks; ++t) {
      const std::size_t r0 = block_begin(N, t, blocks), r1 = block_begin(N, t + 1, blocks);
      zero::simd::dispatch<Vectorised>(level, [&]() ZERO_FLATTEN { bias_rows(out, b, residual, r0, r1, O); });
      sgemm(false, true, static_cast<int>(r1 - r0), O, I, in + r0 * I, I, w, I, 1.0f, out + r0 * o, O);
      if (gelu_out != nullptr) zero::simd::dispatch<GeluForward>(level, out, gelu_out, 0, r0 * o, r1 * o);
    }
  }

  // dW = dout^T in, db = column sums of dout, din = dout W (all
  // overwritten); with gelu_in (the GELU input whose output `in` is), din
  // then becomes d(loss)/d(gelu_in). One parallel region over the same
  // blocks of rows as linear_forward: block t computes its rows of din and
  // its rows' share of dW and db (a product over its rows, K = its row
  // count); block 0 writes dw and db, the others partial sums that are then
  // added in block order. Cut by rows, each block packs only its own rows of
  // dout and `in`: cut by dW's rows or columns (gemm's cut), every tile
  // packed all N rows of the operand the tiles share again.
  void linear_backward(const float* dout, const float* in, const float* w, std::size_t N, int I, int O, float* dw,
                       float* db, float* din, const float* gelu_in) {
    const int blocks = row_blocks(N, I, O);
    const std::size_t dw_size = static_cast<std::size_t>(O) * I, stride = dw_size + O;  // one block's partial dw, db
    if (partials_.size() < (blocks - 1) * stride) partials_.resize((blocks - 1) * stride);
    float* partials = partials_.data();
    const zero::simd::IsaLevel level = zero::simd::active_isa();
    const auto o = static_cast<std::size_t>(O), i = static_cast<std::size_t>(I);
#pragma omp parallel if (blocks > 1)
    {
#pragma omp for schedule(dynamic, 1)
      for (int t = 0; t < blocks; ++t) {
        const std::size_t r0 = block_begin(N, t, blocks), r1 = block_begin(N, t + 1, blocks);
        const int rows = static_cast<int>(r1 - r0);
        const float* d = dout + r0 * o;
        float* dw_t = t == 0 ? dw : partials + (t - 1) * stride;
        float* db_t = t == 0 ? db : partials + (t - 1) * stride + dw_size;
        sgemm(true, false, O, I, rows, d, O, in + r0 * i, I, 0.0f, dw_t, I);
        sgemm(false, false, rows, I, O, d, O, w, I, 0.0f, din + r0 * i, I);
        zero::simd::dispatch<Vectorised>(level, [&]() ZERO_FLATTEN {
          for (int c0 = 0; c0 < O; c0 += kColumnBlock)
            sum_rows(r1 - r0, std::min(kColumnBlock, O - c0), db_t + c0,
                     [&](std::size_t n, int c) ZERO_FLATTEN { return d[n * o + c0 + c]; });
        });
        if (gelu_in != nullptr) zero::simd::dispatch<GeluBackward>(level, gelu_in, din, 0, r0 * i, r1 * i);
      }
      // The partial sums, in block order, over ranges of dw's and db's elements.
      const std::size_t ranges = blocks > 1 ? (stride + kSumGrain - 1) / kSumGrain : 0;
#pragma omp for schedule(static)
      for (std::size_t r = 0; r < ranges; ++r) {
        zero::simd::dispatch<Vectorised>(level, [&]() ZERO_FLATTEN {
          const std::size_t e0 = r * kSumGrain, e1 = std::min(stride, e0 + kSumGrain);
          for (int t = 1; t < blocks; ++t) {
            const float* part = partials + (t - 1) * stride;
            for (std::size_t e = e0; e < std::min(e1, dw_size); ++e) dw[e] += part[e];
            for (std::size_t e = std::max(e0, dw_size); e < e1; ++e) db[e - dw_size] += part[e];
          }
        });
      }
    }
  }

  // `matrices` T x T score matrices back to back; row r is row r mod T of
  // its matrix, defined up to the end of its query block (key_end).
  void causal_softmax(float* att, std::size_t matrices, int T, float scale) {
    const std::size_t rows = matrices * static_cast<std::size_t>(T);
    vector_ranges(rows, kRowGrain, [&](std::size_t r0, std::size_t r1) ZERO_FLATTEN {
      for (std::size_t r = r0; r < r1; ++r) {
        const int row = static_cast<int>(r % T);
        ops::causal_softmax_row(att + r * T, row, key_end(row, T), scale);
      }
    });
  }
  void causal_softmax_backward(const float* att, float* datt, std::size_t matrices, int T, float scale) {
    const std::size_t rows = matrices * static_cast<std::size_t>(T);
    vector_ranges(rows, kRowGrain, [&](std::size_t r0, std::size_t r1) ZERO_FLATTEN {
      for (std::size_t r = r0; r < r1; ++r) {
        const int row = static_cast<int>(r % T);
        ops::causal_softmax_backward_row(att + r * T, datt + r * T, row, key_end(row, T), scale);
      }
    });
  }

  // Adds the N rows' losses to the running total; with `backward`, logits
  // become grad_scale x d(loss)/d(logits).
  void cross_entropy(float* logits, const std::uint8_t* targets, std::size_t N, int V, bool backward,
                     float grad_scale) {
    double sum = 0.0;
#pragma omp parallel for reduction(+ : sum) schedule(static)
    for (std::size_t n = 0; n < N; ++n) {
      float* z = logits + n * static_cast<std::size_t>(V);
      sum += ops::cross_entropy_row(z, backward ? z : nullptr, V, targets[n], grad_scale);
    }
    loss_sum_ += sum;
  }
  // The total since the last call.
  double take_loss_sum() { return std::exchange(loss_sum_, 0.0); }

 private:
  double loss_sum_ = 0.0;
  // Bodies for zero::simd::dispatch: GELU over elements [begin, end), compiled
  // for the CPU's instruction set, so expf's vector version is the widest.
  struct GeluForward {
    template <class Isa>
    ZERO_FLATTEN static void run(const float* x, float* y, int, std::size_t begin, std::size_t end) {
      ZERO_GPT_SIMD_LOOP
      for (std::size_t i = begin; i < end; ++i) y[i] = ops::gelu_forward(x[i]);
    }
  };
  struct GeluBackward {
    template <class Isa>
    ZERO_FLATTEN static void run(const float* x, float* d, int, std::size_t begin, std::size_t end) {
      ZERO_GPT_SIMD_LOOP
      for (std::size_t i = begin; i < end; ++i) d[i] = ops::gelu_backward(x[i], d[i]);
    }
  };

  // Products below this many multiply-adds run as one sgemm (the tiles' setup
  // would cost more than the second thread gains). Each tile packs the
  // operand all tiles share again: on the GPT's products (4096 rows, K 128
  // to 4096) 16 tiles ran at 50-75% of the GFLOP/s of 2 or 4, and 4 leave
  // room to balance two threads on busy cores (tiles are taken dynamically).
  static constexpr double kMinSplitWork = 4.0 * (1 << 20);
  static constexpr int kMinTile = 64;
  static constexpr int kMaxTiles = 4;
  // The blocks of rows of a linear layer over N rows (I inputs, O outputs):
  // gemm's tiles of its products.
  static int row_blocks(std::size_t N, int I, int O) {
    const bool large = static_cast<double>(N) * I * O >= kMinSplitWork;
    return large ? std::clamp(static_cast<int>(std::min<std::size_t>(N / kMinTile, kMaxTiles)), 1, kMaxTiles) : 1;
  }
  static std::size_t block_begin(std::size_t N, int t, int blocks) {
    return N * static_cast<std::size_t>(t) / static_cast<std::size_t>(blocks);
  }
  // Elements per range of linear_backward's sum of partial gradients.
  static constexpr std::size_t kSumGrain = 4096;
  // linear_backward's partial dW and db of its row blocks after the first
  // (grown to the largest layer on first use, then reused).
  std::vector<float> partials_;
  static constexpr int kCausalBlock = 32;
  // The end of the keys that row `row`'s query block sees.
  static int key_end(int row, int T) { return std::min(T, (row / kCausalBlock + 1) * kCausalBlock); }
  // Columns per block of a sum over rows: one 64-byte cache line of floats,
  // one AVX-512 register of sums.
  static constexpr int kColumnBlock = 16;
  // Rows per range of a row-wise loop (vector_ranges).
  static constexpr std::size_t kRowGrain = 64;

  // Rows [r0, r1) of out (rows of O) = b, plus residual's rows unless it is
  // null: a linear layer's output before the product is added to it (one
  // pass instead of zeroing, adding the bias and adding the residual).
  static void bias_rows(float* out, const float* b, const float* residual, std::size_t r0, std::size_t r1, int O) {
    for (std::size_t n = r0; n < r1; ++n) {
      float* row = out + n * O;
      if (residual == nullptr) {
        for (int o = 0; o < O; ++o) row[o] = b[o];
      } else {
        for (int o = 0; o < O; ++o) row[o] = ops::add(b[o], residual[n * O + o]);
      }
    }
  }

  static void sgemm(bool trans_a, bool trans_b, int M, int N, int K, const float* A, int lda, const float* B, int ldb,
                    float beta, float* C, int ldc) {
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K,
                1.0f, A, lda, B, ldb, beta, C, ldc);
  }

  // A body for zero::simd::dispatch: f() compiled for the instruction set
  // Isa (`flatten` compiles f and all it calls into the one function). The
  // build's default target is SSE2: the row loops of gpt_ops.hpp ran 4 wide.
  struct Vectorised {
    template <class Isa, class F>
    ZERO_FLATTEN static void run(const F& f) {
      f();
    }
  };

  // body(begin, end) for the ranges of `grain` items that tile [0, n), side
  // by side, each compiled for the CPU's widest vector instructions.
  template <class Body>
  static void vector_ranges(std::size_t n, std::size_t grain, const Body& body) {
    const zero::simd::IsaLevel level = zero::simd::active_isa();
    const std::size_t ranges = (n + grain - 1) / grain;
#pragma omp parallel for schedule(static)
    for (std::size_t r = 0; r < ranges; ++r)
      zero::simd::dispatch<Vectorised>(level,
                                       [&]() ZERO_FLATTEN { body(r * grain, std::min(n, (r + 1) * grain)); });
  }

  // body(c0, c1) for each block of kColumnBlock columns of `cols`, side by
  // side; a body sums its columns over the rows in order, as one thread would.
  template <class Body>
  static void by_column_block(int cols, const Body& body) {
    vector_ranges(static_cast<std::size_t>(cols), kColumnBlock,
                  [&](std::size_t c0, std::size_t c1) ZERO_FLATTEN {
                    body(static_cast<int>(c0), static_cast<int>(c1));
                  });
  }

  // out[c] = the sum of term(n, c) over the rows n in order, for c in
  // [0, width), width <= kColumnBlock: the sums of a block stay in registers
  // (in memory, each add would wait for the last one's store).
  template <class Term>
  ZERO_FLATTEN static void sum_rows(std::size_t N, int width, float* out, const Term& term) {
    float acc[kColumnBlock] = {};
    if (width == kColumnBlock) {
      for (std::size_t n = 0; n < N; ++n)
        for (int c = 0; c < kColumnBlock; ++c) acc[c] += term(n, c);
    } else {
      for (std::size_t n = 0; n < N; ++n)
        for (int c = 0; c < width; ++c) acc[c] += term(n, c);
    }
    std::copy(acc, acc + width, out);
  }
};

using Gpt = GptModel<HostCompute>;

}  // namespace gpt
