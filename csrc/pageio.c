/* Pages (pageio.h): CRC-32C in three variants and the batch reads and writes of the pages area.
 *
 * CRC-32C.  The scalar code is slicing-by-8 over tables built once (the reference: tests compare every
 * variant with it and with a bitwise Python model).  The hardware code runs three independent streams over
 * consecutive 4 KiB blocks (the instruction's latency is three cycles, its throughput one a cycle) and joins
 * them by shifting the first two forward (multiplication by x^(8 len) modulo the polynomial, as zlib's
 * crc32_combine does); what is left is taken 8 bytes, then 1 byte, at a time.  Everything works on the raw
 * register (the initial value's and the final xor's complement taken once, in mcf_crc32c).
 *
 * Batches.  One call runs a whole batch on `threads` pthreads (the caller is one of them), each taking the
 * next page from an atomic counter: a page's I/O and checksum never wait on Python.  A read opens the page,
 * reads its head, then its payload in 256 KiB pieces, and checksums each piece right after it arrives, while
 * it is still in the cache, so the payload crosses memory once; the threads' reads of different pages are the
 * parallelism a cold batch needs, the kernel's readahead the rest.  (Advising POSIX_FADV_WILLNEED on every
 * page first, to start all their reads at once, made cold batches slower, 2.1 against 3.2 GB/s on 6.18 with
 * ext4, and the warm reads of what it had read slower too, 8.9 against 15.9 GB/s: the advice fills the page
 * cache with single pages where readahead puts large folios.)  A write checksums each piece just before it
 * writes it.
 * Threads are created per call and joined before it returns (as the read engine's, readengine.c: nothing to
 * survive fork()), with every signal blocked (Python's handlers run in the calling thread). */
#define _GNU_SOURCE
#include "pageio.h"
#include "dispatch.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <nmmintrin.h>
#elif defined(__aarch64__)
#include <arm_acle.h>
#if defined(__linux__)
#include <sys/auxv.h>
#endif
#endif

#define POLY 0x82F63B78u
#define BLOCK 4096u               /* bytes per stream in the three-stream loop */
#define PIECE (256u << 10)        /* bytes read or written, then checksummed, at a time */

/* ---- the scalar reference: slicing-by-8 ----------------------------------------------------------------- */
static uint32_t TABLE[8][256];
static uint32_t SHIFT_1, SHIFT_2;  /* x^(8 BLOCK), x^(16 BLOCK) modulo the polynomial (reflected) */
static pthread_once_t tables_once = PTHREAD_ONCE_INIT;

/* a * b modulo the polynomial, both reflected (zlib's multmodp) */
static uint32_t multmodp(uint32_t a, uint32_t b)
{
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ POLY : b >> 1;
    }
    return p;
}

/* x^(8 n) modulo the polynomial */
static uint32_t x8nmodp(uint64_t n)
{
    uint32_t p = 1u << 31, sq = 1u << 30;  /* x^0; x^1 */
    for (int k = 0; k < 3; k++) sq = multmodp(sq, sq);  /* x^8 */
    while (n) {
        if (n & 1) p = multmodp(sq, p);
        sq = multmodp(sq, sq);
        n >>= 1;
    }
    return p;
}

static void build_tables(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        TABLE[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) TABLE[t][i] = (TABLE[t - 1][i] >> 8) ^ TABLE[0][TABLE[t - 1][i] & 0xff];
    SHIFT_1 = x8nmodp(BLOCK);
    SHIFT_2 = x8nmodp(2 * (uint64_t)BLOCK);
}

static uint32_t crc_scalar(uint32_t r, const uint8_t *p, size_t n)
{
    while (n && ((uintptr_t)p & 7)) {
        r = (r >> 8) ^ TABLE[0][(r ^ *p++) & 0xff];
        n--;
    }
    while (n >= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        lo = __builtin_bswap32(lo);
        hi = __builtin_bswap32(hi);
#endif
        lo ^= r;
        r = TABLE[7][lo & 0xff] ^ TABLE[6][(lo >> 8) & 0xff] ^ TABLE[5][(lo >> 16) & 0xff] ^ TABLE[4][lo >> 24] ^
            TABLE[3][hi & 0xff] ^ TABLE[2][(hi >> 8) & 0xff] ^ TABLE[1][(hi >> 16) & 0xff] ^ TABLE[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) r = (r >> 8) ^ TABLE[0][(r ^ *p++) & 0xff];
    return r;
}

/* ---- the hardware variants ------------------------------------------------------------------------------ */
#if defined(__x86_64__)
#define HW_TARGET __attribute__((target("sse4.2")))
#define HW_U64(r, v) ((uint32_t)_mm_crc32_u64((r), (v)))
#define HW_U8(r, v) _mm_crc32_u8((r), (v))
#define HW_ROW MCF_IMPL_AVX2   /* every AVX2 row (AVX-512 falls back to it) runs SSE4.2's crc32 */

static int hw_detect(void)
{
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && ((c >> 20) & 1);   /* SSE4.2 */
}
#elif defined(__aarch64__)
#define HW_TARGET __attribute__((target("+crc")))
#define HW_U64(r, v) __crc32cd((r), (v))
#define HW_U8(r, v) __crc32cb((r), (v))
#define HW_ROW MCF_IMPL_NEON

static int hw_detect(void)
{
#if defined(__linux__)
#ifndef HWCAP_CRC32
#define HWCAP_CRC32 (1UL << 7)
#endif
    return (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0;
#elif defined(__APPLE__)
    return 1;   /* every Apple arm64 CPU has the CRC extension */
#else
    return 0;
#endif
}
#endif

#ifdef HW_ROW
static int hw_ok = -1;

static int hw_available(void)
{
    int ok = __atomic_load_n(&hw_ok, __ATOMIC_RELAXED);
    if (ok < 0) {
        ok = hw_detect();
        __atomic_store_n(&hw_ok, ok, __ATOMIC_RELAXED);
    }
    return ok;
}

static inline uint64_t load64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;   /* both architectures are little-endian here */
}

HW_TARGET static uint32_t crc_hw(uint32_t r, const uint8_t *p, size_t n)
{
    while (n && ((uintptr_t)p & 7)) {
        r = HW_U8(r, *p++);
        n--;
    }
    while (n >= 3 * (size_t)BLOCK) {
        uint32_t a = r, b = 0, c = 0;
        for (size_t i = 0; i < BLOCK; i += 8) {
            a = HW_U64(a, load64(p + i));
            b = HW_U64(b, load64(p + BLOCK + i));
            c = HW_U64(c, load64(p + 2 * BLOCK + i));
        }
        r = multmodp(SHIFT_2, a) ^ multmodp(SHIFT_1, b) ^ c;
        p += 3 * (size_t)BLOCK;
        n -= 3 * (size_t)BLOCK;
    }
    while (n >= 8) {
        r = HW_U64(r, load64(p));
        p += 8;
        n -= 8;
    }
    while (n--) r = HW_U8(r, *p++);
    return r;
}
#endif

int mcf_crc32c_variant(int impl)
{
    impl = mcf_variant(impl);
#ifdef HW_ROW
    for (int v = impl; v >= 0; v = mcf_impl_below(v))
        if (v == HW_ROW) return hw_available() ? HW_ROW : MCF_IMPL_SCALAR;
#endif
    return MCF_IMPL_SCALAR;
}

static uint32_t crc_raw(int variant, uint32_t r, const uint8_t *p, size_t n)
{
#ifdef HW_ROW
    if (variant == HW_ROW) return crc_hw(r, p, n);
#endif
    (void)variant;
    return crc_scalar(r, p, n);
}

uint32_t mcf_crc32c(int impl, uint32_t crc, const void *buf, size_t n)
{
    pthread_once(&tables_once, build_tables);
    return ~crc_raw(mcf_crc32c_variant(impl), ~crc, (const uint8_t *)buf, n);
}

/* ---- batches -------------------------------------------------------------------------------------------- */
#if defined(__APPLE__)
#define MTIME_NS(st) ((int64_t)(st).st_mtimespec.tv_sec * 1000000000 + (st).st_mtimespec.tv_nsec)
#define CTIME_NS(st) ((int64_t)(st).st_ctimespec.tv_sec * 1000000000 + (st).st_ctimespec.tv_nsec)
#else
#define MTIME_NS(st) ((int64_t)(st).st_mtim.tv_sec * 1000000000 + (st).st_mtim.tv_nsec)
#define CTIME_NS(st) ((int64_t)(st).st_ctim.tv_sec * 1000000000 + (st).st_ctim.tv_nsec)
#endif

/* bytes read into dst from offset until n or the end of the file; -1 with errno on an error */
static int64_t pread_full(int fd, uint8_t *dst, size_t n, uint64_t offset)
{
    size_t done = 0;
    while (done < n) {
        ssize_t got = pread(fd, dst + done, n - done, (off_t)(offset + done));
        if (got < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (got == 0) break;
        done += (size_t)got;
    }
    return (int64_t)done;
}

static int pwrite_full(int fd, const uint8_t *src, size_t n, uint64_t offset)
{
    size_t done = 0;
    while (done < n) {
        ssize_t put = pwrite(fd, src + done, n - done, (off_t)(offset + done));
        if (put < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        done += (size_t)put;
    }
    return 0;
}

static void fail(mcf_page_io *p, int status, int err)
{
    p->status = status;
    p->err = err;
    if (p->fd >= 0) {
        close(p->fd);
        p->fd = -1;
    }
}

/* open, fstat and the checks that need no read */
static void read_open(mcf_page_io *p, const mcf_page_batch *c)
{
    p->status = MCF_PAGE_OK;
    p->err = 0;
    p->fd = openat(c->dir_fd, p->name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (p->fd < 0) {
        int e = errno;
        if (e == ENOENT || e == ENOTDIR || e == ELOOP || e == ENXIO || e == EISDIR || e == ENAMETOOLONG)
            fail(p, MCF_PAGE_ABSENT, 0);
        else
            fail(p, MCF_PAGE_ERROR, e);
        return;
    }
    struct stat st;
    if (fstat(p->fd, &st) != 0) {
        fail(p, MCF_PAGE_ERROR, errno);
        return;
    }
    if (!S_ISREG(st.st_mode)) {
        fail(p, MCF_PAGE_ABSENT, 0);
        return;
    }
    p->st_dev = (uint64_t)st.st_dev;
    p->st_ino = (uint64_t)st.st_ino;
    p->st_size = (uint64_t)st.st_size;
    p->mtime_ns = MTIME_NS(st);
    p->ctime_ns = CTIME_NS(st);
    if (p->mtime_ns <= c->expire_ns) {
        fail(p, MCF_PAGE_EXPIRED, 0);
        return;
    }
    if (p->st_size != p->head_len + p->payload) {
        fail(p, MCF_PAGE_OTHER_SIZE, 0);
        return;
    }
}

/* the head, then the payload in pieces, each checksummed as it arrives */
static void read_rest(mcf_page_io *p, const mcf_page_batch *c)
{
    if (p->fd < 0) return;
    int64_t head = pread_full(p->fd, p->head, p->head_len, 0);
    if (head < 0) {
        fail(p, MCF_PAGE_ERROR, errno);
        return;
    }
    if ((uint64_t)head < p->head_len) {
        fail(p, MCF_PAGE_SHORT, 0);
        return;
    }
    int variant = mcf_crc32c_variant(c->impl);
    uint32_t r = ~0u;
    uint64_t offset = p->head_len;
    for (int i = 0; i < p->iovcnt; i++) {
        uint8_t *base = (uint8_t *)p->iov[i].iov_base;
        size_t len = p->iov[i].iov_len;
        for (size_t at = 0; at < len; at += PIECE) {
            size_t want = len - at < PIECE ? len - at : PIECE;
            int64_t got = pread_full(p->fd, base + at, want, offset);
            if (got < 0) {
                fail(p, MCF_PAGE_ERROR, errno);
                return;
            }
            if ((uint64_t)got < want) {
                fail(p, MCF_PAGE_SHORT, 0);
                return;
            }
            if (c->checksum) r = crc_raw(variant, r, base + at, want);
            offset += want;
        }
    }
    p->crc = ~r;
    close(p->fd);
    p->fd = -1;
}

static void read_whole(mcf_page_io *p, const mcf_page_batch *c)
{
    read_open(p, c);
    read_rest(p, c);
}

static void put_le32(uint8_t *at, uint32_t v)
{
    for (int i = 0; i < 4; i++) at[i] = (uint8_t)(v >> (8 * i));
}

static void write_one(mcf_page_io *p, const mcf_page_batch *c)
{
    p->status = MCF_PAGE_OK;
    p->err = 0;
    p->fd = openat(c->dir_fd, p->name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (p->fd < 0) {
        fail(p, MCF_PAGE_ERROR, errno);
        return;
    }
    int variant = mcf_crc32c_variant(c->impl);
    uint32_t r = ~0u;
    uint64_t offset = p->head_len;
    int err = 0;
    for (int i = 0; i < p->iovcnt && !err; i++) {
        const uint8_t *base = (const uint8_t *)p->iov[i].iov_base;
        size_t len = p->iov[i].iov_len;
        for (size_t at = 0; at < len; at += PIECE) {
            size_t want = len - at < PIECE ? len - at : PIECE;
            r = crc_raw(variant, r, base + at, want);
            if (pwrite_full(p->fd, base + at, want, offset) != 0) {
                err = errno;
                break;
            }
            offset += want;
        }
    }
    if (!err) {
        p->crc = ~r;
        put_le32(p->head + c->payload_crc_at, p->crc);
        put_le32(p->head + c->head_crc_at, 0);
        put_le32(p->head + c->head_crc_at, ~crc_raw(variant, ~0u, p->head, p->head_sum_len));
        if (pwrite_full(p->fd, p->head, p->head_len, 0) != 0) err = errno;
    }
    if (!err && c->set_mtime_ns >= 0) {
        struct timespec ts[2] = {{c->set_mtime_ns / 1000000000, c->set_mtime_ns % 1000000000},
                                 {c->set_mtime_ns / 1000000000, c->set_mtime_ns % 1000000000}};
        if (futimens(p->fd, ts) != 0) err = errno;
    }
    if (!err && c->durable) {
#if defined(F_FULLFSYNC)
        if (fcntl(p->fd, F_FULLFSYNC) != 0 && fsync(p->fd) != 0) err = errno;
#else
        if (fsync(p->fd) != 0) err = errno;
#endif
    }
    if (close(p->fd) != 0 && !err) err = errno;
    p->fd = -1;
    if (!err && renameat(c->dir_fd, p->name, c->dir_fd, p->final) != 0) err = errno;
    if (err) {
        unlinkat(c->dir_fd, p->name, 0);
        p->status = MCF_PAGE_ERROR;
        p->err = err;
    }
}

typedef struct {
    mcf_page_io *pages;
    size_t n;
    const mcf_page_batch *cfg;
    void (*fn)(mcf_page_io *, const mcf_page_batch *);
    atomic_size_t next;
} job_t;

static void *work(void *arg)
{
    job_t *j = (job_t *)arg;
    for (;;) {
        size_t i = atomic_fetch_add(&j->next, 1);
        if (i >= j->n) break;
        j->fn(&j->pages[i], j->cfg);
    }
    return NULL;
}

/* fn over every page on up to `threads` threads, the caller one of them; a thread that cannot be started
 * leaves its share to the others */
static void run(mcf_page_io *pages, size_t n, const mcf_page_batch *cfg,
                void (*fn)(mcf_page_io *, const mcf_page_batch *))
{
    job_t j = {pages, n, cfg, fn, 0};
    size_t want = cfg->threads < 1 ? 1 : cfg->threads;
    if (want > n) want = n;
    if (want > 64) want = 64;
    pthread_t tid[64];
    size_t started = 0;
    if (want > 1) {
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        for (; started < want - 1; started++)
            if (pthread_create(&tid[started], NULL, work, &j) != 0) break;
        pthread_sigmask(SIG_SETMASK, &old, NULL);
    }
    work(&j);
    for (size_t i = 0; i < started; i++) pthread_join(tid[i], NULL);
}

void mcf_pages_read(mcf_page_io *pages, size_t n, const mcf_page_batch *cfg)
{
    pthread_once(&tables_once, build_tables);
    for (size_t i = 0; i < n; i++) pages[i].fd = -1;
    run(pages, n, cfg, read_whole);
}

void mcf_pages_write(mcf_page_io *pages, size_t n, const mcf_page_batch *cfg)
{
    pthread_once(&tables_once, build_tables);
    for (size_t i = 0; i < n; i++) pages[i].fd = -1;
    run(pages, n, cfg, write_one);
}

size_t mcf_pages_live(int dir_fd, const char *const *names, size_t n, uint64_t min_size, int64_t expire_ns,
                      int stop_at_gap, uint8_t *live)
{
    size_t count = 0;
    for (size_t i = 0; i < n; i++) {
        struct stat st;
        int ok = fstatat(dir_fd, names[i], &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode) &&
                 (uint64_t)st.st_size >= min_size && MTIME_NS(st) > expire_ns;
        if (live) live[i] = (uint8_t)ok;
        if (ok) count++;
        else if (stop_at_gap) return count;
    }
    return count;
}
