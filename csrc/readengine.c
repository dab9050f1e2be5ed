/* The read engine (readengine.h): sort and coalesce a plan, cut it into chunk-sized requests, and let a
 * pool of pthreads read them, in one of two layouts.
 *
 * Why this shape:
 * - One stream (cfg->streams == 0, network filesystems): every worker takes the next request in file
 *   order from one atomic counter, through one descriptor, so a network filesystem has `threads` requests
 *   in flight and the pool as a whole reads the file front to back.
 * - Per-worker streams (cfg->streams == 1, local disks): the plan is cut into one contiguous part per
 *   worker, of equal bytes, and each worker reads its part front to back through a descriptor of its own.
 *   The kernel keeps readahead state per open file description: through one descriptor, requests that
 *   arrive out of order from many threads look random to it and readahead shrinks, where N descriptors
 *   each read sequentially keep N full windows in flight -- what `fio --numjobs=N --offset_increment`
 *   does, and what reached the disk's limit here when the shared counter did not.  A new open file
 *   description needs a real open (dup() shares the description): the file is reopened through
 *   /proc/self/fd (the same inode, checked, no path to race with) and advised POSIX_FADV_SEQUENTIAL.  A
 *   worker that finishes its part takes over the back half of the largest part left, so one slow part
 *   does not leave the others idle.
 * - Request boundaries fall on multiples of the chunk size in the file, so interior requests start on
 *   page (and O_DIRECT block) boundaries whatever the ranges' offsets.
 * - A request is located by a per-worker cursor over the prefix counts of pieces per range (a worker's
 *   request numbers only grow within its part; a new part is found by binary search), so a plan of a
 *   million tiny ranges costs no per-request search and no per-request allocation.
 * - One thread per worker is created per call and joined before returning: a plan moves at least
 *   megabytes when it asks for many workers (workers are capped at the number of requests), against
 *   tens of microseconds to start them, and a pool that outlives the call would have to survive fork()
 *   (DataLoader workers) and interpreter shutdown.  The per-worker descriptors live as long as the call.
 * - Workers block every signal: the interpreter's handlers run in the thread that called, as they
 *   would without the engine.
 * - There is one O_DIRECT staging buffer per worker, not two: the copy out of it runs on the worker that
 *   read it, so a second buffer would have nothing to overlap with on a CPU destination; the other
 *   workers' reads are what overlaps each worker's copies.  O_DIRECT reads bypass readahead, so they go
 *   through the one O_DIRECT descriptor in either layout. */
#define _GNU_SOURCE
#include "readengine.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Linux transfers at most 0x7ffff000 bytes per read call; stay well below it. */
#define MAX_IO ((uint64_t)1 << 30)
#define NO_FAILURE UINT64_MAX

/* One worker's part of the plan in per-worker streams: requests [next, end), taken from the front by its
 * owner and split from the back by an idle worker.  next and end change under lock only; left (end - next)
 * is there for idle workers to choose a part without taking every lock. */
typedef struct {
    pthread_mutex_t lock;
    uint64_t next, end;
    atomic_uint_fast64_t left;
    atomic_int owned;               /* 0: its worker could not be started, an idle worker takes all of it */
} part_state;

typedef struct {
    const mcf_read_range *ranges;
    const uint64_t *first;          /* first[i]: number of the first request of range i; first[m]: total */
    size_t m;
    const mcf_read_config *cfg;
    atomic_uint_fast64_t next;      /* one-stream mode: next request to take */
    part_state *parts;              /* per-worker streams: one part per worker, NULL in one-stream mode */
    unsigned nparts;
    atomic_uint_fast64_t fail_at;   /* lowest offset a request failed at (NO_FAILURE): none starts beyond it */
    atomic_int direct_refused;
    atomic_int direct_used;
    atomic_uint_fast64_t bytes;
    atomic_uint_fast64_t requests;
    atomic_uint streams;
    atomic_uint steals;
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

/* Record a failure; of several, the one at the lowest offset is kept.  No worker starts a request at or
 * beyond fail_at from then on, and every request below it is still made (in one-stream mode requests are
 * handed out in file order; with per-worker streams each part is read front to back by one worker), so the
 * lowest failure is where the file really ended or first failed, whichever worker got there first. */
static void fail(plan_state *st, int error, int truncated, uint64_t offset) {
    pthread_mutex_lock(&st->lock);
    if (!st->failed || offset < st->fail_offset) {
        st->failed = 1;
        st->error = error;
        st->truncated = truncated;
        st->fail_offset = offset;
    }
    pthread_mutex_unlock(&st->lock);
    uint64_t cur = atomic_load(&st->fail_at);
    while (offset < cur && !atomic_compare_exchange_weak(&st->fail_at, &cur, offset))
        ;
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
    unsigned index;                 /* per-worker streams: the part this worker owns */
    int fd;                         /* buffered reads: its own descriptor, or cfg->fd */
    uint8_t *bounce;                /* O_DIRECT staging, allocated on first need */
    uint64_t bytes, calls;
    size_t r;                       /* cursor: the range of the last request */
} worker_ctx;

/* [lo, hi) into d with buffered reads; 0, or -1 after recording the failure. */
static int read_buffered(worker_ctx *w, uint64_t lo, uint64_t hi, uint8_t *d) {
    uint64_t done = 0;
    int err = pread_full(w->fd, d, hi - lo, lo, &done, &w->calls);
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

/* Request k: the file bytes [*lo, *hi) and where they go.  The worker's cursor moves forward over the
 * ranges (its request numbers grow within a part); a jump back (a part taken over) searches. */
static size_t locate(const plan_state *st, uint64_t k) {
    size_t a = 0, b = st->m;         /* the last range whose first request is <= k */
    while (b - a > 1) {
        size_t mid = a + (b - a) / 2;
        if (st->first[mid] <= k)
            a = mid;
        else
            b = mid;
    }
    return a;
}

static void request(plan_state *st, worker_ctx *w, uint64_t k, uint64_t *lo, uint64_t *hi, uint8_t **d) {
    size_t r = w->r;
    if (st->first[r] > k)
        r = locate(st, k);
    while (st->first[r + 1] <= k)
        r++;
    w->r = r;
    const mcf_read_range *rg = &st->ranges[r];
    const uint64_t c = st->cfg->chunk, end = rg->offset + rg->size;
    uint64_t piece = rg->offset / c + (k - st->first[r]);
    uint64_t a = piece * c, b = a + c;
    if (a < rg->offset)
        a = rg->offset;
    if (b > end)
        b = end;
    *lo = a;
    *hi = b;
    *d = rg->dst + (a - rg->offset);
}

/* Read request k; 0, or -1 after recording a failure. */
static int serve(worker_ctx *w, uint64_t k) {
    plan_state *st = w->st;
    uint64_t lo, hi;
    uint8_t *d;
    request(st, w, k, &lo, &hi, &d);
    if (lo >= atomic_load_explicit(&st->fail_at, memory_order_relaxed))
        return -1;                  /* beyond a failure: this request and the rest of the part are not needed */
    int rc = 1;
    if (st->cfg->direct_fd >= 0 && !atomic_load_explicit(&st->direct_refused, memory_order_relaxed))
        rc = read_direct(w, lo, hi, d);
    if (rc == 1)
        rc = read_buffered(w, lo, hi, d);
    return rc < 0 ? -1 : 0;
}

/* The next request of part p, from its front; 0 when the part is empty. */
static int take(part_state *p, uint64_t *k) {
    int got = 0;
    pthread_mutex_lock(&p->lock);
    if (p->next < p->end) {
        *k = p->next++;
        atomic_store_explicit(&p->left, p->end - p->next, memory_order_relaxed);
        got = 1;
    }
    pthread_mutex_unlock(&p->lock);
    return got;
}

/* An idle worker takes over the back half of the part with the most requests left (all of a part whose
 * worker never started) as its own part; 0 when there is nothing to take. */
static int steal(plan_state *st, worker_ctx *w) {
    for (;;) {
        /* after a failure each part is finished by its owner, up to it; a part without one still is */
        int failed = atomic_load_explicit(&st->fail_at, memory_order_relaxed) != NO_FAILURE;
        unsigned best = st->nparts;
        uint64_t most = 0;
        for (unsigned i = 0; i < st->nparts; i++) {
            part_state *p = &st->parts[i];
            uint64_t left = atomic_load_explicit(&p->left, memory_order_relaxed);
            uint64_t worth = !atomic_load_explicit(&p->owned, memory_order_relaxed) ? left : failed ? 0 : left / 2;
            if (i != w->index && worth > most) {
                most = worth;
                best = i;
            }
        }
        if (best == st->nparts)
            return 0;
        part_state *v = &st->parts[best];
        uint64_t lo = 0, hi = 0;
        pthread_mutex_lock(&v->lock);
        uint64_t n = v->end - v->next;
        uint64_t take_n = !atomic_load_explicit(&v->owned, memory_order_relaxed) ? n : failed ? 0 : n / 2;
        if (take_n) {
            hi = v->end;
            lo = hi - take_n;
            v->end = lo;
            atomic_store_explicit(&v->left, v->end - v->next, memory_order_relaxed);
        }
        pthread_mutex_unlock(&v->lock);
        if (!take_n)
            continue;               /* it changed since it was looked at: choose again */
        part_state *own = &st->parts[w->index];
        pthread_mutex_lock(&own->lock);
        own->next = lo;
        own->end = hi;
        atomic_store_explicit(&own->left, hi - lo, memory_order_relaxed);
        pthread_mutex_unlock(&own->lock);
        atomic_fetch_add_explicit(&st->steals, 1, memory_order_relaxed);
        w->r = locate(st, lo);
        return 1;
    }
}

/* The file again, as a new open file description (its own readahead state), read sequentially; -1 where
 * it cannot be reopened. */
static int reopen_sequential(int fd) {
#if defined(__linux__)
    char path[48];
    snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
    int f = open(path, O_RDONLY | O_CLOEXEC);
    if (f >= 0) {
        struct stat a, b;   /* the same file, whatever /proc showed */
        if (fstat(f, &a) != 0 || fstat(fd, &b) != 0 || a.st_ino != b.st_ino || a.st_dev != b.st_dev) {
            close(f);
            return -1;
        }
        posix_fadvise(f, 0, 0, POSIX_FADV_SEQUENTIAL);
    }
    return f;
#else
    (void)fd;
    return -1;
#endif
}

static void *worker(void *arg) {
    worker_ctx *w = arg;
    plan_state *st = w->st;
    const uint64_t total = st->first[st->m];
    uint64_t k;
    w->fd = st->cfg->fd;
    if (st->parts == NULL) {
        for (;;) {
            k = atomic_fetch_add_explicit(&st->next, 1, memory_order_relaxed);
            if (k >= total || serve(w, k) < 0)
                break;
        }
    } else {
        int own = reopen_sequential(st->cfg->fd);
        if (own >= 0) {
            w->fd = own;
            atomic_fetch_add_explicit(&st->streams, 1, memory_order_relaxed);
        }
        part_state *p = &st->parts[w->index];
        w->r = locate(st, p->next);     /* only its owner moves next */
        for (;;) {
            if (!take(p, &k)) {
                if (!steal(st, w))
                    break;
                continue;
            }
            if (serve(w, k) < 0)
                break;
        }
        if (own >= 0)
            close(own);
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

/* Cut requests [0, first[m]) into `n` parts of about equal bytes, in file order: part t is requests
 * [bound[t], bound[t + 1]).  A bound is the request holding the plan's (t/n)th byte. */
static void cut_parts(const mcf_read_range *ranges, const uint64_t *first, size_t m, uint64_t chunk, unsigned n,
                      uint64_t *bound) {
    uint64_t bytes = 0;
    for (size_t i = 0; i < m; i++)
        bytes += ranges[i].size;
    uint64_t cum = 0;
    size_t i = 0;
    bound[0] = 0;
    for (unsigned t = 1; t < n; t++) {
        uint64_t at = bytes / n * t + bytes % n * t / n;
        while (i < m && cum + ranges[i].size <= at) {
            cum += ranges[i].size;
            i++;
        }
        bound[t] = i == m ? first[m]
                          : first[i] + (ranges[i].offset + (at - cum)) / chunk - ranges[i].offset / chunk;
    }
    bound[n] = first[m];
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

    unsigned want = cfg->threads ? cfg->threads : 1;
    if ((uint64_t)want > total)
        want = (unsigned)total;
    int streams = cfg->streams && want > 1;
    worker_ctx *ctx = calloc(want, sizeof(*ctx));
    pthread_t *tids = want > 1 ? calloc(want - 1, sizeof(*tids)) : NULL;
    part_state *parts = streams ? calloc(want, sizeof(*parts)) : NULL;
    uint64_t *bound = streams ? malloc((want + 1) * sizeof(*bound)) : NULL;
    if (ctx == NULL || (want > 1 && tids == NULL) || (streams && (parts == NULL || bound == NULL))) {
        free(ctx);
        free(tids);
        free(parts);
        free(bound);
        free(first);
        res->error = ENOMEM;
        return -1;
    }

    plan_state st;
    memset(&st, 0, sizeof(st));
    st.ranges = ranges;
    st.first = first;
    st.m = m;
    st.cfg = cfg;
    atomic_init(&st.next, 0);
    atomic_init(&st.fail_at, NO_FAILURE);
    atomic_init(&st.direct_refused, 0);
    atomic_init(&st.direct_used, 0);
    atomic_init(&st.bytes, 0);
    atomic_init(&st.requests, 0);
    atomic_init(&st.streams, 0);
    atomic_init(&st.steals, 0);
    pthread_mutex_init(&st.lock, NULL);
    if (streams) {
        cut_parts(ranges, first, m, c, want, bound);
        for (unsigned t = 0; t < want; t++) {
            pthread_mutex_init(&parts[t].lock, NULL);
            parts[t].next = bound[t];
            parts[t].end = bound[t + 1];
            atomic_init(&parts[t].left, bound[t + 1] - bound[t]);
            atomic_init(&parts[t].owned, 1);
        }
        st.parts = parts;
        st.nparts = want;
    }
    for (unsigned t = 0; t < want; t++) {
        ctx[t].st = &st;
        ctx[t].index = t;
    }

    unsigned started = 0;
    if (want > 1) {
        pthread_attr_t attr;
        sigset_t all, old;
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, 256 * 1024);
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        for (unsigned t = 1; t < want; t++) {
            if (pthread_create(&tids[started], &attr, worker, &ctx[t]) != 0) {
                /* fewer workers than asked: the ones running take the rest (the parts of those that did
                 * not start, whole) */
                for (unsigned u = t; u < want && streams; u++)
                    atomic_store(&parts[u].owned, 0);
                break;
            }
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
    res->streams = atomic_load(&st.streams);
    res->steals = atomic_load(&st.steals);
    res->error = st.error;
    res->truncated = st.truncated;
    res->fail_offset = st.fail_offset;
    int failed = st.failed;
    pthread_mutex_destroy(&st.lock);
    if (streams)
        for (unsigned t = 0; t < want; t++)
            pthread_mutex_destroy(&parts[t].lock);
    free(ctx);
    free(tids);
    free(parts);
    free(bound);
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
