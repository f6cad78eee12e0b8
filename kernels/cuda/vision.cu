// The vision tower on the GPU (engine/src/vision, `Qwen4ExpVisionModel` in transformers' modeling_qwen4_exp.py):
// the element-wise and per-row pieces around the tower's cuBLAS f32 GEMMs. Patches are rows [n][hidden] in the
// spatial-merge-block order of the CPU tower (each merge x merge square of patches contiguous), frames one after
// another; the attention of a patch covers the patches of its own frame.
#include "common.cuh"

// y[r][c] = act(y[r][c] + b[c]): act 0 none, 1 GELU with the tanh approximation (`gelu_pytorch_tanh`, the blocks'
// MLP), 2 the exact erf GELU of nn.GELU() (the merger), erf in double as the CPU tower evaluates it.
extern "C" __global__ void vision_bias_act(float* y, const float* __restrict__ b, long long rows, int cols, int act) {
    pdl_entry();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * cols) return;
    const float x = y[i] + b[i % cols];
    float v = x;
    if (act == 1) {
        const float k = 0.7978846f;  // sqrt(2 / pi), as the CPU tower's f32 constant
        v = 0.5f * x * (1.f + tanhf(k * (x + 0.044715f * x * x * x)));
    } else if (act == 2) {
        v = (float)(0.5 * (double)x * (1.0 + erf((double)x / 1.4142135623730951)));
    }
    y[i] = v;
}

// x[r][c] += y[r][c] + b[c]: a block's residual add of a linear layer's output with its bias.
extern "C" __global__ void vision_bias_residual(float* x, const float* __restrict__ y, const float* __restrict__ b,
                                                long long rows, int cols) {
    pdl_entry();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * cols) return;
    x[i] += y[i] + b[i % cols];
}

// LayerNorm of every row of `width` values: (x - mean) / sqrt(var + eps) * w + b, biased variance, two passes
// over the row. One block per row (a multiple of 32 threads).
extern "C" __global__ void vision_layer_norm(const float* __restrict__ x, const float* __restrict__ w,
                                             const float* __restrict__ b, float* out, int rows, int width,
                                             float eps) {
    pdl_entry();
    const int r = blockIdx.x;
    if (r >= rows) return;
    const float* xr = x + (long long)r * width;
    float s = 0.f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) s += xr[i];
    const float mean = block_sum(s) / (float)width;
    float ss = 0.f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        const float d = xr[i] - mean;
        ss += d * d;
    }
    const float var = block_sum(ss) / (float)width;
    const float inv = 1.f / sqrtf(var + eps);
    float* o = out + (long long)r * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) o[i] = (xr[i] - mean) * inv * w[i] + b[i];
}

// The (row, column) of patch `within` of an h x w frame (w = `cols` patches) in spatial-merge-block order.
__device__ __forceinline__ void vision_patch_rc(int within, int cols, int merge, int* row, int* col) {
    const int in_col = within % merge, in_row = (within / merge) % merge;
    const int blocks_w = cols / merge;
    const int bc = (within / (merge * merge)) % blocks_w, br = within / (merge * merge * blocks_w);
    *row = br * merge + in_row;
    *col = bc * merge + in_col;
}

// One axis of the learned grid's bilinear resampling (align_corners, border clamping): output index i of `size`
// reads grid rows taps[0..2) with weights wt[0..2) (engine/src/vision/pos_embed.rs `axis`).
__device__ __forceinline__ void vision_axis(int i, int size, int side, int* taps, float* wt) {
    const int den = size - 1 > 1 ? size - 1 : 1;
    const float src = ((float)i * (float)(side - 1)) / (float)den;
    const float fl = floorf(src);
    for (int k = 0; k < 2; k++) {
        int raw = (int)fl + k;
        taps[k] = raw < 0 ? 0 : (raw > side - 1 ? side - 1 : raw);
        wt[k] = fmaxf(0.f, 1.f - fabsf(src - fl - (float)k));
    }
}

// x[p][j] += the learned position grid (`table`, [side * side][d]) resampled to the t frames of h x w patches,
// at patch p's (row, column): four taps in the CPU tower's order. thread = (p, j).
extern "C" __global__ void vision_pos_embed(float* x, const float* __restrict__ table, int t, int h, int w, int merge,
                                            int side, int d) {
    pdl_entry();
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)t * h * w * d) return;
    const int j = idx % d;
    const int p = idx / d;
    int r, c;
    vision_patch_rc(p % (h * w), w, merge, &r, &c);
    int ht[2], wt[2];
    float hw_[2], ww[2];
    vision_axis(r, h, side, ht, hw_);
    vision_axis(c, w, side, wt, ww);
    const int ta[4] = {ht[0], ht[0], ht[1], ht[1]};
    const int tb[4] = {wt[0], wt[1], wt[0], wt[1]};
    const float wk[4] = {hw_[0] * ww[0], hw_[0] * ww[1], hw_[1] * ww[0], hw_[1] * ww[1]};
    float s = 0.f;
    for (int k = 0; k < 4; k++) s += table[(long long)(ta[k] * side + tb[k]) * d + j] * wk[k];
    x[idx] += s;
}

// The 2-D rotary of the tower's attention on the q and k of every patch (qkv rows [n][3 * heads * hd]): slot
// i < hd/4 turns with the patch's row, slot hd/4 + i with its column, at inv_freq[i] (hd/4 values, made on the
// host as the CPU tower makes them); the hd/2 angles rotate the pairs (j, j + hd/2) (rotate_half).
// thread = (patch, head, slot).
extern "C" __global__ void vision_rotary(float* qkv, int n, int hw, int w, int merge, int heads, int hd,
                                         const float* __restrict__ inv_freq) {
    pdl_entry();
    const int half = hd / 2, quarter = hd / 4;
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * heads * half) return;
    const int i = idx % half;
    const int h = (idx / half) % heads;
    const int p = idx / ((long long)half * heads);
    int r, c;
    vision_patch_rc(p % hw, w, merge, &r, &c);
    const float a = i < quarter ? (float)r * inv_freq[i] : (float)c * inv_freq[i - quarter];
    const float cs = (float)cos((double)a), sn = (float)sin((double)a);
    const long long d = (long long)heads * hd;
    for (int part = 0; part < 2; part++) {  // q, then k
        float* x = qkv + (long long)p * 3 * d + part * d + (long long)h * hd;
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * cs - x2 * sn;
        x[i + half] = x2 * cs + x1 * sn;
    }
}

// Keys per shared-memory tile of the tower's attention.
#define VISION_KT 16

// Softmax attention of every patch over the patches of its own frame (no mask, scale 1/sqrt(hd)), head h:
// out[p][h*hd ..] = sum_j softmax_j(<q_p, k_j> * scale) v_j, q/k/v from qkv rows [n][3 * heads * hd]. One thread
// per query (a block holds blockDim.x queries of one frame and head; grid (ceil(hw / blockDim.x), heads,
// frames)), keys and values through shared memory VISION_KT at a time with an online softmax (running maximum
// and sum, the accumulator rescaled once per tile).
template <int HD>
__device__ __forceinline__ void vision_attention_body(const float* __restrict__ qkv, float* out, int hw, int heads,
                                                      float scale) {
    __shared__ float ks[VISION_KT][HD];
    __shared__ float vs[VISION_KT][HD];
    const long long d = (long long)heads * HD;
    const int h = blockIdx.y;
    const long long base = (long long)blockIdx.z * hw;
    const int qi = blockIdx.x * blockDim.x + threadIdx.x;
    const bool live = qi < hw;
    float q[HD], acc[HD];
#pragma unroll
    for (int c = 0; c < HD; c++) {
        q[c] = live ? qkv[(base + qi) * 3 * d + (long long)h * HD + c] : 0.f;
        acc[c] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    for (int k0 = 0; k0 < hw; k0 += VISION_KT) {
        __syncthreads();
        for (int e = threadIdx.x; e < VISION_KT * HD; e += blockDim.x) {
            const int j = e / HD, c = e % HD;
            const int key = k0 + j;
            const bool in = key < hw;
            const float* row = qkv + (base + (in ? key : 0)) * 3 * d + (long long)h * HD + c;
            ks[j][c] = in ? row[d] : 0.f;
            vs[j][c] = in ? row[2 * d] : 0.f;
        }
        __syncthreads();
        const int kn = hw - k0 < VISION_KT ? hw - k0 : VISION_KT;
        float s[VISION_KT];
        float mt = m;
#pragma unroll
        for (int j = 0; j < VISION_KT; j++) {
            float dot = 0.f;
#pragma unroll
            for (int c = 0; c < HD; c++) dot += q[c] * ks[j][c];
            s[j] = j < kn ? dot * scale : -INFINITY;
            mt = fmaxf(mt, s[j]);
        }
        const float corr = expf(m - mt);
        l *= corr;
#pragma unroll
        for (int c = 0; c < HD; c++) acc[c] *= corr;
#pragma unroll
        for (int j = 0; j < VISION_KT; j++) {
            const float pj = j < kn ? expf(s[j] - mt) : 0.f;
            l += pj;
#pragma unroll
            for (int c = 0; c < HD; c++) acc[c] += pj * vs[j][c];
        }
        m = mt;
    }
    if (!live) return;
    const float inv = 1.f / l;
    float* o = out + (base + qi) * d + (long long)h * HD;
#pragma unroll
    for (int c = 0; c < HD; c++) o[c] = acc[c] * inv;
}

#define VISION_ATTENTION(NAME, T)                                                                                   \
    extern "C" __global__ void vision_attention_##NAME(const float* __restrict__ qkv, float* out, int hw, int heads, \
                                                       float scale) {                                               \
        pdl_entry();                                                                                                \
        vision_attention_body<T>(qkv, out, hw, heads, scale);                                                       \
    }
VISION_ATTENTION(16, 16)
VISION_ATTENTION(32, 32)
VISION_ATTENTION(48, 48)
VISION_ATTENTION(64, 64)
VISION_ATTENTION(72, 72)
VISION_ATTENTION(80, 80)
VISION_ATTENTION(96, 96)
VISION_ATTENTION(128, 128)
