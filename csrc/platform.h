/* What differs between the POSIX systems mcf builds on (Linux and macOS), each in one place.  Windows is not
 * one of them: the I/O core is POSIX (mmap, pread, descriptor-relative opens; README.md "Platforms").
 *
 * - Which filesystem holds a file: Linux names it by fstatfs's f_type magic number (linux/magic.h), which
 *   mcf._core.storage maps to a kind; macOS has no sys/vfs.h, and its f_type numbers are its own, but
 *   statfs carries the type's name (f_fstypename: "apfs", "nfs", "smbfs", "macfuse"...).
 * - MAP_NORESERVE (a private mapping's copy-on-write pages are not reserved up front) where the system has
 *   it; without it the flag is 0 and the mapping is made the same way.
 * The other differences are in Python, next to their callers' rules: fsync vs F_FULLFSYNC and
 * posix_fallocate (mcf._core.fs), O_DIRECT (mcf._core._io: absent on macOS, reads stay buffered); the CPU
 * features in csrc/cpu.c. */
#ifndef MCF_PLATFORM_H
#define MCF_PLATFORM_H
#include <stddef.h>
#include <string.h>
#include <sys/mman.h>
#if defined(__APPLE__)
#include <sys/mount.h>
#include <sys/param.h>
#else
#include <sys/vfs.h>
#endif

#ifndef MAP_NORESERVE
#define MAP_NORESERVE 0
#endif

/* The filesystem holding fd: *magic is Linux's f_type (0 on macOS), name its type name on macOS ("" on
 * Linux), at most cap - 1 bytes.  Returns 0, or -1 with errno set. */
static inline int mcf_fs_of_fd(int fd, unsigned long *magic, char *name, size_t cap)
{
    struct statfs b;
    if (fstatfs(fd, &b) != 0) return -1;
    if (cap) name[0] = 0;
#if defined(__APPLE__)
    *magic = 0;
    if (cap) {
        strncpy(name, b.f_fstypename, cap - 1);
        name[cap - 1] = 0;
    }
#else
    *magic = (unsigned long)b.f_type;
#endif
    return 0;
}

#endif
