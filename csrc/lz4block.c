/* LZ4 block decoding straight into a caller's buffer (the lz4 package's block API can only return a
 * new bytes object, whose fresh pages cost more to fault in than the decoding itself).
 *
 * Block format (lz4_Block_format.md): sequences of a token (4 bits literal length, 4 bits match
 * length - 4), extra length bytes while 255, the literals, a 2-byte little-endian offset and extra
 * match-length bytes; the last sequence has literals only.  Every length and offset is checked against
 * both buffers before any byte moves: a malformed block returns an error code, never reads or writes
 * outside [src, src+src_len) and [dst, dst+dst_len).  The output must fill dst exactly.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "lz4block.h"

/* The extra bytes of a length whose 4-bit field was 15, added to *len: each byte is added, and another follows
 * while it is 255.  Returns 0, or -1 when the input ends first. */
static inline int add_length_bytes(const uint8_t **ip, const uint8_t *iend, size_t *len)
{
    unsigned b;
    do {
        if (*ip >= iend)
            return -1;
        b = *(*ip)++;
        *len += b; /* at most 255 per input byte: cannot overflow size_t */
    } while (b == 255);
    return 0;
}

int64_t mcf_lz4_decompress_into(const uint8_t *src, size_t src_len, uint8_t *dst, size_t dst_len)
{
    const uint8_t *ip = src, *const iend = src + src_len;
    uint8_t *op = dst, *const oend = dst + dst_len;

    if (src_len == 0)
        return MCF_LZ4_MALFORMED; /* even an empty block holds one token */
    for (;;) {
        unsigned token = *ip++;
        size_t lit = token >> 4;
        if (lit == 15 && add_length_bytes(&ip, iend, &lit) != 0)
            return MCF_LZ4_MALFORMED;
        if (lit > (size_t)(iend - ip))
            return MCF_LZ4_MALFORMED;
        if (lit > (size_t)(oend - op))
            return MCF_LZ4_TOO_LONG;
        memcpy(op, ip, lit);
        op += lit;
        ip += lit;
        if (ip == iend)
            break; /* the last sequence: literals only */
        if (iend - ip < 2)
            return MCF_LZ4_MALFORMED;
        size_t offset = (size_t)ip[0] | ((size_t)ip[1] << 8);
        ip += 2;
        if (offset == 0 || offset > (size_t)(op - dst))
            return MCF_LZ4_MALFORMED; /* a match may only refer to bytes already written */
        size_t mlen = token & 15;
        if (mlen == 15 && add_length_bytes(&ip, iend, &mlen) != 0)
            return MCF_LZ4_MALFORMED;
        mlen += 4;
        if (mlen > (size_t)(oend - op))
            return MCF_LZ4_TOO_LONG;
        /* the bytes from op - offset on repeat with period `offset`; copying from a distance that is a
         * multiple of it, never more bytes than that distance, keeps each memcpy non-overlapping, and
         * doubling the distance makes long runs (offset 1: a repeated byte) take log2 steps */
        size_t dist = offset;
        while (mlen > 0) {
            size_t n = mlen < dist ? mlen : dist;
            memcpy(op, op - dist, n);
            op += n;
            mlen -= n;
            dist += dist;
        }
    }
    if (op != oend)
        return MCF_LZ4_TOO_SHORT;
    return (int64_t)(op - dst);
}
