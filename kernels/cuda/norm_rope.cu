// RMS norms, partial multi-axis RoPE, activations and small vector ops (engine/src/model/norm.rs, rope.rs).
#include "common.cuh"

// out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w[(r % w_rows) * width ..]: one block per row of `width` values.
// A grouped bundle norm is rows of `hidden` with w_rows = streams; a per-head norm has w_rows = 1. In place ok.
extern "C" __global__ void rms_norm_rows(const float* __restrict__ x, const float* __restrict__ w, float* out,
                                         int rows, int width, int w_rows, float eps) {
    pdl_entry();
    const int r = blockIdx.x;
    if (r >= rows) return;
    const float* xr = x + (long long)r * width;
    float ss = 0.f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss);
    const float inv = rsqrtf(ss / width + eps);
    const float* wr = w + (long long)(r % w_rows) * width;
    float* o = out + (long long)r * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) o[i] = xr[i] * inv * wr[i];
}

// Partial NeoX RoPE on `heads` heads of each of n tokens: head h of token t starts at x + t*token_stride +
// h*head_stride; dims [0, rope_dim) rotate in pairs (i, i + rope_dim/2). Frequency slot i uses the height
// position when i % 3 == 1 && i < 3*sec1, the width position when i % 3 == 2 && i < 3*sec2, else time; text
// tokens have all three equal to (pos0 + t) * pos_mul (pos_mul = the QSA block size for pooled block keys, which
// rotate at their block's first position). thread = (t, h, i).
// The first position comes from *pos_dev when given (CUDA Graph replays), else from pos0.
extern "C" __global__ void rope_heads(float* x, int n, int heads, long long token_stride, long long head_stride,
                                      int pos0, const int* pos_dev, int pos_mul, int rope_dim, float theta, int sec1,
                                      int sec2) {
    pdl_entry();
    if (pos_dev) pos0 = *pos_dev;
    const int half = rope_dim / 2;
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * heads * half) return;
    const int i = idx % half;
    const int h = (idx / half) % heads;
    const int t = idx / ((long long)half * heads);
    (void)sec1; (void)sec2;  // text positions: every axis is pos0 + t
    const float inv_freq = 1.f / powf(theta, (float)(2 * i) / (float)rope_dim);
    const float a = (float)((pos0 + t) * pos_mul) * inv_freq;
    const float c = (float)cos((double)a), s = (float)sin((double)a);
    float* p = x + t * token_stride + h * head_stride;
    const float x1 = p[i], x2 = p[i + half];
    p[i] = x1 * c - x2 * s;
    p[i + half] = x2 * c + x1 * s;
}

extern "C" __global__ void add_inplace(float* x, const float* __restrict__ y, long long count) {
    pdl_entry();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) x[i] += y[i];
}

// g = silu(g) * u; with qx, also its 8-bit form in blocks of blk (quantize_thread; 256-thread blocks, rows a
// whole number of quantization blocks).
extern "C" __global__ void silu_mul(float* g, const float* __restrict__ u, long long count, signed char* qx, float* dx,
                                    int blk) {
    pdl_entry();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    float v = 0.f;
    if (i < count) {
        v = siluf_(g[i]) * u[i];
        g[i] = v;
    }
    if (qx) quantize_thread(v, i < count, i, blk, qx, dx);
}

// out[i] = silu(g[i]) * u[i], leaving g and u as they are (streamed prefill applies it once per expert group).
extern "C" __global__ void silu_mul_into(const float* __restrict__ g, const float* __restrict__ u, float* out,
                                         long long count) {
    pdl_entry();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) out[i] = siluf_(g[i]) * u[i];
}

// out[t][i] = x[t][i] * sigmoid(gate[t][i]) (attention output gate).
extern "C" __global__ void mul_sigmoid(float* x, const float* __restrict__ gate, long long count) {
    pdl_entry();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) x[i] *= sigmoidf_(gate[i]);
}

// Copies `n` rows of `width` from src (src_stride apart) to dst (dst_stride apart).
extern "C" __global__ void copy_rows(const float* __restrict__ src, long long src_stride, float* dst,
                                     long long dst_stride, int n, int width) {
    pdl_entry();
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * width) return;
    const int t = idx / width, i = idx % width;
    dst[t * dst_stride + i] = src[t * src_stride + i];
}

// Sets out[t][masked ranges] to -inf: ranges[2k], ranges[2k+1] are [start, end) of token ids no token has.
extern "C" __global__ void mask_logits(float* logits, int n, int vocab, const int* __restrict__ ranges, int nranges) {
    pdl_entry();
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * vocab) return;
    const int v = idx % vocab;
    for (int k = 0; k < nranges; k++)
        if (v >= ranges[2 * k] && v < ranges[2 * k + 1]) logits[idx] = -INFINITY;
}

// dst[(pos + t) * width + i] = src[t * width + i]: appends n rows at the sequence position (KV caches, raw indexer
// keys). pos = *pos_dev when given, else pos0.
extern "C" __global__ void copy_rows_at(const float* __restrict__ src, float* dst, int pos0, const int* pos_dev, int n,
                                        int width) {
    pdl_entry();
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * width) return;
    const int pos = pos_dev ? *pos_dev : pos0;
    dst[(long long)pos * width + idx] = src[idx];
}

// The MTP block's eh_proj input (engine/src/model/mtp.rs, steps 1-3): row (t, s) of [n*S][2d] is
// [en[t] ; hn[t][s]], the normalised next-token embedding beside stream s of the normalised hidden bank.
extern "C" __global__ void mtp_eh_input(const float* __restrict__ en, const float* __restrict__ hn, float* out, int n,
                                        int S, int d) {
    pdl_entry();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * S * 2 * d) return;
    const int c = (int)(i % (2 * d));
    const long long ts = i / (2 * d);
    const long long t = ts / S, s = ts % S;
    out[i] = c < d ? en[t * d + c] : hn[t * S * d + s * d + (c - d)];
}
