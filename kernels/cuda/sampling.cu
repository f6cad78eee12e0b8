// Token choice on the GPU: argmax (greedy) and the top-k candidates for host-side sampling.
#include "common.cuh"

// A running maximum over increasing ids: a strictly larger value wins (the first of equal values stays; -inf and
// NaN never win).
__device__ __forceinline__ void argmax_scan(float v, int i, float& best, int& besti) {
    if (v > best) {
        best = v;
        besti = i;
    }
}

// Merges another running maximum (v, i) into (best, besti): the larger value, the lower id on ties (an empty one,
// id 0x7fffffff, never wins a tie).
__device__ __forceinline__ void argmax_take(float v, int i, float& best, int& besti) {
    if (v > best || (v == best && i < besti)) {
        best = v;
        besti = i;
    }
}

// out[t] = argmax of logits[t] (ties to the lower id; -inf and NaN never win). One block per row. Each thread keeps
// four independent running maxima over 16-byte loads (rows of a multiple of 4 values, 16-byte aligned), so
// several loads are in flight per thread instead of one dependent load at a time: a 248,320-value row is a few
// microseconds, not hundreds.
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, int V, int* out) {
    pdl_entry();
    const int t = blockIdx.x;
    const float* row = logits + (long long)t * V;
    float best[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    int besti[4] = {0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff};
    const int step = blockDim.x;
    if ((V & 3) == 0 && (reinterpret_cast<unsigned long long>(row) & 15) == 0) {
        const float4* r4 = reinterpret_cast<const float4*>(row);
        const int n4 = V >> 2;
        int i = threadIdx.x;
        for (; i + 3 * step < n4; i += 4 * step) {
            float4 a[4];
#pragma unroll
            for (int u = 0; u < 4; u++) a[u] = r4[i + u * step];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int b = 4 * (i + u * step);
                argmax_scan(a[u].x, b, best[u], besti[u]);
                argmax_scan(a[u].y, b + 1, best[u], besti[u]);
                argmax_scan(a[u].z, b + 2, best[u], besti[u]);
                argmax_scan(a[u].w, b + 3, best[u], besti[u]);
            }
        }
        for (; i < n4; i += step) {
            const float4 a = r4[i];
            argmax_scan(a.x, 4 * i, best[0], besti[0]);
            argmax_scan(a.y, 4 * i + 1, best[0], besti[0]);
            argmax_scan(a.z, 4 * i + 2, best[0], besti[0]);
            argmax_scan(a.w, 4 * i + 3, best[0], besti[0]);
        }
    } else {
        for (int i = threadIdx.x; i < V; i += step) argmax_scan(row[i], i, best[0], besti[0]);
    }
#pragma unroll
    for (int u = 1; u < 4; u++) argmax_take(best[u], besti[u], best[0], besti[0]);
    float b0 = best[0];
    int i0 = besti[0];
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, b0, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i0, o);
        argmax_take(ov, oi, b0, i0);
    }
    __shared__ float bv[32];
    __shared__ int bi[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        bv[warp] = b0;
        bi[warp] = i0;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++) argmax_take(bv[w], bi[w], b0, i0);
        out[t] = i0 == 0x7fffffff ? -1 : i0;
    }
}
