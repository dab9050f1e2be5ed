/* Pages (mcf/bucket/pages.py): the checksum of a page (CRC-32C) and the batch reads and writes of the
 * bucket's pages area, each one call for a whole batch, run on a few threads without the GIL.
 *
 * The checksum is CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, initial value and final xor
 * 0xFFFFFFFF, as iSCSI, ext4 and btrfs use): x86-64 has an instruction for it (SSE4.2 `crc32`) and so has
 * aarch64 (the ARMv8 CRC extension, `crc32cx`), where zlib's CRC-32 needs carry-less multiplication folding
 * to be as fast.  The scalar table code is always compiled and is the reference; the hardware variant is
 * picked at run time (cpu.h's variants: the AVX2 / AVX-512 rows run SSE4.2's instruction, the NEON row the
 * ARMv8 CRC one, each only where cpuid / the auxiliary vector reports it, else the scalar code).
 *
 * The page layout is the caller's: it passes where the two checksum fields are in the bytes before the
 * payload (the "head": header, key, metadata, padding), so the layout is written once, in pages.py.
 * Nothing here interprets a page's header beyond filling in (write) or returning (read) checksums: the
 * caller checks what it reads. */
#ifndef MCF_PAGEIO_H
#define MCF_PAGEIO_H
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

/* CRC-32C of buf, continuing from crc (0 to start), as variant impl (cpu.h) runs it. */
uint32_t mcf_crc32c(int impl, uint32_t crc, const void *buf, size_t n);
/* The variant mcf_crc32c really runs for impl on this CPU (scalar where the instruction is missing). */
int mcf_crc32c_variant(int impl);

enum {
    MCF_PAGE_OK = 0,        /* read whole; crc is the payload's CRC-32C (when asked), head holds the head */
    MCF_PAGE_ABSENT = 1,    /* no file, or a name that is no regular file (a link, a FIFO, a directory) */
    MCF_PAGE_EXPIRED = 2,   /* the file's mtime is at or before expire_ns */
    MCF_PAGE_OTHER_SIZE = 3,/* the file is not head_len + payload bytes: the caller looks at it itself */
    MCF_PAGE_SHORT = 4,     /* the file ended early (it shrank under the read) */
    MCF_PAGE_ERROR = 5,     /* an I/O error: err is its errno */
    MCF_PAGE_EXISTS = 6,    /* write: a page is there and was kept (only when keep_existing) */
};

typedef struct {
    const char *name;       /* read: the page's name; write: the temp name, renamed to `final` */
    const char *final;      /* write only: the page's name */
    uint8_t *head;          /* read: filled with the head_len bytes before the payload; write: the head to
                             * write, whose checksum fields this call fills in */
    uint64_t head_len;
    uint64_t head_sum_len;  /* write: the head's CRC covers head[0:head_sum_len] (its own field zero) */
    const struct iovec *iov;/* the payload: where it is read to / written from, in order */
    int iovcnt;
    uint64_t payload;       /* bytes of payload (the sum of iov) */
    /* results */
    int status;
    int err;
    uint32_t crc;           /* the payload's CRC-32C */
    uint64_t st_dev, st_ino, st_size;
    int64_t mtime_ns, ctime_ns;
    int fd;                 /* internal: the page's descriptor while it is read or written */
} mcf_page_io;

typedef struct {
    int dir_fd;             /* the namespace's directory: every name is relative to it */
    unsigned threads;       /* workers, the calling thread included (>= 1) */
    int impl;               /* the CRC variant */
    int checksum;           /* read: compute the payload's CRC (write always does) */
    int64_t expire_ns;      /* read: a file whose mtime_ns <= this is expired (INT64_MIN: never) */
    int64_t set_mtime_ns;   /* write: give each page this time (-1: leave the file system's) */
    int durable;            /* write: fsync each page before its rename */
    uint64_t payload_crc_at;/* write: offset in head of the payload's CRC field (4 bytes, little-endian) */
    uint64_t head_crc_at;   /* write: offset in head of the head's CRC field */
} mcf_page_batch;

/* Read every page of `pages` (n entries) into its head and iov: open it (O_NOFOLLOW | O_NONBLOCK, relative
 * to dir_fd), fstat it (a regular file, unexpired, of head_len + payload bytes), read the head, then the
 * payload in 256 KiB pieces, each checksummed right after it arrives (still in the cache).  Each entry's
 * status says what happened; the call itself cannot fail.  Runs without touching Python. */
void mcf_pages_read(mcf_page_io *pages, size_t n, const mcf_page_batch *cfg);

/* Write every page: the payload in pieces, checksummed as they go, to the temp file `name` (created
 * O_EXCL), then the head with both checksums filled in, then (durable) fsync, then rename to `final`.  A
 * failure removes the temp file and leaves err.  Runs without touching Python. */
void mcf_pages_write(mcf_page_io *pages, size_t n, const mcf_page_batch *cfg);

/* How many of names[0..n), from the first, are live pages (a regular file of at least min_size bytes,
 * unexpired): one fstatat each, stopping at the first that is not (stop_at_gap), else live[i] for each. */
size_t mcf_pages_live(int dir_fd, const char *const *names, size_t n, uint64_t min_size, int64_t expire_ns,
                      int stop_at_gap, uint8_t *live);

#endif
