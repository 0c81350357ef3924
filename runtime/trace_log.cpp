// See trace_log.h. A record: its Header, then the category, name and args bytes, padded to 8.
#include "runtime/trace_log.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "runtime/error.h"

namespace zeroshard::trace {

namespace {

struct Header {
  int64_t start_ns;
  int64_t duration_ns;
  int32_t track;
  uint32_t category_len;
  uint32_t name_len;
  uint32_t args_len;
  char phase;
};

size_t padded(size_t bytes) { return (bytes + 7) & ~size_t(7); }

size_t record_bytes(const Header& h) {
  return padded(sizeof(Header) + size_t(h.category_len) + h.name_len + h.args_len);
}

uint32_t length_of(std::string_view s, const char* what) {
  ZS_CHECK(s.size() <= UINT32_MAX, "trace: an event's ", what, " of ", s.size(), " bytes is over 4 GiB");
  return static_cast<uint32_t>(s.size());
}

}  // namespace

TraceLog::TraceLog(size_t chunk_bytes) : chunk_bytes_(chunk_bytes) {
  ZS_CHECK(chunk_bytes >= sizeof(Header), "TraceLog: chunk_bytes ", chunk_bytes, " is under one record");
}

TraceLog::~TraceLog() { clear(); }

int64_t TraceLog::mapped_bytes() const {
  int64_t total = 0;
  for (const Chunk& c : chunks_) total += static_cast<int64_t>(c.bytes);
  return total;
}

char* TraceLog::reserve(size_t bytes) {
  if (chunks_.empty() || chunks_.back().bytes - chunks_.back().used < bytes) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t size = (std::max(bytes, chunk_bytes_) + page - 1) / page * page;
    void* data = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ZS_CHECK(data != MAP_FAILED, "trace: mapping ", size, " bytes for events failed: ", std::strerror(errno));
    chunks_.push_back({static_cast<char*>(data), size, 0});
  }
  Chunk& chunk = chunks_.back();
  char* at = chunk.data + chunk.used;
  chunk.used += bytes;
  return at;
}

void TraceLog::append(char phase, std::string_view category, std::string_view name, int64_t start_ns,
                      int64_t duration_ns, int track, std::string_view args) {
  const Header h{start_ns, duration_ns, track, length_of(category, "category"), length_of(name, "name"),
                 length_of(args, "args"), phase};
  char* at = reserve(record_bytes(h));
  std::memcpy(at, &h, sizeof h);
  at += sizeof h;
  for (std::string_view s : {category, name, args}) {
    if (!s.empty()) std::memcpy(at, s.data(), s.size());
    at += s.size();
  }
  ++count_;
}

std::vector<Event> TraceLog::take() {
  std::vector<Event> out;
  out.reserve(static_cast<size_t>(count_));
  for (const Chunk& c : chunks_) {
    for (size_t off = 0; off < c.used;) {
      Header h;
      std::memcpy(&h, c.data + off, sizeof h);
      const char* s = c.data + off + sizeof h;
      Event e;
      e.phase = h.phase;
      e.category.assign(s, h.category_len);
      e.name.assign(s + h.category_len, h.name_len);
      e.args.assign(s + h.category_len + h.name_len, h.args_len);
      e.start_ns = h.start_ns;
      e.duration_ns = h.duration_ns;
      e.track = h.track;
      out.push_back(std::move(e));
      off += record_bytes(h);
    }
  }
  clear();
  return out;
}

void TraceLog::clear() {
  for (const Chunk& c : chunks_) munmap(c.data, c.bytes);
  chunks_.clear();
  count_ = 0;
}

}  // namespace zeroshard::trace
