// The disk tier's swap file: data written comes back bit for bit and lands at
// the offsets asked for (read back independently with pread), requests really
// overlap up to the queue depth, O_DIRECT is used where the filesystem allows
// it, and every fault (truncation, bytes changed underneath, a replaced file,
// a full disk, a file-size limit, an unusable directory) gives an IoError that
// names the file and the offset, after which the swap refuses further calls.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "zero/offload/disk_swap.hpp"

namespace {

using zero::offload::AlignedBuffer;
using zero::offload::DiskOptions;
using zero::offload::DiskSwap;
using zero::offload::Ticket;

constexpr std::size_t KiB = 1024, MiB = 1024 * 1024;

// A fresh directory under `base`, removed with everything in it.
struct TempDir {
  std::string path;
  explicit TempDir(const std::string& base = "/tmp") {
    std::string pattern = base + "/zero-test-disk-XXXXXX";
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    path = pattern;
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::size_t files() const {
    return static_cast<std::size_t>(std::distance(std::filesystem::directory_iterator(path), {}));
  }
};

DiskOptions options_in(const std::string& dir, std::size_t block = 1 * MiB, unsigned depth = 8) {
  DiskOptions o;
  o.directory = dir;
  o.block_bytes = block;
  o.queue_depth = depth;
  return o;
}

AlignedBuffer<unsigned char> random_bytes(std::size_t n, std::uint64_t seed) {
  AlignedBuffer<unsigned char> b(n);
  std::mt19937_64 rng(seed);
  for (std::size_t i = 0; i < n; i += 8) {
    const std::uint64_t v = rng();
    std::memcpy(b.data() + i, &v, std::min<std::size_t>(8, n - i));
  }
  return b;
}

// The file's bytes as another program sees them (buffered pread, no DiskSwap).
std::vector<unsigned char> file_bytes(const std::string& path, std::size_t offset, std::size_t n) {
  std::vector<unsigned char> out(n);
  const int fd = ::open(path.c_str(), O_RDONLY);
  REQUIRE(fd >= 0);
  REQUIRE(::pread(fd, out.data(), n, static_cast<off_t>(offset)) == static_cast<ssize_t>(n));
  ::close(fd);
  return out;
}

// The open flags of this process's descriptor for `path` (/proc/self/fdinfo).
long open_flags_of(const std::string& path) {
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    if (std::filesystem::read_symlink(entry.path(), ec) != path) continue;
    std::ifstream info("/proc/self/fdinfo/" + entry.path().filename().string());
    std::string key;
    while (info >> key)
      if (key == "flags:") {
        std::string octal;
        info >> octal;
        return std::stol(octal, nullptr, 8);
      }
  }
  return -1;
}

// Runs `body` in a forked child and returns what it wrote to the pipe; the
// child's exit must be normal (a signal such as SIGXFSZ fails the test).
template <class Body>
std::string in_child(Body body) {
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::close(fds[0]);
    const std::string message = body();
    (void)!::write(fds[1], message.data(), message.size());
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string message;
  char chunk[512];
  for (ssize_t n; (n = ::read(fds[0], chunk, sizeof chunk)) > 0;) message.append(chunk, static_cast<std::size_t>(n));
  ::close(fds[0]);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  INFO("child status " << status << (WIFSIGNALED(status) ? " (killed by a signal)" : ""));
  REQUIRE(WIFEXITED(status));
  return message;
}

// What stderr received while `body` ran.
template <class Body>
std::string stderr_of(Body body) {
  std::fflush(stderr);
  char name[] = "/tmp/zero-test-stderr-XXXXXX";
  const int capture = ::mkstemp(name);
  REQUIRE(capture >= 0);
  const int saved = ::dup(2);
  ::dup2(capture, 2);
  body();
  std::fflush(stderr);
  ::dup2(saved, 2);
  ::close(saved);
  std::ifstream in(name);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ::close(capture);
  ::unlink(name);
  return text;
}

bool accepts_o_direct(const std::string& dir) {
  const std::string probe = dir + "/o-direct-probe";
  const int fd = ::open(probe.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0600);
  if (fd >= 0) ::close(fd);
  ::unlink(probe.c_str());
  return fd >= 0;
}

}  // namespace

TEST_CASE("DiskOptions name each bad value and the fix", "[offload][disk]") {
  DiskOptions o = options_in("/tmp");
  REQUIRE_NOTHROW(o.validate());
  o.directory.clear();
  REQUIRE_THROWS_WITH(o.validate(), Catch::Contains("directory is empty"));
  o = options_in("/tmp", 1000);
  REQUIRE_THROWS_WITH(o.validate(), Catch::Contains("block_bytes = 1000 is not a positive multiple of 4096"));
  o = options_in("/tmp", 0);
  REQUIRE_THROWS_AS(o.validate(), zero::InvalidArgument);
  o = options_in("/tmp", std::size_t{2} << 30);
  REQUIRE_THROWS_WITH(o.validate(), Catch::Contains("above 1 GiB"));
  o = options_in("/tmp", MiB, 0);
  REQUIRE_THROWS_WITH(o.validate(), Catch::Contains("queue_depth = 0 is outside 1..4096"));
  REQUIRE_THROWS_WITH(DiskSwap(MiB, options_in("/tmp", 12345)), Catch::Contains("block_bytes = 12345"));
}

TEST_CASE("Where O_DIRECT is refused the file is opened buffered, with one notice", "[offload][disk]") {
  TempDir dir;
  // A filesystem that refuses O_DIRECT at open (as tmpfs before Linux 6.6 and ramfs do).
  auto refuses_direct = [](const char* path, int flags, mode_t mode) {
    if (flags & O_DIRECT) {
      errno = EINVAL;
      return -1;
    }
    return ::open(path, flags, mode);
  };
  zero::offload::detail::buffered_notice_printed() = false;
  zero::offload::detail::OpenedFile first, second;
  const std::string notice = stderr_of([&] {
    first = zero::offload::detail::open_swap_file(dir.path + "/a", true, refuses_direct);
    second = zero::offload::detail::open_swap_file(dir.path + "/b", true, refuses_direct);
  });
  CHECK(first.fd >= 0);
  CHECK(second.fd >= 0);
  CHECK_FALSE(first.direct);
  CHECK_FALSE(second.direct);
  CHECK((open_flags_of(dir.path + "/a") & O_DIRECT) == 0);
  // One line, once per process.
  CHECK_THAT(notice, Catch::Contains("refuses O_DIRECT; its swap files use buffered I/O"));
  CHECK(std::count(notice.begin(), notice.end(), '\n') == 1);
  ::close(first.fd);
  ::close(second.fd);

  // Any other refusal is an error naming the file.
  auto denies = [](const char*, int, mode_t) {
    errno = EACCES;
    return -1;
  };
  REQUIRE_THROWS_WITH(zero::offload::detail::open_swap_file(dir.path + "/c", true, denies),
                      Catch::Contains("cannot create the swap file " + dir.path + "/c: Permission denied"));
}

TEST_CASE("Random data makes the round trip at several sizes and offsets", "[offload][disk]") {
  TempDir dir;
  const std::size_t block = 1 * MiB;
  const std::size_t asked = 12 * MiB + 100;  // rounded up to 4096
  std::string path;
  {
    DiskSwap swap(asked, options_in(dir.path, block, 4), 3);
    path = swap.path();
    CHECK(swap.size() == 12 * MiB + 4096);
    CHECK_THAT(path, Catch::StartsWith(dir.path + "/zero-swap-r3-" + std::to_string(::getpid()) + "-"));
    CHECK_THAT(path, Catch::EndsWith(".bin"));
    struct stat st {};
    REQUIRE(::stat(path.c_str(), &st) == 0);
    CHECK(static_cast<std::size_t>(st.st_size) == swap.size());
    CHECK(static_cast<std::size_t>(st.st_blocks) * 512 >= swap.size());  // preallocated, not sparse

    // (offset, bytes): one page, a whole block off the block grid, a partial
    // last block, and the file's last bytes.
    const std::vector<std::pair<std::size_t, std::size_t>> ranges = {
        {0, 4 * KiB}, {3 * 4 * KiB, block}, {2 * MiB, 3 * MiB + 512 * KiB + 8 * KiB}, {swap.size() - 64 * KiB, 64 * KiB}};
    std::vector<AlignedBuffer<unsigned char>> written, read;
    std::vector<Ticket> tickets;
    for (std::size_t i = 0; i < ranges.size(); ++i) {
      written.push_back(random_bytes(ranges[i].second, 100 + i));
      tickets.push_back(swap.write(ranges[i].first, written.back().data(), ranges[i].second));
    }
    swap.wait_all();
    for (const Ticket t : tickets) CHECK(swap.done(t));
    std::size_t total = 0;
    for (std::size_t i = 0; i < ranges.size(); ++i) {
      read.emplace_back(ranges[i].second);
      swap.wait(swap.read(ranges[i].first, read.back().data(), ranges[i].second));
      INFO("range " << i << ": offset " << ranges[i].first << ", " << ranges[i].second << " bytes");
      CHECK(std::memcmp(read[i].data(), written[i].data(), ranges[i].second) == 0);
      // On disk at the offset asked for, as another reader of the file sees it.
      const auto on_disk = file_bytes(path, ranges[i].first, ranges[i].second);
      CHECK(std::memcmp(on_disk.data(), written[i].data(), ranges[i].second) == 0);
      total += ranges[i].second;
    }
    CHECK(swap.bytes_written() == total);
    CHECK(swap.bytes_read() == total);
    CHECK(swap.verified_bytes() == total);  // every byte read had been written whole, so was checked

    // A read across pieces written separately and bytes never written
    // (zeros, from the preallocation), file bytes 1 MiB..5 MiB: the end of
    // range 1, zeros, then range 2's first three pieces, checked whole.
    AlignedBuffer<unsigned char> span(4 * MiB);
    std::uint64_t verified_before = swap.verified_bytes();
    swap.wait(swap.read(MiB, span.data(), span.bytes()));
    CHECK(std::memcmp(span.data(), written[1].data() + block - 12 * KiB, 12 * KiB) == 0);
    CHECK(std::all_of(span.data() + 12 * KiB, span.data() + MiB, [](unsigned char c) { return c == 0; }));
    CHECK(std::memcmp(span.data() + MiB, written[2].data(), 3 * MiB) == 0);
    CHECK(swap.verified_bytes() - verified_before == 3 * MiB);
    // Off the pieces' grid no piece is covered whole: read, not checked.
    verified_before = swap.verified_bytes();
    swap.wait(swap.read(2 * MiB + 512 * KiB, span.data(), MiB));
    CHECK(std::memcmp(span.data(), written[2].data() + 512 * KiB, MiB) == 0);
    CHECK(swap.verified_bytes() == verified_before);
    CHECK_FALSE(swap.failed());
  }
  CHECK_FALSE(std::filesystem::exists(path));  // removed with the DiskSwap
}

TEST_CASE("Requests overlap up to the queue depth and complete in any order", "[offload][disk]") {
  TempDir dir;
  for (unsigned depth : {1u, 4u, 32u}) {
    DiskSwap swap(16 * MiB, options_in(dir.path, 64 * KiB, depth));
    const std::size_t n = 64, each = 256 * KiB;
    const auto data = random_bytes(n * each, depth);
    std::vector<Ticket> tickets;
    for (std::size_t i = 0; i < n; ++i) tickets.push_back(swap.write(i * each, data.data() + i * each, each));
    while (!swap.poll()) {
    }
    CHECK(swap.peak_in_flight() == depth);
    AlignedBuffer<unsigned char> back(n * each);
    tickets.clear();
    for (std::size_t i = 0; i < n; ++i) tickets.push_back(swap.read(i * each, back.data() + i * each, each));
    for (std::size_t i = n; i-- > 0;) swap.wait(tickets[i]);  // the last first
    CHECK(std::memcmp(back.data(), data.data(), n * each) == 0);
    CHECK(swap.verified_bytes() == n * each);
    // wait_some(), as the disk tier's I/O thread calls it: each call takes at
    // least one completion, so n pieces take at most n calls, and the last
    // says the swap is idle.
    for (std::size_t i = 0; i < n; ++i) swap.read(i * each, back.data() + i * each, each);
    std::size_t calls = 1;
    while (!swap.wait_some()) ++calls;
    CHECK(calls <= n * (each / (64 * KiB)) + 1);
    CHECK(swap.poll());
    CHECK(swap.verified_bytes() == 2 * n * each);
  }
}

TEST_CASE("Swap files never share a name, and one destroyed mid-transfer waits, then goes", "[offload][disk]") {
  TempDir dir;
  {
    DiskSwap a(MiB, options_in(dir.path)), b(MiB, options_in(dir.path));  // same rank, same directory
    CHECK(a.path() != b.path());
    CHECK(dir.files() == 2);
    auto big = std::make_unique<DiskSwap>(64 * MiB, options_in(dir.path, MiB, 4));
    const auto data = random_bytes(64 * MiB, 9);
    big->write(0, data.data(), 64 * MiB);  // not waited for
    CHECK_FALSE(big->poll());              // still under way (64 requests, 4 at a time)
    big.reset();                           // waits out the 4 with the kernel before `data` goes
    CHECK(dir.files() == 2);
  }
  CHECK(dir.files() == 0);
}

TEST_CASE("Misaligned, out-of-range and conflicting requests are refused", "[offload][disk]") {
  TempDir dir;
  DiskSwap swap(MiB, options_in(dir.path));
  AlignedBuffer<unsigned char> buf(256 * KiB);
  REQUIRE_THROWS_WITH(swap.write(100, buf.data(), 4096), Catch::Contains("must each be a multiple of 4096"));
  REQUIRE_THROWS_WITH(swap.write(0, buf.data() + 8, 4096), Catch::Contains("must each be a multiple of 4096"));
  REQUIRE_THROWS_WITH(swap.read(0, buf.data(), 4000), Catch::Contains("must each be a multiple of 4096"));
  REQUIRE_THROWS_WITH(swap.read(MiB - 4096, buf.data(), 8192), Catch::Contains("runs past the end of " + swap.path()));
  const Ticket w = swap.write(0, buf.data(), 256 * KiB);
  if (!swap.done(w))
    REQUIRE_THROWS_WITH(swap.read(128 * KiB, buf.data(), 4096), Catch::Contains("overlaps a write still in flight"));
  swap.wait(w);
  CHECK(swap.done(Ticket{}));
  CHECK_FALSE(swap.failed());  // bad arguments do not put the swap out of use
}

TEST_CASE("O_DIRECT is used where the filesystem allows it", "[offload][disk]") {
  TempDir tmp;
  struct statfs fs {};
  REQUIRE(::statfs(tmp.path.c_str(), &fs) == 0);
  DiskSwap swap(MiB, options_in(tmp.path));
  CHECK(swap.direct() == accepts_o_direct(tmp.path));
  if (accepts_o_direct(tmp.path)) CHECK((open_flags_of(swap.path()) & O_DIRECT) != 0);

  DiskOptions buffered = options_in(tmp.path);
  buffered.direct = false;
  DiskSwap plain(MiB, buffered);
  CHECK_FALSE(plain.direct());
  CHECK((open_flags_of(plain.path()) & O_DIRECT) == 0);

  // tmpfs: O_DIRECT since Linux 6.6, refused before; either way the swap works.
  if (std::filesystem::is_directory("/dev/shm")) {
    TempDir shm("/dev/shm");
    const bool kernel_accepts = accepts_o_direct(shm.path);
    DiskSwap on_tmpfs(MiB, options_in(shm.path));
    CHECK(on_tmpfs.direct() == kernel_accepts);
    const auto data = random_bytes(MiB, 7);
    AlignedBuffer<unsigned char> back(MiB);
    on_tmpfs.wait(on_tmpfs.write(0, data.data(), MiB));
    on_tmpfs.wait(on_tmpfs.read(0, back.data(), MiB));
    CHECK(std::memcmp(back.data(), data.data(), MiB) == 0);
  }
}

TEST_CASE("A file truncated underneath gives an IoError, then the swap refuses every call", "[offload][disk][fault]") {
  TempDir dir;
  DiskSwap swap(4 * MiB, options_in(dir.path));
  const auto data = random_bytes(2 * MiB, 1);
  swap.wait(swap.write(0, data.data(), 2 * MiB));
  REQUIRE(::truncate(swap.path().c_str(), static_cast<off_t>(MiB)) == 0);
  AlignedBuffer<unsigned char> back(2 * MiB);
  REQUIRE_THROWS_AS(swap.wait(swap.read(0, back.data(), 2 * MiB)), zero::IoError);
  CHECK(swap.failed());
  CHECK_THAT(swap.failure(), Catch::Contains("read of 2097152 bytes at byte offset 0 of " + swap.path()));
  CHECK_THAT(swap.failure(), Catch::Contains("the file is now 1048576 bytes instead of 4194304, so it was truncated"));
  CHECK_THAT(swap.failure(), Catch::Contains("What to do:"));
  // Every call now refuses, naming the first cause.
  for (int call = 0; call < 5; ++call) {
    try {
      switch (call) {
        case 0: swap.write(0, data.data(), 4096); break;
        case 1: swap.read(0, back.data(), 4096); break;
        case 2: swap.wait_all(); break;
        case 3: swap.poll(); break;
        default: swap.wait(Ticket{1}); break;
      }
      FAIL("call " << call << " did not throw");
    } catch (const zero::IoError& e) {
      CHECK_THAT(e.what(), Catch::Contains("failed earlier and refuses further reads and writes"));
      CHECK_THAT(e.what(), Catch::Contains("instead of 4194304"));
    }
  }
}

TEST_CASE("A file truncated while a read is queued ends the read early: an IoError", "[offload][disk][fault]") {
  TempDir dir;
  DiskSwap swap(4 * MiB, options_in(dir.path, MiB, 1));  // one request in flight, the others queued
  const auto data = random_bytes(4 * MiB, 4);
  swap.wait(swap.write(0, data.data(), 4 * MiB));
  AlignedBuffer<unsigned char> back(4 * MiB);
  const Ticket t = swap.read(0, back.data(), 4 * MiB);  // at most the first MiB is under way
  REQUIRE(::truncate(swap.path().c_str(), static_cast<off_t>(MiB)) == 0);
  try {
    swap.wait(t);
    FAIL("the truncated read went unnoticed");
  } catch (const zero::IoError& e) {
    CHECK_THAT(e.what(), Catch::Contains("read of 1048576 bytes at byte offset 1048576 of " + swap.path()));
    CHECK_THAT(e.what(), Catch::Contains("the read ended early (0 bytes), so the file was truncated"));
  }
  CHECK(swap.failed());
}

TEST_CASE("Bytes changed underneath fail their checksum, naming the piece", "[offload][disk][fault]") {
  TempDir dir;
  DiskSwap swap(4 * MiB, options_in(dir.path, MiB));
  const auto data = random_bytes(3 * MiB, 2);
  swap.wait(swap.write(0, data.data(), 3 * MiB));
  // Another program flips one byte inside the second piece.
  const int fd = ::open(swap.path().c_str(), O_WRONLY);
  REQUIRE(fd >= 0);
  const unsigned char flipped = static_cast<unsigned char>(data[MiB + 777] ^ 0x40);
  REQUIRE(::pwrite(fd, &flipped, 1, static_cast<off_t>(MiB + 777)) == 1);
  ::close(fd);

  AlignedBuffer<unsigned char> back(3 * MiB);
  swap.wait(swap.read(0, back.data(), MiB));  // the first piece is intact
  try {
    swap.wait(swap.read(0, back.data(), 3 * MiB));
    FAIL("the changed byte went unnoticed");
  } catch (const zero::IoError& e) {
    CHECK_THAT(e.what(), Catch::Contains("read of 1048576 bytes at byte offset 1048576 of " + swap.path()));
    CHECK_THAT(e.what(), Catch::Contains("differ from those written there"));
  }
  CHECK(swap.failed());
  REQUIRE_THROWS_WITH(swap.read(0, back.data(), 4096), Catch::Contains("failed earlier"));
}

TEST_CASE("A swap file removed or replaced underneath is noticed and not removed later", "[offload][disk][fault]") {
  TempDir dir;
  std::string path;
  {
    DiskSwap swap(MiB, options_in(dir.path));
    path = swap.path();
    AlignedBuffer<unsigned char> buf(MiB);
    swap.wait(swap.write(0, buf.data(), MiB));
    std::ofstream(dir.path + "/other") << "someone else's file";
    std::filesystem::rename(dir.path + "/other", path);
    REQUIRE_THROWS_WITH(swap.read(0, buf.data(), MiB), Catch::Contains("removed or replaced") &&
                                                          Catch::Contains(path) && Catch::Contains("byte offset 0"));
  }
  CHECK(std::filesystem::exists(path));  // the other file is left alone
}

TEST_CASE("A file-size limit gives EFBIG errors, not SIGXFSZ", "[offload][disk][fault]") {
  TempDir dir;
  const DiskOptions o = options_in(dir.path, 256 * KiB, 4);
  auto limit_file_size = [](std::size_t bytes) {
    const rlimit r{bytes, bytes};
    return ::setrlimit(RLIMIT_FSIZE, &r) == 0;
  };
  // Below the swap's size from the start: the preallocation fails.
  const std::string at_start = in_child([&]() -> std::string {
    if (!limit_file_size(512 * KiB)) return "setrlimit failed";
    try {
      DiskSwap swap(2 * MiB, o);
      return "no error";
    } catch (const zero::IoError& e) {
      return e.what();
    }
  });
  CHECK_THAT(at_start, Catch::Contains("preallocation of 2097152 bytes at byte offset 0 of " + dir.path +
                                       "/zero-swap-r0-"));
  CHECK_THAT(at_start, Catch::Contains("File too large") && Catch::Contains("ulimit -f"));

  // Lowered after the file exists: the write past the limit fails. One
  // request in flight, so the pieces go in order.
  // Both with O_DIRECT and buffered (where io_uring hands writes to its
  // worker threads, which the signal and the limit reach too).
  for (const bool direct : {true, false}) {
    const std::string mid_run = in_child([&]() -> std::string {
      try {
        DiskOptions one_at_a_time = options_in(dir.path, 256 * KiB, 1);
        one_at_a_time.direct = direct;
        DiskSwap swap(2 * MiB, one_at_a_time);
        const auto data = random_bytes(2 * MiB, 3);
        if (!limit_file_size(MiB + 128 * KiB)) return "setrlimit failed";  // inside the fifth piece
        swap.wait(swap.write(0, data.data(), 2 * MiB));
        return "no error";
      } catch (const zero::IoError& e) {
        return e.what();
      }
    });
    // The piece at 1 MiB is written short (128 KiB); its remainder, asked
    // for again, is what fails.
    INFO("direct " << direct);
    CHECK_THAT(mid_run, Catch::Contains("write of 131072 bytes at byte offset 1179648 of " + dir.path));
    CHECK_THAT(mid_run, Catch::Contains("File too large"));
  }
  CHECK(dir.files() == 0);  // the children removed their files
}

TEST_CASE("A full disk fails at construction and leaves no file", "[offload][disk][fault]") {
  struct statvfs vfs {};
  if (!std::filesystem::is_directory("/dev/shm") || ::statvfs("/dev/shm", &vfs) != 0) return;
  TempDir shm("/dev/shm");
  // More than the tmpfs can hold: refused at once, before anything is allocated.
  const std::size_t too_big = static_cast<std::size_t>(vfs.f_blocks) * vfs.f_frsize + 64 * MiB;
  REQUIRE_THROWS_WITH(DiskSwap(too_big, options_in(shm.path)),
                      Catch::Contains("preallocation of") && Catch::Contains(shm.path + "/zero-swap-r0-") &&
                          Catch::Contains("No space left on device") && Catch::Contains("free space"));
  CHECK(shm.files() == 0);
}

TEST_CASE("A missing or unwritable directory is named at construction", "[offload][disk][fault]") {
  TempDir dir;
  REQUIRE_THROWS_WITH(DiskSwap(MiB, options_in(dir.path + "/missing")),
                      Catch::Contains("swap directory " + dir.path + "/missing cannot be used") &&
                          Catch::Contains("No such file or directory") && Catch::Contains("mkdir -p"));
  std::ofstream(dir.path + "/plain") << "x";
  REQUIRE_THROWS_WITH(DiskSwap(MiB, options_in(dir.path + "/plain")),
                      Catch::Contains(dir.path + "/plain is not a directory"));
  REQUIRE_THROWS_WITH(DiskSwap(MiB, options_in(dir.path + "/plain/sub")),
                      Catch::Contains(dir.path + "/plain/sub cannot be used") && Catch::Contains("Not a directory"));
  // Unwritable even for root: /proc takes no new files.
  REQUIRE_THROWS_WITH(DiskSwap(MiB, options_in("/proc")),
                      Catch::Contains("cannot create the swap file /proc/zero-swap-r0-") &&
                          Catch::Contains("DiskOptions::directory"));
  REQUIRE_THROWS_AS(DiskSwap(MiB, options_in("/proc")), zero::IoError);
}
