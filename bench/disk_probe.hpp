// Why: the disk tier is judged against the disk itself, measured in the same
// run. This raw probe is that measure: a fresh preallocated file opened with
// O_DIRECT, written then read through one io_uring in requests of the
// tier's block size with up to its queue depth in flight, and none of
// DiskSwap's queueing or checksums. bench_disk (DiskSwap alone) and
// bench_offload (the optimizer step on the disk tier) both compare to it.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "zero/offload/uring.hpp"

namespace zero::bench {

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// A probe that cannot run ends the benchmark: its figures would be no peer.
[[noreturn]] inline void probe_failed(const std::string& what) {
  std::fprintf(stderr, "disk probe: %s\n", what.c_str());
  std::exit(1);
}

// Rates of one probe run, GB/s (10^9 bytes per second).
struct ProbeRates {
  double write = 0, read = 0;
  // Seconds to write then read `bytes` at these rates, as the tier does.
  double seconds(std::size_t bytes) const { return static_cast<double>(bytes) * (1.0 / write + 1.0 / read) / 1e9; }
};

// `bytes` through `fd` in `block` requests, `depth` in flight, each
// completing whole (anything else ends the benchmark): GB/s.
inline double probe_pass(int fd, bool write, unsigned char* buf, std::size_t bytes, std::size_t block,
                         unsigned depth) {
  zero::offload::detail::Uring ring(depth);
  const auto t0 = std::chrono::steady_clock::now();
  std::size_t next = 0;
  unsigned in_flight = 0;
  while (next < bytes || in_flight > 0) {
    bool prepared = false;
    for (; in_flight < depth && next < bytes; ++in_flight, prepared = true) {
      const std::size_t n = std::min(block, bytes - next);
      ring.prepare(ring.next(), write, fd, buf + next, n, next, n);
      next += n;
    }
    if (prepared && ring.submit() < 0) probe_failed("io_uring_submit failed");
    std::uint64_t expected;
    int result;
    for (bool wait = true; in_flight > 0 && ring.completion(wait, expected, result); wait = false) {
      if (result < 0 || static_cast<std::uint64_t>(result) != expected)
        probe_failed(std::string(write ? "write" : "read") + " returned " + std::to_string(result) +
                     (result < 0 ? " (" + zero::offload::detail::errno_text(-result) + ")" : ""));
      --in_flight;
    }
  }
  return static_cast<double>(bytes) / seconds_since(t0) / 1e9;
}

// One probe run on a fresh preallocated file under `dir` (creation and
// preallocation not timed): `bytes` from src written, then read into dst
// and compared. src, dst and bytes are 4096-aligned.
inline ProbeRates probe_disk(const std::string& dir, unsigned char* src, unsigned char* dst, std::size_t bytes,
                             std::size_t block, unsigned depth) {
  const std::string path = dir + "/zero-bench-disk-probe-" + std::to_string(::getpid()) + ".bin";
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
  if (fd < 0) probe_failed("cannot open " + path + " with O_DIRECT: " + zero::offload::detail::errno_text(errno));
  if (::fallocate(fd, 0, 0, static_cast<off_t>(bytes)) != 0)
    probe_failed("cannot preallocate " + path + ": " + zero::offload::detail::errno_text(errno));
  ProbeRates rates;
  rates.write = probe_pass(fd, true, src, bytes, block, depth);
  rates.read = probe_pass(fd, false, dst, bytes, block, depth);
  ::close(fd);
  ::unlink(path.c_str());
  if (std::memcmp(src, dst, bytes) != 0) probe_failed("the probe read back other bytes than it wrote");
  return rates;
}

// Bytes a disk can neither compress nor deduplicate.
inline void fill_incompressible(unsigned char* p, std::size_t bytes) {
  for (std::size_t i = 0; i + 8 <= bytes; i += 8) {
    const std::uint64_t v = (i + 1) * 0x9E3779B97F4A7C15ull;
    std::memcpy(p + i, &v, 8);
  }
}

}  // namespace zero::bench
