// Why: the other engine tests train whole optimizers, so a fault in one of
// the engine's parts shows, if at all, as a wrong number after a step, far
// from its cause. These test two parts on their own, as finalize() binds
// them (sizes from engine/detail/buffer_sizes.hpp), each over a stand-in
// communicator that plays one rank of several alone and records every call:
//   - ParamGatherer, stage 3's gather arena: what acquire() hands out, what
//     it prefetches and when it gathers again, and where the units it holds
//     lie in the arena;
//   - GradientReducer's bucket ring: which staging set each bucket is written
//     into, when and in which order a bucket's collectives are issued, and
//     that each rank keeps the sum over the ranks (computed here in double).
// Every rank of the run is played in turn, so each block of a unit is once
// this rank's own, written by the part under test.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "zero/backend/host.hpp"
#include "zero/comm/communicator.hpp"
#include "zero/engine/detail/buffer_sizes.hpp"
#include "zero/engine/detail/comm_channel.hpp"
#include "zero/engine/detail/gradient_reducer.hpp"
#include "zero/engine/layout.hpp"
#include "zero/engine/options.hpp"
#include "zero/engine/detail/param_gatherer.hpp"
#include "zero/engine/stage_rules.hpp"

namespace {

using HostOps = zero::backend::Ops<zero::backend::Host>;
using zero::DType;
using zero::Layout;
using zero::Options;
using Catch::Matchers::Contains;

constexpr int ranks = 4;
constexpr std::size_t no_unit = ~std::size_t{0};

// Units of different sizes, two of them with alignment gaps between their
// parameters, all with padding at the tail.
Layout model_layout() {
  Layout layout(ranks);
  const auto embedding = layout.add_unit("embedding");
  layout.add_param(embedding, "tokens", 1500);
  layout.add_param(embedding, "positions", 90);
  const auto block0 = layout.add_unit("block0");
  layout.add_param(block0, "block0.w", 601);
  layout.add_param(block0, "block0.b", 21);
  layout.add_param(layout.add_unit("block1"), "block1.w", 1000);
  layout.add_param(layout.add_unit("norm"), "norm.g", 33);
  layout.add_param(layout.add_unit("head"), "head.w", 2500);
  layout.finalize(sizeof(float));
  return layout;
}

// Whether element e of unit u's padded buffer belongs to a parameter (not
// to a gap), read from the parameters' own offsets.
bool in_param(const Layout& layout, std::size_t u, std::size_t e) {
  for (const std::size_t p : layout.units()[u].params) {
    const zero::ParamInfo& info = layout.params()[p];
    if (e >= info.offset && e < info.offset + info.numel) return true;
  }
  return false;
}

// One collective (or group bracket) as the stand-in saw it.
struct Call {
  std::string kind;      // "all_gather", "reduce_scatter", "all_reduce", "group_begin", ...
  std::size_t count = 0;  // elements, per rank for all_gather and reduce_scatter
  bool control = false;
  std::string verb;       // the purpose's (comm::Purpose), "" outside one
  std::size_t unit = no_unit;  // the unit the purpose names
};

// Plays rank `rank` of `ranks` alone. What the other ranks hold comes from
// `others(rank, unit, element)` (element: within the unit's padded buffer),
// the unit being the one the caller's comm::Purpose names: all_gather fills
// their blocks with it, reduce_scatter and all_reduce add it to this rank's
// values (in double, rounded once). Every call is recorded, in order.
class StandInRank {
 public:
  using Values = std::function<double(int rank, std::size_t unit, std::size_t element)>;

  StandInRank(int rank, int size, Values others) : rank_(rank), size_(size), others_(std::move(others)) {}
  int rank() const { return rank_; }
  int size() const { return size_; }

  void all_gather(const void* send, void* recv, std::size_t count, DType t, bool control) {
    const std::size_t unit = record("all_gather", count, t, control);
    auto* out = static_cast<float*>(recv);
    std::memmove(out + block(rank_, count), send, count * sizeof(float));
    for (int q = 0; q < size_; ++q)
      for (std::size_t i = 0; q != rank_ && i < count; ++i)
        out[block(q, count) + i] = static_cast<float>(others_(q, unit, block(q, count) + i));
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, DType t) {
    const std::size_t unit = record("reduce_scatter", count, t, false);
    const float* mine = static_cast<const float*>(send) + block(rank_, count);
    auto* out = static_cast<float*>(recv);  // may be `mine` itself
    for (std::size_t i = 0; i < count; ++i) out[i] = sum_with_others(mine[i], unit, block(rank_, count) + i);
  }
  void all_reduce(void* buf, std::size_t count, DType t, zero::comm::ReduceOp, bool control) {
    const std::size_t unit = record("all_reduce", count, t, control);
    auto* values = static_cast<float*>(buf);
    for (std::size_t i = 0; i < count; ++i) values[i] = sum_with_others(values[i], unit, i);
  }
  void broadcast(void*, std::size_t count, DType t, int) { record("broadcast", count, t, false); }
  void barrier() { mark("barrier"); }
  void group_begin() { mark("group_begin"); }
  void group_end() { mark("group_end"); }
  const zero::comm::ByteCounters& counters() const { return counters_; }
  void reset_counters() { counters_ = {}; }

  const std::vector<Call>& calls() const { return calls_; }

 private:
  void mark(const char* kind) {
    Call c;
    c.kind = kind;
    calls_.push_back(std::move(c));
  }
  static std::size_t block(int q, std::size_t count) { return static_cast<std::size_t>(q) * count; }
  float sum_with_others(float own, std::size_t unit, std::size_t element) const {
    double sum = own;
    for (int q = 0; q < size_; ++q)
      if (q != rank_) sum += others_(q, unit, element);
    return static_cast<float>(sum);
  }
  // The parts under test name what each exchange is for; the stand-in needs
  // that name to know which unit the other ranks send.
  std::size_t record(const char* kind, std::size_t count, DType t, bool control) {
    const zero::comm::Purpose* purpose = zero::comm::Purpose::current();
    calls_.push_back(Call{kind, count, control, purpose != nullptr ? purpose->verb : "",
                          purpose != nullptr ? static_cast<std::size_t>(purpose->index) : no_unit});
    INFO(kind << " of " << count << " elements");
    REQUIRE(t == DType::f32);
    REQUIRE(purpose != nullptr);
    REQUIRE(purpose->subject != nullptr);
    REQUIRE(std::string(purpose->subject) == "unit");
    return static_cast<std::size_t>(purpose->index);
  }

  int rank_, size_;
  Values others_;
  std::vector<Call> calls_;
  zero::comm::ByteCounters counters_;
};
static_assert(zero::comm::Communicator<StandInRank>);

// The calls from position `from` on, and those of one kind.
std::vector<Call> since(const std::vector<Call>& calls, std::size_t from) {
  return {calls.begin() + static_cast<std::ptrdiff_t>(from), calls.end()};
}
std::vector<Call> calls_of(const std::vector<Call>& calls, const std::string& kind, std::size_t from = 0) {
  std::vector<Call> out;
  for (std::size_t i = from; i < calls.size(); ++i)
    if (calls[i].kind == kind) out.push_back(calls[i]);
  return out;
}
std::vector<std::size_t> units_of(const std::vector<Call>& calls) {
  std::vector<std::size_t> out;
  for (const Call& c : calls) out.push_back(c.unit);
  return out;
}

// ---------------------------------------------------------------- gatherer

// The whole model's parameters: element e of unit u's padded buffer, in
// version v of its shards (a step, a load or set_param makes a new one).
// Halves of small integers: exact in float, and no two units' values alike.
double param_value(int version, std::size_t unit, std::size_t element) {
  return 0.5 * static_cast<double>(element) + 4096.0 * static_cast<double>(unit) + 0.25 * version;
}

// One rank's gatherer, bound as finalize() binds it at stage 3, over shards
// cut from param_value.
struct GatherBench {
  GatherBench(int rank, int prefetch_units)
      : comm(rank, ranks, [this](int, std::size_t u, std::size_t e) { return param_value(version[u], u, e); }),
        channel(comm) {
    Options options;
    options.prefetch_units = prefetch_units;
    const zero::RunShape run{.stage = zero::stage_rules(3), .precision = zero::PrecisionChoice::fp32};
    const zero::BufferSizes sizes = zero::buffer_sizes(layout, run, options);
    version.assign(layout.units().size(), 0);
    params.bind(HostOps::Buffer<float>(layout.shard_total()), layout, true);
    write_shards();
    HostOps::Buffer<float> arena(sizes.gather_slots);
    arena_begin = arena.data();
    arena_elements = arena.size();
    slots = sizes.gather_slot_count;
    const std::size_t first_event = zero::staging_set_count(options, true);  // the reducer's events come first
    channel.open(first_event + slots);
    gatherer.bind(std::move(arena), slots, layout, params, channel, prefetch_units, first_event);
  }
  GatherBench(const GatherBench&) = delete;
  GatherBench& operator=(const GatherBench&) = delete;

  // The shards now hold `version` (every rank's: the stand-in's too).
  void write_shards() {
    const auto r = static_cast<std::size_t>(comm.rank());
    for (std::size_t u = 0; u < layout.units().size(); ++u) {
      const zero::UnitInfo& info = layout.units()[u];
      for (std::size_t i = 0; i < info.shard; ++i)
        params.data()[info.shard_offset + i] = static_cast<float>(param_value(version[u], u, r * info.shard + i));
    }
  }
  std::vector<std::size_t> gathered_since(std::size_t mark) const {
    return units_of(calls_of(comm.calls(), "all_gather", mark));
  }
  std::size_t mark() const { return comm.calls().size(); }

  // Unit u's values at `data` are the whole unit, as its shards hold it now.
  void expect_whole(std::size_t u, const float* data) const {
    REQUIRE(data != nullptr);
    std::size_t wrong = 0, first = 0;
    for (std::size_t e = layout.units()[u].padded; e-- > 0;)
      if (data[e] != static_cast<float>(param_value(version[u], u, e))) {
        ++wrong;
        first = e;
      }
    INFO("unit '" << layout.units()[u].name << "' (rank " << comm.rank() << "): " << wrong
                  << " elements differ from the reference, the first at " << first);
    REQUIRE(wrong == 0);
  }
  // Every acquired unit lies inside the arena, apart from the others, and
  // still holds its values.
  void expect_held_apart() const {
    std::vector<std::pair<const float*, const float*>> ranges;
    for (std::size_t u = 0; u < layout.units().size(); ++u) {
      const float* data = gatherer.acquired_data(u);
      if (data == nullptr) continue;
      INFO("unit '" << layout.units()[u].name << "'");
      REQUIRE(data >= arena_begin);
      REQUIRE(data + layout.units()[u].padded <= arena_begin + arena_elements);
      for (const auto& [begin, end] : ranges) REQUIRE((data + layout.units()[u].padded <= begin || end <= data));
      ranges.emplace_back(data, data + layout.units()[u].padded);
      expect_whole(u, data);
    }
  }

  Layout layout = model_layout();
  std::vector<int> version;  // per unit
  StandInRank comm;
  zero::detail::CommChannel<HostOps> channel;
  zero::detail::ParamStore<HostOps, float> params;  // this rank's shards
  zero::detail::ParamGatherer<HostOps, float> gatherer;
  const float* arena_begin = nullptr;
  std::size_t arena_elements = 0, slots = 0;
};

TEST_CASE("acquire hands out the whole unit, gathered by one all_gather of its shards", "[gatherer]") {
  for (int rank = 0; rank < ranks; ++rank) {
    INFO("rank " << rank);
    GatherBench bench(rank, 0);
    // Out of layout order, so that no unit's values could be another's.
    for (const std::size_t u : {3, 0, 4, 1, 2}) {
      const std::size_t mark = bench.mark();
      bench.gatherer.end_micro_batch();
      bench.expect_whole(u, bench.gatherer.acquire(u, false));
      const std::vector<Call> made = since(bench.comm.calls(), mark);
      REQUIRE(made.size() == 1);
      CHECK(made[0].kind == "all_gather");
      CHECK(made[0].count == bench.layout.units()[u].shard);  // one rank's block
      CHECK_FALSE(made[0].control);
      CHECK(made[0].verb == "gathers");
      CHECK(made[0].unit == u);
      CHECK(bench.gatherer.is_acquired(u));
      bench.gatherer.release(u);
      CHECK_FALSE(bench.gatherer.is_acquired(u));
    }
  }
}

// A forward pass acquires units upwards, a backward pass downwards, each
// released before the next is acquired (the engine's pattern). Returns, for
// each acquire, the units gathered since the pass began, and checks the
// values each acquire hands out.
std::vector<std::vector<std::size_t>> one_pass(GatherBench& bench, bool backward) {
  const std::size_t n = bench.layout.units().size();
  const std::size_t start = bench.mark();
  std::vector<std::vector<std::size_t>> gathered;
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t u = backward ? n - 1 - i : i;
    INFO((backward ? "backward" : "forward") << ", unit " << u);
    bench.expect_whole(u, bench.gatherer.acquire(u, backward));
    gathered.push_back(bench.gathered_since(start));
    bench.gatherer.release(u);
  }
  return gathered;
}

// What the header promises a pass of prefetch_units = k: acquire(u) has
// gathered, since the pass began, the units from its first one to k past u
// in the pass's direction (the end of the model permitting), in that order,
// each once.
std::vector<std::size_t> promised(std::size_t n, std::size_t k, std::size_t i, bool backward) {
  std::vector<std::size_t> units;
  for (std::size_t j = 0; j <= std::min(i + k, n - 1); ++j) units.push_back(backward ? n - 1 - j : j);
  return units;
}

TEST_CASE("prefetch_units = k gathers the next k units in the pass's direction, once each", "[gatherer]") {
  const std::size_t n = model_layout().units().size();
  for (int k = 0; k <= static_cast<int>(n); ++k)
    for (int rank : {0, ranks - 1}) {
      INFO("prefetch_units " << k << ", rank " << rank);
      GatherBench bench(rank, k);
      // Forward, then backward in the same micro-batch.
      for (const bool backward : {false, true}) {
        const auto gathered = one_pass(bench, backward);
        for (std::size_t i = 0; i < n; ++i) {
          INFO((backward ? "backward" : "forward") << ", acquire #" << i);
          const std::vector<std::size_t> expected = promised(n, static_cast<std::size_t>(k), i, backward);
          if (k <= 1) {
            // Two units always fit the arena (arena_place): the promise, exactly.
            CHECK(gathered[i] == expected);
          } else {
            // More may not (the [!shouldfail] case below): a prefetch that
            // finds no room is made on demand instead. Still each unit once,
            // in the pass's order, none beyond the promise.
            CHECK(gathered[i].size() <= expected.size());
            CHECK(gathered[i].size() >= i + 1);
            CHECK(std::equal(gathered[i].begin(), gathered[i].end(), expected.begin()));
          }
        }
      }
    }
}

// buffer_sizes.hpp: "an arena of the prefetch_units + 1 largest units'
// elements holds any set of them"; arena_place: "then two units always fit
// (each sits at an end ...)". A prefetch placed while others hold both ends
// goes into a gap in the middle, and stays there: with three or more units
// the free room can be in pieces, none large enough, though together they
// are, and a prefetch the header promises is not made (it is made on demand
// at the acquire). Tagged [!shouldfail]: when the placement keeps the
// promise this passes, and the tag must go.
TEST_CASE("known: with prefetch_units = 3 a forward pass misses a prefetch the arena has room for",
          "[gatherer][!shouldfail]") {
  GatherBench bench(0, 3);
  const std::size_t n = bench.layout.units().size();
  const auto gathered = one_pass(bench, false);
  for (std::size_t i = 0; i < n; ++i) {
    INFO("acquire #" << i);
    CHECK(gathered[i] == promised(n, 3, i, false));
  }
}

// An acquired unit goes against an end of the arena (prefetched units make
// way), so a second unit beside one held always finds room. Before, the
// acquire of unit 0 below went into the gap in the middle, between the
// prefetched 3 and 1, and the acquire of 4 beside it failed with the arena's
// error although the arena holds any two units.
TEST_CASE("with prefetch_units = 2 a second unit beside one held finds room in the arena", "[gatherer]") {
  GatherBench bench(0, 2);
  const auto& units = bench.layout.units();
  REQUIRE(units[0].padded + units[4].padded <= bench.arena_elements);  // any two fit, the header says
  bench.gatherer.acquire(0, false);  // 0 at the start, 1 prefetched to the end, 2 between
  bench.gatherer.release(0);
  bench.gatherer.acquire(2, true);  // against the pass: no prefetch
  bench.gatherer.release(2);
  bench.gatherer.acquire(2, false);  // 2 at the start, 3 prefetched after it (1 still at the end)
  bench.gatherer.release(2);
  bench.expect_whole(0, bench.gatherer.acquire(0, false));  // against the pass: 1 and 3 make way, 0 at an end
  bench.expect_whole(4, bench.gatherer.acquire(4, false));
  bench.expect_held_apart();
}

// A tied weight: forward ends by acquiring the first unit again (a language
// model's output layer is its input embedding).
TEST_CASE("a unit acquired against the pass's direction prefetches nothing", "[gatherer]") {
  GatherBench bench(1, 1);
  const std::size_t n = bench.layout.units().size();
  for (std::size_t u = n - 2; u < n; ++u) {  // the pass's last units
    bench.gatherer.acquire(u, false);
    bench.gatherer.release(u);
  }
  std::size_t mark = bench.mark();
  bench.expect_whole(0, bench.gatherer.acquire(0, false));
  CHECK(bench.gathered_since(mark) == std::vector<std::size_t>{0});  // not unit 1 too
  bench.gatherer.release(0);
  // The next micro-batch's forward starts there, and prefetches.
  bench.gatherer.end_micro_batch();
  mark = bench.mark();
  bench.gatherer.acquire(0, false);
  CHECK(bench.gathered_since(mark) == std::vector<std::size_t>{0, 1});
  bench.gatherer.release(0);
}

// The engine says "backward" only from the first grad_ready on, so
// backward's first acquire (the unit forward ended with) comes flagged as
// forward; acquired again right after forward's, it starts backward and
// prefetches the unit below. Before, it prefetched nothing (upwards from the
// last unit), and backward's second unit was gathered on demand.
TEST_CASE("backward's first acquire, the unit forward ended with, prefetches the unit below", "[gatherer]") {
  GatherBench bench(1, 1);
  const std::size_t n = bench.layout.units().size();
  for (std::size_t u = 0; u < n; ++u) {  // forward
    bench.gatherer.acquire(u, false);
    bench.gatherer.release(u);
  }
  std::size_t mark = bench.mark();
  bench.expect_whole(n - 1, bench.gatherer.acquire(n - 1, false));  // before any grad_ready
  CHECK(bench.gathered_since(mark) == std::vector<std::size_t>{n - 1, n - 2});
  bench.gatherer.release(n - 1);
  mark = bench.mark();
  bench.expect_whole(n - 2, bench.gatherer.acquire(n - 2, true));  // prefetched: no gather now but the next one's
  CHECK(bench.gathered_since(mark) == std::vector<std::size_t>{n - 3});
  bench.gatherer.release(n - 2);
}

// Units acquired and released in an irregular order, with prefetches between
// them: after every call, each acquired unit lies inside the arena, apart
// from the others, with its values intact (a unit placed over another's
// range would overwrite them). Up to two units held (prefetch_units 0 and
// 1), every acquire must succeed; with more, one may find no room (the
// arena's free room in pieces), and the sequence goes on without it.
TEST_CASE("units held at once never overlap in the arena and stay inside it", "[gatherer]") {
  for (const int k : {0, 1, 2, 3})
    for (const int rank : {0, 2}) {
      INFO("prefetch_units " << k << ", rank " << rank);
      GatherBench bench(rank, k);
      const std::size_t n = bench.layout.units().size();
      std::uint64_t state = 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(rank);
      auto next = [&](std::size_t bound) {  // a 64-bit LCG: the same sequence every run
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        return static_cast<std::size_t>(state >> 33) % bound;
      };
      std::vector<std::size_t> held;
      for (int op = 0; op < 400; ++op) {
        INFO("operation " << op);
        if (held.size() < bench.slots && (held.empty() || next(3) != 0)) {
          std::size_t u = next(n);
          while (bench.gatherer.is_acquired(u)) u = (u + 1) % n;
          if (next(8) == 0) bench.gatherer.end_micro_batch();
          const bool backward = next(2) == 0;
          if (k >= 2) {
            try {
              bench.expect_whole(u, bench.gatherer.acquire(u, backward));
            } catch (const zero::InvalidArgument& e) {
              CHECK_THAT(e.what(), Contains("gather arena"));
              continue;
            }
          } else {
            bench.expect_whole(u, bench.gatherer.acquire(u, backward));
          }
          held.push_back(u);
        } else {
          const std::size_t i = next(held.size());
          bench.gatherer.release(held[i]);
          held.erase(held.begin() + static_cast<std::ptrdiff_t>(i));
        }
        bench.expect_held_apart();
      }
    }
}

TEST_CASE("acquiring more units than the arena holds is an error naming the held units; release frees room",
          "[gatherer]") {
  GatherBench bench(0, 1);  // room for two units
  const auto& units = bench.layout.units();
  REQUIRE(bench.slots == 2);
  bench.gatherer.acquire(0, false);
  bench.gatherer.acquire(1, false);
  const std::size_t mark = bench.mark();
  try {
    bench.gatherer.acquire(4, false);
    FAIL("acquire of a third unit with room for two succeeded");
  } catch (const zero::InvalidArgument& e) {
    CHECK_THAT(e.what(), Contains("acquire_unit('" + units[4].name + "')"));
    CHECK_THAT(e.what(), Contains("'" + units[0].name + "'"));
    CHECK_THAT(e.what(), Contains("'" + units[1].name + "'"));
    CHECK_THAT(e.what(), Contains("prefetch_units"));
  }
  CHECK(bench.gathered_since(mark).empty());  // nothing was gathered over the held units
  bench.expect_held_apart();
  CHECK_FALSE(bench.gatherer.is_acquired(4));
  bench.gatherer.release(0);
  bench.expect_whole(4, bench.gatherer.acquire(4, false));
  bench.expect_held_apart();
  // Releasing a unit that is not acquired is an error too.
  CHECK_THROWS_WITH(bench.gatherer.release(0), Contains("'" + units[0].name + "'") && Contains("not acquired"));
}

TEST_CASE("after the shards change, drop_all and drop make the next acquire gather again", "[gatherer]") {
  SECTION("drop_all: a step changed every shard") {
    GatherBench bench(3, 2);
    bench.gatherer.acquire(0, false);  // prefetches 1 and 2
    bench.gatherer.release(0);
    for (int& v : bench.version) ++v;
    bench.write_shards();
    bench.gatherer.drop_all();
    bench.gatherer.end_micro_batch();
    const std::size_t mark = bench.mark();
    bench.expect_whole(1, bench.gatherer.acquire(1, false));  // the new values, not the prefetched copy
    CHECK(bench.gathered_since(mark).front() == 1);
    bench.gatherer.release(1);
  }
  SECTION("drop: set_param changed one unit's shards") {
    GatherBench bench(2, 2);
    bench.gatherer.acquire(0, false);  // prefetches 1 and 2
    bench.gatherer.release(0);
    ++bench.version[2];
    bench.write_shards();
    bench.gatherer.drop(2);
    const std::size_t mark = bench.mark();
    bench.expect_whole(1, bench.gatherer.acquire(1, false));  // its prefetched copy, still current
    CHECK(bench.gathered_since(mark) == std::vector<std::size_t>{2, 3});  // 2 gathered again, with 3
    bench.gatherer.release(1);
    const std::size_t again = bench.mark();
    bench.expect_whole(2, bench.gatherer.acquire(2, false));  // the new values
    CHECK(bench.gathered_since(again) == std::vector<std::size_t>{4});
    bench.gatherer.release(2);
  }
  SECTION("a prefetch dropped before anyone acquired it is not made again in that direction") {
    GatherBench bench(0, 1);
    bench.gatherer.acquire(0, false);  // prefetches 1, which this micro-batch never acquires
    bench.gatherer.release(0);
    bench.gatherer.drop_all();
    bench.gatherer.end_micro_batch();
    std::size_t mark = bench.mark();
    bench.gatherer.acquire(0, false);
    CHECK(bench.gathered_since(mark) == std::vector<std::size_t>{0});  // 1 was gathered in vain
    bench.gatherer.release(0);
    bench.gatherer.acquire(1, false);  // wanted after all: prefetched again from now on
    bench.gatherer.release(1);
    bench.gatherer.drop_all();
    bench.gatherer.end_micro_batch();
    mark = bench.mark();
    bench.gatherer.acquire(0, false);
    CHECK(bench.gathered_since(mark) == std::vector<std::size_t>{0, 1});
    bench.gatherer.release(0);
  }
}

// ---------------------------------------------------------------- reducer

// Rank q's gradient of element e of unit u in micro-batch m: sixteenths of
// small integers, so that every sum here is exact in float; zero where no
// parameter is (a real rank's gradient is zero in the gaps).
double grad_value(const Layout& layout, int q, int m, std::size_t u, std::size_t e) {
  if (!in_param(layout, u, e)) return 0.0;
  return static_cast<double>((q + 1) * 3 + m * 5 + static_cast<int>(u) * 7 + static_cast<int>(e % 11)) / 16.0 - 2.0;
}

// One rank's reducer, bound as finalize() binds it, for `micro_batches`
// micro-batches per step. The stand-in's other ranks send, for a reduction
// at a flush, this micro-batch's gradient (stages 2-3), or the sum of the
// window's so far (stages 0 and 1, which accumulate whole gradients first).
struct ReduceBench {
  ReduceBench(int rank, int stage_, const Options& o, bool overlap, int micro_batches_)
      : stage(stage_),
        plan(zero::stage_rules(stage_)),
        options(o),
        micro_batches(micro_batches_),
        comm(rank, ranks, [this](int q, std::size_t u, std::size_t e) { return others(q, u, e); }),
        channel(comm) {
    options.grad_accumulation_steps = micro_batches;
    const zero::RunShape run{.stage = plan, .precision = zero::PrecisionChoice::fp32, .overlap = overlap};
    sizes = zero::buffer_sizes(layout, run, options);
    in_place = zero::gradients_in_place(plan, options);
    own_writes.assign(static_cast<std::size_t>(micro_batches), std::vector<int>(layout.units().size(), 0));
    channel.open(zero::staging_set_count(options, true));
    zero::detail::GradientReducer<HostOps, float>::Buffers buffers;
    buffers.accumulator = HostOps::Buffer<float>(sizes.grads);
    buffers.staging = HostOps::Buffer<float>(sizes.grad_staging);
    buffers.staging_fp32 = HostOps::Buffer<float>(sizes.reduce_staging_fp32);
    buffers.shard_staging = HostOps::Buffer<float>(sizes.shard_staging);
    staging_begin = buffers.staging.data();
    reducer.bind(std::move(buffers), sizes.buckets, plan, options.grad_writes, in_place, sizes.staging_sets, layout,
                 channel);
  }
  ReduceBench(const ReduceBench&) = delete;
  ReduceBench& operator=(const ReduceBench&) = delete;

  double others(int q, std::size_t u, std::size_t e) const {
    double sum = 0;
    for (int m = stage >= 2 ? micro : 0; m <= micro; ++m) sum += grad_value(layout, q, m, u, e);
    return sum;
  }
  bool first() const { return micro == 0; }
  bool last() const { return micro == micro_batches - 1; }
  const zero::GradientBuckets& buckets() const { return sizes.buckets; }
  // This rank's gradient of unit u in this micro-batch, written over g (gaps
  // included: the reducer must zero them), assigned or added.
  void write(std::size_t u, float* g, bool add) {
    ++own_writes[static_cast<std::size_t>(micro)][u];
    for (std::size_t e = 0; e < layout.units()[u].padded; ++e) {
      const auto v = static_cast<float>(1.0 + grad_value(layout, comm.rank(), micro, u, e));
      g[e] = add ? g[e] + v : v;
    }
  }
  // Where staging set `set` puts unit u.
  const float* staged(std::size_t set, std::size_t u) const {
    return staging_begin + set * buckets().max_elements + buckets().offset[u];
  }
  // After the window: this rank's part of the sum is the reference, the
  // sum over ranks and micro-batches in double. This rank's own values are
  // what write() wrote (grad_value + 1, the + 1 also in the gaps, where it
  // must not count), as often as it wrote them: a unit it never wrote in a
  // micro-batch added zeros.
  void expect_reduced() {
    const auto r = static_cast<std::size_t>(comm.rank());
    std::size_t wrong = 0, checked = 0;
    std::string first;
    for (std::size_t u = 0; u < layout.units().size(); ++u) {
      const zero::UnitInfo& info = layout.units()[u];
      // Stage 0 keeps the whole sum, stage 1 this rank's shard of it in
      // place, stages 2-3 only the shard.
      const std::size_t begin = stage == 0 ? 0 : r * info.shard, end = stage == 0 ? info.padded : begin + info.shard;
      const float* reduced =
          reducer.accumulator() + (stage >= 2 ? info.shard_offset : info.full_offset + begin);
      for (std::size_t e = begin; e < end; ++e, ++checked) {
        const float got = reduced[e - begin];
        double expected = 0;
        for (int q = 0; q < ranks; ++q)
          for (int m = 0; m < micro_batches; ++m) {
            if (q != comm.rank()) {
              expected += grad_value(layout, q, m, u, e);
              continue;
            }
            const double own = grad_value(layout, q, m, u, e) + (in_param(layout, u, e) ? 1.0 : 0.0);
            expected += own * own_writes[static_cast<std::size_t>(m)][u];
          }
        if (got != static_cast<float>(expected) && wrong++ == 0)
          first = info.name + "[" + std::to_string(e) + "]: " + std::to_string(got) + ", expected " +
                  std::to_string(expected);
      }
    }
    INFO(wrong << " of " << checked << " reduced elements differ; the first: " << first);
    REQUIRE(checked > 0);
    REQUIRE(wrong == 0);
  }

  Layout layout = model_layout();
  int stage;
  zero::StageRules plan;  // what finalize() hands the reducer
  Options options;
  int micro_batches;
  int micro = 0;
  StandInRank comm;
  zero::detail::CommChannel<HostOps> channel;
  zero::BufferSizes sizes;
  bool in_place = false;
  const float* staging_begin = nullptr;
  std::vector<std::vector<int>> own_writes;  // per micro-batch and unit: write() calls
  zero::detail::GradientReducer<HostOps, float> reducer;
};

// The bucket size that packs the model into several buckets, one of them of
// several units: two of its block1s.
std::size_t test_bucket_bytes() {
  const Layout layout = model_layout();
  return 2 * layout.units()[2].padded * sizeof(float);
}

TEST_CASE("the buckets pack units in backward's order while they fit in bucket_bytes", "[reducer]") {
  const Layout layout = model_layout();
  const auto& units = layout.units();
  for (const std::size_t bucket_bytes : {std::size_t{1}, test_bucket_bytes(), std::size_t{1} << 30}) {
    INFO("bucket_bytes " << bucket_bytes);
    const zero::GradientBuckets g = zero::gradient_buckets(layout, sizeof(float), bucket_bytes);
    std::size_t next_unit = units.size();  // backward fills buckets from the last unit down
    for (std::size_t b = 0; b < g.buckets.size(); ++b) {
      const auto& bucket = g.buckets[b];
      REQUIRE(bucket.units >= 1);
      REQUIRE(bucket.first_unit + bucket.units == next_unit);
      std::size_t bytes = 0, elements = 0, shards = 0;
      for (std::size_t u = bucket.first_unit; u < next_unit; ++u) {
        CHECK(g.bucket_of[u] == b);
        CHECK(g.offset[u] == elements);  // back to back in layout order
        CHECK(g.shard_offset[u] == shards);
        bytes += units[u].padded * sizeof(float);
        elements += units[u].padded;
        shards += units[u].shard;
      }
      CHECK(bucket.elements == elements);
      CHECK(bucket.shard_elements == shards);
      CHECK((bytes <= bucket_bytes || bucket.units == 1));
      // Full: the unit below would not have fit.
      if (bucket.first_unit > 0) CHECK(bytes + units[bucket.first_unit - 1].padded * sizeof(float) > bucket_bytes);
      next_unit = bucket.first_unit;
    }
    CHECK(next_unit == 0);
  }
}

// GradWrites::overwrite, one unit at a time from the last to the first, over
// one or two micro-batches: when a bucket's last unit is ready its
// collectives are issued, as one group, in the order its units became ready
// (stage 0 on the last micro-batch only, stage 1 none until the step); the
// staging sets are taken in turn (stages 0-1 without accumulation write into
// the accumulator itself); each rank ends with its part of the sum.
void overwrite_window(int stage, int micro_batches, bool overlap, int rank) {
  INFO("stage " << stage << ", " << micro_batches << " micro-batches, overlap " << overlap << ", rank " << rank);
  Options options;
  options.bucket_bytes = test_bucket_bytes();
  ReduceBench bench(rank, stage, options, overlap, micro_batches);
  const auto& units = bench.layout.units();
  const zero::GradientBuckets& buckets = bench.buckets();
  REQUIRE(buckets.buckets.size() >= 3);
  REQUIRE(buckets.max_units >= 2);
  std::size_t opened = 0, set = 0;  // buckets opened so far (the ring takes sets in turn), the open one's
  for (bench.micro = 0; bench.micro < bench.micro_batches; ++bench.micro) {
    INFO("micro-batch " << bench.micro);
    for (std::size_t u = units.size(); u-- > 0;) {
      INFO("unit " << u);
      const auto& bucket = buckets.of(u);
      const bool opens = u == bucket.first_unit + bucket.units - 1;
      if (opens) set = opened++ % bench.sizes.staging_sets;
      float* g = bench.reducer.hand_out(u, bench.first(), bench.last());
      if (bench.in_place)
        CHECK(g == bench.reducer.accumulator() + units[u].full_offset);
      else
        CHECK(g == bench.staged(set, u));
      bench.write(u, g, false);
      const std::size_t mark = bench.comm.calls().size();
      bench.reducer.ready(u, bench.first(), bench.last());
      const std::vector<Call> made = since(bench.comm.calls(), mark);
      const bool flushes = u == bucket.first_unit;
      // The header's table: stages 2-3 reduce-scatter each bucket as it
      // fills, stage 0 all-reduces it on the window's last micro-batch,
      // stage 1 waits for the step.
      const bool scatters = stage >= 2;
      const char* reduction = scatters ? "reduce_scatter" : stage == 0 && bench.last() ? "all_reduce" : nullptr;
      if (!flushes || reduction == nullptr) {
        CHECK(made.empty());
        continue;
      }
      REQUIRE(made.size() == bucket.units + 2);
      CHECK(made.front().kind == "group_begin");
      CHECK(made.back().kind == "group_end");
      for (std::size_t i = 0; i < bucket.units; ++i) {
        const Call& c = made[1 + i];
        const std::size_t unit = bucket.first_unit + bucket.units - 1 - i;  // the order they became ready
        CHECK(c.kind == reduction);
        CHECK(c.unit == unit);
        CHECK(c.count == (scatters ? units[unit].shard : units[unit].padded));
        CHECK(c.verb == std::string(scatters ? "reduce-scatters the gradient of" : "all-reduces the gradient of"));
      }
    }
    const std::size_t mark = bench.comm.calls().size();
    bench.reducer.finish_units(bench.first(), bench.last(), [](std::size_t) { return false; });
    bench.reducer.end_micro_batch(bench.first(), bench.last());
    CHECK(bench.comm.calls().size() == mark);  // every bucket was reduced already
  }
  bench.micro = bench.micro_batches - 1;
  const std::size_t mark = bench.comm.calls().size();
  bench.reducer.reduce_at_step();
  const std::vector<Call> at_step = calls_of(bench.comm.calls(), "reduce_scatter", mark);
  if (stage == 1) {
    // Stage 1: every unit's accumulated gradient, in layout order.
    REQUIRE(at_step.size() == units.size());
    for (std::size_t u = 0; u < units.size(); ++u) {
      CHECK(at_step[u].unit == u);
      CHECK(at_step[u].count == units[u].shard);
    }
  } else {
    CHECK(bench.comm.calls().size() == mark);
  }
  bench.expect_reduced();
}

TEST_CASE("overwrite: each bucket is reduced when its last unit is ready, and each rank keeps the sum", "[reducer]") {
  for (const int stage : {0, 1, 2, 3})
    for (const int micro_batches : {1, 2})
      for (const bool overlap : {false, true})
        for (int rank = 0; rank < ranks; ++rank) overwrite_window(stage, micro_batches, overlap, rank);
}

// GradWrites::accumulate with two live buckets, over one micro-batch: units
// are handed out and become final in any order, yet buckets are reduced in
// backward's order, each as one group of its units in the order they became
// final; each open bucket has a staging set of its own; the step finishes
// the units never handed out, as zeros.
TEST_CASE("accumulate: buckets are reduced in backward's order whatever order their units become final in",
          "[reducer]") {
  Options options;
  options.bucket_bytes = test_bucket_bytes();
  options.grad_writes = zero::GradWrites::accumulate;
  options.live_buckets = 2;
  for (int rank = 0; rank < ranks; ++rank) {
    INFO("rank " << rank);
    ReduceBench bench(rank, 2, options, false, 1);
    const auto& buckets = bench.buckets().buckets;
    REQUIRE(buckets.size() >= 3);
    REQUIRE(bench.sizes.staging_sets == 2);
    // Bucket 1's units, then bucket 0's, each upwards (against backward's
    // order); the rest never. Added into: the buffers come zeroed.
    std::vector<std::size_t> handed;
    for (const std::size_t b : {1, 0}) {
      const auto& bucket = buckets[b];
      for (std::size_t u = bucket.first_unit; u < bucket.first_unit + bucket.units; ++u) handed.push_back(u);
    }
    std::vector<const float*> set_of_bucket(2, nullptr);  // where each bucket's staging set begins
    for (const std::size_t u : handed) {
      float* g = bench.reducer.hand_out(u, true, true);
      bench.write(u, g, true);
      set_of_bucket[bench.buckets().bucket_of[u]] = g - bench.buckets().offset[u];
    }
    CHECK(set_of_bucket[0] != set_of_bucket[1]);  // two live buckets, two staging sets
    // Final in the order handed out: bucket 1 first, which waits for bucket 0.
    for (const std::size_t u : handed) {
      bench.reducer.ready(u, true, true);
      if (bench.buckets().bucket_of[u] == 1) CHECK(bench.comm.calls().empty());
    }
    // The step: bucket 2 onwards are final, as zeros.
    bench.reducer.finish_units(true, true, [](std::size_t) { return false; });
    bench.reducer.end_micro_batch(true, true);
    // Each bucket, in backward's order, as one group: its units in the
    // order they became final (those the step finished: downwards).
    std::vector<std::string> expected_kinds;
    std::vector<std::size_t> expected_units;
    auto expect = [&](const char* kind, std::size_t u) {
      expected_kinds.push_back(kind);
      expected_units.push_back(u);
    };
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      expect("group_begin", no_unit);
      for (const std::size_t u : handed)
        if (bench.buckets().bucket_of[u] == b) expect("reduce_scatter", u);
      for (std::size_t u = buckets[b].first_unit + buckets[b].units; b >= 2 && u-- > buckets[b].first_unit;)
        expect("reduce_scatter", u);
      expect("group_end", no_unit);
    }
    std::vector<std::string> kinds;
    for (const Call& c : bench.comm.calls()) kinds.push_back(c.kind);
    CHECK(kinds == expected_kinds);
    CHECK(units_of(bench.comm.calls()) == expected_units);
    bench.expect_reduced();  // bucket 2 onwards: this rank's zeros
  }
}

TEST_CASE("accumulate: more live buckets than staging sets is an error naming the oldest", "[reducer]") {
  Options options;
  options.bucket_bytes = test_bucket_bytes();
  options.grad_writes = zero::GradWrites::accumulate;
  options.live_buckets = 2;
  ReduceBench bench(1, 2, options, false, 1);
  const auto& buckets = bench.buckets().buckets;
  REQUIRE(buckets.size() >= 3);
  const auto& units = bench.layout.units();
  bench.reducer.hand_out(buckets[0].first_unit, true, true);
  bench.reducer.hand_out(buckets[1].first_unit, true, true);
  CHECK_THROWS_WITH(bench.reducer.hand_out(buckets[2].first_unit, true, true),
                    Contains("grad_buffer('" + units[buckets[2].first_unit].name + "')") &&
                        Contains("2 gradient buckets are live") &&
                        Contains("'" + units[buckets[0].first_unit + buckets[0].units - 1].name + "'") &&
                        Contains("live_buckets"));
  CHECK(bench.comm.calls().empty());
}

}  // namespace
