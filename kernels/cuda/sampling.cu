// Token choice on the GPU: argmax (greedy) and the top-k candidates for host-side sampling.
#include "common.cuh"

// out[t] = argmax of logits[t] (ties to the lower id; -inf and NaN never win). One block per row.
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, int V, int* out) {
    pdl_entry();
    const int t = blockIdx.x;
    const float* row = logits + (long long)t * V;
    float best = -INFINITY;
    int besti = 0x7fffffff;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float v = row[i];
        if (v > best) {
            best = v;
            besti = i;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, besti, o);
        if (ov > best || (ov == best && oi < besti)) {
            best = ov;
            besti = oi;
        }
    }
    __shared__ float bv[32];
    __shared__ int bi[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        bv[warp] = best;
        bi[warp] = besti;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++)
            if (bv[w] > best || (bv[w] == best && bi[w] < besti)) {
                best = bv[w];
                besti = bi[w];
            }
        out[t] = besti == 0x7fffffff ? -1 : besti;
    }
}
