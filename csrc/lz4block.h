#ifndef MCF_LZ4BLOCK_H
#define MCF_LZ4BLOCK_H
#include <stddef.h>
#include <stdint.h>

#define MCF_LZ4_MALFORMED (-1) /* truncated sequence, or a match before the start of the output */
#define MCF_LZ4_TOO_LONG (-2)  /* decodes to more than dst_len bytes */
#define MCF_LZ4_TOO_SHORT (-3) /* decodes to fewer than dst_len bytes */

/* Decode one LZ4 block of src_len bytes into exactly dst_len bytes at dst; returns dst_len or one of
 * the negative codes above.  Never touches memory outside the two ranges. */
int64_t mcf_lz4_decompress_into(const uint8_t *src, size_t src_len, uint8_t *dst, size_t dst_len);

#endif
