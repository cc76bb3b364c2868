/* multihead's native CPU kernels, built by an explicit step (python -m multihead.kernels.native build, multihead
   tune, the set-up) once per instruction-set variant (cc -O3 -fopenmp and the variant's -m flags: "generic",
   "avx512", "avx512bf16"; the CPU's best one is loaded at run time): mh_gemv_bf16 and mh_gemv_f32 (decoding's
   one-row bfloat16 and float32 products), mh_attend_quantized (a decode step over a 4- or 8-bit cache's codes),
   mh_attend_dense (a decode step over a float32/bfloat16 cache) and mh_quantize / mh_dequantize (a quantized
   cache's codec, written and read back in one pass), each described where it is defined. The attention kernels and
   the codec take their arguments as one struct (mh_dense_args, mh_quant_args, mh_codec_args), declared in kernels.h
   with every prototype and filled by ops.cpp, the PyTorch operators linked with this file into one library a
   variant; mh_isa says which instruction sets the variant was compiled with.

   mh_gemv_bf16: y = W x (+ bias) for one bfloat16 row x, float32 accumulation, rounded to bfloat16 once
   (round to nearest even), the same product as F.linear(x, W, bias) within bfloat16's rounding. Decoding's one-row
   product is bound by reading the weight: each row is read once, straight through (one stream a thread, which the
   hardware prefetchers follow), with a software prefetch GEMV_AHEAD_BYTES ahead. Without any prefetch the loop
   reached ~9-10 GB/s on the 2-core Xeon of benchmarks/RESULTS.md where a large sum reads 17-21 GB/s; four rows
   read side by side with a prefetch 16 rows ahead reached 21-25 GB/s there but 16-18 on the AMD host of 2026-12-07,
   where this row by row loop reads as fast as PyTorch's best kind ("blas"; benchmarks/products.py). With
   AVX512-BF16 the products are _mm512_dpbf16_ps (pairs of bfloat16 products added into float32 lanes); without it,
   a portable loop. The rows are spread over `threads` OpenMP threads (the process's runtime: PyTorch's own libgomp
   when loaded). */
#include <stdint.h>
#include <string.h>

#include "kernels.h" /* the structs and prototypes, shared with ops.cpp */
#if defined(__AVX512F__) /* the AVX-512 paths; the bfloat16 products also need AVX512-BF16 */
#include <immintrin.h>
#endif

#define GEMV_AHEAD_BYTES 2048 /* the one-row products' prefetch distance along the weight */

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

/* one row's dot product, the row streamed in 256-byte steps (four accumulators) with a prefetch GEMV_AHEAD_BYTES
   ahead along the weight (the next rows' lines once near the row's end) */
static inline float dot1(const uint16_t *w, const uint16_t *x, int64_t in) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const char *ahead = (const char *)w + GEMV_AHEAD_BYTES;
    int64_t j = 0;
    for (; j + 128 <= in; j += 128) {
        _mm_prefetch(ahead + 2 * j, _MM_HINT_T0);
        _mm_prefetch(ahead + 2 * j + 64, _MM_HINT_T0);
        _mm_prefetch(ahead + 2 * j + 128, _MM_HINT_T0);
        _mm_prefetch(ahead + 2 * j + 192, _MM_HINT_T0);
        a0 = _mm512_dpbf16_ps(a0, load_bh(w + j), load_bh(x + j));
        a1 = _mm512_dpbf16_ps(a1, load_bh(w + j + 32), load_bh(x + j + 32));
        a2 = _mm512_dpbf16_ps(a2, load_bh(w + j + 64), load_bh(x + j + 64));
        a3 = _mm512_dpbf16_ps(a3, load_bh(w + j + 96), load_bh(x + j + 96));
    }
    for (; j + 32 <= in; j += 32) a0 = _mm512_dpbf16_ps(a0, load_bh(w + j), load_bh(x + j));
    if (j < in) {
        __mmask32 m = (__mmask32)((1ull << (in - j)) - 1);
        a1 = _mm512_dpbf16_ps(a1, load_bh_masked(m, w + j), load_bh_masked(m, x + j));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}
#else
static inline float dot1(const uint16_t *w, const uint16_t *x, int64_t in) {
    float a = 0.0f;
    for (int64_t j = 0; j < in; j++) a += bf16_to_f32(w[j]) * bf16_to_f32(x[j]);
    return a;
}
#endif

/* the instruction sets this variant was compiled with: bit 0 AVX-512 (F, BW, DQ, VL: the attention kernels' fast
   chunks), bit 1 AVX512-BF16 (the bfloat16 products); 0 for the portable loops */
int mh_isa(void) {
    int isa = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    isa |= 1;
#endif
#if defined(__AVX512BF16__)
    isa |= 2;
#endif
    return isa;
}

/* y[r] = sum_j w[r * ld + j] * x[j] (+ bias[r]) for r < out; bias may be NULL */
void mh_gemv_bf16(const uint16_t *w, int64_t ld, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t out,
                  int64_t in, int threads) {
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < out; r++)
        y[r] = f32_to_bf16(dot1(w + r * ld, x, in) + (bias ? bf16_to_f32(bias[r]) : 0.0f));
}

/* mh_gemv_f32: y = W x (+ bias) for one float32 row x, the same product as F.linear(x, W, bias) within float32's
   rounding (the sums in another order). Read like mh_gemv_bf16: row by row, a prefetch GEMV_AHEAD_BYTES ahead, the
   rows spread over `threads` OpenMP threads; AVX-512 FMA where the variant has AVX-512, else a portable loop. */
#if defined(__AVX512F__)
static inline float dot1_f32(const float *w, const float *x, int64_t in) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const char *ahead = (const char *)w + GEMV_AHEAD_BYTES;
    int64_t j = 0;
    for (; j + 64 <= in; j += 64) {
        _mm_prefetch(ahead + 4 * j, _MM_HINT_T0);
        _mm_prefetch(ahead + 4 * j + 64, _MM_HINT_T0);
        _mm_prefetch(ahead + 4 * j + 128, _MM_HINT_T0);
        _mm_prefetch(ahead + 4 * j + 192, _MM_HINT_T0);
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + j), _mm512_loadu_ps(x + j), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + j + 16), _mm512_loadu_ps(x + j + 16), a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w + j + 32), _mm512_loadu_ps(x + j + 32), a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(w + j + 48), _mm512_loadu_ps(x + j + 48), a3);
    }
    for (; j + 16 <= in; j += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + j), _mm512_loadu_ps(x + j), a0);
    if (j < in) {
        __mmask16 m = (__mmask16)((1u << (in - j)) - 1);
        a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w + j), _mm512_maskz_loadu_ps(m, x + j), a1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}
#else
static inline float dot1_f32(const float *w, const float *x, int64_t in) {
    float a = 0.0f;
    for (int64_t j = 0; j < in; j++) a += w[j] * x[j];
    return a;
}
#endif

/* y[r] = sum_j w[r * ld + j] * x[j] (+ bias[r]) for r < out; bias may be NULL */
void mh_gemv_f32(const float *w, int64_t ld, const float *x, const float *bias, float *y, int64_t out, int64_t in,
                 int threads) {
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < out; r++) y[r] = dot1_f32(w + r * ld, x, in) + (bias ? bias[r] : 0.0f);
}

/* ------------------------------------------------------------------------------------------------------------------
   mh_attend_quantized: one decode step's attention over a 4- or 8-bit KIVI cache (multihead.cache.QuantizedKVCache)
   read as codes, never dequantised into memory (its dispatcher is at the end of the file, after the 8-bit chunks).
   Keys are quantized per channel over groups of `group` tokens (scale and minimum per group and channel), values per
   token over groups of `group` channels; 4 bits: two codes a byte, the even channel in the low nibble; 8 bits: one
   code a byte. For a query q and a key group with scales s and minimums mn:
       q . k_t = sum_c (q_c s_c) code_tc + sum_c q_c mn_c
   and for the weights p_t of the softmax:
       out_c = sum_t (p_t s_t,grp(c)) code_tc + sum_t p_t mn_t,grp(c)
   so each code is read once and turned into a float once per query head of its KV head. The `m` full-precision keys
   and values after the codes (the residual window and the step's own tokens, float32) are attended in the same
   softmax. Work items: (batch, KV head, chunk of MH_CHUNK tokens) and (batch, KV head, the full-precision tail), each
   a partial softmax (max, sum, weighted values) in `scratch`, merged per query head at the end (flash decoding).
   Layouts: q and out (B, G, HPG, D) float32 contiguous (query head h = g * HPG + i); code rows of D * bits / 8 bytes
   and key-scale rows of D halves, value-scale rows of D / group halves, with the given batch and head strides (in
   elements); tk, tv (B, G, m, D) float32 contiguous. Needs D % group == 0, and for 4 bits D and group even. */

#define MH_CHUNK 256

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, ex = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    float f;
    if (ex == 0) {
        f = (float)man * 5.9604644775390625e-8f; /* 2^-24: zero or subnormal */
        memcpy(&u, &f, sizeof u);
        u |= sign;
    } else if (ex == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((ex + 112u) << 23) | (man << 13);
    }
    memcpy(&f, &u, sizeof f);
    return f;
}

#include <math.h>

/* exp(x) for x <= 0 (a softmax's shifted scores), vectorisable: 2^n * e^r with |r| <= ln2 / 2 and a degree-6
   polynomial for e^r (relative error under 2e-7); 0 below -87 (e^-87 is under float's smallest normal) */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = __builtin_roundevenf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (0.166666672f + r * (4.16666716e-2f + r * (8.33336078e-3f
              + r * 1.38889148e-3f)))));
    int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, sizeof scale);
    return x <= -87.0f ? 0.0f : p * scale;
}

#if defined(__AVX512F__)
/* exp_neg on 16 lanes (the same polynomial and range) */
static inline __m512 exp_neg16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.38889148e-3f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.33336078e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.16666716e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.166666672f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GT_OQ), y);
}

/* r[0..n) -> exp(r - max), in place; returns the sum, *mx the max (the chunk's unnormalised softmax) */
static inline float softmax_part(float *r, int64_t n, float *mx_out) {
    __m512 m16 = _mm512_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) m16 = _mm512_max_ps(m16, _mm512_loadu_ps(r + i));
    float mx = _mm512_reduce_max_ps(m16);
    for (; i < n; i++) mx = r[i] > mx ? r[i] : mx;
    __m512 l16 = _mm512_setzero_ps(), mv = _mm512_set1_ps(mx);
    for (i = 0; i + 16 <= n; i += 16) {
        __m512 e = exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(r + i), mv));
        _mm512_storeu_ps(r + i, e);
        l16 = _mm512_add_ps(l16, e);
    }
    float l = _mm512_reduce_add_ps(l16);
    for (; i < n; i++) {
        r[i] = exp_neg(r[i] - mx);
        l += r[i];
    }
    *mx_out = mx;
    return l;
}
#endif

/* a key mask (keep[i] 0: key i hidden) applied to one head's scores: hidden scores -inf (their weight 0, the
   values they would weight never read into the sum); returns how many keys stay (0: the row is set to zeros) */
static inline int64_t mask_scores(float *restrict r, int64_t n, const uint8_t *restrict keep) {
    int64_t seen = 0;
    for (int64_t i = 0; i < n; i++) {
        if (keep[i]) {
            seen++;
        } else {
            r[i] = -INFINITY;
        }
    }
    if (seen == 0)
        for (int64_t i = 0; i < n; i++) r[i] = 0.0f;
    return seen;
}

/* the chunk's unnormalised softmax of each query head: sc (HPG x n) -> exp(sc - max) in place, each head's max and sum
   into its partial (part: HPG x (D + 2), max then sum then D weighted values) */
static inline void chunk_softmax(int64_t HPG, int64_t D, int64_t n, float *restrict sc, float *restrict part,
                                 const uint8_t *restrict keep) {
    for (int64_t h = 0; h < HPG; h++) {
        float *r = sc + h * n, mx;
        if (keep != NULL && !mask_scores(r, n, keep)) { /* every key of the chunk hidden: weight 0 */
            part[h * (D + 2)] = -INFINITY;
            part[h * (D + 2) + 1] = 0.0f;
            continue;
        }
#if defined(__AVX512F__)
        float l = softmax_part(r, n, &mx);
#else
        float l = 0.0f;
        mx = -INFINITY;
        for (int64_t i = 0; i < n; i++) mx = r[i] > mx ? r[i] : mx;
#pragma omp simd reduction(+ : l)
        for (int64_t i = 0; i < n; i++) {
            r[i] = exp_neg(r[i] - mx);
            l += r[i];
        }
#endif
        part[h * (D + 2)] = mx;
        part[h * (D + 2) + 1] = l;
    }
}

/* a key group's scales and minimums (float16 rows of D at sg, mg) into s and mn, and each query head's sum of q_c mn_c
   times the softmax scale into qm (the score every key of the group shares) */
static inline void key_group(int64_t HPG, int64_t D, const uint16_t *sg, const uint16_t *mg, const float *q,
                             float scale, float *s, float *mn, float *qm) {
    for (int64_t c = 0; c < D; c++) {
        s[c] = f16_to_f32(sg[c]);
        mn[c] = f16_to_f32(mg[c]);
    }
    for (int64_t h = 0; h < HPG; h++) {
        float m0 = 0.0f;
        for (int64_t c = 0; c < D; c++) m0 += q[h * D + c] * mn[c];
        qm[h] = m0 * scale;
    }
}

/* the partial softmaxes of `per` work items for each of BG (batch, KV head) pairs, laid out [pair][item][head]
   (max, sum, D weighted values), merged into out (BG, HPG, D): each partial rescaled by exp(its max - the max) */
static void merge_parts(int64_t BG, int64_t HPG, int64_t D, int64_t per, const float *parts, float *out) {
    int64_t part_size = HPG * (D + 2);
    for (int64_t bg = 0; bg < BG; bg++) {
        for (int64_t h = 0; h < HPG; h++) {
            float mx = -INFINITY, l = 0.0f, *dst = out + (bg * HPG + h) * D;
            for (int64_t c = 0; c < per; c++) {
                float m = parts[(bg * per + c) * part_size + h * (D + 2)];
                mx = m > mx ? m : mx;
            }
            for (int64_t j = 0; j < D; j++) dst[j] = 0.0f;
            for (int64_t c = 0; c < per; c++) {
                const float *p = parts + (bg * per + c) * part_size + h * (D + 2);
                float f = exp_neg(p[0] - mx);
                l += p[1] * f;
                for (int64_t j = 0; j < D; j++) dst[j] += p[2 + j] * f;
            }
            for (int64_t j = 0; j < D; j++) dst[j] /= l;
        }
    }
}

/* mh_attend_quantized's chunk of tokens (whole key groups, about MH_CHUNK) and each work item's floats of working
   memory (the 4-bit chunk's layout; the 8-bit one needs D fewer) */
static inline int64_t quant_chunk_len(int64_t group) {
    return MH_CHUNK / group > 0 ? (MH_CHUNK / group) * group : group;
}

static inline int64_t quant_work_size(int64_t HPG, int64_t D, int64_t group, int64_t m) {
    int64_t chunk = quant_chunk_len(group), longest = chunk > m ? chunk : m;
    return HPG * longest + 4 * D + HPG * D + HPG + 2 * HPG * (D / group + 1) + HPG * D;
}

static inline __attribute__((always_inline)) void q4_chunk(
        int64_t HPG, int64_t D, int64_t group, int64_t t0, int64_t t1, const float *restrict q,
        const uint8_t *restrict ck, const uint16_t *restrict sk, const uint16_t *restrict mk,
        const uint8_t *restrict cv, const uint16_t *restrict sv, const uint16_t *restrict mv, float scale,
        float *restrict part, float *restrict work, const uint8_t *restrict keep) {
    int64_t half = D / 2, n = t1 - t0, vg = D / group;
    float *qe = work, *qo = qe + HPG * half, *qm = qo + HPG * half, *sc = qm + HPG;  /* sc: HPG x n */
    float *lo = sc + HPG * n, *hi = lo + half, *s = hi + half, *mn = s + D, *w = mn + D, *wm = w + HPG * vg;
    for (int64_t t = t0; t < t1; t += group) {
        key_group(HPG, D, sk + (t / group) * D, mk + (t / group) * D, q, scale, s, mn, qm);
        for (int64_t h = 0; h < HPG; h++) {
            const float *qh = q + h * D;
            for (int64_t j = 0; j < half; j++) {
                qe[h * half + j] = qh[2 * j] * s[2 * j] * scale;
                qo[h * half + j] = qh[2 * j + 1] * s[2 * j + 1] * scale;
            }
        }
        int64_t end = t + group < t1 ? t + group : t1;
        for (int64_t tt = t; tt < end; tt++) {
            const uint8_t *code = ck + tt * half;
            for (int64_t j = 0; j < half; j++) {
                lo[j] = (float)(code[j] & 15u);
                hi[j] = (float)(code[j] >> 4);
            }
            for (int64_t h = 0; h < HPG; h++) {
                const float *e = qe + h * half, *o = qo + h * half;
                float a = 0.0f;
#pragma omp simd reduction(+ : a)
                for (int64_t j = 0; j < half; j++) a += e[j] * lo[j] + o[j] * hi[j];
                sc[h * n + (tt - t0)] = a + qm[h];
            }
        }
    }
    chunk_softmax(HPG, D, n, sc, part, keep);
    float *acc = work + HPG * n + 4 * D + 2 * HPG * half + HPG + 2 * HPG * vg; /* HPG x D: even then odd halves */
    memset(acc, 0, sizeof(float) * (size_t)(HPG * D));
    memset(wm, 0, sizeof(float) * (size_t)(HPG * vg));
    for (int64_t tt = t0; tt < t1; tt++) {
        const uint8_t *code = cv + tt * half;
        const uint16_t *st = sv + tt * vg, *mt = mv + tt * vg;
        for (int64_t j = 0; j < half; j++) {
            lo[j] = (float)(code[j] & 15u);
            hi[j] = (float)(code[j] >> 4);
        }
        for (int64_t k = 0; k < vg; k++) {
            s[k] = f16_to_f32(st[k]);
            mn[k] = f16_to_f32(mt[k]);
        }
        for (int64_t h = 0; h < HPG; h++) {
            float p = sc[h * n + (tt - t0)];
            for (int64_t k = 0; k < vg; k++) {
                w[h * vg + k] = p * s[k];
                wm[h * vg + k] += p * mn[k];
            }
            float *ae = acc + h * D, *ao = ae + half;
            int64_t per = group / 2; /* byte columns of one value group */
            for (int64_t k = 0; k < vg; k++) {
                float wk = w[h * vg + k];
                for (int64_t j = k * per; j < (k + 1) * per; j++) {
                    ae[j] += wk * lo[j];
                    ao[j] += wk * hi[j];
                }
            }
        }
    }
    for (int64_t h = 0; h < HPG; h++) {
        float *ae = acc + h * D, *ao = ae + half, *dst = part + h * (D + 2) + 2;
        for (int64_t j = 0; j < half; j++) {
            dst[2 * j] = ae[j] + wm[h * vg + (2 * j) / group];
            dst[2 * j + 1] = ao[j] + wm[h * vg + (2 * j + 1) / group];
        }
    }
}

#if defined(__AVX512F__)
/* 16 rows of 32 bytes (8 words of 4 bytes, rows contiguous) -> cols[j] lane i = word j of row i: three rounds of
   two-source permutes (pairs of rows, then of 4, then of 8), 24 in all, where 8 gathers of 16 words would be */
static inline void transpose16x8(const uint8_t *base, __m512i *cols) {
    __m512i r[8], u[8], w[8];
    for (int k = 0; k < 8; k++) r[k] = _mm512_loadu_si512((const void *)(base + 64 * k)); /* rows 2k, 2k + 1 */
    static const int i1[2][16] = {{0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27},
                                  {4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31}};
    static const int i2[2][16] = {{0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23},
                                  {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31}};
    static const int i3[2][16] = {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                                  {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}};
    __m512i x1[2], x2[2], x3[2];
    for (int h = 0; h < 2; h++) {
        x1[h] = _mm512_loadu_si512((const void *)i1[h]);
        x2[h] = _mm512_loadu_si512((const void *)i2[h]);
        x3[h] = _mm512_loadu_si512((const void *)i3[h]);
    }
    for (int m = 0; m < 4; m++) /* rows 4m .. 4m + 3: u[2m] words 0-3, u[2m + 1] words 4-7, 4 lanes a word */
        for (int h = 0; h < 2; h++) u[2 * m + h] = _mm512_permutex2var_epi32(r[2 * m], x1[h], r[2 * m + 1]);
    for (int n = 0; n < 2; n++) /* rows 8n .. 8n + 7: w[4n + 2c + h], words 4c + 2h, +1, 8 lanes a word */
        for (int c = 0; c < 2; c++)
            for (int h = 0; h < 2; h++)
                w[4 * n + 2 * c + h] = _mm512_permutex2var_epi32(u[4 * n + c], x2[h], u[4 * n + 2 + c]);
    for (int c = 0; c < 2; c++) /* all 16 rows: word 4c + 2h + a */
        for (int h = 0; h < 2; h++)
            for (int a = 0; a < 2; a++)
                cols[4 * c + 2 * h + a] = _mm512_permutex2var_epi32(w[2 * c + h], x3[a], w[4 + 2 * c + h]);
}

/* q4_chunk for group 32 and head_dim 32 * PIECES with AVX-512: keys 16 tokens at a time in the lanes (codes gathered
   4 bytes a token, so no sum across lanes), values a token at a time with the channels in the lanes (the 16 bytes of
   piece p hold channels 32p .. 32p + 31, one value group: the even ones in the low nibbles). */
static inline __attribute__((always_inline)) void q4_chunk_avx512(
        const int64_t HPG, const int64_t PIECES, int64_t t0, int64_t t1, const float *restrict q,
        const uint8_t *restrict ck, const uint16_t *restrict sk, const uint16_t *restrict mk,
        const uint8_t *restrict cv, const uint16_t *restrict sv, const uint16_t *restrict mv, float scale,
        float *restrict part, float *restrict work, const uint8_t *restrict keep) {
    const int64_t D = 32 * PIECES, half = D / 2, n = t1 - t0;
    float *qe = work, *qo = qe + HPG * half, *qm = qo + HPG * half, *sc = qm + HPG; /* sc: HPG x n */
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)half));
    const __m512i nibble = _mm512_set1_epi32(15);
    for (int64_t t = t0; t < t1; t += 32) {
        const uint16_t *sg = sk + (t / 32) * D, *mg = mk + (t / 32) * D;
        __m512 s16[16], m16[16]; /* the group's scales and minimums, 16 channels a vector */
        for (int64_t p = 0; p < 2 * PIECES; p++) {
            s16[p] = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sg + 16 * p))),
                                   _mm512_set1_ps(scale));
            m16[p] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mg + 16 * p)));
        }
        for (int64_t h = 0; h < HPG; h++) {
            const float *qh = q + h * D;
            float qs[256];
            __m512 m0 = _mm512_setzero_ps();
            for (int64_t p = 0; p < 2 * PIECES; p++) {
                __m512 qv = _mm512_loadu_ps(qh + 16 * p);
                _mm512_storeu_ps(qs + 16 * p, _mm512_mul_ps(qv, s16[p]));
                m0 = _mm512_fmadd_ps(qv, m16[p], m0);
            }
            for (int64_t j = 0; j < half; j++) {
                qe[h * half + j] = qs[2 * j];
                qo[h * half + j] = qs[2 * j + 1];
            }
            qm[h] = _mm512_reduce_add_ps(m0) * scale;
        }
        int64_t end = t + 32 < t1 ? t + 32 : t1;
        for (int64_t tb = t; tb < end; tb += 16) {
            __m512 acc[8];
            for (int64_t h = 0; h < HPG; h++) acc[h] = _mm512_set1_ps(qm[h]);
            const uint8_t *base = ck + tb * half;
            for (int64_t off = 0; off < 16 * half; off += 64) /* the next 16 tokens' codes */
                _mm_prefetch((const char *)(base + 16 * half + off), _MM_HINT_T0);
            __m512i cols[8]; /* head_dim 64: the 16 x 8 block of 4-byte words transposed in registers */
            if (PIECES == 2) transpose16x8(base, cols);
            for (int64_t jj = 0; jj < half / 4; jj++) {
                __m512i x = PIECES == 2 ? cols[jj] : _mm512_i32gather_epi32(rows, (const void *)(base + 4 * jj), 1);
                for (int bb = 0; bb < 4; bb++) {
                    int64_t j = 4 * jj + bb;
                    __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(x, 8 * bb), nibble));
                    __m512 hi = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(x, 8 * bb + 4), nibble));
                    for (int64_t h = 0; h < HPG; h++) {
                        acc[h] = _mm512_fmadd_ps(lo, _mm512_set1_ps(qe[h * half + j]), acc[h]);
                        acc[h] = _mm512_fmadd_ps(hi, _mm512_set1_ps(qo[h * half + j]), acc[h]);
                    }
                }
            }
            for (int64_t h = 0; h < HPG; h++) _mm512_storeu_ps(sc + h * n + (tb - t0), acc[h]);
        }
    }
    chunk_softmax(HPG, D, n, sc, part, keep);
    __m512 lo_acc[8][8], hi_acc[8][8]; /* [head][piece]: even channels (low nibbles), odd (high) */
    float wm[8][8];
    for (int64_t h = 0; h < HPG; h++)
        for (int64_t p = 0; p < PIECES; p++) {
            lo_acc[h][p] = hi_acc[h][p] = _mm512_setzero_ps();
            wm[h][p] = 0.0f;
        }
    for (int64_t tt = t0; tt < t1; tt++) {
        const uint8_t *code = cv + tt * half;
        if (tt % 2 == 0) _mm_prefetch((const char *)(code + 16 * half), _MM_HINT_T0); /* 16 tokens ahead */
        const uint16_t *st = sv + tt * PIECES, *mt = mv + tt * PIECES;
        for (int64_t p = 0; p < PIECES; p++) {
            __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(code + 16 * p)));
            __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(w, nibble));
            __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4));
            float s0 = _cvtsh_ss(st[p]), m0 = _cvtsh_ss(mt[p]);
            for (int64_t h = 0; h < HPG; h++) {
                float pr = sc[h * n + (tt - t0)];
                __m512 wv = _mm512_set1_ps(pr * s0);
                lo_acc[h][p] = _mm512_fmadd_ps(lo, wv, lo_acc[h][p]);
                hi_acc[h][p] = _mm512_fmadd_ps(hi, wv, hi_acc[h][p]);
                wm[h][p] += pr * m0;
            }
        }
    }
    for (int64_t h = 0; h < HPG; h++) {
        float *dst = part + h * (D + 2) + 2, lo[16], hi[16];
        for (int64_t p = 0; p < PIECES; p++) {
            _mm512_storeu_ps(lo, lo_acc[h][p]);
            _mm512_storeu_ps(hi, hi_acc[h][p]);
            for (int k = 0; k < 16; k++) {
                dst[32 * p + 2 * k] = lo[k] + wm[h][p];
                dst[32 * p + 2 * k + 1] = hi[k] + wm[h][p];
            }
        }
    }
}
#endif

/* the full-precision tail (m keys and values, float32) of one (batch, KV head) */
static void f32_tail(int64_t HPG, int64_t D, int64_t m, const float *q, const float *tk, const float *tv, float scale,
                     float *part, float *work, const uint8_t *keep) {
    for (int64_t h = 0; h < HPG; h++) {
        const float *qh = q + h * D;
        float *r = work, mx = -INFINITY, l = 0.0f, *dst = part + h * (D + 2) + 2;
        for (int64_t i = 0; i < m; i++) {
            float a = 0.0f;
            const float *k = tk + i * D;
#pragma omp simd reduction(+ : a)
            for (int64_t c = 0; c < D; c++) a += qh[c] * k[c];
            r[i] = keep != NULL && !keep[i] ? -INFINITY : a * scale;
            mx = r[i] > mx ? r[i] : mx;
        }
        for (int64_t c = 0; c < D; c++) dst[c] = 0.0f;
        for (int64_t i = 0; i < m && mx > -INFINITY; i++) {
            float p = exp_neg(r[i] - mx);
            const float *v = tv + i * D;
            l += p;
            for (int64_t c = 0; c < D; c++) dst[c] += p * v[c];
        }
        part[h * (D + 2)] = mx;
        part[h * (D + 2) + 1] = l;
    }
}

/* ------------------------------------------------------------------------------------------------------------------
   mh_attend_dense: one decode step's attention (one query a head) over a float32 or bfloat16 KV cache, each KV head
   read once for all the query heads it serves (GQA): softmax(q k^T * scale) v. Work items (batch, KV head, chunk of
   MH_CHUNK tokens), partial softmaxes merged per query head as in mh_attend_quantized. q and out (B, G, HPG, D) float32
   contiguous; k and v rows of D elements (float32, or bfloat16 when bf16 is 1) with the given batch, head and token
   strides (in elements). AVX-512, D 64, 128 or 256 (Gemma's), HPG <= 8; returns 1 (nothing computed) for any other
   case. */

#if defined(__AVX512F__)
static inline __m512 load16(const void *p, int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    return _mm512_loadu_ps((const float *)p);
}

/* the 16 horizontal sums of v[0..15], in order, in one vector: pairs of lanes, then of 64-bit halves, then of
   128-bit quarters added in a tree (15 shuffle-add steps where 16 separate reductions take ~10 operations each) */
static inline __m512 hsum16(const __m512 *v) {
    __m512 s1[8], s2[4], s3[2];
    for (int i = 0; i < 8; i++)
        s1[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d x = _mm512_castps_pd(s1[2 * i]), y = _mm512_castps_pd(s1[2 * i + 1]);
        s2[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        s3[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s3[0], s3[1], 0x88), _mm512_shuffle_f32x4(s3[0], s3[1], 0xDD));
}

static inline __attribute__((always_inline)) void dense_chunk(
        const int64_t HPG, const int64_t P, const int bf16, int64_t t0, int64_t t1, const float *restrict q,
        const char *restrict k, const char *restrict v, int64_t ts_bytes, float scale, float *restrict part,
        float *restrict sc, const uint8_t *restrict keep) {
    const int64_t D = 16 * P, n = t1 - t0, es = bf16 ? 2 : 4;
    __m512 qv[8][16];
    for (int64_t h = 0; h < HPG; h++)
        for (int64_t p = 0; p < P; p++) qv[h][p] = _mm512_mul_ps(_mm512_loadu_ps(q + h * D + 16 * p), _mm512_set1_ps(scale));
    int64_t tb = t0;
    for (; tb + 16 <= t1; tb += 16) { /* 16 keys at a time: their scores summed across lanes in one tree */
        for (int64_t i = 0; i < 16; i++) {
            const char *ahead = k + (tb + 16 + i) * ts_bytes;
            for (int64_t off = 0; off < D * es; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
        }
        float kf[16 * 16 * 16]; /* the 16 keys in float32, converted once for every query head */
        for (int64_t i = 0; i < 16; i++)
            for (int64_t p = 0; p < P; p++)
                _mm512_storeu_ps(kf + (i * P + p) * 16, load16(k + (tb + i) * ts_bytes + 16 * p * es, bf16));
        for (int64_t h = 0; h < HPG; h++) {
            __m512 a[16];
            for (int64_t i = 0; i < 16; i++) {
                a[i] = _mm512_mul_ps(_mm512_loadu_ps(kf + i * P * 16), qv[h][0]);
                for (int64_t p = 1; p < P; p++)
                    a[i] = _mm512_fmadd_ps(_mm512_loadu_ps(kf + (i * P + p) * 16), qv[h][p], a[i]);
            }
            _mm512_storeu_ps(sc + h * n + (tb - t0), hsum16(a));
        }
    }
    for (int64_t tt = tb; tt < t1; tt++) {
        const char *row = k + tt * ts_bytes;
        __m512 kv[16];
        for (int64_t p = 0; p < P; p++) kv[p] = load16(row + 16 * p * es, bf16);
        for (int64_t h = 0; h < HPG; h++) {
            __m512 a = _mm512_mul_ps(kv[0], qv[h][0]);
            for (int64_t p = 1; p < P; p++) a = _mm512_fmadd_ps(kv[p], qv[h][p], a);
            sc[h * n + (tt - t0)] = _mm512_reduce_add_ps(a);
        }
    }
    chunk_softmax(HPG, D, n, sc, part, keep);
    __m512 o[8][16];
    for (int64_t h = 0; h < HPG; h++)
        for (int64_t p = 0; p < P; p++) o[h][p] = _mm512_setzero_ps();
    for (int64_t tt = t0; tt < t1; tt++) {
        const char *row = v + tt * ts_bytes;
        _mm_prefetch(row + 8 * ts_bytes, _MM_HINT_T0);
        if (D * es > 64) _mm_prefetch(row + 8 * ts_bytes + 64, _MM_HINT_T0);
        if (D * es > 128) {
            _mm_prefetch(row + 8 * ts_bytes + 128, _MM_HINT_T0);
            _mm_prefetch(row + 8 * ts_bytes + 192, _MM_HINT_T0);
        }
        for (int64_t off = 256; off < D * es; off += 64) _mm_prefetch(row + 8 * ts_bytes + off, _MM_HINT_T0);
        __m512 vv[16];
        for (int64_t p = 0; p < P; p++) vv[p] = load16(row + 16 * p * es, bf16);
        for (int64_t h = 0; h < HPG; h++) {
            __m512 w = _mm512_set1_ps(sc[h * n + (tt - t0)]);
            for (int64_t p = 0; p < P; p++) o[h][p] = _mm512_fmadd_ps(vv[p], w, o[h][p]);
        }
    }
    for (int64_t h = 0; h < HPG; h++)
        for (int64_t p = 0; p < P; p++) _mm512_storeu_ps(part + h * (D + 2) + 2 + 16 * p, o[h][p]);
}
#endif

int64_t mh_attend_dense_scratch(int64_t B, int64_t G, int64_t HPG, int64_t D, int64_t t) {
    int64_t per = (t + MH_CHUNK - 1) / MH_CHUNK;
    return B * G * per * (HPG * (D + 2) + HPG * MH_CHUNK);
}

int mh_attend_dense(const mh_dense_args *a) {
#if defined(__AVX512F__)
    const int64_t B = a->B, G = a->G, HPG = a->HPG, D = a->D, t = a->t, k_t = a->k_t;
    const int bf16 = (int)a->bf16;
    const float scale = a->scale;
    if ((D != 64 && D != 128 && D != 256) || HPG < 1 || HPG > 8 || t < 1 || k_t != a->v_t) return 1;
    int64_t per = (t + MH_CHUNK - 1) / MH_CHUNK, items = B * G * per, es = bf16 ? 2 : 4;
    int64_t part_size = HPG * (D + 2);
    float *parts = a->scratch, *works = a->scratch + items * part_size;
    int threads = a->threads < 1 ? 1 : (int)a->threads;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t it = 0; it < items; it++) {
        int64_t bg = it / per, c = it % per, b = bg / G, g = bg % G;
        int64_t t0 = c * MH_CHUNK, t1 = t0 + MH_CHUNK < t ? t0 + MH_CHUNK : t;
        const float *qg = a->q + bg * HPG * D;
        const char *kp = (const char *)a->k + (b * a->k_b + g * a->k_g) * es;
        const char *vp = (const char *)a->v + (b * a->v_b + g * a->v_g) * es;
        float *part = parts + it * part_size, *sc = works + it * HPG * MH_CHUNK;
        const uint8_t *kb = a->keep == NULL ? NULL : a->keep + b * a->keep_b + t0;
        if (D == 64 && HPG == 3 && bf16)
            dense_chunk(3, 4, 1, t0, t1, qg, kp, vp, k_t * es, scale, part, sc, kb);
        else if (D == 64 && HPG == 3)
            dense_chunk(3, 4, 0, t0, t1, qg, kp, vp, k_t * es, scale, part, sc, kb);
        else if (D == 64)
            dense_chunk(HPG, 4, bf16, t0, t1, qg, kp, vp, k_t * es, scale, part, sc, kb);
        else if (D == 128)
            dense_chunk(HPG, 8, bf16, t0, t1, qg, kp, vp, k_t * es, scale, part, sc, kb);
        else
            dense_chunk(HPG, 16, bf16, t0, t1, qg, kp, vp, k_t * es, scale, part, sc, kb);
    }
    merge_parts(B * G, HPG, D, per, parts, a->out);
    return 0;
#else
    (void)a;
    return 1;
#endif
}

/* ------------------------------------------------------------------------------------------------------------------
   The 8-bit store: one code a byte, rows of D bytes, otherwise as the 4-bit one (keys per channel over groups of
   `group` tokens, values per token over groups of `group` channels, the same two identities). */

/* one chunk [t0, t1) of the 8-bit codes of one (batch, KV head): partial softmax of every query head of the group */
static inline __attribute__((always_inline)) void q8_chunk(
        int64_t HPG, int64_t D, int64_t group, int64_t t0, int64_t t1, const float *restrict q,
        const uint8_t *restrict ck, const uint16_t *restrict sk, const uint16_t *restrict mk,
        const uint8_t *restrict cv, const uint16_t *restrict sv, const uint16_t *restrict mv, float scale,
        float *restrict part, float *restrict work, const uint8_t *restrict keep) {
    int64_t n = t1 - t0, vg = D / group;
    float *qs = work, *qm = qs + HPG * D, *sc = qm + HPG; /* sc: HPG x n */
    float *s = sc + HPG * n, *mn = s + D, *cf = mn + D, *w = cf + D, *wm = w + HPG * vg, *acc = wm + HPG * vg;
    for (int64_t t = t0; t < t1; t += group) {
        key_group(HPG, D, sk + (t / group) * D, mk + (t / group) * D, q, scale, s, mn, qm);
        for (int64_t h = 0; h < HPG; h++)
            for (int64_t c = 0; c < D; c++) qs[h * D + c] = q[h * D + c] * s[c] * scale;
        int64_t end = t + group < t1 ? t + group : t1;
        for (int64_t tt = t; tt < end; tt++) {
            const uint8_t *code = ck + tt * D;
            for (int64_t c = 0; c < D; c++) cf[c] = (float)code[c];
            for (int64_t h = 0; h < HPG; h++) {
                const float *e = qs + h * D;
                float a = 0.0f;
#pragma omp simd reduction(+ : a)
                for (int64_t c = 0; c < D; c++) a += e[c] * cf[c];
                sc[h * n + (tt - t0)] = a + qm[h];
            }
        }
    }
    chunk_softmax(HPG, D, n, sc, part, keep);
    memset(acc, 0, sizeof(float) * (size_t)(HPG * D));
    memset(wm, 0, sizeof(float) * (size_t)(HPG * vg));
    for (int64_t tt = t0; tt < t1; tt++) {
        const uint8_t *code = cv + tt * D;
        const uint16_t *st = sv + tt * vg, *mt = mv + tt * vg;
        for (int64_t c = 0; c < D; c++) cf[c] = (float)code[c];
        for (int64_t k = 0; k < vg; k++) {
            s[k] = f16_to_f32(st[k]);
            mn[k] = f16_to_f32(mt[k]);
        }
        for (int64_t h = 0; h < HPG; h++) {
            float p = sc[h * n + (tt - t0)], *a = acc + h * D;
            for (int64_t k = 0; k < vg; k++) {
                w[h * vg + k] = p * s[k];
                wm[h * vg + k] += p * mn[k];
            }
            for (int64_t k = 0; k < vg; k++) {
                float wk = w[h * vg + k];
                for (int64_t c = k * group; c < (k + 1) * group; c++) a[c] += wk * cf[c];
            }
        }
    }
    for (int64_t h = 0; h < HPG; h++) {
        float *dst = part + h * (D + 2) + 2;
        for (int64_t c = 0; c < D; c++) dst[c] = acc[h * D + c] + wm[h * vg + c / group];
    }
}

#if defined(__AVX512F__)
/* 16 codes -> 16 floats */
static inline __m512 codes16(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* q8_chunk for group 32 and head_dim 16 * P (P 4, 8 or 16: head_dim 64, 128 or 256) with AVX-512: keys 16 tokens at a time, each converted once
   with its channels in the lanes and the 16 scores of a query head summed across lanes in one tree (hsum16); values
   a token at a time with the channels in the lanes (the 16 channels of piece p lie in value group p / 2). */
static inline __attribute__((always_inline)) void q8_chunk_avx512(
        const int64_t HPG, const int64_t P, int64_t t0, int64_t t1, const float *restrict q,
        const uint8_t *restrict ck, const uint16_t *restrict sk, const uint16_t *restrict mk,
        const uint8_t *restrict cv, const uint16_t *restrict sv, const uint16_t *restrict mv, float scale,
        float *restrict part, float *restrict work, const uint8_t *restrict keep) {
    const int64_t D = 16 * P, n = t1 - t0, VG = P / 2;
    float *sc = work; /* HPG x n */
    for (int64_t t = t0; t < t1; t += 32) {
        const uint16_t *sg = sk + (t / 32) * D, *mg = mk + (t / 32) * D;
        __m512 qv[8][16];
        float qm[8];
        for (int64_t h = 0; h < HPG; h++) {
            __m512 m0 = _mm512_setzero_ps();
            for (int64_t p = 0; p < P; p++) {
                __m512 qp = _mm512_loadu_ps(q + h * D + 16 * p);
                __m512 s16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sg + 16 * p)));
                __m512 m16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mg + 16 * p)));
                qv[h][p] = _mm512_mul_ps(_mm512_mul_ps(qp, s16), _mm512_set1_ps(scale));
                m0 = _mm512_fmadd_ps(qp, m16, m0);
            }
            qm[h] = _mm512_reduce_add_ps(m0) * scale;
        }
        for (int64_t tb = t; tb < t + 32; tb += 16) {
            const uint8_t *base = ck + tb * D;
            for (int64_t i = 0; i < 16; i++)
                for (int64_t off = 0; off < D; off += 64) _mm_prefetch((const char *)(base + (16 + i) * D + off), _MM_HINT_T0);
            float kf[16 * 16 * 16]; /* the 16 keys' codes as floats, converted once for every query head */
            for (int64_t i = 0; i < 16; i++)
                for (int64_t p = 0; p < P; p++) _mm512_storeu_ps(kf + (i * P + p) * 16, codes16(base + i * D + 16 * p));
            for (int64_t h = 0; h < HPG; h++) {
                __m512 a[16];
                for (int64_t i = 0; i < 16; i++) {
                    a[i] = _mm512_mul_ps(_mm512_loadu_ps(kf + i * P * 16), qv[h][0]);
                    for (int64_t p = 1; p < P; p++)
                        a[i] = _mm512_fmadd_ps(_mm512_loadu_ps(kf + (i * P + p) * 16), qv[h][p], a[i]);
                }
                _mm512_storeu_ps(sc + h * n + (tb - t0), _mm512_add_ps(hsum16(a), _mm512_set1_ps(qm[h])));
            }
        }
    }
    chunk_softmax(HPG, D, n, sc, part, keep);
    __m512 o[8][16];
    float wm[8][8];
    for (int64_t h = 0; h < HPG; h++) {
        for (int64_t p = 0; p < P; p++) o[h][p] = _mm512_setzero_ps();
        for (int64_t k = 0; k < VG; k++) wm[h][k] = 0.0f;
    }
    for (int64_t tt = t0; tt < t1; tt++) {
        const uint8_t *code = cv + tt * D;
        _mm_prefetch((const char *)(code + 8 * D), _MM_HINT_T0);
        if (D > 64) _mm_prefetch((const char *)(code + 8 * D + 64), _MM_HINT_T0);
        const uint16_t *st = sv + tt * VG, *mt = mv + tt * VG;
        __m512 vv[16];
        float s[8], mn[8];
        for (int64_t p = 0; p < P; p++) vv[p] = codes16(code + 16 * p);
        for (int64_t k = 0; k < VG; k++) {
            s[k] = _cvtsh_ss(st[k]);
            mn[k] = _cvtsh_ss(mt[k]);
        }
        for (int64_t h = 0; h < HPG; h++) {
            float pr = sc[h * n + (tt - t0)];
            for (int64_t k = 0; k < VG; k++) {
                __m512 w = _mm512_set1_ps(pr * s[k]);
                o[h][2 * k] = _mm512_fmadd_ps(vv[2 * k], w, o[h][2 * k]);
                o[h][2 * k + 1] = _mm512_fmadd_ps(vv[2 * k + 1], w, o[h][2 * k + 1]);
                wm[h][k] += pr * mn[k];
            }
        }
    }
    for (int64_t h = 0; h < HPG; h++)
        for (int64_t p = 0; p < P; p++)
            _mm512_storeu_ps(part + h * (D + 2) + 2 + 16 * p, _mm512_add_ps(o[h][p], _mm512_set1_ps(wm[h][p / 2])));
}
#endif

/* floats of scratch a call needs (one partial per work item, and each item's working memory) */
int64_t mh_attend_quantized_scratch(int64_t B, int64_t G, int64_t HPG, int64_t D, int64_t n, int64_t group,
                                    int64_t m) {
    int64_t chunk = quant_chunk_len(group), per = (n + chunk - 1) / chunk + (m > 0);
    return B * G * per * (HPG * (D + 2) + quant_work_size(HPG, D, group, m));
}

/* one chunk of a (batch, KV head)'s codes, `bits` 4 or 8: the AVX-512 chunk where it fits, else the portable one */
static void quantized_chunk(int bits, int64_t HPG, int64_t D, int64_t group, int64_t t0, int64_t t1, const float *q,
                            const uint8_t *ck, const uint16_t *sk, const uint16_t *mk, const uint8_t *cv,
                            const uint16_t *sv, const uint16_t *mv, float scale, float *part, float *work,
                            const uint8_t *keep) {
#if defined(__AVX512F__)
    if (group == 32 && (D == 64 || D == 128 || D == 256) && HPG <= 8 && (t1 - t0) % 16 == 0) {
        if (bits == 4 && D == 64 && HPG == 3) /* SmolLM2's shape: constant trip counts throughout */
            q4_chunk_avx512(3, 2, t0, t1, q, ck, sk, mk, cv, sv, mv, scale, part, work, keep);
        else if (bits == 4)
            q4_chunk_avx512(HPG, D / 32, t0, t1, q, ck, sk, mk, cv, sv, mv, scale, part, work, keep);
        else if (D == 64 && HPG == 3)
            q8_chunk_avx512(3, 4, t0, t1, q, ck, sk, mk, cv, sv, mv, scale, part, work, keep);
        else
            q8_chunk_avx512(HPG, D / 16, t0, t1, q, ck, sk, mk, cv, sv, mv, scale, part, work, keep);
        return;
    }
#endif
    if (bits == 4)
        q4_chunk(HPG, D, group, t0, t1, q, ck, sk, mk, cv, sv, mv, scale, part, work, keep);
    else
        q8_chunk(HPG, D, group, t0, t1, q, ck, sk, mk, cv, sv, mv, scale, part, work, keep);
}

/* One decode step's attention over a `bits`-bit (4 or 8) KIVI store and its full-precision tail: work items (batch,
   KV head, chunk) and (batch, KV head, tail), merged per query head. Returns 1 (nothing computed) for a shape the
   kernels do not take. */
int mh_attend_quantized(const mh_quant_args *a) {
    const int bits = (int)a->bits;
    const int64_t G = a->G, HPG = a->HPG, D = a->D, n = a->n, group = a->group, m = a->m;
    if ((bits != 4 && bits != 8) || group < 1 || D % group || (bits == 4 && (D % 2 || group % 2)) || n % group
        || n + m < 1)
        return 1;
    int64_t chunk = quant_chunk_len(group);
    int64_t nq = (n + chunk - 1) / chunk, per = nq + (m > 0), items = a->B * G * per;
    int64_t part_size = HPG * (D + 2), work_size = quant_work_size(HPG, D, group, m);
    float *parts = a->scratch, *works = a->scratch + items * part_size;
    int threads = a->threads < 1 ? 1 : (int)a->threads;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t it = 0; it < items; it++) {
        int64_t bg = it / per, c = it % per, b = bg / G, g = bg % G;
        const float *qg = a->q + bg * HPG * D;
        float *part = parts + it * part_size, *work = works + it * work_size;
        if (c < nq) {
            int64_t t0 = c * chunk, t1 = t0 + chunk < n ? t0 + chunk : n;
            const uint8_t *kb = a->keep == NULL ? NULL : a->keep + b * a->keep_b + t0;
            quantized_chunk(bits, HPG, D, group, t0, t1, qg, a->ck + b * a->ck_b + g * a->ck_g,
                            a->sk + b * a->sk_b + g * a->sk_g, a->mk + b * a->sk_b + g * a->sk_g,
                            a->cv + b * a->cv_b + g * a->cv_g, a->sv + b * a->sv_b + g * a->sv_g,
                            a->mv + b * a->sv_b + g * a->sv_g, a->scale, part, work, kb);
        } else {
            f32_tail(HPG, D, m, qg, a->tk + bg * m * D, a->tv + bg * m * D, a->scale, part, work,
                     a->keep == NULL ? NULL : a->keep + b * a->keep_b + n);
        }
    }
    merge_parts(a->B * G, HPG, D, per, parts, a->out);
    return 0;
}

/* ------------------------------------------------------------------------------------------------------------------
   mh_quantize and mh_dequantize: KIVI's codec (multihead.quant) in one pass over a layer's keys or values, what a
   quantized cache runs when it stores whole groups and when a kernel reads its codes back as keys and values.

   mh_quantize: asymmetric min-max codes, each step the float32 operation multihead.quant.quantize runs, in its order,
   so the codes, scales and minimums are the same bits: the group's minimum rounded to float16 (lo), the scale
   (max - lo) / (2^bits - 1) rounded to float16 (1 where that is not above 0), the codes round-half-even((x - lo) /
   scale) clamped to [0, 2^bits - 1] and packed low bits first (multihead.quant.pack). Keys (axis 0) per channel over
   groups of `group` tokens (n a multiple of group), values (axis 1) per token over groups of `group` channels.
   mh_dequantize: codes * scale + lo in float32 (the product of a code below 256 and a float16 scale is exact in
   float32, so a fused multiply-add gives the same sum), rounded once to x's dtype (round to nearest even): the values
   of multihead.quant.read_keys / read_values. D at most MH_CODEC_MAX_D, D * bits a multiple of 8, group dividing D
   for values; returns 1 (nothing done) otherwise. Work items (batch, KV head, token group) for keys, (batch, KV head,
   token) for values, spread over `threads` OpenMP threads when there are MH_CODEC_PARALLEL elements or more. */

#define MH_CODEC_MAX_D 1024
#define MH_CODEC_PARALLEL 32768

static inline uint16_t f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u); /* NaN */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* 65520 and above round to infinity */
    if (a < 0x38800000u) {                                    /* below 2^-14: a subnormal half (or zero) */
        float v;
        memcpy(&v, &a, sizeof v);
        return (uint16_t)(sign | (uint32_t)nearbyintf(v * 16777216.0f)); /* in units of 2^-24, half to even */
    }
    uint32_t r = a - 0x38000000u; /* the exponent rebiased from 127 to 15 */
    r += 0x0fffu + ((r >> 13) & 1u);
    return (uint16_t)(sign | (r >> 13));
}

static inline float x_at(const void *x, int64_t dtype, int64_t i) {
    if (dtype == 0) return ((const float *)x)[i];
    if (dtype == 1) return bf16_to_f32(((const uint16_t *)x)[i]);
    return f16_to_f32(((const uint16_t *)x)[i]);
}

static inline void x_put(void *x, int64_t dtype, int64_t i, float f) {
    if (dtype == 0)
        ((float *)x)[i] = f;
    else if (dtype == 1)
        ((uint16_t *)x)[i] = f32_to_bf16(f);
    else
        ((uint16_t *)x)[i] = f32_to_f16(f);
}

/* D codes (each below 2^bits, one a byte) -> D * bits / 8 packed bytes, low bits first; 8 codes a step as one
   little-endian 64-bit word whose code bytes are folded into the low byte of each 16-bit (4 bits) or 32-bit (2 bits)
   part, as multihead.quant.pack_fast folds them */
static inline void pack_row(const uint8_t *restrict c, int64_t D, int bits, uint8_t *restrict out) {
    if (bits == 8) {
        memcpy(out, c, (size_t)D);
        return;
    }
    int64_t j = 0;
    for (; j + 8 <= D; j += 8) {
        uint64_t u;
        memcpy(&u, c + j, 8);
        if (bits == 4) {
            u |= u >> 4;
            uint32_t w = (uint32_t)((u & 0xffu) | ((u >> 8) & 0xff00u) | ((u >> 16) & 0xff0000u) |
                                    ((u >> 24) & 0xff000000u));
            memcpy(out + j / 2, &w, 4);
        } else {
            u |= u >> 6;
            u |= u >> 12;
            out[j / 4] = (uint8_t)u;
            out[j / 4 + 1] = (uint8_t)(u >> 32);
        }
    }
    for (; j < D; j++) { /* a row of fewer than 8 codes left (D not a multiple of 8) */
        int per = 8 / bits, k = (int)(j % per);
        if (k == 0) out[j / per] = 0;
        out[j / per] |= (uint8_t)(c[j] << (k * bits));
    }
}

/* D * bits / 8 packed bytes -> D codes, one a byte (multihead.quant.unpack) */
static inline void unpack_row(const uint8_t *restrict p, int64_t D, int bits, uint8_t *restrict c) {
    if (bits == 8) {
        memcpy(c, p, (size_t)D);
        return;
    }
    int64_t j = 0;
    for (; j + 8 <= D; j += 8) {
        uint64_t x;
        if (bits == 4) { /* 4 bytes: each spread to every other byte, then its high half into the byte after */
            uint32_t w;
            memcpy(&w, p + j / 2, 4);
            x = w;
            x = (x | (x << 16)) & 0x0000ffff0000ffffull;
            x = (x | (x << 8)) & 0x00ff00ff00ff00ffull;
            x = (x & 0x000f000f000f000full) | ((x << 4) & 0x0f000f000f000f00ull);
        } else { /* 2 bytes: each to the low byte of a 32-bit part, then its four codes into that part's bytes */
            x = (uint64_t)p[j / 4] | ((uint64_t)p[j / 4 + 1] << 32);
            x = (x & 0x0000000300000003ull) | ((x << 6) & 0x0000030000000300ull) |
                ((x << 12) & 0x0003000000030000ull) | ((x << 18) & 0x0300000003000000ull);
        }
        memcpy(c + j, &x, 8);
    }
    for (; j < D; j++) {
        int per = 8 / bits, k = (int)(j % per);
        c[j] = (uint8_t)((p[j / per] >> (k * bits)) & ((1 << bits) - 1));
    }
}

/* a group's float16 minimum and scale from its float32 min and max, as multihead.quant.quantize rounds them */
static inline void lo_scale(float mn, float mx, float levels, uint16_t *lo_h, uint16_t *sc_h, float *lo, float *sc) {
    *lo_h = f32_to_f16(mn);
    *lo = f16_to_f32(*lo_h);
    *sc_h = f32_to_f16((mx - *lo) / levels);
    *sc = f16_to_f32(*sc_h);
    if (*sc <= 0.0f) { /* a constant group: scale 1, codes 0 */
        *sc_h = 0x3c00u;
        *sc = 1.0f;
    }
}

static inline uint8_t code_of(float x, float lo, float sc, float levels) {
    float q = nearbyintf((x - lo) / sc);
    q = q < 0.0f ? 0.0f : (q > levels ? levels : q);
    return (uint8_t)q;
}

#if defined(__AVX512F__)
static inline __m512 load16x(const void *x, int64_t dtype, int64_t i) {
    if (dtype == 0) return _mm512_loadu_ps((const float *)x + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
    if (dtype == 1) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

static inline void store16x(void *x, int64_t dtype, int64_t i, __m512 v) {
    if (dtype == 0) {
        _mm512_storeu_ps((float *)x + i, v);
        return;
    }
    __m256i h;
    if (dtype == 2) {
        h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    } else {
#if defined(__AVX512BF16__)
        h = (__m256i)_mm512_cvtneps_pbh(v);
#else
        __m512i u = _mm512_castps_si512(v); /* round to nearest even (finite values; the codec makes no NaN) */
        u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                 _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
        h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
#endif
    }
    _mm256_storeu_si256((__m256i *)((uint16_t *)x + i), h);
}

static inline __m512 f16_round(__m512 v) {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* 16 lanes' float16 minimum and scale (lo_scale's rounding) stored at lo_h, sc_h; lo and sc as float32 */
static inline void lo_scale16(__m512 mn, __m512 mx, __m512 levels, uint16_t *lo_h, uint16_t *sc_h, __m512 *lo,
                              __m512 *sc) {
    __m256i lh = _mm512_cvtps_ph(mn, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    *lo = _mm512_cvtph_ps(lh);
    __m512 s = f16_round(_mm512_div_ps(_mm512_sub_ps(mx, *lo), levels));
    s = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_LE_OQ), s, _mm512_set1_ps(1.0f));
    *sc = s;
    _mm256_storeu_si256((__m256i *)lo_h, lh);
    _mm256_storeu_si256((__m256i *)sc_h, _mm512_cvtps_ph(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

static inline void quantize16(__m512 v, __m512 lo, __m512 sc, __m512 levels, uint8_t *out) {
    __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_sub_ps(v, lo), sc),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm512_min_ps(_mm512_max_ps(q, _mm512_setzero_ps()), levels);
    _mm_storeu_si128((__m128i *)out, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q)));
}
#endif

/* one key group: `group` token rows of x (row stride xt) -> their code rows (stride ct) and one scale/min row */
static void quantize_key_group(const mh_codec_args *a, const void *x, int64_t xt, uint8_t *codes, int64_t ct,
                               uint16_t *sc_h, uint16_t *lo_h) {
    const int64_t D = a->D, group = a->group, dtype = a->dtype;
    const int bits = (int)a->bits;
    const float levels = (float)((1 << bits) - 1);
    const size_t esize = dtype == 0 ? 4 : 2;
    float lo[MH_CODEC_MAX_D], sc[MH_CODEC_MAX_D];
    uint8_t c[MH_CODEC_MAX_D];
    int64_t c0 = 0;
#if defined(__AVX512F__)
    const __m512 lv = _mm512_set1_ps(levels);
    for (; c0 + 16 <= D; c0 += 16) {
        __m512 mn = load16x(x, dtype, c0), mx = mn;
        for (int64_t t = 1; t < group; t++) {
            __m512 v = load16x((const char *)x + t * xt * esize, dtype, c0);
            mn = _mm512_min_ps(mn, v);
            mx = _mm512_max_ps(mx, v);
        }
        __m512 l, s;
        lo_scale16(mn, mx, lv, lo_h + c0, sc_h + c0, &l, &s);
        _mm512_storeu_ps(lo + c0, l);
        _mm512_storeu_ps(sc + c0, s);
    }
#endif
    for (int64_t ch = c0; ch < D; ch++) {
        float mn = x_at(x, dtype, ch), mx = mn;
        for (int64_t t = 1; t < group; t++) {
            float v = x_at((const char *)x + t * xt * esize, dtype, ch);
            mn = v < mn ? v : mn;
            mx = v > mx ? v : mx;
        }
        lo_scale(mn, mx, levels, lo_h + ch, sc_h + ch, lo + ch, sc + ch);
    }
    for (int64_t t = 0; t < group; t++) {
        const void *row = (const char *)x + t * xt * esize;
        int64_t ch = 0;
#if defined(__AVX512F__)
        for (; ch + 16 <= D; ch += 16)
            quantize16(load16x(row, dtype, ch), _mm512_loadu_ps(lo + ch), _mm512_loadu_ps(sc + ch), lv, c + ch);
#endif
        for (; ch < D; ch++) c[ch] = code_of(x_at(row, dtype, ch), lo[ch], sc[ch], levels);
        pack_row(c, D, bits, codes + t * ct);
    }
}

/* one value token: its row of x -> its code row and D / group scales and minimums */
static void quantize_value_row(const mh_codec_args *a, const void *x, uint8_t *codes, uint16_t *sc_h,
                               uint16_t *lo_h) {
    const int64_t D = a->D, group = a->group, dtype = a->dtype;
    const int bits = (int)a->bits;
    const float levels = (float)((1 << bits) - 1);
    uint8_t c[MH_CODEC_MAX_D];
    for (int64_t g0 = 0, k = 0; g0 < D; g0 += group, k++) {
        float mn, mx, lo, sc;
#if defined(__AVX512F__)
        if (group % 16 == 0) {
            __m512 vmn = load16x(x, dtype, g0), vmx = vmn;
            for (int64_t ch = g0 + 16; ch < g0 + group; ch += 16) {
                __m512 v = load16x(x, dtype, ch);
                vmn = _mm512_min_ps(vmn, v);
                vmx = _mm512_max_ps(vmx, v);
            }
            mn = _mm512_reduce_min_ps(vmn);
            mx = _mm512_reduce_max_ps(vmx);
            lo_scale(mn, mx, levels, lo_h + k, sc_h + k, &lo, &sc);
            __m512 l = _mm512_set1_ps(lo), s = _mm512_set1_ps(sc), lv = _mm512_set1_ps(levels);
            for (int64_t ch = g0; ch < g0 + group; ch += 16) quantize16(load16x(x, dtype, ch), l, s, lv, c + ch);
            continue;
        }
#endif
        mn = mx = x_at(x, dtype, g0);
        for (int64_t ch = g0 + 1; ch < g0 + group; ch++) {
            float v = x_at(x, dtype, ch);
            mn = v < mn ? v : mn;
            mx = v > mx ? v : mx;
        }
        lo_scale(mn, mx, levels, lo_h + k, sc_h + k, &lo, &sc);
        for (int64_t ch = g0; ch < g0 + group; ch++) c[ch] = code_of(x_at(x, dtype, ch), lo, sc, levels);
    }
    pack_row(c, D, bits, codes);
}

/* one token's code row -> its row of x: codes * scale + minimum, scale and minimum per channel (keys: stride 1,
   per 1) or per group of channels (values: per `group`) */
static void dequantize_row(const mh_codec_args *a, const uint8_t *codes, const uint16_t *sc_h, const uint16_t *lo_h,
                           int per, void *x) {
    const int64_t D = a->D, dtype = a->dtype;
    uint8_t c[MH_CODEC_MAX_D];
    unpack_row(codes, D, (int)a->bits, c);
    int64_t ch = 0;
#if defined(__AVX512F__)
    if (per == 1 || per % 16 == 0) {
        for (; ch + 16 <= D; ch += 16) {
            __m512 s, l;
            if (per == 1) {
                s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc_h + ch)));
                l = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(lo_h + ch)));
            } else {
                s = _mm512_set1_ps(f16_to_f32(sc_h[ch / per]));
                l = _mm512_set1_ps(f16_to_f32(lo_h[ch / per]));
            }
            __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + ch))));
            store16x(x, dtype, ch, _mm512_fmadd_ps(v, s, l));
        }
    }
#endif
    for (; ch < D; ch++) x_put(x, dtype, ch, (float)c[ch] * f16_to_f32(sc_h[ch / per]) + f16_to_f32(lo_h[ch / per]));
}

static int codec_refused(const mh_codec_args *a) {
    return (a->bits != 2 && a->bits != 4 && a->bits != 8) || a->D < 1 || a->D > MH_CODEC_MAX_D ||
           (a->D * a->bits) % 8 || a->group < 1 || a->dtype < 0 || a->dtype > 2 || a->axis < 0 || a->axis > 1 ||
           (a->axis == 0 && a->n % a->group) || (a->axis == 1 && a->D % a->group);
}

int mh_quantize(const mh_codec_args *a) {
    if (codec_refused(a)) return 1;
    const int64_t G = a->G, keys = a->axis == 0, per = keys ? a->n / a->group : a->n, items = a->B * G * per;
    const size_t esize = a->dtype == 0 ? 4 : 2;
    int threads = a->threads < 1 ? 1 : (int)a->threads;
#pragma omp parallel for num_threads(threads) schedule(static) if (a->B * G * a->n * a->D >= MH_CODEC_PARALLEL)
    for (int64_t it = 0; it < items; it++) {
        int64_t b = it / (G * per), g = (it / per) % G, j = it % per, t = keys ? j * a->group : j;
        const void *x = (const char *)a->x + (b * a->x_b + g * a->x_g + t * a->x_t) * esize;
        uint8_t *codes = a->codes + b * a->c_b + g * a->c_g + t * a->c_t;
        int64_t s = b * a->s_b + g * a->s_g + j * a->s_t;
        if (keys)
            quantize_key_group(a, x, a->x_t, codes, a->c_t, a->scale + s, a->minimum + s);
        else
            quantize_value_row(a, x, codes, a->scale + s, a->minimum + s);
    }
    return 0;
}

int mh_dequantize(const mh_codec_args *a) {
    if (codec_refused(a)) return 1;
    const int64_t G = a->G, n = a->n, items = a->B * G * n, keys = a->axis == 0;
    const size_t esize = a->dtype == 0 ? 4 : 2;
    int threads = a->threads < 1 ? 1 : (int)a->threads;
#pragma omp parallel for num_threads(threads) schedule(static) if (a->B * G * n * a->D >= MH_CODEC_PARALLEL)
    for (int64_t it = 0; it < items; it++) {
        int64_t b = it / (G * n), g = (it / n) % G, t = it % n;
        int64_t s = b * a->s_b + g * a->s_g + (keys ? t / a->group : t) * a->s_t;
        dequantize_row(a, a->codes + b * a->c_b + g * a->c_g + t * a->c_t, a->scale + s, a->minimum + s,
                       keys ? 1 : (int)a->group, (char *)a->x + (b * a->x_b + g * a->x_g + t * a->x_t) * esize);
    }
    return 0;
}
