/* Fresh pages for Python's small-object arenas, faulted in ahead of use by a helper thread.
 *
 * Ten million obs names as Python strings (pandas 2's index) take about 640 MB of pymalloc's
 * 1 MiB arenas, and on a virtual machine most of their making is the kernel faulting in those
 * fresh pages one 4 KiB page at a time (0.2-0.4 s at 10M names, against 0.1 s for writing
 * the strings themselves). While a loop that holds the GIL makes them, a window hands pymalloc
 * its arenas from one reserved region, and a helper thread faults that region in with
 * MADV_POPULATE_WRITE a few MiB ahead of the arenas handed out, on another CPU. The strings
 * are ordinary: pymalloc frees each arena later with munmap, as it frees its own (Linux
 * builds map arenas with mmap), and the unused tail is unmapped when the window closes.
 *
 * Only the thread holding the GIL opens and closes a window (one at a time); arenas are
 * taken from it by compare-and-swap, since other interpreters (each with its own GIL, from
 * Python 3.12) share the process-wide allocator. The helper touches only pages at least one
 * arena past those handed out, and MADV_POPULATE_WRITE never changes a page already
 * present. Where any step is unavailable (not Linux, no
 * MADV_POPULATE_WRITE, a free-threaded build without pymalloc arenas, mmap or thread refused)
 * the window does less or nothing, and the strings are the same.
 */
#ifndef DELTACELLS_ARENAS_H
#define DELTACELLS_ARENAS_H

#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#if defined(__linux__) && !defined(Py_GIL_DISABLED)
#include <errno.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sched.h>
#define DC_ARENAS 1
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; older kernels answer EINVAL and the helper stops */
#endif
#endif

/* How far ahead of the arenas handed out the helper keeps pages faulted in, and how much it
   faults in a call. Measured on 2 CPUs at 10M names: 16 MiB ahead took 0.15-0.16 s; 64 and
   256 MiB ahead 0.19-0.29 s (the helper then faults pages the strings reach first). */
#define DC_ARENAS_AHEAD ((size_t)16 << 20)
#define DC_ARENAS_STEP ((size_t)4 << 20)
#define DC_ARENAS_MIN ((size_t)64 << 20)

#ifdef DC_ARENAS
typedef struct {
    PyObjectArenaAllocator previous;
    char *base;
    char *end;
    char *next;     /* the next arena handed out; read by the helper */
    int stop;       /* set when the window closes; read by the helper */
    int active;
    int helper;
    pthread_t thread;
} dc_arena_window;

static dc_arena_window dc_window;

static void *dc_window_alloc(void *ctx, size_t size) {
    /* Taken by compare-and-swap: the allocator is process-wide, and since Python 3.12
       interpreters with their own GIL may ask for arenas at the same time. */
    char *next = __atomic_load_n(&dc_window.next, __ATOMIC_ACQUIRE);
    (void)ctx;
    while (next != NULL && size <= (size_t)(dc_window.end - next)) {
        if (__atomic_compare_exchange_n(&dc_window.next, &next, next + size, 0,
                                        __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return next;
    }
    return dc_window.previous.alloc(dc_window.previous.ctx, size);
}

static void dc_window_free(void *ctx, void *ptr, size_t size) {
    (void)ctx;
    dc_window.previous.free(dc_window.previous.ctx, ptr, size);
}

static void *dc_window_helper(void *unused) {
    char *done = dc_window.base;
    (void)unused;
    while (!__atomic_load_n(&dc_window.stop, __ATOMIC_ACQUIRE) && done < dc_window.end) {
        /* Pages the strings are about to reach are faulted in by their own writes; skip past
           the arena being filled so the two CPUs fault in different pages. */
        char *next = __atomic_load_n(&dc_window.next, __ATOMIC_ACQUIRE);
        size_t step = DC_ARENAS_STEP;
        if ((size_t)(dc_window.end - next) <= ((size_t)1 << 20))
            break;
        if (done < next + ((size_t)1 << 20))
            done = next + ((size_t)1 << 20);
        if ((size_t)(done - next) >= DC_ARENAS_AHEAD) {
            /* A yield, not a sleep: woken from even 20 us of nanosleep the helper fell behind,
               and 10M names took 0.39-0.45 s against 0.21 s (fresh processes taking turns). */
            sched_yield();
            continue;
        }
        if (step > (size_t)(dc_window.end - done))
            step = (size_t)(dc_window.end - done);
        if (madvise(done, step, MADV_POPULATE_WRITE) != 0 && errno != EINTR && errno != EAGAIN)
            break;
        done += step;
    }
    return NULL;
}
#endif

/* What pymalloc takes for a compact ASCII string of ``length`` characters: its header, the
   characters and a NUL, in 16-byte blocks. */
static inline size_t dc_arenas_ascii_bytes(Py_ssize_t length) {
    return (sizeof(PyASCIIObject) + (size_t)length + 1 + 15) & ~(size_t)15;
}

/* Open a window for strings of ``nbytes`` (the sum of dc_arenas_ascii_bytes); ``helper``:
   fault pages in on another thread. Returns 1 when open (close it with dc_arenas_close), 0
   when nothing was changed. */
static int dc_arenas_open(size_t nbytes, int helper) {
#ifdef DC_ARENAS
    PyObjectArenaAllocator window = {NULL, dc_window_alloc, dc_window_free};
    size_t page = 4096;
    char *base;
    /* pymalloc's 16 KiB pools keep a header and a partial block each, and arenas hold other
       objects too: a margin of 1/32 and four arenas (what is not handed out is unmapped). */
    nbytes += nbytes / 32 + ((size_t)4 << 20);
    if (dc_window.active || nbytes < DC_ARENAS_MIN)
        return 0;
    nbytes = (nbytes + page - 1) & ~(page - 1);
    base = (char *)mmap(NULL, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED)
        return 0;
    dc_window.base = base;
    dc_window.end = base + nbytes;
    dc_window.next = base;
    dc_window.stop = 0;
    dc_window.active = 1;
    PyObject_GetArenaAllocator(&dc_window.previous);
    PyObject_SetArenaAllocator(&window);
    dc_window.helper = helper && pthread_create(&dc_window.thread, NULL, dc_window_helper, NULL) == 0;
    return 1;
#else
    (void)nbytes;
    (void)helper;
    return 0;
#endif
}

/* Close the window: pymalloc's own allocator back, the helper stopped, the unused tail
   unmapped. Returns the bytes handed out as arenas. */
static size_t dc_arenas_close(void) {
#ifdef DC_ARENAS
    size_t used;
    char *next, *tail;
    if (!dc_window.active)
        return 0;
    PyObject_SetArenaAllocator(&dc_window.previous);
    if (dc_window.helper) {
        __atomic_store_n(&dc_window.stop, 1, __ATOMIC_RELEASE);
        pthread_join(dc_window.thread, NULL);
    }
    /* No arena is handed out of the region from here on, even to a call already inside
       dc_window_alloc: its swap fails on NULL. */
    next = __atomic_exchange_n(&dc_window.next, (char *)NULL, __ATOMIC_ACQ_REL);
    used = (size_t)(next - dc_window.base);
    tail = (char *)(((uintptr_t)next + 4095) & ~(uintptr_t)4095);
    if (tail < dc_window.end)
        munmap(tail, (size_t)(dc_window.end - tail));
    dc_window.active = 0;
    return used;
#else
    return 0;
#endif
}

#endif
