// The disk tier's swap file against the disk itself: DiskSwap writes then
// reads B bytes, and a raw probe (io_uring, O_DIRECT, the same block size and
// queue depth, a fresh preallocated file, no queueing or checksums of
// DiskSwap's) writes and reads the same bytes in the same run, interleaved;
// each figure is the fastest of --reps. The ratio DiskSwap / probe is what
// survives a noisy machine; GB/s are 10^9 bytes per second.
//
//   bench_disk [--dir DIR] [--bytes B] [--block B ...] [--depth D ...] [--reps R] [--json]
//   bench_disk --sweep     blocks 128K..4M x depths 1..32
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench_args.hpp"
#include "disk_probe.hpp"
#include "zero/offload/disk_swap.hpp"

namespace {

using zero::offload::AlignedBuffer;
using zero::offload::DiskOptions;
using zero::offload::DiskSwap;
using zero::bench::seconds_since;

struct Options {
  std::string dir = "/tmp";
  std::size_t bytes = std::size_t{1} << 30;
  std::vector<std::size_t> blocks;
  std::vector<unsigned> depths;
  int reps = 3;
  bool json = false;
};

struct Row {
  std::size_t block = 0;
  unsigned depth = 0;
  bool direct = false;                          // DiskSwap got O_DIRECT (the probe insists on it)
  double probe_write = 0, probe_read = 0;       // GB/s, fastest of the reps
  double swap_write = 0, swap_read = 0;
  // Write then read of the same bytes, as the tier does per step.
  static double both(double w, double r) { return 2.0 / (1.0 / w + 1.0 / r); }
  double ratio() const { return both(swap_write, swap_read) / both(probe_write, probe_read); }
};

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "bench_disk: %s\n", what.c_str());
  std::exit(1);
}

// One DiskSwap run on a fresh swap file (its creation and preallocation not
// timed, as the probe's are not): {write GB/s, read GB/s}.
std::pair<double, double> swap_run(const Options& o, unsigned char* src, unsigned char* dst, std::size_t block,
                                   unsigned depth, bool& direct) {
  DiskOptions d;
  d.directory = o.dir;
  d.block_bytes = block;
  d.queue_depth = depth;
  DiskSwap swap(o.bytes, d);
  direct = swap.direct();
  auto t0 = std::chrono::steady_clock::now();
  swap.wait(swap.write(0, src, o.bytes));
  const double w = static_cast<double>(o.bytes) / seconds_since(t0) / 1e9;
  t0 = std::chrono::steady_clock::now();
  swap.wait(swap.read(0, dst, o.bytes));
  const double r = static_cast<double>(o.bytes) / seconds_since(t0) / 1e9;
  if (swap.verified_bytes() != o.bytes) die("DiskSwap verified only part of what it read");
  return {w, r};
}

Row measure(const Options& o, unsigned char* src, unsigned char* dst, std::size_t block, unsigned depth) {
  Row row;
  row.block = block;
  row.depth = depth;
  for (int rep = 0; rep < o.reps; ++rep) {  // interleaved, so both see the same disk and load
    const zero::bench::ProbeRates probe = zero::bench::probe_disk(o.dir, src, dst, o.bytes, block, depth);
    const double pw = probe.write, pr = probe.read;
    std::memset(dst, 0, o.bytes);
    const auto [sw, sr] = swap_run(o, src, dst, block, depth, row.direct);
    row.probe_write = std::max(row.probe_write, pw);
    row.probe_read = std::max(row.probe_read, pr);
    row.swap_write = std::max(row.swap_write, sw);
    row.swap_read = std::max(row.swap_read, sr);
  }
  return row;
}

void print_table(const std::vector<Row>& rows, const Options& o) {
  std::printf("bench_disk: %zu bytes in %s (GB/s = 1e9 bytes/s, fastest of %d)\n", o.bytes, o.dir.c_str(), o.reps);
  std::printf("%9s %5s %7s %12s %11s %11s %10s %11s %10s %8s\n", "block", "depth", "direct", "probe_write",
              "probe_read", "swap_write", "swap_read", "write_ratio", "read_ratio", "ratio");
  for (const Row& r : rows)
    std::printf("%9zu %5u %7s %12.3f %11.3f %11.3f %10.3f %11.3f %10.3f %8.3f\n", r.block, r.depth,
                r.direct ? "yes" : "no", r.probe_write, r.probe_read, r.swap_write, r.swap_read,
                r.swap_write / r.probe_write, r.swap_read / r.probe_read, r.ratio());
}

// {"bytes":B,"dir":"...","rows":[{...}]}; ratio compares write-then-read
// throughput (harmonic mean of the two rates).
void print_json(const std::vector<Row>& rows, const Options& o) {
  std::printf("{\"bytes\":%zu,\"dir\":\"%s\",\"reps\":%d,\"rows\":[", o.bytes, o.dir.c_str(), o.reps);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    std::printf("%s\n{\"block_bytes\":%zu,\"queue_depth\":%u,\"direct\":%s,\"probe_write_GBps\":%.4f,"
                "\"probe_read_GBps\":%.4f,\"swap_write_GBps\":%.4f,\"swap_read_GBps\":%.4f,\"write_ratio\":%.4f,"
                "\"read_ratio\":%.4f,\"ratio\":%.4f}",
                i == 0 ? "" : ",", r.block, r.depth, r.direct ? "true" : "false", r.probe_write, r.probe_read,
                r.swap_write, r.swap_read, r.swap_write / r.probe_write, r.swap_read / r.probe_read, r.ratio());
  }
  std::printf("]}\n");
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  zero::bench::Args args(argc, argv,
                         "[--dir DIR (/tmp)] [--bytes B (1G)] [--block B (repeatable; 1M)] [--depth D (repeatable; "
                         "16)] [--sweep (blocks 128K..4M x depths 1..32)] [--reps R (3)] [--json]");
  bool sweep = false;
  while (args.next()) {
    if (args.is("--dir")) {
      o.dir = args.value();
    } else if (args.is("--bytes")) {
      o.bytes = args.count();
    } else if (args.is("--block")) {
      o.blocks.push_back(args.count());
    } else if (args.is("--depth")) {
      o.depths.push_back(static_cast<unsigned>(args.positive()));
    } else if (args.is("--sweep")) {
      sweep = true;
    } else if (args.is("--reps")) {
      o.reps = args.positive();
    } else if (args.is("--json")) {
      o.json = true;
    } else {
      args.usage();
    }
  }
  const DiskOptions defaults;
  if (o.blocks.empty())
    o.blocks = sweep ? std::vector<std::size_t>{128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20}
                     : std::vector<std::size_t>{defaults.block_bytes};
  if (o.depths.empty()) o.depths = sweep ? std::vector<unsigned>{1, 2, 4, 8, 16, 32} : std::vector<unsigned>{defaults.queue_depth};
  o.bytes = zero::offload::round_up_to_disk_alignment(o.bytes);
  for (std::size_t b : o.blocks)
    if (b % zero::offload::disk_alignment != 0) die("--block " + std::to_string(b) + " is not a multiple of 4096");

  AlignedBuffer<unsigned char> src(o.bytes), dst(o.bytes);
  zero::bench::fill_incompressible(src.data(), o.bytes);
  std::vector<Row> rows;
  for (std::size_t block : o.blocks)
    for (unsigned depth : o.depths) {
      rows.push_back(measure(o, src.data(), dst.data(), block, depth));
      if (!o.json) std::fprintf(stderr, "  block %zu depth %u done\n", block, depth);
    }
  if (o.json)
    print_json(rows, o);
  else
    print_table(rows, o);
  return 0;
}
