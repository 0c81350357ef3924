// Live heap bytes of a process, for bench/zero_step.py: LD_PRELOAD this library and every malloc
// family call is counted (malloc_usable_size of each block), so the peak of live bytes includes
// every transient buffer and none of the allocator's free-but-unreturned memory. That makes the
// figure the same for every implementation measured, whatever glibc's heap does with RSS.
// Read it with ctypes: memtrack_current(), memtrack_peak(), memtrack_reset_peak().
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <stdatomic.h>
#include <stddef.h>

// glibc's own entry points, so that nothing here recurses into the interposed symbols.
extern void* __libc_malloc(size_t);
extern void* __libc_calloc(size_t, size_t);
extern void* __libc_realloc(void*, size_t);
extern void* __libc_memalign(size_t, size_t);
extern void __libc_free(void*);

static atomic_long live_bytes;
static atomic_long peak_bytes;

static void* counted(void* p) {
  if (p) {
    const long now = atomic_fetch_add(&live_bytes, (long)malloc_usable_size(p)) +
                     (long)malloc_usable_size(p);
    long peak = atomic_load(&peak_bytes);
    while (now > peak && !atomic_compare_exchange_weak(&peak_bytes, &peak, now)) {
    }
  }
  return p;
}

static void uncount(void* p) {
  if (p) atomic_fetch_sub(&live_bytes, (long)malloc_usable_size(p));
}

void* malloc(size_t n) { return counted(__libc_malloc(n)); }
void* calloc(size_t k, size_t n) { return counted(__libc_calloc(k, n)); }
void free(void* p) {
  uncount(p);
  __libc_free(p);
}
void* realloc(void* p, size_t n) {
  uncount(p);
  void* q = __libc_realloc(p, n);
  if (!q && n) {  // failed: the old block is still live, and the caller keeps it
    counted(p);
    return NULL;
  }
  return counted(q);
}
void* memalign(size_t align, size_t n) { return counted(__libc_memalign(align, n)); }
void* aligned_alloc(size_t align, size_t n) { return counted(__libc_memalign(align, n)); }
int posix_memalign(void** out, size_t align, size_t n) {
  void* p = __libc_memalign(align, n);
  if (!p) return ENOMEM;
  *out = counted(p);
  return 0;
}

long memtrack_current(void) { return atomic_load(&live_bytes); }
long memtrack_peak(void) { return atomic_load(&peak_bytes); }
void memtrack_reset_peak(void) { atomic_store(&peak_bytes, atomic_load(&live_bytes)); }
