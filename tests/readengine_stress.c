/* csrc/readengine.c on its own, for ThreadSanitizer and AddressSanitizer builds (tests/test_read_engine.py
 * compiles and runs it): argv[2] (default 300) random plans over the file named by argv[1] (neighbours in
 * the file and in memory, empty ranges, 1..16 workers, chunks of 4 KiB..128 KiB, every third plan through
 * O_DIRECT, every other one in per-worker streams, and in some of those the starting of workers failing
 * after the first few, so that parts without a worker are taken over), each compared with one pread of the
 * whole file; then a plan past the end, in both layouts, which must fail as truncated at the file's size.
 * Prints "ok" and exits 0 when all held.
 *
 * The engine is included rather than linked, so that its pthread_create can be made to fail. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int creates_left = -1;           /* -1: every pthread_create succeeds; else this many more do */

static int stress_pthread_create(pthread_t *t, const pthread_attr_t *a, void *(*fn)(void *), void *arg) {
    if (creates_left == 0)
        return EAGAIN;
    if (creates_left > 0)
        creates_left--;
    return pthread_create(t, a, fn, arg);
}

#define pthread_create stress_pthread_create
#include "readengine.c"
#undef pthread_create

int main(int argc, char **argv) {
    const char *path = argv[1];
    int fd = open(path, O_RDONLY), dfd = open(path, O_RDONLY | O_DIRECT);   /* dfd -1: no O_DIRECT here */
    int plans = argc > 2 ? atoi(argv[2]) : 300;
    if (argc < 2 || fd < 0)
        return 2;
    off_t size = lseek(fd, 0, SEEK_END);
    uint8_t *file = malloc(size);
    if (pread(fd, file, size, 0) != size) return 2;
    unsigned long steals = 0, short_pools = 0;
    srand(1);
    for (int it = 0; it < plans; it++) {
        size_t n = 1 + rand() % 200;
        mcf_read_range *r = calloc(n, sizeof(*r));
        uint64_t *off = calloc(n, 8), *sz = calloc(n, 8), *dpos = calloc(n, 8), total = 0;
        for (size_t i = 0; i < n; i++) {
            off[i] = (uint64_t)rand() % size;
            uint64_t cap = size - off[i];
            sz[i] = rand() % 4 == 0 ? 0 : (uint64_t)rand() % (cap < 300000 ? cap + 1 : 300000);
            if (i && rand() % 3 == 0 && off[i - 1] + sz[i - 1] <= (uint64_t)size) {   /* file and memory neighbours */
                off[i] = off[i - 1] + sz[i - 1];
                cap = size - off[i];
                if (sz[i] > cap) sz[i] = cap;
            }
            dpos[i] = total;
            total += sz[i] + (rand() % 2 ? 0 : 17);
        }
        uint8_t *arena = malloc(total + 1);
        memset(arena, 0xA5, total + 1);
        for (size_t i = 0; i < n; i++) r[i] = (mcf_read_range){off[i], sz[i], arena + dpos[i]};
        mcf_read_config cfg = {fd, it % 3 == 0 ? dfd : -1, 1 + rand() % 16, 4096u << (rand() % 6), 4096, it % 2};
        creates_left = cfg.streams && it % 4 == 1 ? rand() % 3 : -1;
        mcf_read_result res;
        int rc = mcf_read_plan(r, n, &cfg, &res);
        creates_left = -1;
        if (rc != 0) { printf("failed: %d %d\n", res.error, res.truncated); return 1; }
        steals += res.steals;
        short_pools += res.threads < cfg.threads && res.threads < res.requests;
        if (res.streams > res.threads) { printf("streams %u > threads %u\n", res.streams, res.threads); return 1; }
        uint64_t want = 0;
        for (size_t i = 0; i < n; i++) {
            want += sz[i];
            if (memcmp(arena + dpos[i], file + off[i], sz[i])) {
                printf("mismatch: plan %d, range %zu\n", it, i);
                return 1;
            }
        }
        if (cfg.direct_fd < 0 && res.bytes != want) { printf("bytes %lu != %lu\n", res.bytes, want); return 1; }
        free(arena); free(r); free(off); free(sz); free(dpos);
    }
    /* truncated: ask past the end; in per-worker streams the parts beyond the end fail first, and the part
     * holding the end must still get there */
    uint8_t *buf = malloc(size + 100000);
    for (int streams = 0; streams < 2; streams++) {
        mcf_read_range r = {0, size + 100000, buf};
        mcf_read_config cfg = {fd, -1, 8, 65536, 4096, streams};
        mcf_read_result res;
        int rc = mcf_read_plan(&r, 1, &cfg, &res);
        printf("past end, streams %d: rc %d truncated %d at %lu (size %ld), %lu bytes\n", streams, rc, res.truncated,
               (unsigned long)res.fail_offset, (long)size, (unsigned long)res.bytes);
        if (rc == 0 || !res.truncated || res.fail_offset != (uint64_t)size || res.bytes != (uint64_t)size
            || memcmp(buf, file, size))
            return 1;
    }
    free(buf);
    printf("%lu steals, %lu plans with workers that did not start\n", steals, short_pools);
    free(file);
    close(fd);
    if (dfd >= 0)
        close(dfd);
    puts("ok");
    return 0;
}
