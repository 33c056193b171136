// After finalize() and a warm-up step, optimizer steps allocate nothing:
// constant-size buffers, no fragmentation. Counts every operator new in the
// process (all rank threads) and every backend buffer.
#include <atomic>
#include <cstdlib>
#include <new>

#include "engine_harness.hpp"

namespace {
std::atomic<long> g_news{0};
}

// A counting replacement of the global allocation functions, backed by malloc.
// Every form that frees with free() is replaced, array and nothrow ones too:
// AddressSanitizer supplies its own for any left out (Catch2 uses nothrow
// new), and their blocks reaching the free() below are an alloc-dealloc mismatch.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

void* operator new(std::size_t n) {
  g_news.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return ::operator new(n); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  g_news.fetch_add(1, std::memory_order_relaxed);
  return std::malloc(n ? n : 1);
}
void* operator new[](std::size_t n, const std::nothrow_t& tag) noexcept { return ::operator new(n, tag); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }

namespace {

template <int S, class Precision>
void check_no_allocation(int ranks) {
  INFO("stage " << S << ", ranks " << ranks);
  using Opt = zero::ZeroOptimizer<Precision, zero::optim::AdamW, zero::stage<S>, zero::offload::None,
                                  zero::backend::Host>;
  std::atomic<long> news_during_steps{0};
  std::atomic<long> buffers_during_steps{0};
  zero::comm::LocalGroup group(ranks);
  group.run([&](zero::comm::Local& c) {
    Opt opt(c, {}, zero::test::steady_state_options());
    zero::test::SteadyStateRun<Opt> run(opt);
    run.micro_batch();  // warm-up: first use of thread pools and scratch space
    run.micro_batch();
    c.barrier();
    const long news = g_news.load();
    const auto buffers = zero::backend::Ops<zero::backend::Host>::allocation_count();
    c.barrier();
    for (int i = 0; i < 6; ++i) run.micro_batch();
    c.barrier();
    if (c.rank() == 0) {
      news_during_steps = g_news.load() - news;
      buffers_during_steps = static_cast<long>(zero::backend::Ops<zero::backend::Host>::allocation_count() - buffers);
    }
    c.barrier();
  });
  CHECK(news_during_steps == 0);
  CHECK(buffers_during_steps == 0);
}

}  // namespace

TEST_CASE("Steady-state steps allocate nothing", "[engine][memory]") {
  check_no_allocation<0, zero::precision::Mixed<zero::bf16>>(2);
  check_no_allocation<1, zero::precision::Full<float>>(3);
  check_no_allocation<2, zero::precision::Mixed<zero::fp16>>(4);
  check_no_allocation<3, zero::precision::Mixed<zero::bf16>>(4);
}

TEST_CASE("The allocation counter sees allocations (the check above can fail)", "[engine][memory]") {
  const long before = g_news.load();
  std::vector<int> v(1000);
  v[0] = 1;
  volatile int sink = v[0] + v[999];
  (void)sink;
  CHECK(g_news.load() - before >= 1);
}
