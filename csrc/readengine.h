/* The read engine: a plan of byte ranges read from one file by a pool of threads with pread, straight
 * into the destinations.
 *
 * The caller (mcf/_core/_io.pyx) checks every range against the file size and every destination against
 * its buffer before calling, and keeps the descriptors open until the call returns; nothing here
 * re-checks them.  What this file does check is what the file answers: a read that returns fewer bytes
 * than asked is retried until the file ends (then the plan fails as truncated), EINTR is retried, any
 * other errno fails the plan.  The first failure stops every worker before its next request and is the
 * one reported.
 *
 * Memory: the plan's ranges (sorted and coalesced in place), one prefix-count array, and with O_DIRECT at
 * most one chunk-sized aligned buffer per worker, for the requests whose destination or range is not
 * aligned.  Nothing else is allocated, whatever the size of the plan. */
#ifndef MCF_READENGINE_H
#define MCF_READENGINE_H
#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint64_t offset;            /* file offset */
    uint64_t size;              /* bytes; zero-size ranges are dropped */
    uint8_t *dst;               /* where the bytes go */
} mcf_read_range;

typedef struct {
    int fd;                     /* buffered descriptor, open for reading */
    int direct_fd;              /* the same file opened with O_DIRECT, or -1 for buffered reads only */
    unsigned threads;           /* workers (>= 1); the calling thread is one of them */
    uint64_t chunk;             /* most bytes per request (>= 1; a multiple of align when direct_fd >= 0) */
    uint64_t align;             /* O_DIRECT alignment of offsets, lengths and memory (a power of two) */
    int streams;                /* 0: one stream, every worker takes the next request through fd;
                                 * 1: per-worker streams, see mcf_read_plan */
} mcf_read_config;

typedef struct {
    int error;                  /* errno of the first failure, 0 when none */
    int truncated;              /* the file ended before a range did */
    uint64_t fail_offset;       /* file offset where the failing read stopped */
    uint64_t bytes;             /* bytes the file returned (O_DIRECT: alignment padding included) */
    uint64_t requests;          /* read calls that returned data or failed */
    uint64_t ranges;            /* ranges left after dropping empty ones and coalescing neighbours */
    unsigned threads;           /* workers that ran (never more than the requests) */
    int direct;                 /* some request went through direct_fd */
    int direct_refused;         /* the filesystem refused O_DIRECT (EINVAL): buffered from then on */
    unsigned streams;           /* workers that read a contiguous part of the plan through a descriptor of
                                 * their own (0 in one-stream mode, or where the file could not be reopened) */
    unsigned steals;            /* times an idle worker took over the second half of another's part */
} mcf_read_result;

/* Read every range of `ranges` (n entries, reordered and coalesced in place: ranges adjacent both in
 * the file and in memory become one) in requests of at most cfg->chunk bytes whose boundaries fall on
 * multiples of cfg->chunk in the file.
 *
 * cfg->streams == 0: the workers take requests in file order from one counter, all through cfg->fd (a
 * network filesystem sees `threads` requests in flight).  cfg->streams == 1: the plan is cut into one
 * contiguous part per worker, of equal bytes, and each worker reads its part front to back through a
 * descriptor of its own (the file reopened through /proc/self/fd: a new open file description, so the
 * kernel keeps one readahead window per part, advised POSIX_FADV_SEQUENTIAL), as `fio --numjobs` reads
 * a file; a worker done with its part takes over the second half of the largest part left.  Where the
 * file cannot be reopened (no /proc, no descriptor left) a worker reads its part through cfg->fd.
 *
 * Returns 0 when every byte arrived, -1 when the plan failed (res->error / res->truncated /
 * res->fail_offset say how; res->error is ENOMEM when the scratch arrays could not be allocated, before
 * anything was read).  On a failure no worker starts a request beyond it, and every request before it
 * is still made, so the failure reported is the one at the lowest offset (where the file really ended).
 * Runs without touching Python: call it with the GIL released. */
int mcf_read_plan(mcf_read_range *ranges, size_t n, const mcf_read_config *cfg, mcf_read_result *res);

/* Whether two non-empty ranges of the plan share a destination byte: returns 1 and their indices (first <
 * second) if so, 0 if not, -1 when the scratch array could not be allocated.  The caller checks this before
 * reading: bytes written twice by different workers would depend on timing. */
int mcf_plan_overlap(const mcf_read_range *ranges, size_t n, size_t *first, size_t *second);

#endif
