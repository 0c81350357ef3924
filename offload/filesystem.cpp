// Filesystem facts for offload/; see filesystem.h.
#include "offload/filesystem.h"

#include <sys/statfs.h>
#include <sys/statvfs.h>

#include <cerrno>
#include <cstdio>

namespace zeroshard {
namespace {

// Magic numbers from linux/magic.h (not every libc header set has them all).
constexpr long kTmpfs = 0x01021994;
constexpr long kRamfs = 0x858458f6;

struct NamedMagic {
  long magic;
  const char* name;
};
constexpr NamedMagic kKnown[] = {
    {0xEF53, "ext4"},       {0x58465342, "xfs"},      {0x9123683E, "btrfs"},  {kTmpfs, "tmpfs"},
    {kRamfs, "ramfs"},      {0x6969, "nfs"},          {0xFF534D42, "cifs"},   {0xFE534D42, "smb2"},
    {0x65735546, "fuse"},   {0x01021997, "9p"},       {0x794c7630, "overlay"}, {0x2FC12FC1, "zfs"},
    {0x0BD00BD0, "lustre"}, {0x47504653, "gpfs"},     {0x19830326, "beegfs"},
};

long magic_of(const std::string& path) {
  struct statfs st {};
  if (statfs(path.c_str(), &st) != 0) return -1;
  return static_cast<long>(st.f_type);
}

}  // namespace

std::string filesystem_type(const std::string& path) {
  const long magic = magic_of(path);
  if (magic == -1) return "unknown";
  for (const NamedMagic& known : kKnown) {
    if (known.magic == magic) return known.name;
  }
  char hex[32];
  std::snprintf(hex, sizeof(hex), "type 0x%lx", static_cast<unsigned long>(magic));
  return hex;
}

bool filesystem_in_memory(const std::string& path) {
  const long magic = magic_of(path);
  return magic == kTmpfs || magic == kRamfs;
}

int64_t filesystem_available_bytes(const std::string& path) {
  struct statvfs st {};
  if (statvfs(path.c_str(), &st) != 0) return -errno;
  return static_cast<int64_t>(st.f_bavail) * static_cast<int64_t>(st.f_frsize);
}

}  // namespace zeroshard
