// Hyper-connections (engine/src/model/hyper_connection.rs): the 4-stream residual bundle's mixer and injection.
#include "common.cuh"

// X[t][s*d + i] = e[t][i] for every stream s (the embedding enters every stream).
extern "C" __global__ void broadcast_streams(const float* __restrict__ e, float* X, int n, int streams, int d) {
    pdl_entry();
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * streams * d) return;
    const int i = idx % d;
    const int t = idx / ((long long)streams * d);
    X[idx] = e[(long long)t * d + i];
}

// low = silu(low / streams); with qx, also its 8-bit form in blocks of blk (quantize_thread; 256-thread blocks,
// rows a whole number of quantization blocks).
extern "C" __global__ void hc_low_act(float* low, long long count, float inv_streams, signed char* qx, float* dx,
                                      int blk) {
    pdl_entry();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    float v = 0.f;
    if (i < count) {
        v = siluf_(low[i] * inv_streams);
        low[i] = v;
    }
    if (qx) quantize_thread(v, i < count, i, blk, qx, dx);
}

// m[t][i] = (1/S) sum_s sigmoid(g[t][s*d+i]) * xn[t][s*d+i]   (the block input); with qx, also its 8-bit form
// as hc_low_act.
extern "C" __global__ void hc_mix(const float* __restrict__ g, const float* __restrict__ xn, float* m, int n,
                                  int streams, int d, signed char* qx, float* dx, int blk) {
    pdl_entry();
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const bool live = idx < (long long)n * d;
    float v = 0.f;
    if (live) {
        const int i = idx % d, t = idx / d;
        const long long base = (long long)t * streams * d + i;
        float acc = 0.f;
        for (int s = 0; s < streams; s++) acc += sigmoidf_(g[base + s * d]) * xn[base + s * d];
        v = acc * (1.f / streams);
        m[idx] = v;
    }
    if (qx) quantize_thread(v, live, idx, blk, qx, dx);
}

// a = 2 sigmoid(a / S)   (injection weights, one per stream).
extern "C" __global__ void hc_inject_act(float* a, long long count, float inv_streams) {
    pdl_entry();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) a[i] = 2.f * sigmoidf_(a[i] * inv_streams);
}


// The down and injection projections stacked into one product y [n][rank + S]: low[t][j] = silu(y[t][j] / S)
// (compact [n][rank], with qx also its 8-bit form as hc_low_act) and a[t][s] = 2 sigmoid(y[t][rank + s] / S).
// Thread i of the flat grid over n * rank values also computes a's value i when i < n * S.
extern "C" __global__ void hc_acts(const float* __restrict__ y, float* low, float* a, int n, int rank, int streams,
                                   signed char* qx, float* dx, int blk) {
    pdl_entry();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const float inv_s = 1.f / streams;
    const int width = rank + streams;
    const bool live = i < (long long)n * rank;
    float v = 0.f;
    if (live) {
        v = siluf_(y[(i / rank) * width + i % rank] * inv_s);
        low[i] = v;
    }
    if (i < (long long)n * streams) a[i] = 2.f * sigmoidf_(y[(i / streams) * width + rank + i % streams] * inv_s);
    if (qx) quantize_thread(v, live, i, blk, qx, dx);
}

// A bundle's RMS norm per stream, optionally after the residual update of the block before: with y,
// X[t][s*d + i] += a[t][s] * y[t][i] first (the residual update after a block, written back to X); then
// xn[t][s*d + i] = X[t][s*d + i] * rsqrt(mean_i(X[t][s*d + .]^2) + eps) * w[s*d + i], and with qx its 8-bit form
// (quantize_thread; blockDim a multiple of blk, d a multiple of blk). One block per (token, stream) row of d, with
// d <= HC_NORM_PER_THREAD * blockDim: each thread keeps its values, and the norm weights it needs, in registers
// from one round of loads (a decode step's rows are latency-bound: one memory round trip, not three).
#define HC_NORM_PER_THREAD 4
extern "C" __global__ void __launch_bounds__(1024) hc_norm(float* X, const float* __restrict__ y,
                                                           const float* __restrict__ a, const float* __restrict__ w,
                                                           float* xn, int streams, int d, float eps,
                                                           signed char* qx, float* dx, int blk) {
    pdl_entry();
    const int row = blockIdx.x;  // t * streams + s
    const int t = row / streams, s = row % streams;
    float* xr = X + (long long)row * d;
    const float* wr = w + (long long)s * d;
    const float* yr = y ? y + (long long)t * d : nullptr;
    const float as = y ? a[row] : 0.f;
    float v[HC_NORM_PER_THREAD], wv[HC_NORM_PER_THREAD];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < HC_NORM_PER_THREAD; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        v[k] = 0.f;
        wv[k] = 0.f;
        if (i < d) {
            v[k] = xr[i];
            wv[k] = __ldg(wr + i);
            if (yr) v[k] += yr[i] * as;
        }
    }
#pragma unroll
    for (int k = 0; k < HC_NORM_PER_THREAD; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < d && yr) xr[i] = v[k];
        ss += v[k] * v[k];
    }
    ss = block_sum(ss);
    const float inv = rsqrtf(ss / d + eps);
    float* o = xn + (long long)row * d;
#pragma unroll
    for (int k = 0; k < HC_NORM_PER_THREAD; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        const float r = v[k] * inv * wv[k];
        if (i < d) o[i] = r;
        // Every thread of the block takes part in each quantization round that covers part of the row.
        if (qx && k * blockDim.x < d) quantize_thread(r, i < d, (long long)row * d + i, blk, qx, dx);
    }
}
