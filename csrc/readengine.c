/* The read engine (readengine.h): sort and coalesce a plan, cut it into chunk-sized requests, and let a
 * pool of pthreads take requests in file order from one atomic counter.
 *
 * Why this shape:
 * - Requests are taken in ascending file order by every worker, so the file is read front to back by
 *   the pool as a whole: the kernel's readahead sees a sequential stream on local disks, and a network
 *   filesystem has `threads` requests in flight.
 * - Request boundaries fall on multiples of the chunk size in the file, so interior requests start on
 *   page (and O_DIRECT block) boundaries whatever the ranges' offsets.
 * - A request is located by a per-worker cursor over the prefix counts of pieces per range (a worker's
 *   request numbers only grow), so a plan of a million tiny ranges costs no search and no per-request
 *   allocation.
 * - One thread per worker is created per call and joined before returning: a plan moves at least
 *   megabytes when it asks for many workers (workers are capped at the number of requests), against
 *   tens of microseconds to start them, and a pool that outlives the call would have to survive fork()
 *   (DataLoader workers) and interpreter shutdown.
 * - Workers block every signal: the interpreter's handlers run in the thread that called, as they
 *   would without the engine.
 * - There is one O_DIRECT staging buffer per worker, not two: the copy out of it runs on the worker that
 *   read it, so a second buffer would have nothing to overlap with on a CPU destination; the other
 *   workers' reads are what overlaps each worker's copies. */
#define _GNU_SOURCE
#include "readengine.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Linux transfers at most 0x7ffff000 bytes per read call; stay well below it. */
#define MAX_IO ((uint64_t)1 << 30)

typedef struct {
    const mcf_read_range *ranges;
    const uint64_t *first;          /* first[i]: number of the first request of range i; first[m]: total */
    size_t m;
    const mcf_read_config *cfg;
    atomic_uint_fast64_t next;      /* next request to take */
    atomic_int stop;                /* a worker failed: the others take no new request */
    atomic_int direct_refused;
    atomic_int direct_used;
    atomic_uint_fast64_t bytes;
    atomic_uint_fast64_t requests;
    pthread_mutex_t lock;           /* guards the failure below */
    int failed;
    int error;
    int truncated;
    uint64_t fail_offset;
} plan_state;

static int by_offset(const void *a, const void *b) {
    const mcf_read_range *x = a, *y = b;
    if (x->offset != y->offset)
        return x->offset < y->offset ? -1 : 1;
    if (x->dst != y->dst)
        return x->dst < y->dst ? -1 : 1;
    return 0;
}

/* Record a failure; of several, the one at the lowest offset is kept: requests are handed out in file
 * order and each worker finishes the one it holds, so every request before a failing one completes or
 * fails too, and the lowest failure is where the file really ended or first failed, whichever worker
 * got there first. */
static void fail(plan_state *st, int error, int truncated, uint64_t offset) {
    pthread_mutex_lock(&st->lock);
    if (!st->failed || offset < st->fail_offset) {
        st->failed = 1;
        st->error = error;
        st->truncated = truncated;
        st->fail_offset = offset;
    }
    pthread_mutex_unlock(&st->lock);
    atomic_store(&st->stop, 1);
}

/* pread until n bytes arrived, the file ended or a call failed; returns 0 or the errno, *done the bytes. */
static int pread_full(int fd, uint8_t *dst, uint64_t n, uint64_t off, uint64_t *done, uint64_t *calls) {
    uint64_t got = 0;
    while (got < n) {
        uint64_t want = n - got;
        if (want > MAX_IO)
            want = MAX_IO;
        ssize_t k = pread(fd, dst + got, (size_t)want, (off_t)(off + got));
        if (k < 0) {
            if (errno == EINTR)
                continue;
            *done = got;
            (*calls)++;
            return errno;
        }
        (*calls)++;
        if (k == 0)
            break;
        got += (uint64_t)k;
    }
    *done = got;
    return 0;
}

typedef struct {
    plan_state *st;
    uint8_t *bounce;                /* O_DIRECT staging, allocated on first need */
    uint64_t bytes, calls;
} worker_ctx;

/* [lo, hi) into d with buffered reads; 0, or -1 after recording the failure. */
static int read_buffered(worker_ctx *w, uint64_t lo, uint64_t hi, uint8_t *d) {
    uint64_t done = 0;
    int err = pread_full(w->st->cfg->fd, d, hi - lo, lo, &done, &w->calls);
    w->bytes += done;
    if (err) {
        fail(w->st, err, 0, lo + done);
        return -1;
    }
    if (done < hi - lo) {
        fail(w->st, 0, 1, lo + done);
        return -1;
    }
    return 0;
}

/* [lo, hi) into d through the O_DIRECT descriptor: straight into d when the request and d are aligned,
 * else the aligned blocks around it into the worker's staging buffer and the wanted bytes copied out.
 * Returns 0, -1 after recording a failure, or 1 when the filesystem refused O_DIRECT (read buffered). */
static int read_direct(worker_ctx *w, uint64_t lo, uint64_t hi, uint8_t *d) {
    const mcf_read_config *cfg = w->st->cfg;
    uint64_t al = cfg->align;
    uint64_t a0 = lo & ~(al - 1), a1 = (hi + al - 1) & ~(al - 1);
    uint8_t *target = d;
    if (a0 != lo || a1 != hi || ((uintptr_t)d & (al - 1))) {
        if (w->bounce == NULL) {
            void *p = NULL;
            if (posix_memalign(&p, (size_t)al, (size_t)cfg->chunk)) {
                fail(w->st, ENOMEM, 0, lo);
                return -1;
            }
            w->bounce = p;
        }
        target = w->bounce;
    }
    uint64_t need = hi - a0, len = a1 - a0, done = 0;
    while (done < len) {
        uint64_t want = len - done;
        if (want > MAX_IO)
            want = MAX_IO;
        ssize_t k = pread(cfg->direct_fd, target + done, (size_t)want, (off_t)(a0 + done));
        if (k < 0) {
            if (errno == EINTR)
                continue;
            w->calls++;
            if (errno == EINVAL && done == 0) {
                atomic_store(&w->st->direct_refused, 1);
                return 1;
            }
            fail(w->st, errno, 0, a0 + done > lo ? a0 + done : lo);
            return -1;
        }
        w->calls++;
        if (k == 0)
            break;
        done += (uint64_t)k;
        w->bytes += (uint64_t)k;
        if (done & (al - 1))        /* a partial block: the end of the file */
            break;
    }
    atomic_store_explicit(&w->st->direct_used, 1, memory_order_relaxed);
    if (done < need) {
        /* the end of the file: what did arrive of [lo, hi) reaches d too, as a buffered read leaves it */
        if (target != d && a0 + done > lo)
            memcpy(d, target + (lo - a0), (size_t)(a0 + done - lo));
        fail(w->st, 0, 1, a0 + done > lo ? a0 + done : lo);
        return -1;
    }
    if (target != d)
        memcpy(d, target + (lo - a0), (size_t)(hi - lo));
    return 0;
}

static void *worker(void *arg) {
    worker_ctx *w = arg;
    plan_state *st = w->st;
    const mcf_read_config *cfg = st->cfg;
    const uint64_t c = cfg->chunk, total = st->first[st->m];
    size_t r = 0;
    for (;;) {
        if (atomic_load_explicit(&st->stop, memory_order_relaxed))
            break;
        uint64_t k = atomic_fetch_add_explicit(&st->next, 1, memory_order_relaxed);
        if (k >= total)
            break;
        while (st->first[r + 1] <= k)
            r++;
        const mcf_read_range *rg = &st->ranges[r];
        uint64_t end = rg->offset + rg->size;
        uint64_t piece = rg->offset / c + (k - st->first[r]);
        uint64_t lo = piece * c, hi = lo + c;
        if (lo < rg->offset)
            lo = rg->offset;
        if (hi > end)
            hi = end;
        uint8_t *d = rg->dst + (lo - rg->offset);
        int rc = 1;
        if (cfg->direct_fd >= 0 && !atomic_load_explicit(&st->direct_refused, memory_order_relaxed))
            rc = read_direct(w, lo, hi, d);
        if (rc == 1)
            rc = read_buffered(w, lo, hi, d);
        if (rc < 0)
            break;
    }
    atomic_fetch_add(&st->bytes, w->bytes);
    atomic_fetch_add(&st->requests, w->calls);
    return NULL;
}

static int sorted_by_offset(const mcf_read_range *r, size_t n) {
    for (size_t i = 1; i < n; i++)
        if (by_offset(&r[i - 1], &r[i]) > 0)
            return 0;
    return 1;
}

int mcf_read_plan(mcf_read_range *ranges, size_t n, const mcf_read_config *cfg, mcf_read_result *res) {
    memset(res, 0, sizeof(*res));
    /* drop empty ranges, order by file offset, merge neighbours in the file and in memory */
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (ranges[i].size)
            ranges[m++] = ranges[i];
    if (!sorted_by_offset(ranges, m))
        qsort(ranges, m, sizeof(*ranges), by_offset);
    size_t k = 0;
    for (size_t i = 0; i < m; i++) {
        if (k && ranges[k - 1].offset + ranges[k - 1].size == ranges[i].offset
              && ranges[k - 1].dst + ranges[k - 1].size == ranges[i].dst)
            ranges[k - 1].size += ranges[i].size;
        else
            ranges[k++] = ranges[i];
    }
    m = k;
    res->ranges = m;
    if (m == 0)
        return 0;

    uint64_t *first = malloc((m + 1) * sizeof(*first));
    if (first == NULL) {
        res->error = ENOMEM;
        return -1;
    }
    const uint64_t c = cfg->chunk;
    first[0] = 0;
    for (size_t i = 0; i < m; i++)
        first[i + 1] = first[i] + (ranges[i].offset + ranges[i].size - 1) / c - ranges[i].offset / c + 1;
    uint64_t total = first[m];

    plan_state st;
    memset(&st, 0, sizeof(st));
    st.ranges = ranges;
    st.first = first;
    st.m = m;
    st.cfg = cfg;
    atomic_init(&st.next, 0);
    atomic_init(&st.stop, 0);
    atomic_init(&st.direct_refused, 0);
    atomic_init(&st.direct_used, 0);
    atomic_init(&st.bytes, 0);
    atomic_init(&st.requests, 0);
    pthread_mutex_init(&st.lock, NULL);

    unsigned want = cfg->threads ? cfg->threads : 1;
    if ((uint64_t)want > total)
        want = (unsigned)total;
    worker_ctx *ctx = calloc(want, sizeof(*ctx));
    pthread_t *tids = want > 1 ? calloc(want - 1, sizeof(*tids)) : NULL;
    if (ctx == NULL || (want > 1 && tids == NULL)) {
        free(ctx);
        free(tids);
        free(first);
        pthread_mutex_destroy(&st.lock);
        res->error = ENOMEM;
        return -1;
    }
    for (unsigned t = 0; t < want; t++)
        ctx[t].st = &st;

    unsigned started = 0;
    if (want > 1) {
        pthread_attr_t attr;
        sigset_t all, old;
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, 256 * 1024);
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        for (unsigned t = 1; t < want; t++) {
            if (pthread_create(&tids[started], &attr, worker, &ctx[t]) != 0)
                break;                  /* fewer workers than asked: the ones running take the rest */
            started++;
        }
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        pthread_attr_destroy(&attr);
    }
    worker(&ctx[0]);
    for (unsigned t = 0; t < started; t++)
        pthread_join(tids[t], NULL);
    for (unsigned t = 0; t < want; t++)
        free(ctx[t].bounce);

    res->threads = started + 1;
    res->bytes = atomic_load(&st.bytes);
    res->requests = atomic_load(&st.requests);
    res->direct = atomic_load(&st.direct_used);
    res->direct_refused = atomic_load(&st.direct_refused);
    res->error = st.error;
    res->truncated = st.truncated;
    res->fail_offset = st.fail_offset;
    int failed = st.failed;
    pthread_mutex_destroy(&st.lock);
    free(ctx);
    free(tids);
    free(first);
    return failed ? -1 : 0;
}

typedef struct {
    uintptr_t start, end;
    size_t index;
} dst_span;

static int by_start(const void *a, const void *b) {
    const dst_span *x = a, *y = b;
    if (x->start != y->start)
        return x->start < y->start ? -1 : 1;
    return x->index < y->index ? -1 : x->index > y->index;
}

int mcf_plan_overlap(const mcf_read_range *ranges, size_t n, size_t *first, size_t *second) {
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        m += ranges[i].size != 0;
    if (m < 2)
        return 0;
    dst_span *s = malloc(m * sizeof(*s));
    if (s == NULL)
        return -1;
    m = 0;
    for (size_t i = 0; i < n; i++)
        if (ranges[i].size)
            s[m++] = (dst_span){(uintptr_t)ranges[i].dst, (uintptr_t)ranges[i].dst + ranges[i].size, i};
    qsort(s, m, sizeof(*s), by_start);
    /* sorted by start, the first span to overlap any earlier one overlaps its predecessor */
    for (size_t k = 1; k < m; k++)
        if (s[k].start < s[k - 1].end) {
            *first = s[k].index < s[k - 1].index ? s[k].index : s[k - 1].index;
            *second = s[k].index < s[k - 1].index ? s[k - 1].index : s[k].index;
            free(s);
            return 1;
        }
    free(s);
    return 0;
}
