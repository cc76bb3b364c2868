/* multihead's native CPU kernels, compiled on first use by multihead.native (cc -O3 -march=native -fopenmp).

   mh_gemv_bf16: y = W x (+ bias) for one bfloat16 row x, float32 accumulation, rounded to bfloat16 once
   (round to nearest even), the same product as F.linear(x, W, bias) within bfloat16's rounding. The weight is read
   once, four rows at a time, with software prefetch PREFETCH_ROWS rows ahead: decoding's one-row product is bound by
   reading the weight, and without the prefetch the loop reached ~9-10 GB/s on the 2-core Xeon of
   benchmarks/RESULTS.md where a large sum reads 17-21 GB/s (measured with it: 21-25 GB/s). With AVX512-BF16 the
   products are _mm512_dpbf16_ps (pairs of bfloat16 products added into float32 lanes); without it, a portable loop.
   The rows are spread over `threads` OpenMP threads (the process's runtime: PyTorch's own libgomp when loaded). */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#define PREFETCH_ROWS 16

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays a (quiet) NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#if defined(__AVX512BF16__)
static inline __m512bh load_bh(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512((const void *)p); }
static inline __m512bh load_bh_masked(__mmask32 m, const uint16_t *p) {
    return (__m512bh)_mm512_maskz_loadu_epi16(m, (const void *)p);
}

static inline void dot4(const uint16_t *w, int64_t ld, const uint16_t *x, int64_t in, float *o) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t j = 0;
    for (; j + 32 <= in; j += 32) {
        __m512bh xv = load_bh(x + j);
        _mm_prefetch((const char *)(w + PREFETCH_ROWS * ld + j), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + (PREFETCH_ROWS + 1) * ld + j), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + (PREFETCH_ROWS + 2) * ld + j), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + (PREFETCH_ROWS + 3) * ld + j), _MM_HINT_T0);
        a0 = _mm512_dpbf16_ps(a0, load_bh(w + j), xv);
        a1 = _mm512_dpbf16_ps(a1, load_bh(w + ld + j), xv);
        a2 = _mm512_dpbf16_ps(a2, load_bh(w + 2 * ld + j), xv);
        a3 = _mm512_dpbf16_ps(a3, load_bh(w + 3 * ld + j), xv);
    }
    if (j < in) {
        __mmask32 m = (__mmask32)((1ull << (in - j)) - 1);
        __m512bh xv = load_bh_masked(m, x + j);
        a0 = _mm512_dpbf16_ps(a0, load_bh_masked(m, w + j), xv);
        a1 = _mm512_dpbf16_ps(a1, load_bh_masked(m, w + ld + j), xv);
        a2 = _mm512_dpbf16_ps(a2, load_bh_masked(m, w + 2 * ld + j), xv);
        a3 = _mm512_dpbf16_ps(a3, load_bh_masked(m, w + 3 * ld + j), xv);
    }
    o[0] = _mm512_reduce_add_ps(a0);
    o[1] = _mm512_reduce_add_ps(a1);
    o[2] = _mm512_reduce_add_ps(a2);
    o[3] = _mm512_reduce_add_ps(a3);
}

static inline float dot1(const uint16_t *w, const uint16_t *x, int64_t in) {
    __m512 a = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 32 <= in; j += 32) a = _mm512_dpbf16_ps(a, load_bh(w + j), load_bh(x + j));
    if (j < in) {
        __mmask32 m = (__mmask32)((1ull << (in - j)) - 1);
        a = _mm512_dpbf16_ps(a, load_bh_masked(m, w + j), load_bh_masked(m, x + j));
    }
    return _mm512_reduce_add_ps(a);
}
#else
static inline float dot1(const uint16_t *w, const uint16_t *x, int64_t in) {
    float a = 0.0f;
    for (int64_t j = 0; j < in; j++) a += bf16_to_f32(w[j]) * bf16_to_f32(x[j]);
    return a;
}

static inline void dot4(const uint16_t *w, int64_t ld, const uint16_t *x, int64_t in, float *o) {
    for (int k = 0; k < 4; k++) o[k] = dot1(w + k * ld, x, in);
}
#endif

/* 1 when the AVX512-BF16 products were compiled in, 0 for the portable loop */
int mh_gemv_bf16_vectorised(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* y[r] = sum_j w[r * ld + j] * x[j] (+ bias[r]) for r < out; bias may be NULL */
void mh_gemv_bf16(const uint16_t *w, int64_t ld, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t out,
                  int64_t in, int threads) {
    int64_t blocks = out / 4;
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        float o[4];
        dot4(w + 4 * b * ld, ld, x, in, o);
        for (int k = 0; k < 4; k++) {
            int64_t r = 4 * b + k;
            y[r] = f32_to_bf16(o[k] + (bias ? bf16_to_f32(bias[r]) : 0.0f));
        }
    }
    for (int64_t r = 4 * blocks; r < out; r++)
        y[r] = f32_to_bf16(dot1(w + r * ld, x, in) + (bias ? bf16_to_f32(bias[r]) : 0.0f));
}
