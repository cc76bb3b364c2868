/* The C interface of kernels.c, included by kernels.c itself and by ops.cpp (the PyTorch operators that call it), so
   one compiler checks both sides: the argument structs of the two attention kernels and every exported function.
   kernels.c describes each function where it is defined. */
#ifndef MULTIHEAD_KERNELS_H
#define MULTIHEAD_KERNELS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* the arguments of mh_attend_dense: q and out (B, G, HPG, D) float32 contiguous (query head h = g * HPG + i); k and
   v (B, G, t, D) float32 or (bf16 = 1) bfloat16 with the given strides in elements (rows contiguous) */
typedef struct {
    int64_t B, G, HPG, D, t;
    const float *q;
    const void *k;
    int64_t k_b, k_g, k_t;
    const void *v;
    int64_t v_b, v_g, v_t;
    int64_t bf16;
    float scale;
    float *out, *scratch;
    int64_t threads;
    const uint8_t *keep; /* NULL: every key visible; else (B, t) bytes, row b at keep + b * keep_b, 0 = hidden */
    int64_t keep_b;
} mh_dense_args;

/* the arguments of mh_attend_quantized: q and out (B, G, HPG, D) float32 contiguous; code rows ck, cv of
   D * bits / 8 bytes, key-scale rows sk, mk of D halves, value-scale rows sv, mv of D / group halves, with the given
   batch and head strides (in elements); the m tail keys and values tk, tv (B, G, m, D) float32 contiguous */
typedef struct {
    int64_t bits, B, G, HPG, D, n, group, m;
    const float *q;
    const uint8_t *ck;
    int64_t ck_b, ck_g;
    const uint16_t *sk, *mk;
    int64_t sk_b, sk_g;
    const uint8_t *cv;
    int64_t cv_b, cv_g;
    const uint16_t *sv, *mv;
    int64_t sv_b, sv_g;
    const float *tk, *tv;
    float scale;
    float *out, *scratch;
    int64_t threads;
    const uint8_t *keep; /* NULL: every key visible; else (B, n + m) bytes, row b at keep + b * keep_b, 0 = hidden */
    int64_t keep_b;
} mh_quant_args;

/* the arguments of mh_quantize and mh_dequantize (KIVI's codec, multihead.quant): `x` (B, G, n, D) in float32
   (dtype 0), bfloat16 (1) or float16 (2) with the given element strides (channels of unit stride), read by
   mh_quantize and written by mh_dequantize; code rows of D * bits / 8 bytes at `codes` with the given strides; float16
   scale and minimum rows (alike laid out) at `scale`, `minimum`: axis 0 (keys) one row of D a group of `group` tokens,
   axis 1 (values) one row of D / group a token */
typedef struct {
    int64_t bits, B, G, n, D, group, axis, dtype;
    void *x;
    int64_t x_b, x_g, x_t;
    uint8_t *codes;
    int64_t c_b, c_g, c_t;
    uint16_t *scale, *minimum;
    int64_t s_b, s_g, s_t;
    int64_t threads;
} mh_codec_args;

int mh_isa(void);
void mh_gemv_bf16(const uint16_t *w, int64_t ld, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t out,
                  int64_t in, int threads);
void mh_gemv_f32(const float *w, int64_t ld, const float *x, const float *bias, float *y, int64_t out, int64_t in,
                 int threads);
int64_t mh_attend_dense_scratch(int64_t B, int64_t G, int64_t HPG, int64_t D, int64_t t);
int mh_attend_dense(const mh_dense_args *a);
int64_t mh_attend_quantized_scratch(int64_t B, int64_t G, int64_t HPG, int64_t D, int64_t n, int64_t group,
                                    int64_t m);
int mh_attend_quantized(const mh_quant_args *a);
int mh_quantize(const mh_codec_args *a);
int mh_dequantize(const mh_codec_args *a);

#ifdef __cplusplus
}
#endif

#endif
