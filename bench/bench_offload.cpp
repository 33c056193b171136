// The offload tiers' optimizer step against peers measured in the same run,
// interleaved, each figure the fastest of --reps (noise on a shared machine
// only ever adds time):
//
// disk   offload::Nvme on backend::Host, AdamW in bf16 mixed precision, stage 1,
//        one rank, a model whose master and state are several times the host
//        window. Its peer is the raw disk probe (disk_probe.hpp) writing and
//        then reading the bytes the step moves (every record of the swap
//        file, read and written once per step), with the same block size and
//        queue depth. ratio = probe seconds / step seconds (goal >= 0.8).
//        Also timed: the same step with the state in memory (offload::None),
//        the update's CPU cost alone. overlap = max(probe, in-memory step) /
//        disk step: 1 when the update and both directions of I/O fully
//        overlap, (max / sum) when nothing overlaps. And the XXH3-64
//        checksums DiskSwap takes of every byte written and read (timed over
//        the same bytes), and the process's CPU time during the disk step:
//        the update, the checksums and the ring, on a machine whose cores
//        may be busy with other work.
// cpu    offload::Cpu on the late-copies test backend (a device backend whose
//        "device" is host memory, tests/engine/late_copies.hpp), so the step
//        runs the whole offload pipeline: owned gradient downloaded, host
//        update unit by unit, parameters uploaded. Its peer is the plain
//        backend::Host step of the same model and optimizer (offload::None).
//        ratio = host seconds / offload seconds (goal: near 1, the pipeline
//        adds only copies).
//
// A step's time is what the optimizer spends: grad_ready() of every unit,
// step() and synchronize(); filling the gradient buffers is not counted.
//
// OpenMP's waiting threads sleep (OMP_WAIT_POLICY=passive, set here and the
// program executed again unless the environment sets a policy, by
// examples/common/openmp_waits.hpp): libgomp's
// idle threads otherwise spin after each of the update's parallel loops on
// the cores the disk tier's I/O thread needs (2 cores, same minutes: 0.69
// and 0.78 of the probe spinning, 0.97 and 1.07 passive). Programs using the
// disk tier on few cores should do the same (docs/offload.md).
//
//   bench_offload [--part disk|cpu|all] [--dir DIR] [--n PARAMS] [--units U] [--window B] [--block B]
//                 [--depth D] [--reps R] [--json] [--lean]
//
// --lean: the disk part also with a remainder master and bf16 states (6
// bytes per element on disk instead of 12) and with a remainder master and
// 8-bit block-wise states (4 bytes), each format's repetitions interleaved
// with today's, and each lean step's speed-up over today's formats.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "bench_args.hpp"
#include "common/openmp_waits.hpp"
#include "disk_probe.hpp"
#include "late_copies.hpp"
#include "zero/offload/disk_state_store.hpp"
#include "zero/zero.hpp"

namespace {

using zero::bench::seconds_since;
using Precision = zero::precision::Mixed<zero::bf16>;
using Optimizer = zero::optim::AdamW;

struct Options {
  std::string part = "all";
  std::string dir = "/tmp";
  std::size_t n = std::size_t{32} << 20;  // parameters
  int units = 16;
  std::size_t window = std::size_t{64} << 20;
  std::size_t block = zero::NvmeOptions{}.block_bytes;
  unsigned depth = zero::NvmeOptions{}.queue_depth;
  int reps = 3;
  bool json = false;
  // --lean: the disk part also with a remainder master and bf16, and 8-bit
  // states (docs/lean-states.md), interleaved with today's formats.
  bool lean = false;
};

// The disk part's formats: today's (fp32 master and states), or lean.
struct Formats {
  zero::MasterWeights master = zero::MasterWeights::fp32;
  zero::StateFormat states = zero::StateFormat::fp32;
  const char* name() const {
    if (master == zero::MasterWeights::fp32) return "fp32 master and states";
    return states == zero::StateFormat::blockwise8 ? "remainder master, 8-bit states" : "remainder master, bf16 states";
  }
};

// One rank's model of `units` equal units of one parameter each, driven as a
// trainer drives it, with a fixed gradient.
template <class Opt>
class Model {
 public:
  using G = typename Opt::grad_type;

  Model(zero::comm::Local& comm, const Options& o, const zero::Options& options)
      : opt_(comm, Optimizer::Hyper{}, options) {
    const std::size_t per_unit = o.n / static_cast<std::size_t>(o.units);
    for (int u = 0; u < o.units; ++u) {
      units_.push_back(opt_.add_unit("layer" + std::to_string(u)));
      params_.push_back(opt_.add_param(units_.back(), "layer" + std::to_string(u) + ".w", per_unit));
    }
    opt_.finalize();
    std::vector<float> values(per_unit);
    for (std::size_t i = 0; i < per_unit; ++i) values[i] = 0.5f + 1e-7f * static_cast<float>(i % 4093);
    for (auto p : params_) opt_.set_param(p, values.data());
    grad_.resize(opt_.layout().unit(units_.front()).padded);
    for (std::size_t i = 0; i < grad_.size(); ++i)
      grad_[i] = zero::from_float<G>(1e-3f * static_cast<float>(static_cast<int>(i % 17) - 8));
  }

  // One optimizer step: the seconds the optimizer spent.
  double step() {
    double seconds = 0;
    for (auto it = units_.rbegin(); it != units_.rend(); ++it) {
      opt_.acquire_unit(*it);
      std::memcpy(opt_.grad_buffer(*it), grad_.data(), grad_.size() * sizeof(G));  // host memory on both backends
      const auto t0 = std::chrono::steady_clock::now();
      opt_.grad_ready(*it);
      seconds += seconds_since(t0);
      opt_.release_unit(*it);
    }
    const auto t0 = std::chrono::steady_clock::now();
    const zero::StepResult r = opt_.step();
    opt_.synchronize();
    seconds += seconds_since(t0);
    if (!r.stepped) zero::bench::probe_failed("the optimizer skipped a step");
    return seconds;
  }

  zero::MemoryReport memory() const { return opt_.memory_report(); }
  const zero::Layout& layout() const { return opt_.layout(); }

 private:
  Opt opt_;
  std::vector<zero::UnitId> units_;
  std::vector<zero::ParamId> params_;
  std::vector<G> grad_;
};

// Runs fn(comm) on one in-process rank.
template <class Fn>
void on_one_rank(Fn&& fn) {
  zero::comm::LocalGroup group(1);
  group.run([&](zero::comm::Local& c) { fn(c); });
}

// User + system CPU seconds of this process so far.
double cpu_seconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

// Seconds to checksum `bytes` twice (once written, once read back), as
// DiskSwap does; the sum is kept so the work cannot be left out.
double checksum_seconds(const unsigned char* p, std::size_t bytes, std::uint64_t& sink) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int pass = 0; pass < 2; ++pass)
    for (std::size_t at = 0; at < bytes; at += zero::NvmeOptions{}.block_bytes)
      sink += XXH3_64bits(p + at, std::min(zero::NvmeOptions{}.block_bytes, bytes - at));
  return seconds_since(t0);
}

void print_mib_line(const char* label, double bytes) { std::printf("  %-34s %10.1f MiB\n", label, bytes / 1048576.0); }

// ---- disk ------------------------------------------------------------------

// One format's disk step, its in-memory twin and the probe of its bytes.
struct DiskCase {
  using Disk = zero::ZeroOptimizer<Precision, Optimizer, zero::stage<1>, zero::offload::Nvme, zero::backend::Host>;
  using Memory = zero::ZeroOptimizer<Precision, Optimizer, zero::stage<1>, zero::offload::None, zero::backend::Host>;

  Formats formats;
  std::unique_ptr<Model<Disk>> disk;
  std::unique_ptr<Model<Memory>> memory;
  std::uint64_t state = 0;  // master + state on disk
  std::size_t chunk = 0, moved = 0;
  zero::offload::AlignedBuffer<unsigned char> src, dst;
  double t_disk = 1e300, t_memory = 1e300, t_probe = 1e300, t_mixed = 1e300, t_hash = 1e300, cpu_disk = 0;
  zero::bench::ProbeRates best{};

  DiskCase(zero::comm::Local& comm, const Options& o, const Formats& f) : formats(f) {
    zero::Options options, in_memory;
    in_memory.master = options.master = formats.master;
    in_memory.states = options.states = formats.states;
    options.nvme.directory = o.dir;
    options.nvme.window_bytes = o.window;
    options.nvme.block_bytes = o.block;
    options.nvme.queue_depth = o.depth;
    disk = std::make_unique<Model<Disk>>(comm, o, options);
    memory = std::make_unique<Model<Memory>>(comm, o, in_memory);
    const zero::MemoryReport report = disk->memory();
    state = report.placed.master.disk + report.placed.optimizer_states.disk;
    // The swap file holds whole records of chunk elements; each step reads
    // and writes every record once (8-bit states: chunks end before a block
    // they would cut, so there may be more of them).
    const std::size_t mb = zero::master_element_bytes(formats.master);
    const std::size_t sb = zero::state_element_bytes(formats.states);
    const std::size_t owned = report.placed.master.disk / mb;
    chunk = zero::offload::disk_chunk_elements(o.window, Optimizer::state_slots, owned, mb, sb);
    const zero::StateBlocks blocks =
        formats.states == zero::StateFormat::blockwise8
            ? zero::StateBlocks::build(zero::Ownership{zero::stage_rules(1), 0, &disk->layout()}, options.state_block,
                                       options.state_fp32_below)
            : zero::StateBlocks{};
    const std::size_t records = zero::offload::disk_chunk_starts(chunk, owned, blocks).size() - 1;
    moved = zero::offload::disk_records_bytes(records, chunk, Optimizer::state_slots, mb, sb);
    src = zero::offload::AlignedBuffer<unsigned char>(moved);
    dst = zero::offload::AlignedBuffer<unsigned char>(moved);
    zero::bench::fill_incompressible(src.data(), moved);
    disk->step();  // warm-up: page faults, the first read of the swap file
    memory->step();
  }

  // One repetition of every measurement, the fastest kept.
  void rep(const Options& o, std::uint64_t& sink) {
    const zero::bench::ProbeRates rates = zero::bench::probe_disk(o.dir, src.data(), dst.data(), moved, o.block, o.depth);
    if (rates.seconds(moved) < t_probe) t_probe = rates.seconds(moved), best = rates;
    t_mixed = std::min(t_mixed, rates.mixed_seconds(moved));
    const double cpu0 = cpu_seconds();
    const double t = disk->step();
    if (t < t_disk) t_disk = t, cpu_disk = cpu_seconds() - cpu0;
    t_memory = std::min(t_memory, memory->step());
    t_hash = std::min(t_hash, checksum_seconds(src.data(), moved, sink));
  }

  void print(const Options& o) const {
    const double gbs = 2.0 * static_cast<double>(moved) / t_disk / 1e9;
    const double ratio = t_probe / t_disk;
    const double ratio_mixed = t_mixed / t_disk;  // the probe moving the step's bytes as the step does
    const double overlap = std::max(t_probe, t_memory) / t_disk;
    const double no_overlap = std::max(t_probe, t_memory) / (t_probe + t_memory);
    const char* wait_policy = std::getenv("OMP_WAIT_POLICY") ? std::getenv("OMP_WAIT_POLICY") : "";
    if (o.json) {
      std::printf("{\"bench\":\"offload_disk\",\"formats\":\"%s\",\"n\":%zu,\"units\":%d,\"window_bytes\":%zu,\"chunk_elements\":%zu,"
                  "\"state_bytes\":%llu,\"moved_bytes_per_step\":%zu,\"block_bytes\":%zu,\"queue_depth\":%u,"
                  "\"step_seconds\":%.6f,\"step_GBps\":%.4f,\"probe_seconds\":%.6f,\"probe_write_GBps\":%.4f,"
                  "\"probe_read_GBps\":%.4f,\"memory_step_seconds\":%.6f,\"ratio_to_probe\":%.4f,\"overlap\":%.4f,"
                  "\"overlap_if_serial\":%.4f,\"checksum_seconds\":%.6f,\"step_cpu_seconds\":%.6f,"
                  "\"probe_mixed_seconds\":%.6f,\"ratio_to_mixed_probe\":%.4f,\"omp_wait_policy\":\"%s\"}\n",
                  formats.name(), o.n, o.units, o.window, chunk, static_cast<unsigned long long>(state), 2 * moved,
                  o.block, o.depth, t_disk, gbs, t_probe, best.write, best.read, t_memory, ratio, overlap, no_overlap,
                  t_hash, cpu_disk, t_mixed, ratio_mixed, wait_policy);
      return;
    }
    std::printf("offload::Nvme step (AdamW, bf16 mixed, %s, stage 1, 1 rank, %zu params in %d units, %s), fastest "
                "of %d, OMP_WAIT_POLICY=%s\n",
                formats.name(), o.n, o.units, o.dir.c_str(), o.reps, *wait_policy ? wait_policy : "(unset)");
    print_mib_line("master + state on disk", static_cast<double>(state));
    print_mib_line("host window", static_cast<double>(o.window));
    print_mib_line("moved per step (read + write)", 2.0 * static_cast<double>(moved));
    std::printf("  disk step                          %10.1f ms  %.3f GB/s moved\n", t_disk * 1e3, gbs);
    std::printf("  probe (write + read, %zu KiB x %u) %7.1f ms  (%.3f / %.3f GB/s)\n", o.block >> 10, o.depth,
                t_probe * 1e3, best.write, best.read);
    std::printf("  probe (read and write at once)     %10.1f ms  (%.3f GB/s moved)\n", t_mixed * 1e3,
                2.0 * static_cast<double>(moved) / t_mixed / 1e9);
    std::printf("  same step, state in memory         %10.1f ms\n", t_memory * 1e3);
    std::printf("  checksums of what it moves         %10.1f ms\n", t_hash * 1e3);
    std::printf("  CPU time of the disk step          %10.1f ms (all threads)\n", cpu_disk * 1e3);
    std::printf("  ratio to probe %.3f, to the probe reading and writing at once %.3f (goal >= 0.8)\n", ratio,
                ratio_mixed);
    std::printf("  overlap %.3f (1: update and I/O fully overlap; %.3f: none)\n", overlap, no_overlap);
  }
};

// The disk step in each of `formats`, their repetitions interleaved (so a
// disk or machine that drifts during the run slows each alike); the first
// is the baseline the others' speed-ups are measured against.
void bench_disk_tier(const Options& o, const std::vector<Formats>& formats) {
  on_one_rank([&](zero::comm::Local& comm) {
    std::vector<std::unique_ptr<DiskCase>> cases;
    for (const Formats& f : formats) cases.push_back(std::make_unique<DiskCase>(comm, o, f));
    std::uint64_t sink = 0;
    for (int r = 0; r < o.reps; ++r)
      for (auto& c : cases) c->rep(o, sink);
    if (sink == 42) std::fprintf(stderr, " ");
    for (const auto& c : cases) c->print(o);
    if (cases.size() > 1 && !o.json) {
      std::printf("the disk step's speed-up over %s (same run, interleaved):", cases.front()->formats.name());
      for (std::size_t i = 1; i < cases.size(); ++i)
        std::printf("%s %s %.2fx", i > 1 ? "," : "", cases[i]->formats.name(), cases.front()->t_disk / cases[i]->t_disk);
      std::printf(" (goal with 8-bit states >= 2)\n");
    }
    std::fflush(stdout);
  });
}

// ---- cpu -------------------------------------------------------------------

template <int Stage>
void bench_cpu_side(const Options& o) {
  using Offloaded =
      zero::ZeroOptimizer<Precision, Optimizer, zero::stage<Stage>, zero::offload::Cpu, zero::backend::LateCopies>;
  using Plain = zero::ZeroOptimizer<Precision, Optimizer, zero::stage<Stage>, zero::offload::None, zero::backend::Host>;
  on_one_rank([&](zero::comm::Local& comm) {
    zero::test::late_copies() = {};
    Model<Offloaded> offloaded(comm, o, zero::Options{});
    Model<Plain> plain(comm, o, zero::Options{});
    offloaded.step();  // warm-up
    plain.step();
    double t_offload = 1e300, t_plain = 1e300;
    const std::size_t deferred_before = zero::test::late_copies().deferred;
    for (int r = 0; r < o.reps; ++r) {
      t_offload = std::min(t_offload, offloaded.step());
      t_plain = std::min(t_plain, plain.step());
    }
    // Evidence that the pipeline ran: copies deferred to the late lane.
    const double copies_per_step =
        static_cast<double>(zero::test::late_copies().deferred - deferred_before) / static_cast<double>(o.reps);
    const double ratio = t_plain / t_offload;
    if (o.json) {
      std::printf("{\"bench\":\"offload_cpu\",\"stage\":%d,\"n\":%zu,\"units\":%d,\"offload_seconds\":%.6f,"
                  "\"host_seconds\":%.6f,\"async_copies_per_step\":%.0f,\"ratio_to_host\":%.4f}\n",
                  Stage, o.n, o.units, t_offload, t_plain, copies_per_step, ratio);
    } else {
      std::printf("offload::Cpu pipeline (late-copies device backend) vs backend::Host, stage %d, %zu params in %d "
                  "units: %.1f ms vs %.1f ms, %.0f async copies per step, ratio %.3f (goal: near 1)\n",
                  Stage, o.n, o.units, t_offload * 1e3, t_plain * 1e3, copies_per_step, ratio);
    }
    std::fflush(stdout);
  });
}

}  // namespace

int main(int argc, char** argv) {
  zero::examples::use_passive_openmp_waits(argv);
  Options o;
  zero::bench::Args args(argc, argv,
                         "[--part disk|cpu|all (all)] [--dir DIR (/tmp)] [--n PARAMS (32M)] [--units U (16)] "
                         "[--window B (64M)] [--block B (1M)] [--depth D (16)] [--reps R (3)] [--json] [--lean]");
  while (args.next()) {
    if (args.is("--part")) {
      o.part = args.value();
      if (o.part != "disk" && o.part != "cpu" && o.part != "all") args.usage();
    } else if (args.is("--dir")) {
      o.dir = args.value();
    } else if (args.is("--n")) {
      o.n = args.count();
    } else if (args.is("--units")) {
      o.units = args.positive();
    } else if (args.is("--window")) {
      o.window = args.count();
    } else if (args.is("--block")) {
      o.block = args.count();
    } else if (args.is("--depth")) {
      o.depth = static_cast<unsigned>(args.positive());
    } else if (args.is("--reps")) {
      o.reps = args.positive();
    } else if (args.is("--json")) {
      o.json = true;
    } else if (args.is("--lean")) {
      o.lean = true;
    } else {
      args.usage();
    }
  }
  if (o.n < static_cast<std::size_t>(o.units)) {
    std::fprintf(stderr, "bench_offload: --n %zu is below --units %d\n", o.n, o.units);
    return 2;
  }
  try {
    if (o.part != "cpu") {
      std::vector<Formats> formats{Formats{}};
      if (o.lean) {
        formats.push_back(Formats{zero::MasterWeights::remainder, zero::StateFormat::bf16});
        formats.push_back(Formats{zero::MasterWeights::remainder, zero::StateFormat::blockwise8});
      }
      bench_disk_tier(o, formats);
    }
    if (o.part != "disk") {
      bench_cpu_side<1>(o);
      bench_cpu_side<2>(o);
    }
  } catch (const zero::Error& e) {
    std::fprintf(stderr, "bench_offload: %s\n", e.what());
    return 1;
  }
  return 0;
}
