/* The benchmarks' store limit (csrc/yardstick.c): n bytes widened into n 32-bit lanes. */
#ifndef MCF_YARDSTICK_H
#define MCF_YARDSTICK_H
#include <stddef.h>
#include <stdint.h>

void mcf_store_yardstick(const uint8_t *src, uint32_t *dst, size_t n, int streaming);

#endif
