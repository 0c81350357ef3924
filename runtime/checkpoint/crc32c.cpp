// CRC32C: slicing-by-8 tables (software) and the SSE4.2 crc32 instruction, picked once per process.
#include "runtime/checkpoint/crc32c.h"

#include <array>
#include <cstdio>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace zeroshard::checkpoint {
namespace {

constexpr uint32_t kPolynomial = 0x82F63B78u;  // Castagnoli, bit-reflected

// tables[k][b]: the CRC of byte b followed by k zero bytes, so 8 bytes fold in one step.
struct Tables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  Tables() {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t crc = b;
      for (int i = 0; i < 8; ++i) crc = (crc >> 1) ^ ((crc & 1u) ? kPolynomial : 0u);
      t[0][b] = crc;
    }
    for (uint32_t b = 0; b < 256; ++b)
      for (size_t k = 1; k < 8; ++k) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFFu];
  }
};
const Tables& tables() {
  static const Tables instance;
  return instance;
}

uint32_t software(uint32_t crc, const unsigned char* p, size_t n) {
  const auto& t = tables().t;
  while (n >= 8) {
    uint32_t lo;
    uint32_t hi;
    std::memcpy(&lo, p, 4);  // little-endian loads: the tables are for the reflected CRC
    std::memcpy(&hi, p + 4, 4);
    lo ^= crc;
    crc = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
          t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xFFu];
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t hardware(uint32_t crc, const unsigned char* p, size_t n) {
  uint64_t c = crc;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
    p += 8;
    n -= 8;
  }
  auto c32 = static_cast<uint32_t>(c);
  while (n--) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}
bool has_hardware() {
  static const bool yes = __builtin_cpu_supports("sse4.2");
  return yes;
}
#else
uint32_t hardware(uint32_t crc, const unsigned char* p, size_t n) { return software(crc, p, n); }
bool has_hardware() { return false; }
#endif

}  // namespace

uint32_t crc32c_extend_software(uint32_t crc, const void* data, size_t num_bytes) {
  return ~software(~crc, static_cast<const unsigned char*>(data), num_bytes);
}

uint32_t crc32c_extend(uint32_t crc, const void* data, size_t num_bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  return ~(has_hardware() ? hardware(~crc, p, num_bytes) : software(~crc, p, num_bytes));
}

bool crc32c_is_hardware() { return has_hardware(); }

std::string crc32c_to_hex(uint32_t crc) {
  char text[9];
  std::snprintf(text, sizeof text, "%08x", crc);
  return text;
}

std::optional<uint32_t> crc32c_from_hex(const std::string& text) {
  if (text.size() != 8) return std::nullopt;
  uint32_t value = 0;
  for (char ch : text) {
    uint32_t digit;
    if (ch >= '0' && ch <= '9') digit = uint32_t(ch - '0');
    else if (ch >= 'a' && ch <= 'f') digit = uint32_t(ch - 'a' + 10);
    else if (ch >= 'A' && ch <= 'F') digit = uint32_t(ch - 'A' + 10);
    else return std::nullopt;
    value = (value << 4) | digit;
  }
  return value;
}

}  // namespace zeroshard::checkpoint
