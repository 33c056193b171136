// Why: the disk tier is judged against the disk itself, measured in the same
// run. This raw probe is that measure: a fresh preallocated file opened with
// O_DIRECT, written, then read, then read and written at once (as the tier's
// step moves its records) through one io_uring in requests of the tier's
// block size with up to its queue depth in flight, and none of
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
  double mixed = 0;  // reads and writes in flight together, both counted
  // Seconds to write then read `bytes` at these rates.
  double seconds(std::size_t bytes) const { return static_cast<double>(bytes) * (1.0 / write + 1.0 / read) / 1e9; }
  // Seconds to read and write `bytes` each with both in flight at once, as
  // the disk tier's step does (it reads record k + 1 while it writes k - 1).
  double mixed_seconds(std::size_t bytes) const { return 2.0 * static_cast<double>(bytes) / mixed / 1e9; }
};

// What a pass moves: `write` or read, or `mixed`: both, alternating one
// request of each, reading the half of the file the writes are not in.
enum class Pass { write, read, mixed };

// `bytes` through `fd` in `block` requests (a mixed pass: `bytes` read and
// `bytes` written), `depth` in flight, each completing whole (anything else
// ends the benchmark): GB/s of both directions.
inline double probe_pass(int fd, Pass pass, unsigned char* src, unsigned char* dst, std::size_t bytes,
                         std::size_t block, unsigned depth) {
  zero::offload::detail::Uring ring(depth);
  const auto t0 = std::chrono::steady_clock::now();
  const std::size_t total = pass == Pass::mixed ? 2 * bytes : bytes;
  const std::size_t half = bytes / 2 / 4096 * 4096;
  std::size_t next = 0, written = 0, read = 0;
  unsigned in_flight = 0;
  while (next < total || in_flight > 0) {
    bool prepared = false;
    for (; in_flight < depth && next < total; ++in_flight, prepared = true) {
      // A mixed pass writes block j of src at j while it reads the block
      // half the file away (the bytes are those of the write pass: the file
      // keeps its content, and the read-back check still holds).
      const bool write = pass == Pass::write || (pass == Pass::mixed && (read >= bytes || (written <= read && written < bytes)));
      std::size_t& done = write ? written : read;
      const std::size_t n = std::min(block, bytes - done);
      const std::size_t offset = pass == Pass::mixed && !write ? (done + half) % bytes : done;
      const std::size_t at = pass == Pass::mixed && !write ? std::min(n, bytes - offset) : n;
      ring.prepare(ring.next(), write, fd, (write ? src : dst) + offset, at, offset, at);
      done += at;
      next += at;
    }
    if (prepared && ring.submit() < 0) probe_failed("io_uring_submit failed");
    std::uint64_t expected;
    int result;
    for (bool wait = true; in_flight > 0 && ring.completion(wait, expected, result); wait = false) {
      if (result < 0 || static_cast<std::uint64_t>(result) != expected)
        probe_failed(std::string(pass == Pass::write ? "write" : pass == Pass::read ? "read" : "mixed") +
                     " returned " + std::to_string(result) +
                     (result < 0 ? " (" + zero::offload::detail::errno_text(-result) + ")" : ""));
      --in_flight;
    }
  }
  return static_cast<double>(total) / seconds_since(t0) / 1e9;
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
  rates.write = probe_pass(fd, Pass::write, src, dst, bytes, block, depth);
  rates.read = probe_pass(fd, Pass::read, src, dst, bytes, block, depth);
  rates.mixed = probe_pass(fd, Pass::mixed, src, dst, bytes, block, depth);
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
