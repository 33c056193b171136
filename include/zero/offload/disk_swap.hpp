// Why: ZeRO-Infinity's disk tier keeps fp32 master weights and optimizer
// state in files and streams them through a small host window. A DiskSwap is
// one such file: preallocated (so a full disk shows at start, not mid-step),
// read and written with O_DIRECT (no page cache: the point of the tier is
// memory the host does not have) through io_uring with several requests in
// flight (an NVMe drive needs a queue to reach its bandwidth).
//
// Faults are never silent. A short transfer is retried; a read that ends
// early, an I/O error, a full disk, a file-size limit, or bytes that differ
// from what was written (an XXH3-64 checksum per written piece, verified when
// the piece is read back) or a file replaced or resized underneath all throw
// zero::IoError naming the file, the byte offset, the size, the cause and
// what to do. After one, the DiskSwap refuses every further call: the state
// it holds may be partial, and training on it would be silent corruption.
//
// Needs liburing (-luring) and xxhash.h (header only here: XXH_INLINE_ALL).
#pragma once

#include "zero/compiler.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <csignal>
#include <cstdio>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "zero/xxhash.hpp"  // (xxHash compiled in, header only)

#include "zero/engine/options.hpp"
#include "zero/error.hpp"
#include "zero/offload/aligned_buffer.hpp"
#include "zero/offload/uring.hpp"

namespace zero::offload {

// Where and how the swap files go.
struct DiskOptions {
  static constexpr std::size_t max_block_bytes = std::size_t{1} << 30;  // below Linux's 2 GiB per request
  static constexpr unsigned max_queue_depth = 4096;

  std::string directory;                         // on a fast local disk; must exist and be writable
  std::size_t block_bytes = std::size_t{1} << 20;  // bytes per request (a multiple of 4096)
  unsigned queue_depth = 16;                      // requests in flight per file
  bool direct = true;                             // O_DIRECT (falls back to buffered where refused)
  // How error messages name these fields: the engine's disk tier sets
  // "Options::nvme.", the options its users set.
  const char* option_names = "zero::offload::DiskOptions::";

  std::string option(const char* field) const { return std::string(option_names) + field; }

  void validate() const {
    require(!directory.empty(), option("directory"),
            " is empty: name a directory on a fast local disk (NVMe) for the swap files");
    require(block_bytes >= disk_alignment && block_bytes % disk_alignment == 0, option("block_bytes"), " = ",
            block_bytes,
            " is not a positive multiple of 4096 (O_DIRECT moves whole 4 KiB blocks); use a power of two such as "
            "1048576 (1 MiB)");
    require(block_bytes <= max_block_bytes, option("block_bytes"), " = ", block_bytes,
            " is above 1 GiB, more than one request can carry; use 1 MiB to 4 MiB");
    require(queue_depth >= 1 && queue_depth <= max_queue_depth, option("queue_depth"), " = ", queue_depth,
            " is outside 1..", max_queue_depth, "; 8 to 32 requests in flight suit an NVMe drive");
  }
};

// The engine's disk options (Options::nvme) for a swap file: what its
// stores, the state's and the parameter and gradient shards' pages, open
// their files with, named in errors as their users set them.
inline DiskOptions disk_options(const NvmeOptions& nvme) {
  DiskOptions disk;
  disk.directory = nvme.directory;
  disk.block_bytes = nvme.block_bytes;
  disk.queue_depth = nvme.queue_depth;
  disk.direct = nvme.direct;
  disk.option_names = "Options::nvme.";
  return disk;
}

// Names one read or write; wait() on it. Ticket{} is complete from the start.
struct Ticket {
  std::uint64_t id = 0;
};

namespace detail {

// open(2) as a plain function pointer, so a test can stand in for a
// filesystem that refuses O_DIRECT.
using OpenFunction = int (*)(const char* path, int flags, mode_t mode);
inline int open_file(const char* path, int flags, mode_t mode) { return ::open(path, flags, mode); }

struct OpenedFile {
  int fd = -1;
  bool direct = false;
};

// Whether the buffered-I/O notice has been printed in this process; the
// first call that sets it prints it.
inline std::atomic<bool>& buffered_notice_printed() {
  static std::atomic<bool> printed{false};
  return printed;
}

// `directory_option`: the option that names the directory, as the caller set it.
[[noreturn]] inline void throw_create_error(const std::string& path, int e, std::string_view directory_option) {
  throw IoError(zero::detail::concat("zero::offload::DiskSwap: cannot create the swap file ", path, ": ",
                                     errno_text(e), ". Set ", directory_option,
                                     " to a directory that exists and that this "
                                     "process can write, on a local disk with room for the optimizer state"));
}

// Creates `path` (which must not exist) for reading and writing, with
// O_DIRECT when `want_direct` and the filesystem allows it. Where O_DIRECT
// is refused with EINVAL (tmpfs before Linux 6.6, ramfs, some network
// filesystems) the file is opened for buffered I/O instead, with a one-line
// notice on stderr, once per process.
inline OpenedFile open_swap_file(const std::string& path, bool want_direct, OpenFunction open_fn = open_file,
                                 std::string_view directory_option = "zero::offload::DiskOptions::directory") {
  const int flags = O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC;
  if (want_direct) {
    const int fd = open_fn(path.c_str(), flags | O_DIRECT, 0600);
    if (fd >= 0) return {fd, true};
    if (errno != EINVAL) throw_create_error(path, errno, directory_option);
    // Some filesystems create the file before they refuse O_DIRECT; the name
    // is this process's own (pid and counter), so no O_EXCL the second time.
    const int buffered = open_fn(path.c_str(), flags & ~O_EXCL, 0600);
    if (buffered < 0) throw_create_error(path, errno, directory_option);
    if (!buffered_notice_printed().exchange(true))
      std::fprintf(stderr,
                   "zero::offload: the filesystem of %s refuses O_DIRECT; its swap files use buffered I/O through "
                   "the page cache (slower, and it takes host memory)\n",
                   path.c_str());
    return {buffered, false};
  }
  const int fd = open_fn(path.c_str(), flags, 0600);
  if (fd < 0) throw_create_error(path, errno, directory_option);
  return {fd, false};
}

// A file-size limit (ulimit -f) sends SIGXFSZ, whose default action ends the
// process with a core dump; ignored, the write fails with EFBIG, which
// DiskSwap reports. A handler the program installed itself is left alone.
inline void ignore_file_size_signal() {
  struct sigaction current {};
  if (sigaction(SIGXFSZ, nullptr, &current) == 0 && current.sa_handler == SIG_DFL &&
      !(current.sa_flags & SA_SIGINFO))
    std::signal(SIGXFSZ, SIG_IGN);
}

inline std::atomic<std::uint64_t>& swap_file_counter() {
  static std::atomic<std::uint64_t> n{0};
  return n;
}

// What to do about an errno from a read or write of a swap file.
inline std::string io_advice(int e, std::string_view directory_option) {
  switch (e) {
    case ENOSPC:
      return zero::detail::concat("free space on that disk or set ", directory_option, " to one with room");
    case EFBIG:
      return "the file-size limit (ulimit -f, RLIMIT_FSIZE) or the filesystem's largest file is below the swap "
             "file's size; raise the limit or use another filesystem";
    case EIO:
      return "the device reported an I/O error; check the disk (dmesg, smartctl) and move the swap to another";
    case EINVAL:
      return "the filesystem refused the request (O_DIRECT alignment or a request too large); report this";
    default:
      return "check the disk and the directory, then restart from a checkpoint";
  }
}

}  // namespace detail

// One preallocated swap file with asynchronous, checked reads and writes.
// Not thread-safe: one thread calls it (its calls drive the ring). Neither
// copyable nor movable (the kernel holds addresses into it); hold it by
// std::unique_ptr to move it.
class DiskSwap {
 public:
  // Creates zero-swap-r<rank>-<pid>-<n>.bin of `bytes` (rounded up to 4096)
  // under options.directory, preallocated. Throws InvalidArgument for bad
  // options and IoError for a directory that is missing or not writable, a
  // disk without room (ENOSPC) or a file-size limit below `bytes` (EFBIG).
  DiskSwap(std::size_t bytes, const DiskOptions& options, int rank = 0) : options_(options) {
    options_.validate();
    require(bytes > 0, "zero::offload::DiskSwap: a swap file of 0 bytes; give the bytes it must hold");
    require(bytes <= (std::size_t{1} << 62), "zero::offload::DiskSwap: ", bytes, " bytes is beyond any disk");
    require(rank >= 0, "zero::offload::DiskSwap: rank ", rank, " is negative");
    size_ = round_up_to_disk_alignment(bytes);
    check_directory();
    path_ = zero::detail::concat(options_.directory, options_.directory.back() == '/' ? "" : "/", "zero-swap-r",
                                 rank, "-", ::getpid(), "-", detail::swap_file_counter().fetch_add(1), ".bin");
    detail::ignore_file_size_signal();
    const detail::OpenedFile file =
        detail::open_swap_file(path_, options_.direct, detail::open_file, options_.option("directory"));
    fd_ = file.fd;
    direct_ = file.direct;
    try {
      preallocate();
      struct stat st {};
      if (::fstat(fd_, &st) != 0) throw_errno("fstat", 0, 0, errno);
      device_ = st.st_dev;
      inode_ = st.st_ino;
      ring_ = std::make_unique<detail::Uring>(options_.queue_depth, options_.option("queue_depth"));
    } catch (...) {
      ::close(fd_);
      ::unlink(path_.c_str());
      throw;
    }
    slots_.resize(options_.queue_depth);
    for (unsigned s = options_.queue_depth; s-- > 0;) free_slots_.push_back(s);
  }

  DiskSwap(const DiskSwap&) = delete;
  DiskSwap& operator=(const DiskSwap&) = delete;

  // Waits for requests in flight (the kernel may still be writing into the
  // caller's buffers), then closes and removes the file.
  ~DiskSwap() {
    drain();
    ring_.reset();
    ::close(fd_);
    if (same_file()) ::unlink(path_.c_str());  // never someone else's file put in its place
  }

  // Starts writing `bytes` from `src` at byte `offset` of the file. offset,
  // bytes and src must be multiples of 4096 (AlignedBuffer, pinned CUDA
  // memory); src must stay unchanged until the ticket completes. A range
  // that overlaps a read or write still in flight is refused.
  Ticket write(std::size_t offset, const void* src, std::size_t bytes) {
    return start(true, offset, const_cast<void*>(src), bytes);
  }
  // Starts reading `bytes` at `offset` into `dst`, alignment as for write.
  // Every piece that a write() put there is verified against its checksum
  // when it arrives (see verified_bytes()).
  Ticket read(std::size_t offset, void* dst, std::size_t bytes) { return start(false, offset, dst, bytes); }

  // Drives the ring until `t` has completed (its data is in place).
  void wait(Ticket t) {
    check_not_failed();
    while (!done(t)) progress(true);
  }
  // Drives the ring until nothing is queued or in flight.
  void wait_all() {
    check_not_failed();
    while (!requests_.empty()) progress(true);
  }
  // Waits for at least one completion and moves requests along; true when
  // nothing is queued or in flight any more (then it does not wait).
  bool wait_some() {
    check_not_failed();
    if (!requests_.empty()) progress(true);
    return requests_.empty();
  }
  // Moves requests along without blocking; true when nothing is queued or in
  // flight any more.
  bool poll() {
    check_not_failed();
    if (!requests_.empty()) progress(false);
    return requests_.empty();
  }
  // Whether `t` has completed (without driving the ring).
  bool done(Ticket t) const { return requests_.find(t.id) == requests_.end(); }

  const std::string& path() const { return path_; }
  std::size_t size() const { return size_; }
  // False where the filesystem refused O_DIRECT (or options().direct is off).
  bool direct() const { return direct_; }
  const DiskOptions& options() const { return options_; }
  // Whether an I/O error has put this swap out of use, and the error's text.
  bool failed() const { return !failure_.empty(); }
  const std::string& failure() const { return failure_; }

  // Bytes completed so far, and the read bytes whose checksum matched (the
  // rest of what was read had never been written whole by this DiskSwap).
  std::uint64_t bytes_written() const { return bytes_written_; }
  std::uint64_t bytes_read() const { return bytes_read_; }
  std::uint64_t verified_bytes() const { return verified_bytes_; }
  // The most requests the kernel has held at once (at most queue_depth).
  std::size_t peak_in_flight() const { return peak_in_flight_; }

 private:
  // One request to the kernel: a piece of a read or write, at most
  // block_bytes. A written piece's checksum is kept under its offset; a read
  // is cut at those offsets so each piece it covers whole is verified.
  struct Piece {
    std::size_t offset;
    std::size_t bytes;
    bool verify;
    XXH64_hash_t hash;  // expected when read
  };
  struct Request {
    bool write;
    unsigned char* buffer;  // the caller's, at the request's first byte
    std::size_t offset;
    std::size_t bytes;
    std::vector<Piece> pieces;
    std::size_t next_piece = 0;   // first one not yet handed to the kernel
    std::size_t outstanding = 0;  // handed over, not yet transferred and checked
  };
  struct Slot {
    std::uint64_t request;
    std::size_t piece;
    std::size_t done;  // bytes of the piece transferred so far
  };
  struct Checksum {
    std::size_t bytes;
    XXH64_hash_t hash;
  };

  Ticket start(bool write, std::size_t offset, void* buffer, std::size_t bytes) {
    check_not_failed();
    const char* op = write ? "write" : "read";
    require(offset % disk_alignment == 0 && bytes % disk_alignment == 0 && is_disk_aligned(buffer),
            "zero::offload::DiskSwap::", op, "(offset ", offset, ", buffer ", buffer, ", bytes ", bytes, ") on ",
            path_,
            ": the offset, the size and the buffer's address must each be a multiple of 4096 for O_DIRECT; use "
            "zero::offload::AlignedBuffer or page-aligned (pinned) memory and pad sizes to 4096");
    require(offset <= size_ && bytes <= size_ - offset, "zero::offload::DiskSwap::", op, " of ", bytes,
            " bytes at offset ", offset, " runs past the end of ", path_, " (", size_,
            " bytes); make the swap file larger");
    if (bytes == 0) return Ticket{};
    for (const auto& [id, r] : requests_)
      require(!(offset < r.offset + r.bytes && r.offset < offset + bytes) || (!write && !r.write),
              "zero::offload::DiskSwap::", op, " of bytes ", offset, "..", offset + bytes, " of ", path_,
              " overlaps a ", r.write ? "write" : "read", " still in flight (bytes ", r.offset, "..",
              r.offset + r.bytes, "); wait() for that ticket first");
    check_file_unchanged(op, offset, bytes);

    Request r{write, static_cast<unsigned char*>(buffer), offset, bytes, {}};
    if (write)
      plan_write(r);
    else
      plan_read(r);
    const std::uint64_t id = next_id_++;
    requests_.emplace(id, std::move(r));
    progress(false);  // start it now; the disk works while the caller goes on
    return Ticket{id};
  }

  void plan_write(Request& r) {
    // The new bytes replace every checksum they touch; pieces only partly
    // overwritten are no longer known as a whole.
    auto first = checksums_.upper_bound(r.offset);
    if (first != checksums_.begin() && std::prev(first)->first + std::prev(first)->second.bytes > r.offset) --first;
    auto last = checksums_.lower_bound(r.offset + r.bytes);
    checksums_.erase(first, last);
    for (std::size_t at = 0; at < r.bytes; at += options_.block_bytes) {
      const std::size_t n = std::min(options_.block_bytes, r.bytes - at);
      r.pieces.push_back(Piece{r.offset + at, n, false, 0});  // hashed once written
    }
  }

  void plan_read(Request& r) {
    const std::size_t end = r.offset + r.bytes;
    for (std::size_t at = r.offset; at < end;) {
      auto it = checksums_.lower_bound(at);
      if (it != checksums_.end() && it->first == at && it->second.bytes <= end - at) {
        r.pieces.push_back(Piece{at, it->second.bytes, true, it->second.hash});
        at += it->second.bytes;
        continue;
      }
      // Bytes no whole written piece covers, up to where the next one starts.
      if (it != checksums_.end() && it->first == at) ++it;  // starts here but runs past the read
      const std::size_t stop = it != checksums_.end() && it->first < end ? it->first : end;
      const std::size_t n = std::min(options_.block_bytes, stop - at);
      r.pieces.push_back(Piece{at, n, false, 0});
      at += n;
    }
  }

  // Hands queued pieces to the kernel while slots are free, then takes the
  // completions there are (waiting for one when `block`). After each, the
  // disk gets its next request before the CPU hashes the finished piece, so
  // hashing overlaps the transfers even with one request in flight.
  void progress(bool block) {
    std::string error;
    try {
      submit_queued(error);
      bool wait = block;
      std::uint64_t slot;
      int result;
      while (error.empty() && in_flight() > 0 && ring_->completion(wait, slot, result)) {
        wait = false;  // a blocking call waited for one completion; it takes the others that are ready
        complete(static_cast<std::size_t>(slot), result, error);
        if (error.empty()) submit_queued(error);
        if (error.empty()) check_transferred(error);
      }
    } catch (const IoError& e) {  // the ring itself broke
      error = e.what();
    }
    if (!error.empty()) fail(error);
  }

  void submit_queued(std::string& error) {
    int prepared = 0;
    for (auto it = requests_.begin(); it != requests_.end() && !free_slots_.empty();) {
      Request& r = it->second;
      if (r.next_piece == r.pieces.size()) {
        ++it;
        continue;
      }
      const std::size_t s = free_slots_.back();
      free_slots_.pop_back();
      slots_[s] = Slot{it->first, r.next_piece++, 0};
      ++r.outstanding;
      prepare(s);
      ++prepared;
    }
    peak_in_flight_ = std::max(peak_in_flight_, in_flight());
    if (prepared > 0 || pending_resubmits_ > 0) {
      const int rc = ring_->submit();
      if (rc < 0) error = zero::detail::concat("io_uring_submit on ", path_, " failed: ", detail::errno_text(-rc));
      pending_resubmits_ = 0;
    }
  }

  // Fills a request for the rest of the slot's piece.
  void prepare(std::size_t s) {
    const Slot& slot = slots_[s];
    const Request& r = requests_.at(slot.request);
    const Piece& p = r.pieces[slot.piece];
    io_uring_sqe* sqe = ring_->next();  // never null: at most queue_depth requests are out
    ring_->prepare(sqe, r.write, fd_, r.buffer + (p.offset - r.offset) + slot.done, p.bytes - slot.done,
                   p.offset + slot.done, s);
  }

  // A completion of slot s: an error, a short transfer (asked for again), or
  // a piece transferred whole, which frees the slot and waits in
  // transferred_ for its checksum.
  void complete(std::size_t s, int result, std::string& error) {
    Slot& slot = slots_[s];
    const Request& r = requests_.at(slot.request);
    const Piece& p = r.pieces[slot.piece];
    const char* op = r.write ? "write" : "read";
    const std::size_t at = p.offset + slot.done, left = p.bytes - slot.done;
    if (result == -EINTR || result == -EAGAIN) {  // nothing moved: ask again
      retry(s);
      return;
    }
    if (result <= 0) {
      if (result < 0)
        error = describe(op, at, left, detail::errno_text(-result),
                         detail::io_advice(-result, options_.option("directory")));
      else if (r.write)
        error = describe(op, at, left, "the write made no progress (0 bytes written)",
                         "check the disk's free space and the file-size limit (ulimit -f)");
      else
        error = describe(op, at, left, file_now() + ": the read ended early (0 bytes), so the file was truncated "
                                                    "underneath",
                         "nothing else may write, truncate or remove the swap files while training runs");
      free_slots_.push_back(s);
      return;
    }
    slot.done += static_cast<std::size_t>(result);
    if (slot.done < p.bytes) {  // short transfer: the rest is asked for again
      retry(s);
      return;
    }
    transferred_.push_back(Slot{slot.request, slot.piece, p.bytes});
    free_slots_.push_back(s);
  }

  void retry(std::size_t s) {
    prepare(s);
    ++pending_resubmits_;
  }

  // Pieces transferred whole: a written one's checksum is recorded, a read
  // one is verified; a request is complete when its last piece is.
  void check_transferred(std::string& error) {
    for (const Slot& done : transferred_) {
      auto it = requests_.find(done.request);
      Request& r = it->second;
      const Piece& p = r.pieces[done.piece];
      const unsigned char* bytes = r.buffer + (p.offset - r.offset);
      if (r.write) {
        checksums_[p.offset] = Checksum{p.bytes, XXH3_64bits(bytes, p.bytes)};
        bytes_written_ += p.bytes;
      } else {
        bytes_read_ += p.bytes;
        if (p.verify) {
          const XXH64_hash_t got = XXH3_64bits(bytes, p.bytes);
          if (got != p.hash) {
            error = describe("read", p.offset, p.bytes,
                             zero::detail::concat("the bytes read differ from those written there (XXH3-64 ",
                                                  std::hex, got, " instead of ", p.hash, std::dec,
                                                  "), so the file was changed underneath or the disk returned bad "
                                                  "data"),
                             "nothing else may write to the swap files while training runs; check the disk, then "
                             "restart from a checkpoint");
            break;
          }
          verified_bytes_ += p.bytes;
        }
      }
      if (--r.outstanding == 0 && r.next_piece == r.pieces.size()) requests_.erase(it);
    }
    transferred_.clear();
  }

  std::size_t in_flight() const { return slots_.size() - free_slots_.size(); }

  // Waits out every request the kernel holds, ignoring results: after an
  // error, and at destruction, no transfer may touch the caller's memory.
  void drain() noexcept {
    if (!ring_) return;
    if (pending_resubmits_ > 0) ring_->submit();
    pending_resubmits_ = 0;
    std::uint64_t tag;
    int result;
    try {
      while (in_flight() > 0 && ring_->completion(true, tag, result)) free_slots_.push_back(tag);
    } catch (const IoError&) {
      // The ring itself broke; nothing more can be waited for.
    }
    requests_.clear();
    transferred_.clear();
  }

  [[noreturn]] void fail(const std::string& message) {
    failure_ = message;
    drain();
    throw IoError(message);
  }

  void check_not_failed() const {
    if (failed())
      throw IoError("zero::offload::DiskSwap on " + path_ +
                    " failed earlier and refuses further reads and writes (the state it holds may be partial): " +
                    failure_);
  }

  std::string describe(const char* op, std::size_t offset, std::size_t bytes, const std::string& cause,
                       std::string_view advice) const {
    return zero::detail::concat("zero::offload::DiskSwap: ", op, " of ", bytes, " bytes at byte offset ", offset,
                                " of ", path_, " failed: ", cause, ". What to do: ", advice);
  }

  [[noreturn]] void throw_errno(const char* call, std::size_t offset, std::size_t bytes, int e) const {
    throw IoError(
        describe(call, offset, bytes, detail::errno_text(e), detail::io_advice(e, options_.option("directory"))));
  }

  void check_directory() const {
    struct stat st {};
    const std::string& dir = options_.directory;
    if (::stat(dir.c_str(), &st) != 0) {
      const int e = errno;
      throw IoError(zero::detail::concat(
          "zero::offload::DiskSwap: the swap directory ", dir, " cannot be used: ", detail::errno_text(e),
          e == ENOENT ? ". Create it (mkdir -p) or set " : ". Set ", options_.option("directory"),
          e == ENOENT ? " to an existing directory" : " to a directory on a local disk that this process can write"));
    }
    if (!S_ISDIR(st.st_mode))
      throw IoError(zero::detail::concat("zero::offload::DiskSwap: the swap directory ", dir, " is not a directory. Set ",
                                         options_.option("directory"), " to a directory on a local disk"));
  }

  // Reserves the file's blocks now, so a disk too small fails here and not
  // in the middle of a step.
  void preallocate() {
    int e = ::fallocate(fd_, 0, 0, static_cast<off_t>(size_)) == 0 ? 0 : errno;
    if (e == EOPNOTSUPP) e = ::posix_fallocate(fd_, 0, static_cast<off_t>(size_));
    if (e != 0)
      throw IoError(describe("preallocation", 0, size_, detail::errno_text(e),
                             e == ENOSPC || e == EFBIG ? detail::io_advice(e, options_.option("directory"))
                                                       : std::string("choose a directory on a local disk (ext4, xfs)")));
  }

  // The file at path_ is still this file (not removed or replaced) and has
  // its size (not truncated or extended by someone else).
  void check_file_unchanged(const char* op, std::size_t offset, std::size_t bytes) {
    struct stat st {};
    std::string cause;
    if (!same_file())
      cause = "the swap file was removed or replaced by another file";
    else if (::fstat(fd_, &st) != 0)
      cause = "fstat failed: " + detail::errno_text(errno);
    else if (static_cast<std::size_t>(st.st_size) != size_)
      cause = file_now() + ", so it was truncated or extended underneath";
    if (!cause.empty())
      fail(describe(op, offset, bytes, cause,
                    "nothing else may write, truncate or remove the swap files while training runs"));
  }

  bool same_file() const {
    struct stat st {};
    return ::stat(path_.c_str(), &st) == 0 && st.st_dev == device_ && st.st_ino == inode_;
  }

  std::string file_now() const {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) return "the file cannot be examined";
    return zero::detail::concat("the file is now ", st.st_size, " bytes instead of ", size_);
  }

  DiskOptions options_;
  std::size_t size_ = 0;
  std::string path_;
  int fd_ = -1;
  bool direct_ = false;
  dev_t device_ = 0;
  ino_t inode_ = 0;
  std::unique_ptr<detail::Uring> ring_;

  std::map<std::uint64_t, Request> requests_;  // queued or in flight, by ticket id (submission order)
  std::vector<Slot> slots_;                    // one per request the kernel may hold
  std::vector<std::size_t> free_slots_;
  std::vector<Slot> transferred_;  // pieces transferred whole, their checksums not yet done
  int pending_resubmits_ = 0;
  std::map<std::size_t, Checksum> checksums_;  // written pieces by offset
  std::uint64_t next_id_ = 1;

  std::string failure_;
  std::uint64_t bytes_written_ = 0, bytes_read_ = 0, verified_bytes_ = 0;
  std::size_t peak_in_flight_ = 0;
};

}  // namespace zero::offload
