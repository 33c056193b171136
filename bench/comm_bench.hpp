// Why: every communicator (host: Local, Mpi; device: LocalDevice, Nccl) is
// measured by one sweep, with one set of formulas and one output format, so
// their figures compare. Bandwidths are nccl-tests' (doc/PERFORMANCE.md):
//   algbw = S / t, with S the full buffer (all-reduce and broadcast: the
//           buffer; reduce-scatter: the send buffer; all-gather: the receive
//           buffer, i.e. ranks x the per-rank count),
//   busbw = algbw x 2(n-1)/n (all-reduce), (n-1)/n (reduce-scatter,
//           all-gather), 1 (broadcast).
// The limit: the memory traffic the collective must move (bytes read plus
// written, summed over ranks) at the bandwidth of a probe that moves that
// traffic in the same shape with trivial arithmetic, run by the same number
// of threads (or processes) beside each row: every rank reads and writes its
// share in the streams the collective's ideal algorithm uses (ProbeShape),
// combining inputs with XOR. The shape matters: a reduce-scatter reads n
// bytes per byte written, and on the 2-core VM this was measured on,
// read-heavy traffic runs at about 0.78 of a copy's bandwidth, which a copy
// probe would have charged to the collective. Out of place, the probe is
// timed with plain and with non-temporal stores and the faster counts, so
// the limit is the memory's, not that of the communicator's choice of
// stores. Probe and collective alternate timing by timing, so both see the
// same cache (at 64 MiB the buffers partly fit a large L3) and the same
// moment of a shared machine, whose bandwidth drifts by 2x within one sweep. A collective over shared memory
// cannot move less than (in units of S, n ranks):
//   all-reduce      2n     every rank's buffer read once and written once
//                          (comm::Local: rank r reduces chunk r of all
//                          buffers and writes it into all of them)
//   reduce-scatter  n + 1  every send buffer read once, the result written once
//   all-gather      n + 1  every send block read once, written into n receive
//                          buffers (out of place; Local: each rank pushes its own)
//   broadcast       n      the root's buffer read once, written into n - 1
//                          (Local: rank r copies part r to every other rank)
// limit_ratio = (traffic / probe bandwidth) / t: 1 is at the memory limit.
// The same minimum applies to every communicator, so an algorithm that moves
// more (Open MPI's copies through shared segments; LocalDevice, whose
// all-reduce reduces into the owner and then copies, 3n - 1, and whose
// all-gather and broadcast pull, 2n and 2(n - 1)) shows its cost as a lower ratio.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "bench_args.hpp"
#include "zero/comm/communicator.hpp"
#include "zero/precision/types.hpp"

namespace zero::bench::comm {

enum class Op { all_reduce, reduce_scatter, all_gather, broadcast };
inline constexpr Op all_ops[] = {Op::all_reduce, Op::reduce_scatter, Op::all_gather, Op::broadcast};

inline const char* op_name(Op op) {
  switch (op) {
    case Op::all_reduce: return "all_reduce";
    case Op::reduce_scatter: return "reduce_scatter";
    case Op::all_gather: return "all_gather";
    case Op::broadcast: return "broadcast";
  }
  return "?";
}

// nccl-tests' bus bandwidth correction.
inline double bus_factor(Op op, int n) {
  const double d = n;
  switch (op) {
    case Op::all_reduce: return 2.0 * (d - 1) / d;
    case Op::reduce_scatter:
    case Op::all_gather: return (d - 1) / d;
    case Op::broadcast: return 1.0;
  }
  return 0.0;
}

// Bytes read + written over all ranks per byte of S (see the table above).
inline double traffic_factor(Op op, int n) {
  const double d = n;
  switch (op) {
    case Op::all_reduce: return 2.0 * d;
    case Op::reduce_scatter:
    case Op::all_gather: return d + 1.0;
    case Op::broadcast: return d;
  }
  return 0.0;
}

// The streams one rank's share of the probe reads and writes, each S / n
// bytes: the traffic above divided over the ranks.
struct ProbeShape {
  int inputs = 1;
  int outputs = 1;
  bool in_place = false;  // the outputs are the inputs (all-reduce)
};
inline ProbeShape probe_shape(Op op, int n) {
  switch (op) {
    case Op::all_reduce: return {n, n, true};
    case Op::reduce_scatter: return {n, 1, false};
    case Op::all_gather: return {1, n, false};
    case Op::broadcast: return {1, std::max(1, n - 1), false};
  }
  return {};
}

struct Options {
  std::size_t min_bytes = std::size_t{4} << 10;
  std::size_t max_bytes = std::size_t{256} << 20;
  int reps = 5;
  bool json = false;
  std::vector<int> ranks;  // empty: the program's default
};

// The command line of a communication benchmark: the flags below and
// --comm NAME, one of `choices` (the first is the default), which it returns.
// Exits 2 with the usage on anything else.
inline std::string parse_command_line(int argc, char** argv, Options& o, const std::vector<std::string>& choices) {
  std::string names;
  for (const auto& c : choices) names += (names.empty() ? "" : "|") + c;
  const std::string usage = "[--comm " + names +
                            "] [--ranks N (repeatable)] [--min BYTES] [--max BYTES] (K/M/G suffixes; sizes are "
                            "4 KiB x powers of 4) [--reps R] [--json]";
  Args args(argc, argv, usage.c_str());
  std::string comm = choices.front();
  while (args.next()) {
    if (args.is("--comm")) {
      comm = args.value();
      if (std::find(choices.begin(), choices.end(), comm) == choices.end()) {
        std::fprintf(stderr, "--comm %s: expected one of %s\n", comm.c_str(), names.c_str());
        std::exit(2);
      }
    } else if (args.is("--min")) {
      o.min_bytes = args.count();
    } else if (args.is("--max")) {
      o.max_bytes = args.count();
    } else if (args.is("--reps")) {
      o.reps = args.positive();
    } else if (args.is("--json")) {
      o.json = true;
    } else if (args.is("--ranks")) {
      o.ranks.push_back(args.positive());
    } else {
      args.usage();
    }
  }
  return comm;
}

// 4 KiB, 16 KiB, ... 256 MiB, within [min, max].
inline std::vector<std::size_t> sizes(const Options& o) {
  std::vector<std::size_t> out;
  for (std::size_t s = std::size_t{4} << 10; s <= (std::size_t{256} << 20); s *= 4)
    if (s >= o.min_bytes && s <= o.max_bytes) out.push_back(s);
  return out;
}

struct Row {
  std::string comm;
  int ranks = 0;
  Op op = Op::all_reduce;
  DType dtype = DType::f32;
  std::size_t bytes = 0;  // S
  double time_s = 0;
  double probe_GBps = 0;  // the probe measured beside this row
  bool probe_streamed = false;  // its faster variant wrote with non-temporal stores
  double algbw() const { return static_cast<double>(bytes) / time_s / 1e9; }
  double busbw() const { return algbw() * bus_factor(op, ranks); }
  double limit_ratio() const {
    return static_cast<double>(bytes) * traffic_factor(op, ranks) / (probe_GBps * 1e9) / time_s;
  }
};

// The fastest of `reps` timings of op and of each probe variant,
// alternating (noise on a shared machine only adds time, and drifts: a probe
// timed minutes away would measure another machine), each timing over
// enough calls to dwarf the barriers around it. probe(v) runs variant v of
// [0, variants). Memory provides sync(): wait for this rank's asynchronous
// work (device streams).
struct Timings {
  double op_s = std::numeric_limits<double>::infinity();
  double probe_s = std::numeric_limits<double>::infinity();  // the fastest variant's
  int probe_variant = 0;
};
template <class Comm, class Memory, class Op, class Probe>
Timings fastest_times(Comm& c, Memory& mem, std::size_t bytes, std::size_t probe_bytes, int reps, Op&& op,
                      int variants, Probe&& probe) {
  auto calls = [](std::size_t b) {
    return static_cast<int>(std::clamp<std::size_t>((std::size_t{64} << 20) / std::max<std::size_t>(b, 1), 1, 100));
  };
  // The clock starts before the barrier that releases the work. Started
  // after it, it starts whenever the scheduler next runs rank 0, and with
  // more ranks than cores the others may have done their shares by then:
  // the probe, whose ranks do not wait for each other, timed 4 ranks on 2
  // cores at up to twice the memory's bandwidth (the collectives, which
  // rendezvous first, were timed whole).
  auto time = [&](int iters, auto& f) {
    const auto t0 = std::chrono::steady_clock::now();
    c.barrier();
    for (int i = 0; i < iters; ++i) f();
    mem.sync();
    c.barrier();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
  };
  op();  // warm-up: first touch, lazy set-up
  for (int v = 0; v < variants; ++v) probe(v);
  mem.sync();
  Timings best;
  for (int r = 0; r < reps; ++r) {
    best.op_s = std::min(best.op_s, time(calls(bytes), op));
    for (int v = 0; v < variants; ++v) {
      auto variant = [&] { probe(v); };
      const double t = time(calls(probe_bytes), variant);
      if (t < best.probe_s) {
        best.probe_s = t;
        best.probe_variant = v;
      }
    }
  }
  return best;
}

// Every collective x {fp32, bf16} x size on this rank; the rows are rank 0's
// timings (every rank returns them; only rank 0 should print). Memory:
// void* alloc(bytes) (zero-filled, touched by this rank, freed with the
// Memory), fold(outputs, n_out, inputs, n_in, bytes, stream) (every output
// = the XOR of the inputs, `bytes` each; in place when the outputs are the
// inputs; `stream`: write past the cache, as the communicators do for
// collectives larger than it), store_kinds (2 where `stream` changes the
// stores, else 1) and sync().
template <class Comm, class Memory>
std::vector<Row> sweep(Comm& c, Memory& mem, const char* name, const Options& o) {
  const int n = c.size();
  void* a = mem.alloc(o.max_bytes);
  void* b = mem.alloc(o.max_bytes);
  // The probe's own streams (2n of S / n at most): probing through a or b
  // would leave them cached for the collective.
  const std::size_t most_stream = o.max_bytes / static_cast<std::size_t>(n) + 64;
  std::vector<void*> probe_streams;
  for (int k = 0; k < 2 * n; ++k) probe_streams.push_back(mem.alloc(most_stream));
  std::vector<Row> rows;
  for (Op op : all_ops) {
    for (DType t : {DType::f32, DType::bf16}) {
      for (std::size_t bytes : sizes(o)) {
        const std::size_t eb = dtype_bytes(t);
        const std::size_t part = bytes / eb / static_cast<std::size_t>(n), count = part * static_cast<std::size_t>(n);
        if (part == 0) continue;
        const std::size_t s = count * eb;
        // Per rank: its share of the row's traffic, in the row's shape.
        const ProbeShape shape = probe_shape(op, n);
        const std::size_t stream_bytes = std::max<std::size_t>(s / static_cast<std::size_t>(n) / 64 * 64, 64);
        const std::size_t probe_bytes = stream_bytes * static_cast<std::size_t>(shape.inputs + shape.outputs);
        void* const* probe_in = probe_streams.data();
        void* const* probe_out = shape.in_place ? probe_in : probe_streams.data() + shape.inputs;
        // Variant 0 stores plainly, 1 streams (out of place only: in place,
        // the lines were just read, as writes_an_input() in reduce.hpp says).
        const int variants = shape.in_place ? 1 : Memory::store_kinds;
        auto probe = [&](int v) { mem.fold(probe_out, shape.outputs, probe_in, shape.inputs, stream_bytes, v == 1); };
        auto beside_probe = [&](auto&& collective) {
          return fastest_times(c, mem, s, probe_bytes, o.reps, collective, variants, probe);
        };
        Timings time;
        switch (op) {
          case Op::all_reduce:
            time = beside_probe([&] { c.all_reduce(a, count, t, zero::comm::ReduceOp::sum, false); });
            break;
          case Op::reduce_scatter:
            time = beside_probe([&] { c.reduce_scatter(a, b, part, t); });
            break;
          case Op::all_gather:
            time = beside_probe([&] { c.all_gather(b, a, part, t, false); });
            break;
          case Op::broadcast:
            time = beside_probe([&] { c.broadcast(a, count, t, 0); });
            break;
        }
        const double probe_GBps = static_cast<double>(probe_bytes) * n / time.probe_s / 1e9;
        rows.push_back(Row{name, n, op, t, s, time.op_s, probe_GBps, time.probe_variant == 1});
      }
    }
  }
  return rows;
}

inline void print_table(const std::vector<Row>& rows) {
  std::printf("%-12s %5s %-15s %-5s %12s %12s %11s %11s %9s %-8s %11s\n", "comm", "ranks", "op", "dtype", "bytes",
              "time_us", "algbw_GB/s", "busbw_GB/s", "probe", "stores", "limit_ratio");
  for (const Row& r : rows)
    std::printf("%-12s %5d %-15s %-5s %12zu %12.1f %11.2f %11.2f %9.1f %-8s %11.3f\n", r.comm.c_str(), r.ranks,
                op_name(r.op), dtype_name(r.dtype), r.bytes, r.time_s * 1e6, r.algbw(), r.busbw(), r.probe_GBps,
                r.probe_streamed ? "streamed" : "plain", r.limit_ratio());
}

// {"probe_GBps":X,"rows":[...]}: X is the fastest probe beside the largest
// messages (out of cache: the machine's memory bandwidth); each row's
// limit_ratio uses the probe measured beside it (the table's "probe" column,
// in each row as probe_GBps, with its faster stores as probe_stores).
inline void print_json(const std::vector<Row>& rows) {
  std::size_t largest = 0;
  for (const Row& r : rows) largest = std::max(largest, r.bytes);
  double probe = 0;
  for (const Row& r : rows)
    if (r.bytes == largest) probe = std::max(probe, r.probe_GBps);
  std::printf("{\"probe_GBps\":%.3f,\"rows\":[", probe);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    std::printf("%s\n{\"comm\":\"%s\",\"ranks\":%d,\"op\":\"%s\",\"dtype\":\"%s\",\"bytes\":%zu,\"time_s\":%.9g,"
                "\"algbw_GBps\":%.4f,\"busbw_GBps\":%.4f,\"probe_GBps\":%.3f,\"probe_stores\":\"%s\",\"limit_ratio\":%.4f}",
                i == 0 ? "" : ",", r.comm.c_str(), r.ranks, op_name(r.op), dtype_name(r.dtype), r.bytes, r.time_s,
                r.algbw(), r.busbw(), r.probe_GBps, r.probe_streamed ? "streamed" : "plain", r.limit_ratio());
  }
  std::printf("]}\n");
}

inline void print(const std::vector<Row>& rows, const Options& o) {
  if (o.json)
    print_json(rows);
  else
    print_table(rows);
  std::fflush(stdout);
}

}  // namespace zero::bench::comm
