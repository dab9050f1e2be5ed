# The float conversions' C-level surface, for compiled code that wraps mcf (see docs/extending.md):
# ``cimport mcf._core._fpconv`` gives the GIL-free conversion loops of csrc/fpconv*.c, and the one rule that
# turns an ``impl=`` keyword / $MCF_FORCE_IMPL into a variant index.
from libc.stdint cimport uint16_t

# The variant to run: ``impl`` ("scalar", "avx2", "avx512", "neon") if not None, else $MCF_FORCE_IMPL, else the
# best this CPU has.  Raises mcf.InvalidArgumentError for an unknown variant or one the CPU cannot run.
cdef int resolve_impl(object impl) except -1

# n elements from src to dst, with the variant index ``impl`` from resolve_impl().  Nothing is checked:
# the caller owns both buffers (n elements each, aligned for their type) and passes a resolved impl.
# Bit-identical for every variant (round to nearest even).
cdef void bf16_to_f32_n(const uint16_t* src, float* dst, size_t n, int impl) noexcept nogil
cdef void f32_to_bf16_n(const float* src, uint16_t* dst, size_t n, int impl) noexcept nogil
cdef void f16_to_f32_n(const uint16_t* src, float* dst, size_t n, int impl) noexcept nogil
cdef void f32_to_f16_n(const float* src, uint16_t* dst, size_t n, int impl) noexcept nogil
