// What offload/ needs to know about the filesystem under a path: its kind (to explain an O_DIRECT
// refusal, and to refuse memory-backed ones) and its free space. Shared by DirectFile and SwapDir.
#pragma once
#include <cstdint>
#include <string>

namespace zeroshard {

// "ext4", "xfs", "tmpfs", ... or "type 0x<magic>" for one not listed; "unknown" when statfs fails.
std::string filesystem_type(const std::string& path);
// tmpfs or ramfs: files there live in host memory, which NVMe offload exists to free.
bool filesystem_in_memory(const std::string& path);
// Free bytes for an unprivileged writer (statvfs f_bavail * f_frsize); -errno when statvfs fails.
int64_t filesystem_available_bytes(const std::string& path);

}  // namespace zeroshard
