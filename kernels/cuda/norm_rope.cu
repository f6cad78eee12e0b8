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

// The position stream (0 time, 1 height, 2 width) of M-RoPE frequency slot i: height when i % 3 == 1 &&
// i < 3*sec1, width when i % 3 == 2 && i < 3*sec2, else time (crate::model::rope, interleaved sections).
__device__ __forceinline__ int mrope_axis(int i, int sec1, int sec2) {
    if (i % 3 == 1 && i < 3 * sec1) return 1;
    if (i % 3 == 2 && i < 3 * sec2) return 2;
    return 0;
}

// Partial NeoX RoPE on `heads` heads of each of n tokens: head h of token t starts at x + t*token_stride +
// h*head_stride; dims [0, rope_dim) rotate in pairs (i, i + rope_dim/2). Without `thw`, text positions: every
// axis is (pos0 + t) * pos_mul (pos_mul = the QSA block size for pooled block keys, which rotate at their
// block's first position). With `thw` (a sequence's M-RoPE position table, [cache index][3] as t, h, w), token t
// at cache index pos0 + t turns frequency slot i with its position of stream mrope_axis(i) (a vision token's
// (p, p + row, p + col), text after an image continuing from the image's largest position). thread = (t, h, i).
// The first position comes from *pos_dev when given (CUDA Graph replays), else from pos0.
extern "C" __global__ void rope_heads(float* x, int n, int heads, long long token_stride, long long head_stride,
                                      int pos0, const int* pos_dev, int pos_mul, int rope_dim, float theta, int sec1,
                                      int sec2, const int* __restrict__ thw) {
    pdl_entry();
    if (pos_dev) pos0 = *pos_dev;
    const int half = rope_dim / 2;
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * heads * half) return;
    const int i = idx % half;
    const int h = (idx / half) % heads;
    const int t = idx / ((long long)half * heads);
    const int p = thw ? thw[(long long)(pos0 + t) * 3 + mrope_axis(i, sec1, sec2)] : pos0 + t;
    const float inv_freq = 1.f / powf(theta, (float)(2 * i) / (float)rope_dim);
    const float a = (float)(p * pos_mul) * inv_freq;
    const float c = (float)cos((double)a), s = (float)sin((double)a);
    float* q = x + t * token_stride + h * head_stride;
    const float x1 = q[i], x2 = q[i + half];
    q[i] = x1 * c - x2 * s;
    q[i + half] = x2 * c + x1 * s;
}

// The input embeddings of a prompt's image (or video) rows: row rows[k] of the pass's hyper-connection banks x
// ([rows][streams][d]) gets emb[k] ([count][d], the vision tower's merged features) in every stream, in place of
// its pad token's embedding (crate::model::forward, X_0 = [e; e; ...; e]). thread = (k, j).
extern "C" __global__ void inject_rows(float* x, const int* __restrict__ rows, const float* __restrict__ emb,
                                       int count, int d, int streams) {
    pdl_entry();
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)count * d) return;
    const int k = idx / d, j = idx % d;
    const float v = emb[idx];
    float* row = x + (long long)rows[k] * streams * d;
    for (int s = 0; s < streams; s++) row[(long long)s * d + j] = v;
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
