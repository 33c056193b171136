// Why: a checkpoint that dies half-way must leave nothing that looks
// complete. Every file is written under a temporary name, fsynced, renamed
// over its final name and the directory fsynced, so a reader sees either the
// old file, the new one whole, or none; and reads go through pread with exact
// lengths, so a truncated file is an error naming the file, never a short
// buffer of garbage.
#pragma once

#include "zero/compiler.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "zero/error.hpp"

namespace zero::checkpoint {

// Throws CheckpointError("<file>: <parts>").
template <class... Parts>
[[noreturn]] void fail(const std::filesystem::path& file, Parts&&... parts) {
  throw CheckpointError(zero::detail::concat(file.string(), ": ", std::forward<Parts>(parts)...));
}

namespace detail {

inline std::string errno_text(int e) { return std::string(std::strerror(e)) + " (errno " + std::to_string(e) + ")"; }

// A file descriptor closed on scope exit.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  int get() const { return fd_; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  // close() reports write-back errors on some file systems (NFS): the last
  // chance to learn that the data did not arrive.
  int close_checked() { return ::close(std::exchange(fd_, -1)); }

 private:
  int fd_ = -1;
};

}  // namespace detail

// fsync of a directory: makes a rename or a new file inside it durable.
inline void fsync_directory(const std::filesystem::path& dir) {
  detail::Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) fail(dir, "cannot open the directory to fsync it: ", detail::errno_text(errno));
  if (::fsync(fd.get()) != 0) fail(dir, "fsync of the directory failed: ", detail::errno_text(errno));
}

// Creates `dir` and its missing parents. A failure (a read-only file system,
// a parent that is a file, no permission) is a CheckpointError naming `dir`,
// `what` it is and the cause, not a std::filesystem::filesystem_error.
inline void make_directories(const std::filesystem::path& dir, std::string_view what) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    fail(dir, "cannot create ", what, ": ", ec.message(), " (errno ", ec.value(),
         "); choose a directory on a writable file system, whose parents are directories you may write into");
}

// A file opened for reading at offsets. Every read is exact: a file shorter
// than the range asked for is "truncated", naming both sizes.
class ReadFile {
 public:
  explicit ReadFile(std::filesystem::path path) : path_(std::move(path)) {
    fd_ = detail::Fd(::open(path_.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd_.get() < 0) {
      const int e = errno;
      if (e == ENOENT) fail(path_, "the file does not exist");
      fail(path_, "cannot open: ", detail::errno_text(e));
    }
    struct stat st {};
    if (::fstat(fd_.get(), &st) != 0) fail(path_, "fstat failed: ", detail::errno_text(errno));
    if (!S_ISREG(st.st_mode)) fail(path_, "not a regular file");
    size_ = static_cast<std::uint64_t>(st.st_size);
  }

  const std::filesystem::path& path() const { return path_; }
  std::uint64_t size() const { return size_; }

  // Reads bytes [offset, offset + bytes) into dst; `what` names the range in
  // the error (e.g. "tensor 'x'").
  void read_at(std::uint64_t offset, std::uint64_t bytes, void* dst, std::string_view what = "data") const {
    std::uint64_t end = 0;
    if (__builtin_add_overflow(offset, bytes, &end) || end > size_)
      fail(path_, "truncated: ", what, " needs bytes [", offset, ", ", offset + bytes, ") but the file has ", size_,
           " bytes");
    auto* out = static_cast<char*>(dst);
    std::uint64_t done = 0;
    while (done < bytes) {
      const std::uint64_t want = std::min<std::uint64_t>(bytes - done, std::uint64_t{1} << 30);
      const ssize_t got = ::pread(fd_.get(), out + done, want, static_cast<off_t>(offset + done));
      if (got < 0) {
        if (errno == EINTR) continue;
        fail(path_, "read of ", what, " failed: ", detail::errno_text(errno));
      }
      if (got == 0) fail(path_, "truncated: the file ended at byte ", offset + done, " while reading ", what);
      done += static_cast<std::uint64_t>(got);
    }
  }

 private:
  std::filesystem::path path_;
  detail::Fd fd_;
  std::uint64_t size_ = 0;
};

// Reads a whole (small) file; files over max_bytes are an error, not an
// allocation of whatever size a corrupt file claims.
inline std::string read_whole_file(const std::filesystem::path& path, std::uint64_t max_bytes = std::uint64_t{1} << 30) {
  ReadFile f(path);
  if (f.size() > max_bytes) fail(path, "is ", f.size(), " bytes, more than the ", max_bytes, " expected at most");
  std::string s(static_cast<std::size_t>(f.size()), '\0');
  f.read_at(0, f.size(), s.data(), "the file");
  return s;
}

// A file that appears under its final name only when commit() succeeds:
// written to "<name>.tmp-<pid>-<n>" in the same directory, then fsynced,
// renamed and the directory fsynced. Destroyed uncommitted, it removes the
// temporary file. Writes go through a bounded buffer (buffer_bytes).
class AtomicFile {
 public:
  static constexpr std::size_t default_buffer_bytes = std::size_t{1} << 20;

  explicit AtomicFile(std::filesystem::path path, std::size_t buffer_bytes = default_buffer_bytes)
      : path_(std::move(path)), buffer_capacity_(buffer_bytes) {
    static std::atomic<std::uint64_t> counter{0};
    temp_ = path_;
    temp_ += ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(counter.fetch_add(1));
    fd_ = detail::Fd(::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
    if (fd_.get() < 0) fail(temp_, "cannot create: ", detail::errno_text(errno));
    buffer_.reserve(buffer_capacity_);
  }
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile() {
    if (!committed_) {
      fd_.reset();
      ::unlink(temp_.c_str());
    }
  }

  const std::filesystem::path& path() const { return path_; }
  std::uint64_t bytes_written() const { return written_; }

  void write(const void* data, std::size_t bytes) {
    const char* p = static_cast<const char*>(data);
    written_ += bytes;
    if (buffer_.size() + bytes <= buffer_capacity_) {
      buffer_.insert(buffer_.end(), p, p + bytes);
      return;
    }
    flush();
    if (bytes <= buffer_capacity_) {
      buffer_.insert(buffer_.end(), p, p + bytes);
    } else {
      write_through(p, bytes);
    }
  }
  void write(std::string_view s) { write(s.data(), s.size()); }

  // fsync, rename over the final name, fsync the directory.
  void commit() {
    flush();
    if (::fsync(fd_.get()) != 0) fail(temp_, "fsync failed: ", detail::errno_text(errno));
    if (fd_.close_checked() != 0) fail(temp_, "close failed: ", detail::errno_text(errno));
    if (::rename(temp_.c_str(), path_.c_str()) != 0)
      fail(path_, "rename from ", temp_.filename().string(), " failed: ", detail::errno_text(errno));
    committed_ = true;
    fsync_directory(path_.has_parent_path() ? path_.parent_path() : std::filesystem::path("."));
  }

 private:
  void flush() {
    write_through(buffer_.data(), buffer_.size());
    buffer_.clear();
  }
  void write_through(const char* p, std::size_t bytes) {
    while (bytes > 0) {
      const ssize_t n = ::write(fd_.get(), p, std::min<std::size_t>(bytes, std::size_t{1} << 30));
      if (n < 0) {
        if (errno == EINTR) continue;
        fail(temp_, "write failed: ", detail::errno_text(errno));
      }
      p += n;
      bytes -= static_cast<std::size_t>(n);
    }
  }

  std::filesystem::path path_, temp_;
  detail::Fd fd_;
  std::size_t buffer_capacity_;
  std::vector<char> buffer_;
  std::uint64_t written_ = 0;
  bool committed_ = false;
};

// Writes `contents` to `path` atomically (temporary name, fsync, rename,
// directory fsync).
inline void write_file_atomically(const std::filesystem::path& path, std::string_view contents) {
  AtomicFile f(path, 0);
  f.write(contents);
  f.commit();
}

}  // namespace zero::checkpoint
