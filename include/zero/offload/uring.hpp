// Why: io_uring lets one thread keep many reads and writes in flight on a
// file without a thread per request, which is what an NVMe drive needs to
// reach its bandwidth (one request at a time leaves it mostly idle). This is
// the ring's owner and nothing more: queueing, retries and checks live in
// DiskSwap (zero/offload/disk_swap.hpp). Needs liburing (apt liburing-dev)
// and -luring.
#pragma once

#include "zero/compiler.hpp"

#include <liburing.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <system_error>

#include "zero/error.hpp"

namespace zero::offload::detail {

// strerror's text for an errno value, thread-safe.
inline std::string errno_text(int e) { return std::error_code(e, std::generic_category()).message(); }

// One submission/completion ring with room for `entries` requests in flight.
// Not thread-safe: one thread drives it.
class Uring {
 public:
  // `queue_depth_option`: the option that set `entries`, as the caller named it.
  explicit Uring(unsigned entries, std::string_view queue_depth_option = "zero::offload::DiskOptions::queue_depth") {
    const int rc = io_uring_queue_init(entries, &ring_, 0);
    if (rc < 0)
      throw IoError(zero::detail::concat(
          "zero::offload: io_uring_queue_init(", entries, ") failed: ", errno_text(-rc),
          ". The disk tier needs io_uring (Linux 5.6 or newer, not disabled by sysctl kernel.io_uring_disabled "
          "or a container's seccomp profile); lower ", queue_depth_option, " if the cause is ENOMEM"));
  }
  Uring(const Uring&) = delete;
  Uring& operator=(const Uring&) = delete;
  ~Uring() { io_uring_queue_exit(&ring_); }

  // A request to fill, or nullptr when the submission queue is full.
  io_uring_sqe* next() { return io_uring_get_sqe(&ring_); }
  void prepare(io_uring_sqe* sqe, bool write, int fd, void* buf, std::size_t bytes, std::size_t offset,
               std::uint64_t tag) {
    if (write)
      io_uring_prep_write(sqe, fd, buf, static_cast<unsigned>(bytes), offset);
    else
      io_uring_prep_read(sqe, fd, buf, static_cast<unsigned>(bytes), offset);
    io_uring_sqe_set_data64(sqe, tag);
  }
  // Hands the prepared requests to the kernel: the count taken, or -errno.
  int submit() { return io_uring_submit(&ring_); }

  // The next completion, waiting for one when `block`; false when none is
  // ready (non-blocking) . A wait that a signal interrupts is resumed.
  // Returns -errno of the ring itself (not of a request) as an exception.
  bool completion(bool block, std::uint64_t& tag, int& result) {
    io_uring_cqe* cqe = nullptr;
    int rc;
    do {
      rc = block ? io_uring_wait_cqe(&ring_, &cqe) : io_uring_peek_cqe(&ring_, &cqe);
    } while (rc == -EINTR);
    if (rc == -EAGAIN && !block) return false;
    if (rc < 0) throw IoError("zero::offload: waiting on the io_uring failed: " + errno_text(-rc));
    tag = io_uring_cqe_get_data64(cqe);
    result = cqe->res;
    io_uring_cqe_seen(&ring_, cqe);
    return true;
  }

 private:
  io_uring ring_{};
};

}  // namespace zero::offload::detail
