// See event_store.h. A record: its Header, then the category, name and args bytes, padded to 8 so
// that every Header starts aligned (they are copied with memcpy anyway).
#include "runtime/event_store.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <new>

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

}  // namespace

EventStore::EventStore(size_t chunk_bytes) : chunk_bytes_(chunk_bytes) {
  ZS_REQUIRE(chunk_bytes > 0, "EventStore: chunk_bytes must be > 0");
}

EventStore::~EventStore() { clear(); }

int64_t EventStore::mapped_bytes() const {
  int64_t total = 0;
  for (const Chunk& c : chunks_) total += static_cast<int64_t>(c.bytes);
  return total;
}

char* EventStore::reserve(size_t bytes) {
  if (chunks_.empty() || chunks_.back().bytes - chunks_.back().used < bytes) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));  // > 0 on Linux
    const size_t size = (std::max(bytes, chunk_bytes_) + page - 1) / page * page;
    void* data = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (data == MAP_FAILED) return nullptr;  // ENOMEM, vm.max_map_count: the event is dropped
    try {
      chunks_.push_back({static_cast<char*>(data), size, 0});
    } catch (const std::bad_alloc&) {
      munmap(data, size);
      return nullptr;
    }
  }
  Chunk& chunk = chunks_.back();
  char* at = chunk.data + chunk.used;
  chunk.used += bytes;
  return at;
}

bool EventStore::append(char phase, std::string_view category, std::string_view name,
                        int64_t start_ns, int64_t duration_ns, int track, std::string_view args) {
  for (std::string_view s : {category, name, args}) {
    if (s.size() > UINT32_MAX) return false;  // a 4 GiB string is no event worth keeping
  }
  const Header h{start_ns, duration_ns, track, static_cast<uint32_t>(category.size()),
                 static_cast<uint32_t>(name.size()), static_cast<uint32_t>(args.size()), phase};
  char* at = reserve(record_bytes(h));
  if (at == nullptr) return false;
  std::memcpy(at, &h, sizeof h);
  at += sizeof h;
  for (std::string_view s : {category, name, args}) {
    if (!s.empty()) std::memcpy(at, s.data(), s.size());
    at += s.size();
  }
  ++count_;
  return true;
}

std::vector<Event> EventStore::take() {
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

void EventStore::clear() {
  // munmap of a whole mapping made here fails only for bad arguments; nothing to do about it.
  for (const Chunk& c : chunks_) munmap(c.data, c.bytes);
  chunks_.clear();
  count_ = 0;
}

}  // namespace zeroshard::trace
