// Why: on a GPU the engine's communication runs on the communicator's stream
// beside the compute, ordered only by the events of Ops<Cuda>::Overlap. A
// missing wait there is a race that a GPU shows only now and then, and CI has
// no GPU. So this test gives the engine a host backend whose communication
// lane runs as LATE as the events allow: everything enqueued in a lane (the
// backend's operations and the collectives) is queued, and runs only when the
// engine waits for it (Overlap::wait / join), or when the lane itself needs a
// result on the host (download, as a stream wait would). Work outside lanes
// (the compute stream) runs at once. A result the engine reads, or a buffer
// it reuses, without the right wait is then stale or overwritten every time,
// and training departs from the single-process reference.
//
// What this cannot see is a lane that starts too EARLY (before compute work
// it needs): on the GPU every lane forks from the compute stream's latest
// event, which this host model gets for free.
#include <algorithm>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "engine_harness.hpp"

namespace zero::test {

// One rank thread's communication lane: queued work and the queue positions
// the numbered events marked.
struct LaneQueue {
  struct Item {
    std::function<void()> run;
    std::size_t compute_before;  // compute operations run before it was queued
  };
  std::vector<Item> work;
  std::size_t done = 0;
  bool in_lane = false;
  bool draining = false;
  std::vector<std::size_t> marks;
  std::size_t compute_ops = 0;  // operations run at once, outside lanes
  std::size_t deferred = 0;     // operations queued (the test's evidence that it deferred)
  std::size_t overtaken = 0;    // ... that ran after compute work issued behind them

  void run_until(std::size_t end) {
    const bool outer = !draining;
    draining = true;
    while (done < end) {
      Item item = std::move(work[done]);
      ++done;
      if (compute_ops > item.compute_before) ++overtaken;
      item.run();
    }
    if (outer) draining = false;
  }
  void drain() { run_until(work.size()); }
};

inline LaneQueue& lane_queue() {
  thread_local LaneQueue q;
  return q;
}

}  // namespace zero::test

namespace zero::backend {

// Host memory and host kernels, with a lazy communication lane.
struct DeferredLane {
  static constexpr bool device = false;
  static constexpr const char* name = "host-deferred-lane";
};

template <>
struct Ops<DeferredLane> {
  using Eager = Ops<Host>;
  template <class T>
  using Buffer = HostBuffer<T>;

  static std::uint64_t allocation_count() { return Eager::allocation_count(); }

  // Queued inside a lane, run at once outside one.
  template <class F>
  static void enqueue(F&& f) {
    test::LaneQueue& q = test::lane_queue();
    if (q.in_lane && !q.draining) {
      q.work.push_back({std::function<void()>(std::forward<F>(f)), q.compute_ops});
      ++q.deferred;
    } else {
      if (!q.in_lane) ++q.compute_ops;
      f();
    }
  }
  // A host wait on the current stream: inside a lane, the lane's work so
  // far; outside, a compute operation that runs at once.
  static void wait_current() {
    test::LaneQueue& q = test::lane_queue();
    if (q.in_lane && !q.draining)
      q.drain();
    else if (!q.in_lane)
      ++q.compute_ops;
  }

  template <class T>
  static void copy(T* dst, const T* src, std::size_t n) {
    enqueue([=] { Eager::copy(dst, src, n); });
  }
  template <class T>
  static void zero(T* dst, std::size_t n) {
    enqueue([=] { Eager::zero(dst, n); });
  }
  template <class T>
  static void upload(T* dst, const T* host_src, std::size_t n) {
    wait_current();
    Eager::upload(dst, host_src, n);
  }
  template <class T>
  static void download(T* host_dst, const T* src, std::size_t n) {
    wait_current();
    Eager::download(host_dst, src, n);
  }
  template <class To, class From>
  static void convert(To* dst, const From* src, std::size_t n) {
    enqueue([=] { Eager::convert(dst, src, n); });
  }
  template <class T, class S>
  static void accumulate(T* dst, const S* src, std::size_t n, bool overwrite) {
    enqueue([=] { Eager::accumulate(dst, src, n, overwrite); });
  }
  template <class Opt, class Grad, class Param>
  static void fused_step(const kernels::FusedStepArgs<Opt, Grad, Param>& args) {
    enqueue([args] { Eager::fused_step(args); });
  }
  template <class T>
  static void quantize(const T* x, float* residual, const quant::Pieces& p, const quant::Format& f, void* payload) {
    enqueue([=] { Eager::quantize(x, residual, p, f, payload); });
  }
  template <class T>
  static void dequantize(const void* payload, const quant::Pieces& p, const quant::Format& f, T* out) {
    enqueue([=] { Eager::dequantize(payload, p, f, out); });
  }
  static void dequantize_sum(const void* payloads, std::size_t count, std::size_t payload_stride, std::size_t n,
                             const quant::Format& f, float* out) {
    enqueue([=] { Eager::dequantize_sum(payloads, count, payload_stride, n, f, out); });
  }
  template <class Grad>
  static kernels::GradStats grad_stats(const Grad* grad, std::size_t n) {
    wait_current();
    return Eager::grad_stats(grad, n);
  }
  template <class Piece>
  static kernels::GradStats grad_stats_pieces(std::size_t count, Piece&& piece) {
    wait_current();
    return Eager::grad_stats_pieces(count, piece);
  }
  static void synchronize() { wait_current(); }

  class Overlap {
   public:
    Overlap() = default;
    Overlap(void* comm_stream, std::size_t events) : active_(comm_stream != nullptr) {
      test::lane_queue().marks.assign(events, 0);
    }
    class Lane {
     public:
      Lane() = default;
      explicit Lane(bool enter) : entered_(enter) {
        if (entered_) test::lane_queue().in_lane = true;
      }
      Lane(const Lane&) = delete;
      Lane& operator=(const Lane&) = delete;
      ~Lane() {
        if (entered_) test::lane_queue().in_lane = false;
      }

     private:
      bool entered_ = false;
    };
    bool active() const { return active_; }
    Lane lane() { return Lane(active_ && !test::lane_queue().in_lane); }
    void mark(std::size_t k) {
      if (active_) test::lane_queue().marks.at(k) = test::lane_queue().work.size();
    }
    void wait(std::size_t k) {
      if (active_) test::lane_queue().run_until(test::lane_queue().marks.at(k));
    }
    void join() {
      if (active_) test::lane_queue().drain();
    }

   private:
    bool active_ = false;
  };
};

static_assert(BackendOps<Ops<DeferredLane>>);  // the contract the engine relies on

}  // namespace zero::backend

namespace zero::test {

// comm::Local whose collectives, issued in a lane, wait in the lane's queue:
// a communicator with "a stream of its own".
class DeferredComm {
 public:
  using Ops = backend::Ops<backend::DeferredLane>;
  explicit DeferredComm(comm::Local& c) : c_(c) {}
  int rank() const { return c_.rank(); }
  int size() const { return c_.size(); }
  // Any non-null handle; `moved_to` stands for the communicator being replaced.
  void* stream() const { return moved_to != nullptr ? moved_to : const_cast<DeferredComm*>(this); }
  void* moved_to = nullptr;
  const comm::ByteCounters& counters() const { return c_.counters(); }
  void reset_counters() { c_.reset_counters(); }
  void all_reduce(void* buf, std::size_t n, DType t, comm::ReduceOp op, bool control) {
    Ops::enqueue([=, this] { c_.all_reduce(buf, n, t, op, control); });
  }
  void reduce_scatter(const void* send, void* recv, std::size_t n, DType t) {
    Ops::enqueue([=, this] { c_.reduce_scatter(send, recv, n, t); });
  }
  void all_gather(const void* send, void* recv, std::size_t n, DType t, bool control) {
    Ops::enqueue([=, this] { c_.all_gather(send, recv, n, t, control); });
  }
  void broadcast(void* buf, std::size_t n, DType t, int root) {
    Ops::enqueue([=, this] { c_.broadcast(buf, n, t, root); });
  }
  void all_to_all(const void* send, void* recv, std::size_t n, DType t) {
    Ops::enqueue([=, this] { c_.all_to_all(send, recv, n, t); });
  }
  void barrier() {
    Ops::wait_current();
    c_.barrier();
  }

 private:
  comm::Local& c_;
};
static_assert(comm::Communicator<DeferredComm>);

}  // namespace zero::test

namespace {

using zero::test::Config;

using zero::bf16;
using zero::fp16;
using namespace zero::precision;
using zero::optim::Adam;
using zero::optim::AdamW;
using zero::optim::Sgd;
using Configs = std::tuple<Config<0, Full<float>, Adam>, Config<0, Mixed<fp16>, Sgd>, Config<1, Mixed<bf16>, AdamW>,
                           Config<1, Full<float>, Sgd>, Config<2, Mixed<bf16>, Adam>, Config<2, Mixed<fp16>, AdamW>,
                           Config<2, Full<float>, Sgd>, Config<3, Mixed<bf16>, AdamW>, Config<3, Mixed<fp16>, Adam>,
                           Config<3, Full<float>, Sgd>>;

}  // namespace

TEMPLATE_LIST_TEST_CASE("a late communication lane trains exactly like the reference",
                        "[engine][overlap]", Configs) {
  using Opt = zero::ZeroOptimizer<typename TestType::Precision, typename TestType::Optimizer,
                                  zero::stage<TestType::stage>, zero::offload::None, zero::backend::DeferredLane>;
  const auto hyper = zero::test::test_hyper<typename TestType::Optimizer>();
  using zero::ReduceDType;
  using zero::test::one_unit_bucket;
  using zero::test::whole_model_bucket;
  const zero::test::Variant variants[] = {
      {"one unit per bucket, accumulate 3 + clip", 3, 0.05, ReduceDType::same_as_grad, one_unit_bucket},
      {"whole model per bucket", 1, 0.0, ReduceDType::same_as_grad, whole_model_bucket},
      {"one unit per bucket, reduce in fp32, prefetch 2", 2, 0.0, ReduceDType::fp32, one_unit_bucket, 2},
      {"one unit per bucket, no prefetch", 1, 0.0, ReduceDType::same_as_grad, one_unit_bucket, 0}};
  // Work of the lane that ran after compute work issued behind it. (Not in
  // every variant: a bucket flushed only at step() is joined at once, and a
  // stage-3 gather without prefetch is waited for at once.)
  std::size_t total_overtaken = 0;
  for (const int ranks : {1, 2, 3}) {
    for (const auto& v : variants) {
      INFO("stage " << TestType::stage << ", " << ranks << " rank(s), " << v.name);
      const zero::Options options = v.options();
      zero::test::TrainSpec spec;
      spec.steps = 4;
      spec.parts = ranks;
      spec.check_acquired = true;

      std::vector<zero::test::RunResult> results(static_cast<std::size_t>(ranks));
      std::vector<std::size_t> deferred(results.size()), overtaken(results.size()), left(results.size());
      zero::comm::LocalGroup group(ranks);
      group.run([&](zero::comm::Local& local) {  // (no Catch2 assertions on these threads)
        zero::test::LaneQueue& q = zero::test::lane_queue();
        q = {};
        zero::test::DeferredComm comm(local);
        const auto r = static_cast<std::size_t>(local.rank());
        results[r] = zero::test::train<Opt>(comm, hyper, options, spec);
        deferred[r] = q.deferred;
        overtaken[r] = q.overtaken;
        left[r] = q.work.size() - q.done;
      });
      const auto want = zero::test::reference_train<typename TestType::Precision, typename TestType::Optimizer>(
          ranks, hyper, options, spec.steps);
      for (int r = 0; r < ranks; ++r) {
        INFO("rank " << r);
        zero::test::require_equivalent<typename Opt::param_type>(results[static_cast<std::size_t>(r)], want);
        // The lane really was deferred, and nothing was left behind.
        CHECK(deferred[static_cast<std::size_t>(r)] > 0);
        CHECK(left[static_cast<std::size_t>(r)] == 0);
        total_overtaken += overtaken[static_cast<std::size_t>(r)];
      }
      for (std::size_t i = 0; i < results[0].steps.size(); ++i) {
        CHECK(results[0].steps[i].stepped);
        CHECK(results[0].steps[i].grad_norm == Approx(want.steps[i].grad_norm).epsilon(1e-9));
      }
      // Gradient staging is double-buffered when communication overlaps
      // (stages 0 and 1 without accumulation stage nothing).
      if (TestType::stage >= 2 || v.accumulation > 1) {
        using Plain = zero::ZeroOptimizer<typename TestType::Precision, typename TestType::Optimizer,
                                          zero::stage<TestType::stage>, zero::offload::None, zero::backend::Host>;
        zero::comm::LocalGroup one(1);
        std::uint64_t plain_staging = 0;
        one.run([&](zero::comm::Local& c) {
          Plain plain(c, hyper, options);
          plain.add_param(plain.add_unit("u"), "w", 1000);
          plain.finalize();
          plain_staging = plain.memory_report().communication_buffers;
        });
        zero::comm::LocalGroup one_more(1);
        std::uint64_t overlapped_staging = 0;
        one_more.run([&](zero::comm::Local& c) {
          zero::test::DeferredComm dc(c);
          Opt overlapped(dc, hyper, options);
          overlapped.add_param(overlapped.add_unit("u"), "w", 1000);
          overlapped.finalize();
          overlapped_staging = overlapped.memory_report().communication_buffers;
        });
        CHECK(overlapped_staging > plain_staging);
        // Exactly the double-buffered sizes the planner predicts (engine/plan.hpp).
        zero::plan::Model model;
        model.units = {{"u", {1000}}};
        CHECK(plain_staging ==
              zero::plan::make_plan(zero::plan::scenario_for<Plain>(model, 1, options, false)).communication_buffers());
        CHECK(overlapped_staging ==
              zero::plan::make_plan(zero::plan::scenario_for<Opt>(model, 1, options, true)).communication_buffers());
      }
    }
  }
  CHECK(total_overtaken > 0);
}

TEST_CASE("a communicator whose stream changes after finalize() is a clear error", "[engine][overlap][errors]") {
  using Opt = zero::ZeroOptimizer<zero::precision::Full<float>, zero::optim::AdamW, zero::stage<2>, zero::offload::None,
                                  zero::backend::DeferredLane>;
  std::string message;
  zero::comm::LocalGroup group(1);
  group.run([&](zero::comm::Local& local) {  // (no Catch2 assertions on this thread)
    zero::test::lane_queue() = {};
    zero::test::DeferredComm comm(local);
    zero::Options options;
    options.bucket_bytes = 1;  // grad_ready flushes at once
    Opt opt(comm, zero::optim::AdamW::Hyper{}, options);
    const zero::UnitId u = opt.add_unit("layer");
    opt.add_param(u, "w", 100);
    opt.finalize();
    int elsewhere = 0;
    comm.moved_to = &elsewhere;
    try {
      std::fill_n(opt.grad_buffer(u), 100, 0.0f);  // (assigned: the contract the first micro-batch checks)
      opt.grad_ready(u);
    } catch (const zero::Error& e) {
      message = e.what();
    }
  });
  CHECK_THAT(message, Catch::Contains("the communicator's stream changed after finalize()"));
}
