// multihead's native kernels as PyTorch operators: the CPU implementations of the operators that
// multihead.kernels.native defines (their schemas, and the fake kernels torch.compile traces with, are registered
// there, so the operators exist and say why they cannot run before this library is built). Each takes tensors, checks
// what the kernel's memory reads rely on (dtypes, shapes, unit-stride rows), fills the kernel's argument struct from
// kernels.h (one declaration, compiled on both sides) and calls kernels.c, linked into the same library per
// instruction-set variant. Working memory is each thread's own buffer, kept between calls up to kScratchKept floats.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <memory>
#include <optional>

#include "kernels.h"

#ifndef MH_NAMESPACE
#define MH_NAMESPACE multihead
#endif

namespace {

constexpr int64_t kScratchKept = int64_t(1) << 22;  // floats (16 MiB) a thread keeps; a larger call gets its own

struct Scratch {
    std::unique_ptr<float[]> kept;
    int64_t size = 0;
};
thread_local Scratch scratch_kept;

// at least `floats` of working memory for one call of this thread (uninitialised: the kernels write before reading)
float *scratch(int64_t floats, std::unique_ptr<float[]> &own) {
    if (floats > kScratchKept) {
        own.reset(new float[floats]);
        return own.get();
    }
    if (scratch_kept.size < floats) {
        scratch_kept.kept.reset(new float[floats]);
        scratch_kept.size = floats;
    }
    return scratch_kept.kept.get();
}

int threads_of(int64_t threads) { return threads > 0 ? static_cast<int>(threads) : at::get_num_threads(); }

bool rows_contiguous(const at::Tensor &t) { return t.dim() >= 1 && t.stride(-1) == 1; }

// (b, t) bool on the CPU, one byte a key, rows contiguous: what the kernels read as `keep`; null when absent
std::optional<at::Tensor> keep_bytes(const std::optional<at::Tensor> &keep, int64_t b, int64_t t, const char *name) {
    if (!keep.has_value()) return std::nullopt;
    const at::Tensor &k = *keep;
    TORCH_CHECK_VALUE(k.scalar_type() == at::kBool && k.dim() == 2 && k.size(0) == b && k.size(1) == t && k.is_cpu(),
                      name, ": keep of shape ", k.sizes(), ", ", k.scalar_type(), " (expected (", b, ", ", t,
                      ") bool on the CPU)");
    return k.contiguous();
}

at::Tensor gemv_bf16(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias,
                     int64_t threads) {
    TORCH_CHECK_VALUE(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 && x.is_cpu() &&
                          weight.is_cpu() && weight.dim() == 2 && weight.stride(1) == 1 && x.is_contiguous() &&
                          x.dim() >= 1 && x.numel() == weight.size(1),
                      "gemv_bf16: x ", x.sizes(), " ", x.scalar_type(), " and weight ", weight.sizes(), " strides ",
                      weight.strides(), " ", weight.scalar_type(),
                      " (one contiguous bfloat16 row, a 2-D bfloat16 weight of unit-stride rows, on the CPU)");
    const uint16_t *b = nullptr;
    if (bias.has_value()) {
        const at::Tensor &bb = *bias;
        TORCH_CHECK_VALUE(bb.scalar_type() == at::kBFloat16 && bb.dim() == 1 && bb.size(0) == weight.size(0) &&
                              bb.is_contiguous() && bb.is_cpu(),
                          "gemv_bf16: bias ", bb.sizes(), " ", bb.scalar_type(), " (contiguous bfloat16 of ",
                          weight.size(0), ")");
        b = static_cast<const uint16_t *>(bb.const_data_ptr());
    }
    auto sizes = x.sizes().vec();
    sizes.back() = weight.size(0);
    at::Tensor y = at::empty(sizes, x.options());
    mh_gemv_bf16(static_cast<const uint16_t *>(weight.const_data_ptr()), weight.stride(0),
                 static_cast<const uint16_t *>(x.const_data_ptr()), b, static_cast<uint16_t *>(y.mutable_data_ptr()),
                 weight.size(0), weight.size(1), threads_of(threads));
    return y;
}

at::Tensor gemv_f32(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias,
                    int64_t threads) {
    TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.is_cpu() &&
                          weight.is_cpu() && weight.dim() == 2 && weight.stride(1) == 1 && x.is_contiguous() &&
                          x.dim() >= 1 && x.numel() == weight.size(1),
                      "gemv_f32: x ", x.sizes(), " ", x.scalar_type(), " and weight ", weight.sizes(), " strides ",
                      weight.strides(), " ", weight.scalar_type(),
                      " (one contiguous float32 row, a 2-D float32 weight of unit-stride rows, on the CPU)");
    const float *b = nullptr;
    if (bias.has_value()) {
        const at::Tensor &bb = *bias;
        TORCH_CHECK_VALUE(bb.scalar_type() == at::kFloat && bb.dim() == 1 && bb.size(0) == weight.size(0) &&
                              bb.is_contiguous() && bb.is_cpu(),
                          "gemv_f32: bias ", bb.sizes(), " ", bb.scalar_type(), " (contiguous float32 of ",
                          weight.size(0), ")");
        b = bb.const_data_ptr<float>();
    }
    auto sizes = x.sizes().vec();
    sizes.back() = weight.size(0);
    at::Tensor y = at::empty(sizes, x.options());
    mh_gemv_f32(weight.const_data_ptr<float>(), weight.stride(0), x.const_data_ptr<float>(), b,
                y.mutable_data_ptr<float>(), weight.size(0), weight.size(1), threads_of(threads));
    return y;
}

at::Tensor attend_dense(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, double scale,
                        const std::optional<at::Tensor> &keep, int64_t threads) {
    TORCH_CHECK_VALUE(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(2) == 1 && k.size(1) > 0 &&
                          q.size(1) % k.size(1) == 0 && k.sizes() == v.sizes() && q.size(0) == k.size(0) &&
                          k.size(3) == q.size(3) && k.scalar_type() == v.scalar_type() &&
                          (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16) &&
                          rows_contiguous(k) && rows_contiguous(v) && k.stride(2) == v.stride(2) && q.is_cpu() &&
                          k.is_cpu() && v.is_cpu() && q.is_floating_point(),
                      "attend_dense: q ", q.sizes(), ", k ", k.sizes(), " strides ", k.strides(), ", v ", v.sizes(),
                      " strides ", v.strides(), " do not fit (one query a head, k and v alike with unit-stride rows, "
                      "float32 or bfloat16, on the CPU)");
    const int64_t b = q.size(0), h = q.size(1), d = q.size(3), g = k.size(1), t = k.size(2), hpg = h / g;
    auto kept = keep_bytes(keep, b, t, "attend_dense");
    at::Tensor qg = q.reshape({b, g, hpg, d}).to(at::kFloat).contiguous();
    at::Tensor out = at::empty({b, g, hpg, d}, q.options().dtype(at::kFloat));
    std::unique_ptr<float[]> own;
    mh_dense_args a{};
    a.B = b, a.G = g, a.HPG = hpg, a.D = d, a.t = t;
    a.q = qg.const_data_ptr<float>();
    a.k = k.const_data_ptr(), a.k_b = k.stride(0), a.k_g = k.stride(1), a.k_t = k.stride(2);
    a.v = v.const_data_ptr(), a.v_b = v.stride(0), a.v_g = v.stride(1), a.v_t = v.stride(2);
    a.bf16 = k.scalar_type() == at::kBFloat16;
    a.scale = static_cast<float>(scale);
    a.out = out.mutable_data_ptr<float>();
    a.scratch = scratch(mh_attend_dense_scratch(b, g, hpg, d, t), own);
    a.threads = threads_of(threads);
    a.keep = kept ? static_cast<const uint8_t *>(kept->const_data_ptr()) : nullptr;
    a.keep_b = kept ? kept->stride(0) : 0;
    TORCH_CHECK_VALUE(mh_attend_dense(&a) == 0, "attend_dense: the kernel refused head_dim ", d, ", ", hpg,
                      " query heads a KV head, ", t, " keys");
    return out.view({b, h, 1, d}).to(q.scalar_type());
}

at::Tensor attend_quantized(int64_t bits, const at::Tensor &q, const at::Tensor &codes_k, const at::Tensor &scale_k,
                            const at::Tensor &min_k, const at::Tensor &codes_v, const at::Tensor &scale_v,
                            const at::Tensor &min_v, int64_t n, int64_t group, const at::Tensor &tail_k,
                            const at::Tensor &tail_v, double scale, const std::optional<at::Tensor> &keep,
                            int64_t threads) {
    TORCH_CHECK_VALUE(bits == 4 || bits == 8, "attend_quantized: bits ", bits, " (4 or 8)");
    bool ok = q.dim() == 4 && q.size(2) == 1 && q.is_cpu() && tail_k.dim() == 4 && tail_v.sizes() == tail_k.sizes();
    for (const at::Tensor *t : {&codes_k, &codes_v, &scale_k, &min_k, &scale_v, &min_v})
        ok = ok && t->dim() == 4 && t->is_cpu() && t->stride(3) == 1 && t->stride(2) == t->size(3) &&
             t->size(0) == q.size(0) && t->size(1) == codes_k.size(1);
    ok = ok && codes_k.scalar_type() == at::kByte && codes_v.scalar_type() == at::kByte &&
         scale_k.scalar_type() == at::kHalf && min_k.scalar_type() == at::kHalf &&
         scale_v.scalar_type() == at::kHalf && min_v.scalar_type() == at::kHalf &&
         scale_k.strides() == min_k.strides() && scale_v.strides() == min_v.strides() && codes_k.size(1) > 0 &&
         q.size(1) % codes_k.size(1) == 0 && codes_k.size(3) == q.size(3) * bits / 8 &&
         codes_v.size(3) == codes_k.size(3) && codes_k.size(2) >= n && codes_v.size(2) >= n;
    TORCH_CHECK_VALUE(ok, "attend_q", bits, ": q ", q.sizes(), ", codes ", codes_k.sizes(), " / ", codes_v.sizes(),
                      ", scales ", scale_k.sizes(), " / ", scale_v.sizes(),
                      " do not fit (multihead.kernels.native.attend_q4's docstring has the layouts)");
    const int64_t b = q.size(0), h = q.size(1), d = q.size(3), g = codes_k.size(1), hpg = h / g, m = tail_k.size(2);
    auto kept = keep_bytes(keep, b, n + m, bits == 4 ? "attend_q4" : "attend_q8");
    at::Tensor qg = q.reshape({b, g, hpg, d}).to(at::kFloat).contiguous();
    at::Tensor tk = tail_k.to(at::kFloat).contiguous(), tv = tail_v.to(at::kFloat).contiguous();
    at::Tensor out = at::empty({b, g, hpg, d}, q.options().dtype(at::kFloat));
    std::unique_ptr<float[]> own;
    mh_quant_args a{};
    a.bits = bits, a.B = b, a.G = g, a.HPG = hpg, a.D = d, a.n = n, a.group = group, a.m = m;
    a.q = qg.const_data_ptr<float>();
    a.ck = static_cast<const uint8_t *>(codes_k.const_data_ptr()), a.ck_b = codes_k.stride(0),
    a.ck_g = codes_k.stride(1);
    a.sk = static_cast<const uint16_t *>(scale_k.const_data_ptr()),
    a.mk = static_cast<const uint16_t *>(min_k.const_data_ptr()), a.sk_b = scale_k.stride(0),
    a.sk_g = scale_k.stride(1);
    a.cv = static_cast<const uint8_t *>(codes_v.const_data_ptr()), a.cv_b = codes_v.stride(0),
    a.cv_g = codes_v.stride(1);
    a.sv = static_cast<const uint16_t *>(scale_v.const_data_ptr()),
    a.mv = static_cast<const uint16_t *>(min_v.const_data_ptr()), a.sv_b = scale_v.stride(0),
    a.sv_g = scale_v.stride(1);
    a.tk = tk.const_data_ptr<float>(), a.tv = tv.const_data_ptr<float>();
    a.scale = static_cast<float>(scale);
    a.out = out.mutable_data_ptr<float>();
    a.scratch = scratch(mh_attend_quantized_scratch(b, g, hpg, d, n, group, m), own);
    a.threads = threads_of(threads);
    a.keep = kept ? static_cast<const uint8_t *>(kept->const_data_ptr()) : nullptr;
    a.keep_b = kept ? kept->stride(0) : 0;
    TORCH_CHECK_VALUE(mh_attend_quantized(&a) == 0, "attend_q", bits, ": the kernel refused head_dim ", d,
                      ", group ", group, ", n ", n, ", m ", m);
    return out.view({b, h, 1, d}).to(q.scalar_type());
}

// the element code of x's dtype for the codec (0 float32, 1 bfloat16, 2 float16), -1 for any other
int64_t codec_dtype(const at::Tensor &x) {
    switch (x.scalar_type()) {
        case at::kFloat: return 0;
        case at::kBFloat16: return 1;
        case at::kHalf: return 2;
        default: return -1;
    }
}

// x (b, g, n, d) and the codes, scales and minimums of a quantized store (multihead.kernels.native.quantize_into's
// docstring has the layouts) into the codec's arguments; raises naming the values when they do not fit
mh_codec_args codec_args(const char *name, int64_t bits, int64_t group, int64_t axis, const at::Tensor &x,
                         const at::Tensor &codes, const at::Tensor &scale, const at::Tensor &minimum,
                         int64_t threads) {
    const bool shaped = x.dim() == 4 && codes.dim() == 4 && scale.dim() == 4 && minimum.dim() == 4;
    const int64_t b = shaped ? x.size(0) : 0, g = shaped ? x.size(1) : 0, n = shaped ? x.size(2) : 0,
                  d = shaped ? x.size(3) : 0;
    const int64_t scale_rows = axis == 0 && group > 0 ? n / group : n,
                  scale_cols = axis == 0 || group < 1 ? d : d / group;
    bool ok = shaped && (bits == 2 || bits == 4 || bits == 8) && (axis == 0 || axis == 1) && group > 0 &&
              codec_dtype(x) >= 0 && codes.scalar_type() == at::kByte && scale.scalar_type() == at::kHalf &&
              minimum.scalar_type() == at::kHalf && x.is_cpu() && codes.is_cpu() && scale.is_cpu() &&
              minimum.is_cpu() && x.stride(3) == 1 && codes.stride(3) == 1 && scale.stride(3) == 1 &&
              scale.strides() == minimum.strides() && scale.sizes() == minimum.sizes() && (d * bits) % 8 == 0 &&
              (axis == 0 ? n % group == 0 : d % group == 0) && codes.size(0) == b && codes.size(1) == g &&
              codes.size(2) == n && codes.size(3) == d * bits / 8 && scale.size(0) == b && scale.size(1) == g &&
              scale.size(2) == scale_rows && scale.size(3) == scale_cols;
    TORCH_CHECK_VALUE(ok, name, ": x ", x.sizes(), " strides ", x.strides(), " ", x.scalar_type(), ", codes ",
                      codes.sizes(), " strides ", codes.strides(), ", scale ", scale.sizes(), " strides ",
                      scale.strides(), ", minimum ", minimum.sizes(), ", bits ", bits, ", group ", group, ", axis ",
                      axis, " do not fit (multihead.kernels.native.quantize_into's docstring has the layouts)");
    mh_codec_args a{};
    a.bits = bits, a.B = b, a.G = g, a.n = n, a.D = d, a.group = group, a.axis = axis, a.dtype = codec_dtype(x);
    a.x = const_cast<void *>(x.const_data_ptr()), a.x_b = x.stride(0), a.x_g = x.stride(1), a.x_t = x.stride(2);
    a.codes = static_cast<uint8_t *>(const_cast<void *>(codes.const_data_ptr())), a.c_b = codes.stride(0),
    a.c_g = codes.stride(1), a.c_t = codes.stride(2);
    a.scale = static_cast<uint16_t *>(const_cast<void *>(scale.const_data_ptr())),
    a.minimum = static_cast<uint16_t *>(const_cast<void *>(minimum.const_data_ptr())), a.s_b = scale.stride(0),
    a.s_g = scale.stride(1), a.s_t = scale.stride(2);
    a.threads = threads_of(threads);
    return a;
}

void quantize_into(int64_t bits, int64_t group, int64_t axis, const at::Tensor &x, const at::Tensor &codes,
                   const at::Tensor &scale, const at::Tensor &minimum, int64_t threads) {
    mh_codec_args a = codec_args("quantize_into", bits, group, axis, x, codes, scale, minimum, threads);
    TORCH_CHECK_VALUE(mh_quantize(&a) == 0, "quantize_into: the kernel refused head_dim ", a.D, " (at most 1024)");
}

void dequantize_into(int64_t bits, int64_t group, int64_t axis, const at::Tensor &codes, const at::Tensor &scale,
                     const at::Tensor &minimum, const at::Tensor &out, int64_t threads) {
    mh_codec_args a = codec_args("dequantize_into", bits, group, axis, out, codes, scale, minimum, threads);
    TORCH_CHECK_VALUE(mh_dequantize(&a) == 0, "dequantize_into: the kernel refused head_dim ", a.D,
                      " (at most 1024)");
}

int64_t isa() { return mh_isa(); }

}  // namespace

TORCH_LIBRARY_IMPL(MH_NAMESPACE, CPU, m) {
    m.impl("gemv_bf16", &gemv_bf16);
    m.impl("gemv_f32", &gemv_f32);
    m.impl("attend_dense", &attend_dense);
    m.impl("attend_quantized", &attend_quantized);
    m.impl("quantize_into", &quantize_into);
    m.impl("dequantize_into", &dequantize_into);
}

TORCH_LIBRARY_IMPL(MH_NAMESPACE, CompositeExplicitAutograd, m) { m.impl("isa", &isa); }
