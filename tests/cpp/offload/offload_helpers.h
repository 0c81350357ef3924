// Shared by the tests/cpp/offload/ binaries: a scratch directory on the real disk (/tmp is ext4
// here, and O_DIRECT needs a real filesystem), page-aligned buffers, and scoped mounts for the
// cases that need another filesystem (read-only, tmpfs, a tiny one to fill).
#pragma once
#include <stdlib.h>
#include <sys/mount.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>

#include "offload/aio_engine.h"

namespace zs_test {

namespace fs = std::filesystem;

// A fresh directory under /tmp, removed with its contents at scope exit.
struct TempDir {
  fs::path path;
  TempDir() {
    char name[] = "/tmp/zs-offload-test-XXXXXX";
    if (::mkdtemp(name) == nullptr) throw std::runtime_error("mkdtemp failed");
    path = name;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

// kDirectAlignment-aligned bytes, as O_DIRECT wants them.
struct AlignedBuffer {
  uint8_t* data = nullptr;
  int64_t bytes = 0;
  explicit AlignedBuffer(int64_t n) : bytes(n) {
    void* p = nullptr;
    if (posix_memalign(&p, zeroshard::kDirectAlignment, static_cast<size_t>(n)) != 0) throw std::bad_alloc();
    data = static_cast<uint8_t*>(p);
    std::memset(data, 0, static_cast<size_t>(n));
  }
  ~AlignedBuffer() { std::free(data); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  // Contents that differ by `seed` and by position, so a block landing in the wrong place shows.
  void fill(uint32_t seed) {
    for (int64_t i = 0; i < bytes; ++i) data[i] = static_cast<uint8_t>((i * 131 + (i >> 12) * 7 + seed * 17) & 0xff);
  }
  bool same_as(const AlignedBuffer& other) const {
    return bytes == other.bytes && std::memcmp(data, other.data, static_cast<size_t>(bytes)) == 0;
  }
};

// A filesystem mounted for one test and detached at scope exit. Mounting needs CAP_SYS_ADMIN
// (root here); `error` says why when it could not, and the test names the case it skips.
struct ScopedMount {
  fs::path target;
  bool mounted = false;
  std::string error;
  ScopedMount(const fs::path& where, const char* type, unsigned long flags, const char* options) : target(where) {
    fs::create_directories(where);
    if (::mount(type, where.c_str(), type, flags, options) == 0) mounted = true;
    else error = std::string("mount -t ") + type + " " + where.string() + ": " + std::strerror(errno);
  }
  ~ScopedMount() {
    if (mounted) ::umount2(target.c_str(), MNT_DETACH);
  }
  ScopedMount(const ScopedMount&) = delete;
  ScopedMount& operator=(const ScopedMount&) = delete;
};

}  // namespace zs_test
