// The NVMe I/O engine (offload/aio_engine.cpp and its backends): real O_DIRECT files under /tmp,
// every case run for each backend that was built (io_uring and libaio, each forced) and over a
// list of queue shapes.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "offload/aio_engine.h"
#include "offload_helpers.h"

using namespace zeroshard;
using zs_test::AlignedBuffer;
using zs_test::TempDir;

namespace {

constexpr int64_t kPage = kDirectAlignment;

std::vector<std::string> built_backends() {
  std::vector<std::string> names;
#ifdef ZEROSHARD_HAVE_URING
  names.push_back("io_uring");
#endif
#ifdef ZEROSHARD_HAVE_LIBAIO
  names.push_back("libaio");
#endif
  return names;
}

// An engine on `backend`, or none when the kernel refuses it here (a seccomp policy can forbid
// io_uring): said in the output, so a skipped backend is seen.
std::unique_ptr<AioEngine> engine_on(const std::string& backend, AioOptions options) {
  options.backend = backend;
  try {
    return std::make_unique<AioEngine>(options);
  } catch (const UsageError&) {
    throw;
  } catch (const Error& e) {
    WARN("backend " << backend << " cannot run here, its cases are skipped: " << e.what());
    return nullptr;
  }
}

// Queue shapes every data case runs under: blocks small enough that a request is many blocks.
struct Shape {
  const char* name;
  int64_t block_size;
  int64_t queue_depth;
  int64_t intra_op_parallelism;
  bool single_submit;
  bool overlap_events;
};
const Shape kShapes[] = {
    {"1 worker, depth 8", 4 * kPage, 8, 1, false, true},
    {"3 workers, depth 4", 4 * kPage, 4, 3, false, true},
    {"single submit", 2 * kPage, 4, 1, true, true},
    {"3 workers, no overlap", 2 * kPage, 2, 3, false, false},
    {"depth 1, 2 workers", 3 * kPage, 1, 2, true, false},
};

AioOptions options_of(const Shape& s) {
  AioOptions o;
  o.block_size = s.block_size;
  o.queue_depth = s.queue_depth;
  o.intra_op_parallelism = s.intra_op_parallelism;
  o.single_submit = s.single_submit;
  o.overlap_events = s.overlap_events;
  return o;
}

// Runs `body(engine, shape)` for every built backend and every shape.
template <typename Body>
void for_each_engine(Body body) {
  for (const std::string& backend : built_backends()) {
    for (const Shape& shape : kShapes) {
      INFO("backend " << backend << ", " << shape.name);
      auto engine = engine_on(backend, options_of(shape));
      if (!engine) break;
      REQUIRE(engine->backend() == backend);
      body(*engine, shape);
    }
  }
}

// The IoError of a request, or an empty string when it succeeded.
std::string error_of(const AioEngine::Handle& h) {
  try {
    AioEngine::wait(h);
  } catch (const IoError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("at least one backend is built, or constructing an engine says how to get one", "[aio]") {
  if (built_backends().empty()) {
    REQUIRE_THROWS_WITH(AioEngine(AioOptions{}),
                        Catch::Contains("built without io_uring or libaio") && Catch::Contains("liburing-dev"));
    return;
  }
  AioEngine engine{AioOptions{}};
  INFO(engine.backend_reason());
  CHECK((engine.backend() == "io_uring" || engine.backend() == "libaio"));
  CHECK(engine.backend_reason().rfind(engine.backend() + ": ", 0) == 0);
}

#if defined(ZEROSHARD_HAVE_URING) && defined(ZEROSHARD_HAVE_LIBAIO)
TEST_CASE("auto falls back to libaio, saying why, where io_uring is refused", "[aio]") {
  // A child process forbids io_uring_setup with a seccomp filter, as a container runtime's default
  // policy can, and reports what the engine chose.
  int out[2];
  REQUIRE(pipe(out) == 0);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::close(out[0]);
    sock_filter filter[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    sock_fprog program{static_cast<unsigned short>(sizeof(filter) / sizeof(filter[0])), filter};
    std::string report;
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program) != 0) {
      report = "seccomp unavailable";
    } else {
      AioEngine automatic{AioOptions{}};
      report = automatic.backend() + "|" + automatic.backend_reason() + "|";
      AioOptions forced;
      forced.backend = "io_uring";
      try {
        AioEngine engine(forced);
      } catch (const Error& e) {
        report += e.what();
      }
    }
    (void)!::write(out[1], report.data(), report.size());
    _exit(0);
  }
  ::close(out[1]);
  std::string report;
  char chunk[512];
  for (ssize_t n; (n = ::read(out[0], chunk, sizeof(chunk))) > 0;) report.append(chunk, static_cast<size_t>(n));
  ::close(out[0]);
  int status = 0;
  waitpid(child, &status, 0);
  if (report == "seccomp unavailable") {
    WARN("the io_uring fallback case is skipped: seccomp filters cannot be installed here");
    return;
  }
  CHECK_THAT(report, Catch::StartsWith("libaio|libaio: io_uring_queue_init failed: Operation not permitted"));
  CHECK_THAT(report, Catch::Contains("|AioOptions::backend = \"io_uring\" cannot run here: io_uring_queue_init failed: "
                                     "Operation not permitted"));
}
#endif

TEST_CASE("written bytes read back, for requests of whole, partial and sub-block sizes", "[aio]") {
  for_each_engine([](AioEngine& engine, const Shape& shape) {
    TempDir dir;
    DirectFile file(dir.file("swap"), /*create=*/true);
    const int64_t b = shape.block_size;
    const std::vector<int64_t> sizes = {3 * b + kPage, kPage, b, 5 * b, b + kPage};
    int64_t offset = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      INFO("request of " << sizes[i] << " bytes at offset " << offset);
      AlignedBuffer out(sizes[i]);
      AlignedBuffer in(sizes[i]);
      out.fill(static_cast<uint32_t>(i + 1));
      AioEngine::wait(engine.write(file, out.data, out.bytes, offset));
      AioEngine::wait(engine.read(file, in.data, in.bytes, offset));
      CHECK(in.same_as(out));
      offset += sizes[i] + kPage;  // a gap: a block written one page off would land in it
    }
  });
}

TEST_CASE("64 requests of mixed sizes in flight at once, waited in reverse order", "[aio]") {
  for_each_engine([](AioEngine& engine, const Shape& shape) {
    TempDir dir;
    DirectFile file(dir.file("swap"), true);
    constexpr int kRequests = 64;
    std::vector<std::unique_ptr<AlignedBuffer>> out, in;
    std::vector<int64_t> offsets;
    int64_t offset = 0;
    for (int i = 0; i < kRequests; ++i) {
      const int64_t bytes = (1 + (i * 7) % 11) * kPage + (i % 3) * shape.block_size;
      out.push_back(std::make_unique<AlignedBuffer>(bytes));
      in.push_back(std::make_unique<AlignedBuffer>(bytes));
      out.back()->fill(static_cast<uint32_t>(100 + i));
      offsets.push_back(offset);
      offset += bytes;
    }
    file.preallocate(offset);
    std::vector<AioEngine::Handle> writes, reads;
    for (int i = 0; i < kRequests; ++i) writes.push_back(engine.write(file, out[i]->data, out[i]->bytes, offsets[i]));
    for (int i = kRequests - 1; i >= 0; --i) AioEngine::wait(writes[i]);
    for (int i = 0; i < kRequests; ++i) reads.push_back(engine.read(file, in[i]->data, in[i]->bytes, offsets[i]));
    for (int i = kRequests - 1; i >= 0; --i) AioEngine::wait(reads[i]);
    for (int i = 0; i < kRequests; ++i) {
      INFO("request " << i << " at offset " << offsets[i]);
      CHECK(in[i]->same_as(*out[i]));
    }
  });
}

TEST_CASE("a read after a write of the same region sees the new bytes", "[aio]") {
  for_each_engine([](AioEngine& engine, const Shape& shape) {
    TempDir dir;
    DirectFile file(dir.file("swap"), true);
    const int64_t bytes = 2 * shape.block_size + kPage;
    AlignedBuffer first(bytes), second(bytes), in(bytes);
    first.fill(1);
    second.fill(2);
    AioEngine::wait(engine.write(file, first.data, bytes, kPage));
    AioEngine::wait(engine.read(file, in.data, bytes, kPage));
    CHECK(in.same_as(first));
    AioEngine::wait(engine.write(file, second.data, bytes, kPage));
    AioEngine::wait(engine.read(file, in.data, bytes, kPage));
    CHECK(in.same_as(second));
  });
}

TEST_CASE("requests from several threads at once", "[aio]") {
  for_each_engine([](AioEngine& engine, const Shape& shape) {
    TempDir dir;
    DirectFile file(dir.file("swap"), true);
    constexpr int kThreads = 4;
    const int64_t bytes = 3 * shape.block_size;
    file.preallocate(kThreads * bytes);
    std::vector<int> mismatches(kThreads, 0);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        AlignedBuffer out(bytes), in(bytes);
        for (int round = 0; round < 8; ++round) {
          out.fill(static_cast<uint32_t>(t * 100 + round));
          AioEngine::wait(engine.write(file, out.data, bytes, t * bytes));
          AioEngine::wait(engine.read(file, in.data, bytes, t * bytes));
          if (!in.same_as(out)) ++mismatches[t];
        }
      });
    }
    for (auto& th : threads) th.join();
    CHECK(mismatches == std::vector<int>(kThreads, 0));
  });
}

TEST_CASE("I/O runs while the caller does other work", "[aio]") {
  for (const std::string& backend : built_backends()) {
    INFO("backend " << backend);
    auto engine = engine_on(backend, AioOptions{});
    if (!engine) continue;
    TempDir dir;
    DirectFile file(dir.file("swap"), true);
    AlignedBuffer out(8 << 20);
    out.fill(3);
    auto h = engine->write(file, out.data, out.bytes, 0);
    // The workers finish the write without the caller in wait(): its last block shows up in the
    // file through an ordinary read (polled; the 30 s bound is for a hang, not a timing).
    const int fd = ::open(dir.file("swap").c_str(), O_RDONLY);
    REQUIRE(fd >= 0);
    std::vector<char> tail(4096);
    bool landed = false;
    for (int i = 0; i < 3000 && !landed; ++i) {
      landed = ::pread(fd, tail.data(), tail.size(), out.bytes - 4096) == 4096 &&
               std::memcmp(tail.data(), out.data + out.bytes - 4096, tail.size()) == 0;
      if (!landed) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ::close(fd);
    CHECK(landed);
    AioEngine::wait(h);
  }
}

TEST_CASE("an injected fault is an IoError naming the operation, file, block and request", "[aio]") {
  struct FaultCase {
    AioFault::Kind kind;
    bool on_write;
    const char* op;
    const char* reason;
  };
  const FaultCase cases[] = {
      {AioFault::Kind::eio, false, "read ", "Input/output error"},
      {AioFault::Kind::eio, true, "write ", "Input/output error"},
      {AioFault::Kind::short_transfer, false, "read ", "short read: got 4096 of 8192 bytes"},
      {AioFault::Kind::short_transfer, true, "write ", "short write: wrote 4096 of 8192 bytes"},
  };
  for (const std::string& backend : built_backends()) {
    for (const FaultCase& c : cases) {
      for (int64_t workers : {1, 3}) {
        INFO("backend " << backend << ", " << c.op << c.reason << ", " << workers << " workers");
        AioOptions o;
        o.block_size = 2 * kPage;
        o.queue_depth = 4;
        o.intra_op_parallelism = workers;
        auto engine = engine_on(backend, o);
        if (!engine) break;
        TempDir dir;
        DirectFile file(dir.file("swap"), true);
        AlignedBuffer buf(3 * o.block_size);  // blocks at 16384, 24576, 32768 of the request at 16384
        buf.fill(9);
        file.preallocate(16 * kPage);
        // The 5th block of the kind: the 2nd block of the second request.
        engine->inject_fault(AioFault{c.kind, c.on_write, 5});
        auto run = [&](int64_t offset) {
          return c.on_write ? engine->write(file, buf.data, buf.bytes, offset)
                            : engine->read(file, buf.data, buf.bytes, offset);
        };
        CHECK(error_of(run(0)).empty());
        const std::string what = error_of(run(4 * kPage));
        CHECK_THAT(what, Catch::StartsWith(std::string(c.op) + file.path()));
        CHECK_THAT(what, Catch::Contains("block at offset 24576 (8192 bytes)"));
        CHECK_THAT(what, Catch::Contains("request at offset 16384 (24576 bytes)"));
        CHECK_THAT(what, Catch::Contains(c.reason));
        CHECK_THAT(what, Catch::Contains("injected"));
        // One fault only: the engine goes on working.
        CHECK(error_of(run(4 * kPage)).empty());
      }
    }
  }
}

TEST_CASE("ZEROSHARD_NVME_FAULT arms a fault at construction; a malformed value is a UsageError", "[aio]") {
  const std::vector<std::string> backends = built_backends();
  if (backends.empty()) return;
  struct ScopedFaultEnv {
    explicit ScopedFaultEnv(const char* v) { setenv("ZEROSHARD_NVME_FAULT", v, 1); }
    ~ScopedFaultEnv() { unsetenv("ZEROSHARD_NVME_FAULT"); }
  };
  for (const char* bad :
       {"eio", "eio:read", "boom:read:1", "eio:append:1", "eio:read:0", "eio:read:x", "eio:read:-1"}) {
    INFO(bad);
    ScopedFaultEnv env(bad);
    REQUIRE_THROWS_MATCHES(AioEngine(AioOptions{}), UsageError,
                           Catch::Matchers::Predicate<UsageError>([](const UsageError& e) {
                             const std::string w = e.what();
                             return w.find("ZEROSHARD_NVME_FAULT") != std::string::npos &&
                                    w.find("<eio|short>:<read|write>:<n>") != std::string::npos;
                           }));
  }
  ScopedFaultEnv env("eio:write:2");
  AioOptions o;
  o.block_size = kPage;
  AioEngine engine(o);
  TempDir dir;
  DirectFile file(dir.file("swap"), true);
  AlignedBuffer buf(2 * kPage);
  const std::string what = error_of(engine.write(file, buf.data, buf.bytes, 0));
  CHECK_THAT(what, Catch::Contains("write " + file.path() + ": block at offset 4096 (4096 bytes)"));
  CHECK_THAT(what, Catch::Contains("Input/output error"));
  CHECK(error_of(engine.read(file, buf.data, buf.bytes, 0)).empty());
}

TEST_CASE("reading past the end of a file is a short read", "[aio]") {
  for (const std::string& backend : built_backends()) {
    INFO("backend " << backend);
    AioOptions o;
    o.block_size = 4 * kPage;
    auto engine = engine_on(backend, o);
    if (!engine) continue;
    TempDir dir;
    DirectFile file(dir.file("swap"), true);
    AlignedBuffer buf(4 * kPage);
    buf.fill(1);
    AioEngine::wait(engine->write(file, buf.data, 2 * kPage, 0));  // the file is 8192 bytes
    std::string what = error_of(engine->read(file, buf.data, buf.bytes, 0));
    CHECK_THAT(what, Catch::StartsWith("read " + file.path() + ": block at offset 0 (16384 bytes)"));
    CHECK_THAT(what, Catch::Contains("short read: got 8192 of 16384 bytes, the file may have been truncated"));
    what = error_of(engine->read(file, buf.data, buf.bytes, 8 * kPage));
    CHECK_THAT(what, Catch::Contains("block at offset 32768 (16384 bytes)"));
    CHECK_THAT(what, Catch::Contains("short read: got 0 of 16384 bytes"));
  }
}

TEST_CASE("misaligned buffers, offsets and sizes are refused before any I/O", "[aio]") {
  for (const std::string& backend : built_backends()) {
    INFO("backend " << backend);
    auto engine = engine_on(backend, AioOptions{});
    if (!engine) continue;
    TempDir dir;
    DirectFile file(dir.file("swap"), true);
    AlignedBuffer buf(4 * kPage);
    CHECK_THROWS_WITH(engine->read(file, buf.data + 512, kPage, 0), Catch::Contains("must be aligned to 4096"));
    CHECK_THROWS_WITH(engine->write(file, buf.data, kPage, 512),
                      Catch::Contains("offset must be a non-negative multiple of 4096 (O_DIRECT), got 512"));
    CHECK_THROWS_WITH(engine->write(file, buf.data, 1000, 0),
                      Catch::Contains("bytes must be a positive multiple of 4096"));
    CHECK_THROWS_AS(engine->read(file, buf.data, 0, 0), UsageError);
    CHECK_THROWS_AS(engine->read(file, buf.data, kPage, -kPage), UsageError);
    CHECK_THROWS_AS(AioEngine::wait(nullptr), UsageError);
  }
}

TEST_CASE("bad options are UsageErrors naming the setting", "[aio]") {
  auto with = [](auto change) {
    AioOptions o;
    change(o);
    return o;
  };
  CHECK_THROWS_WITH(AioEngine(with([](AioOptions& o) { o.block_size = 1000; })),
                    Catch::StartsWith("aio.block_size: got 1000"));
  CHECK_THROWS_WITH(AioEngine(with([](AioOptions& o) { o.queue_depth = 0; })),
                    Catch::StartsWith("aio.queue_depth: got 0"));
  CHECK_THROWS_WITH(AioEngine(with([](AioOptions& o) { o.intra_op_parallelism = 0; })),
                    Catch::StartsWith("aio.intra_op_parallelism: got 0"));
  CHECK_THROWS_WITH(AioEngine(with([](AioOptions& o) { o.backend = "spdk"; })),
                    Catch::Contains("expected one of auto, io_uring, libaio"));
}

TEST_CASE("the destructor drains requests nobody waited for, failed ones included", "[aio]") {
  for (const std::string& backend : built_backends()) {
    INFO("backend " << backend);
    TempDir dir;
    DirectFile file(dir.file("swap"), true);
    AlignedBuffer buf(64 * kPage);
    buf.fill(5);
    std::vector<AioEngine::Handle> handles;
    {
      AioOptions o;
      o.block_size = 2 * kPage;
      o.queue_depth = 2;
      o.intra_op_parallelism = 2;
      auto engine = engine_on(backend, o);
      if (!engine) continue;
      engine->inject_fault(AioFault{AioFault::Kind::eio, true, 3});
      for (int i = 0; i < 16; ++i) handles.push_back(engine->write(file, buf.data, buf.bytes, i * buf.bytes));
    }  // returns only once all 512 blocks are done
    int failed = 0;
    for (auto& h : handles) failed += error_of(h).empty() ? 0 : 1;
    CHECK(failed == 1);
  }
}

TEST_CASE("DirectFile names the file it cannot open or preallocate", "[aio]") {
  TempDir dir;
  CHECK_THROWS_AS(DirectFile(dir.file("missing"), /*create=*/false), IoError);
  CHECK_THROWS_WITH(DirectFile(dir.file("missing"), false),
                    Catch::Contains(dir.file("missing")) && Catch::Contains("No such file or directory"));
  {
    DirectFile file(dir.file("made"), true);
    file.preallocate(8 * kPage);
    CHECK(zs_test::fs::file_size(file.path()) == 8 * kPage);
  }
  // A full disk, on a 1 MiB tmpfs so that nothing real fills up (this kernel takes O_DIRECT there).
  zs_test::ScopedMount small(dir.path / "small", "tmpfs", 0, "size=1m");
  if (!small.mounted) {
    WARN("the ENOSPC case is skipped: " << small.error);
    return;
  }
  std::optional<DirectFile> file;
  try {
    file.emplace((small.target / "swap").string(), true);
  } catch (const IoError& e) {
    WARN("the ENOSPC case is skipped (this kernel refuses O_DIRECT on tmpfs): " << e.what());
    return;
  }
  CHECK_THROWS_WITH(file->preallocate(int64_t{64} << 20),
                    Catch::Contains(file->path()) && Catch::Contains("67108864 bytes asked") &&
                        Catch::Contains("bytes available") && Catch::Contains("No space left on device"));
}
