// CRC32C (runtime/checkpoint/crc32c.cpp): the published check values, the hardware path against
// the table-driven reference at every length and alignment, and the manifest's hex spelling.
#include <catch2/catch.hpp>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "runtime/checkpoint/crc32c.h"

using namespace zeroshard::checkpoint;

TEST_CASE("crc32c gives the published check values") {
  struct Vector {
    std::vector<unsigned char> bytes;
    uint32_t crc;
  };
  std::vector<unsigned char> ascending(32), descending(32);
  for (int i = 0; i < 32; ++i) {
    ascending[size_t(i)] = static_cast<unsigned char>(i);
    descending[size_t(i)] = static_cast<unsigned char>(31 - i);
  }
  const std::string check = "123456789";
  // "123456789" is the CRC catalogue's check value; the 32-byte ones are RFC 3720, appendix B.4.
  const std::vector<Vector> vectors = {
      {std::vector<unsigned char>(check.begin(), check.end()), 0xE3069283u},
      {{}, 0x00000000u},
      {std::vector<unsigned char>(32, 0x00), 0x8A9136AAu},
      {std::vector<unsigned char>(32, 0xFF), 0x62A8AB43u},
      {ascending, 0x46DD794Eu},
      {descending, 0x113FDB5Cu},
  };
  for (const auto& v : vectors) {
    INFO("bytes: " << v.bytes.size());
    REQUIRE(crc32c(v.bytes.data(), v.bytes.size()) == v.crc);
    REQUIRE(crc32c_extend_software(0, v.bytes.data(), v.bytes.size()) == v.crc);
  }
}

TEST_CASE("crc32c: the fast path equals the reference at every length and alignment, and extends") {
  std::mt19937 rng(7);
  std::vector<unsigned char> data(4096 + 16);
  for (auto& b : data) b = static_cast<unsigned char>(rng());
  INFO("hardware path: " << crc32c_is_hardware());
  for (size_t offset = 0; offset < 9; ++offset) {
    for (size_t length : {size_t(0), size_t(1), size_t(7), size_t(8), size_t(9), size_t(63), size_t(4096)}) {
      const unsigned char* p = data.data() + offset;
      const uint32_t whole = crc32c(p, length);
      REQUIRE(whole == crc32c_extend_software(0, p, length));
      for (size_t split : {size_t(0), length / 3, length}) {
        REQUIRE(crc32c_extend(crc32c(p, split), p + split, length - split) == whole);
      }
    }
  }
}

TEST_CASE("crc32c: one flipped bit changes the checksum") {
  std::vector<unsigned char> data(1000, 0x5A);
  const uint32_t before = crc32c(data.data(), data.size());
  data[517] ^= 0x10;
  REQUIRE(crc32c(data.data(), data.size()) != before);
}

TEST_CASE("crc32c is spelled as 8 hex digits in the manifest") {
  REQUIRE(crc32c_to_hex(0xE3069283u) == "e3069283");
  REQUIRE(crc32c_to_hex(0x1u) == "00000001");
  REQUIRE(crc32c_from_hex("e3069283") == 0xE3069283u);
  REQUIRE(crc32c_from_hex("E3069283") == 0xE3069283u);
  REQUIRE_FALSE(crc32c_from_hex("e306928").has_value());
  REQUIRE_FALSE(crc32c_from_hex("e30692830").has_value());
  REQUIRE_FALSE(crc32c_from_hex("e306928g").has_value());
  REQUIRE_FALSE(crc32c_from_hex("").has_value());
}
