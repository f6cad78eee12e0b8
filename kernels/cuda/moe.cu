// MoE routing and combination (engine/src/model/moe.rs; reference `Qwen4ExpTextTopKRouter`).
#include "common.cuh"

// Softmax over E router logits, the top k (ties to the lower expert id), weights renormalised to sum 1.
// One block per token; E <= 1024.
extern "C" __global__ void router_topk(const float* __restrict__ logits, int E, int k, int* ids, float* weights) {
    pdl_entry();
    const int t = blockIdx.x;
    __shared__ float p[1024];
    __shared__ float bv[32];
    __shared__ int bi[32];
    __shared__ float sum_sh;
    const float* lg = logits + (long long)t * E;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    float mx = -INFINITY;
    for (int i = tid; i < E; i += blockDim.x) mx = fmaxf(mx, lg[i]);
    mx = warp_max(mx);
    if (lane == 0) bv[warp] = mx;
    __syncthreads();
    if (tid == 0) {
        float v = -INFINITY;
        for (int w = 0; w < nw; w++) v = fmaxf(v, bv[w]);
        bv[0] = v;
    }
    __syncthreads();
    mx = bv[0];
    float s = 0.f;
    for (int i = tid; i < E; i += blockDim.x) {
        p[i] = expf(lg[i] - mx);
        s += p[i];
    }
    s = block_sum(s);
    for (int i = tid; i < E; i += blockDim.x) p[i] /= s;
    __syncthreads();
    float chosen_sum = 0.f;
    for (int r = 0; r < k; r++) {
        float best = -1.f;
        int besti = 0x7fffffff;
        for (int i = tid; i < E; i += blockDim.x)
            if (p[i] > best || (p[i] == best && i < besti)) {
                best = p[i];
                besti = i;
            }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, besti, o);
            if (ov > best || (ov == best && oi < besti)) {
                best = ov;
                besti = oi;
            }
        }
        __syncthreads();
        if (lane == 0) {
            bv[warp] = best;
            bi[warp] = besti;
        }
        __syncthreads();
        if (tid == 0) {
            float b = bv[0];
            int i0 = bi[0];
            for (int w = 1; w < nw; w++)
                if (bv[w] > b || (bv[w] == b && bi[w] < i0)) {
                    b = bv[w];
                    i0 = bi[w];
                }
            ids[t * k + r] = i0;
            weights[t * k + r] = b;
            chosen_sum += b;
            p[i0] = -2.f;
        }
        __syncthreads();
    }
    if (tid == 0) sum_sh = chosen_sum;
    __syncthreads();
    if (tid < k) weights[t * k + tid] /= sum_sh;
}

// out[t][i] = sum_j w[t][j] * ys[t*k + j][i] + extra[t][i] + sigmoid(sg[t]) * shared[t][i]. Slots of weight 0
// are skipped (their ys are not written: experts computed on the CPU in hybrid decode); extra may be null (the
// CPU's share of the routed experts in hybrid decode, already weighted).
// With X, also the hyper-connection residual update X[t][s*d + i] += a[t][s] * out[t][i] for every stream s
// (the hyper-connection residual update, fused).
extern "C" __global__ void moe_combine(const float* __restrict__ ys, const float* __restrict__ w,
                                       const float* __restrict__ shared, const float* __restrict__ sg,
                                       const float* __restrict__ extra, float* out, int n, int k, int d, float* X,
                                       const float* __restrict__ a, int streams) {
    pdl_entry();
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * d) return;
    const int i = idx % d, t = idx / d;
    // Every slot's value is loaded up front (the loads overlap); a skipped slot's (never written, possibly not
    // finite) is discarded by the select, so the sum is the same as adding only the weighted slots.
    float acc = 0.f;
    for (int j0 = 0; j0 < k; j0 += 8) {
        float yv[8], wv[8];
#pragma unroll
        for (int u = 0; u < 8; u++) {
            wv[u] = 0.f;
            yv[u] = 0.f;
            if (j0 + u < k) {
                wv[u] = w[t * k + j0 + u];
                yv[u] = ys[((long long)t * k + j0 + u) * d + i];
            }
        }
#pragma unroll
        for (int u = 0; u < 8; u++)
            if (j0 + u < k) acc += wv[u] != 0.f ? yv[u] * wv[u] : 0.f;
    }
    if (extra) acc += extra[idx];
    const float v = acc + sigmoidf_(sg[t]) * shared[idx];
    out[idx] = v;
    if (X) {
        for (int s = 0; s < streams; s++) X[((long long)t * streams + s) * d + i] += v * a[t * streams + s];
    }
}

// Hybrid decode (SPEC 3.2-3.3): splits each token's routed experts between the GPU expert cache and the CPU.
// slot_of[e] is expert e's slot in the layer's GPU cache or -1. Per token t (threads t < n): coverage = the
// token's router weight on resident experts; below `handoff` the whole routed MoE goes to the CPU (expert
// handoff), else the resident experts run on the GPU (gpu_slot = their slot, w_gpu = their weight) and the
// others on the CPU. With `omit` > 0 the lightest CPU experts are dropped while their summed weight stays
// within `omit` (the marginal-expert omission, a fraction of the token's mass). Every thread also copies m
// ([n][d]) into the pack the host reads in one copy: pack = [m: n*d floats][ids: n*k ints][w_cpu: n*k floats]
// [handoff flag per token: n ints]. k <= 32.
extern "C" __global__ void hybrid_split(const float* __restrict__ m, const int* __restrict__ ids,
                                        const float* __restrict__ w, const int* __restrict__ slot_of, int n, int k,
                                        int d, float handoff, float omit, int* gpu_slot, float* w_gpu,
                                        float* pack, float* coverage) {
    pdl_entry();
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < (long long)n * d) pack[idx] = m[idx];
    if (idx >= n) return;
    const int t = (int)idx;
    int* pack_ids = reinterpret_cast<int*>(pack + (long long)n * d);
    float* w_cpu = pack + (long long)n * d + n * k;
    int* flags = reinterpret_cast<int*>(pack + (long long)n * d + 2 * n * k);
    float cov = 0.f;
    for (int j = 0; j < k; j++)
        if (slot_of[ids[t * k + j]] >= 0) cov += w[t * k + j];
    // Verify pass (coverage != null, MTP case B): a row whose coverage, or an earlier row's, is below the threshold
    // at this or an earlier layer is not trusted (the decoder cuts the chain at the first such row): it keeps its
    // resident experts only (flag 2, no CPU work); the others run as in a decode step. coverage[t] is the row's
    // minimum over the layers so far.
    bool untrusted = false;
    if (coverage != nullptr) {
        float prior = 1.f;
        for (int u = 0; u <= t; u++) {
            float cu = 0.f;
            for (int j = 0; j < k; j++)
                if (slot_of[ids[u * k + j]] >= 0) cu += w[u * k + j];
            prior = fminf(prior, fminf(coverage[u], cu));
        }
        untrusted = prior < handoff;
    }
    // (Row u's thread may already have lowered coverage[u] to min(old, cu): the same minimum as read above.)
    if (coverage != nullptr) coverage[t] = fminf(coverage[t], cov);
    const bool to_cpu = !untrusted && cov < handoff;
    for (int j = 0; j < k; j++) {
        const int e = ids[t * k + j];
        const float wj = w[t * k + j];
        const int s = slot_of[e];
        pack_ids[t * k + j] = e;
        const bool on_gpu = !to_cpu && s >= 0;
        gpu_slot[t * k + j] = on_gpu ? s : -1;
        w_gpu[t * k + j] = on_gpu ? wj : 0.f;
        w_cpu[t * k + j] = (on_gpu || untrusted) ? 0.f : wj;
    }
    // Omission: drop the lightest CPU experts (ties to the later slot) while the dropped mass stays <= omit.
    float dropped = 0.f;
    while (omit > 0.f) {
        int best = -1;
        for (int j = 0; j < k; j++) {
            const float v = w_cpu[t * k + j];
            if (v > 0.f && (best < 0 || v <= w_cpu[t * k + best])) best = j;
        }
        if (best < 0 || dropped + w_cpu[t * k + best] > omit) break;
        dropped += w_cpu[t * k + best];
        w_cpu[t * k + best] = 0.f;
    }
    flags[t] = untrusted ? 2 : (to_cpu ? 1 : 0);
}

// dst[j] = src[idx[j]] (rows of `width`): gathers the tokens routed to one expert.
extern "C" __global__ void gather_rows(const float* __restrict__ src, const int* __restrict__ idx, float* dst, int n,
                                       int width) {
    pdl_entry();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * width) return;
    const int j = i / width, c = i % width;
    dst[i] = src[(long long)idx[j] * width + c];
}

// out[idx[j]] += w[j] * y[j] (rows of `width`); rows of one call are distinct tokens, so no two threads collide.
extern "C" __global__ void scatter_add_rows(const float* __restrict__ y, const int* __restrict__ idx,
                                            const float* __restrict__ w, float* out, int n, int width) {
    pdl_entry();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * width) return;
    const int j = i / width, c = i % width;
    out[(long long)idx[j] * width + c] += w[j] * y[i];
}

// out[t][i] += sigmoid(sg[t]) * shared[t][i] (the gated shared expert).
extern "C" __global__ void add_gated_shared(const float* __restrict__ shared, const float* __restrict__ sg, float* out,
                                            int n, int d) {
    pdl_entry();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * d) return;
    out[i] += sigmoidf_(sg[i / d]) * shared[i];
}

// Groups the routed (token, expert) slots by expert, stably: offsets[e]..offsets[e+1] index perm, which lists the
// slots routed to expert e in ascending slot order. One block; E <= 1024.
extern "C" __global__ void moe_sort(const int* __restrict__ ids, int slots, int E, int* offsets, int* perm) {
    pdl_entry();
    __shared__ int cnt[1024];
    for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int s = threadIdx.x; s < slots; s += blockDim.x) atomicAdd(&cnt[ids[s]], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        int acc = 0;
        for (int e = 0; e < E; e++) {
            const int c = cnt[e];
            offsets[e] = acc;
            cnt[e] = acc;
            acc += c;
        }
        offsets[E] = acc;
        for (int s = 0; s < slots; s++) perm[cnt[ids[s]]++] = s;
    }
}
