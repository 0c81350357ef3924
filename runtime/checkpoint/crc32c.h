// CRC32C (Castagnoli, the polynomial of iSCSI, ext4 and safetensors tooling): the checksum a
// checkpoint stores per tensor and per file. Hardware (SSE4.2) where the CPU has it, chosen at
// run time; a table-driven software version everywhere, also the reference the tests compare to.
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace zeroshard::checkpoint {

// Extends `crc` (0 to start) with `num_bytes` bytes: crc32c(a+b) == crc32c_extend(crc32c(a), b).
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t num_bytes);
inline uint32_t crc32c(const void* data, size_t num_bytes) { return crc32c_extend(0, data, num_bytes); }
// The same value computed with the tables only (the reference for the hardware path).
uint32_t crc32c_extend_software(uint32_t crc, const void* data, size_t num_bytes);
// Whether crc32c_extend uses the CPU's crc32 instruction.
bool crc32c_is_hardware();

// How the manifest spells a checksum: 8 lowercase hex digits ("e3069283").
std::string crc32c_to_hex(uint32_t crc);
// The inverse; nullopt unless `text` is exactly 8 hex digits.
std::optional<uint32_t> crc32c_from_hex(const std::string& text);

}  // namespace zeroshard::checkpoint
