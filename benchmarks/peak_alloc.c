/* Live heap bytes of a process and their peak, counted at every malloc and free.
 *
 * Loaded with LD_PRELOAD by benchmarks/peak_memory.py (which builds it): every allocation
 * function of the C library is wrapped, so every tensor's storage (PyTorch's CPU allocator,
 * Inductor's buffers, gloo's and fcoll's buffers), on every thread, is counted from its
 * allocation to its free, by malloc_usable_size (the same figure at both ends). Python's small
 * objects (its own arenas, mmapped) are not counted.
 *
 *   fcoll_live_bytes()  bytes allocated and not yet freed
 *   fcoll_peak_bytes()  the largest live_bytes since the last reset
 *   fcoll_reset_peak()  peak := live; returns live
 *
 * glibc's __libc_* entry points are the real allocator (no dlsym, which allocates).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <stddef.h>

extern void *__libc_malloc(size_t);
extern void __libc_free(void *);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);

static long live_bytes, peak_bytes;

static void *counted(void *p) {
    if (p) {
        long v = __atomic_add_fetch(&live_bytes, (long)malloc_usable_size(p), __ATOMIC_RELAXED);
        long pk = __atomic_load_n(&peak_bytes, __ATOMIC_RELAXED);
        while (v > pk && !__atomic_compare_exchange_n(&peak_bytes, &pk, v, 1, __ATOMIC_RELAXED,
                                                      __ATOMIC_RELAXED)) {
        }
    }
    return p;
}

static void uncount(void *p) {
    if (p) __atomic_sub_fetch(&live_bytes, (long)malloc_usable_size(p), __ATOMIC_RELAXED);
}

void *malloc(size_t n) { return counted(__libc_malloc(n)); }
void *calloc(size_t a, size_t b) { return counted(__libc_calloc(a, b)); }
void *memalign(size_t a, size_t n) { return counted(__libc_memalign(a, n)); }
void *aligned_alloc(size_t a, size_t n) { return counted(__libc_memalign(a, n)); }
void *valloc(size_t n) { return counted(__libc_memalign(4096, n)); }
void *pvalloc(size_t n) { return counted(__libc_memalign(4096, (n + 4095) & ~(size_t)4095)); }

void free(void *p) {
    uncount(p);
    __libc_free(p);
}

void *realloc(void *p, size_t n) {
    long old = p ? (long)malloc_usable_size(p) : 0;
    void *q = __libc_realloc(p, n);
    if (q || (p && n == 0)) {   /* moved, grown or freed: the old block is gone */
        __atomic_sub_fetch(&live_bytes, old, __ATOMIC_RELAXED);
        counted(q);
    }
    return q;
}

int posix_memalign(void **out, size_t a, size_t n) {
    if (a < sizeof(void *) || (a & (a - 1))) return EINVAL;
    void *p = counted(__libc_memalign(a, n));
    if (!p && n) return ENOMEM;
    *out = p;
    return 0;
}

long fcoll_live_bytes(void) { return __atomic_load_n(&live_bytes, __ATOMIC_RELAXED); }
long fcoll_peak_bytes(void) { return __atomic_load_n(&peak_bytes, __ATOMIC_RELAXED); }

long fcoll_reset_peak(void) {
    long v = __atomic_load_n(&live_bytes, __ATOMIC_RELAXED);
    __atomic_store_n(&peak_bytes, v, __ATOMIC_RELAXED);
    return v;
}
