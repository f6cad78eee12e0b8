// MoE routing and combination (engine/src/model/moe.rs; reference `Qwen4ExpTextTopKRouter`).
#include "common.cuh"

// Softmax over E router logits, the top k (ties to the lower expert id), weights renormalised to sum 1.
// One warp per token (blockDim 32), E <= 1024: lane l holds p[l + 32 j] in registers, so a round of the top-k
// is a 32-value scan of the lane that lost its best and a 5-step shuffle argmax, with no block barrier.
// With sgw (f32 [d], d a multiple of 128), also the shared expert's gate logit sgate[t] = sgw . x[t] (x [n][d]):
// the one-row product that otherwise takes a launch of its own.
#define ROUTER_PER_LANE 32
extern "C" __global__ void router_topk(const float* __restrict__ logits, int E, int k, int* ids, float* weights,
                                       const float* __restrict__ x, int d, const float* __restrict__ sgw,
                                       float* sgate) {
    pdl_entry();
    const int t = blockIdx.x, lane = threadIdx.x;
    if (sgw) {
        const float4* xp = reinterpret_cast<const float4*>(x + (long long)t * d);
        const float4* wp = reinterpret_cast<const float4*>(sgw);
        // Eight float4 pairs in flight per lane before any is used: one warp is latency-bound on this row.
        float a = 0.f;
        for (int base = lane; base < d / 4; base += 32 * 8) {
            float4 u[8], v[8];
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const int i = base + 32 * j;
                u[j] = i < d / 4 ? xp[i] : make_float4(0.f, 0.f, 0.f, 0.f);
                v[j] = i < d / 4 ? __ldg(wp + i) : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int j = 0; j < 8; j++) a += u[j].x * v[j].x + u[j].y * v[j].y + u[j].z * v[j].z + u[j].w * v[j].w;
        }
        a = warp_sum(a);
        if (lane == 0) sgate[t] = a;
    }
    const float* lg = logits + (long long)t * E;
    float p[ROUTER_PER_LANE];
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < ROUTER_PER_LANE; j++) {
        const int i = lane + 32 * j;
        p[j] = i < E ? lg[i] : -INFINITY;
        mx = fmaxf(mx, p[j]);
    }
    mx = warp_max(mx);
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < ROUTER_PER_LANE; j++) {
        p[j] = lane + 32 * j < E ? expf(p[j] - mx) : 0.f;
        s += p[j];
    }
    s = warp_sum(s);
    // The lane's best (value, id): -1 after the lane's values are all taken (probabilities are >= 0).
    float best = -1.f;
    int besti = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < ROUTER_PER_LANE; j++) {
        if (lane + 32 * j < E) {
            p[j] /= s;
            if (p[j] > best) {
                best = p[j];
                besti = lane + 32 * j;
            }
        } else {
            p[j] = -2.f;
        }
    }
    float chosen_sum = 0.f, mine = 0.f;
    for (int r = 0; r < k; r++) {
        float b = best;
        int bi = besti;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, b, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > b || (ov == b && oi < bi)) {
                b = ov;
                bi = oi;
            }
        }
        chosen_sum += b;
        if (lane == r) {
            ids[t * k + r] = bi;
            mine = b;
        }
        if ((bi & 31) == lane) {
            // This lane gave the winner: take it out and find the lane's next best (ties: lower id first).
            best = -1.f;
            besti = 0x7fffffff;
#pragma unroll
            for (int j = 0; j < ROUTER_PER_LANE; j++) {
                if (lane + 32 * j == bi) p[j] = -2.f;
                if (p[j] > best) {
                    best = p[j];
                    besti = lane + 32 * j;
                }
            }
        }
    }
    if (lane < k) weights[t * k + lane] = mine / chosen_sum;
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

// Hybrid decode: splits each token's routed experts between the GPU expert cache and the CPU.
// slot_of[e] is expert e's slot in the layer's GPU cache or -1. Per token t (threads t < n): coverage = the
// token's router weight on resident experts; below `handoff` the whole routed MoE goes to the CPU (expert
// handoff), else the resident experts run on the GPU (gpu_slot = their slot, w_gpu = their weight) and the
// others on the CPU. With `omit` > 0 the lightest CPU experts are dropped while their summed weight stays
// within `omit` (the marginal-expert omission, a fraction of the token's mass). Every thread also copies m
// ([n][d]) into the pack the host reads in one copy: pack = [m: n*d floats][ids: n*k ints][w_cpu: n*k floats]
// [handoff flag per token: n ints][w: n*k floats, every slot's router weight, for the host's routing log]. k <= 32.
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
    float* w_all = pack + (long long)n * d + 2 * n * k + n;
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
        w_all[t * k + j] = wj;
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

// An exclusive prefix sum over the block (blockDim.x a multiple of 32, at most 1024): thread i gets the sum of v
// over threads 0 .. i - 1, and `total` the sum over the block. Every thread must call it; it synchronises the block.
__device__ __forceinline__ int block_exclusive_scan_(int v, int& total) {
    __shared__ int wsum[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads();  // wsum is free (an earlier call's readers are done)
    if (lane == 31) wsum[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int t = lane < nwarps ? wsum[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, t, o);
            if (lane >= o) t += y;
        }
        wsum[lane] = t;
    }
    __syncthreads();
    total = wsum[nwarps - 1];
    return (warp > 0 ? wsum[warp - 1] : 0) + x - v;
}

// Groups the routed (token, expert) slots by expert, stably: offsets[e]..offsets[e+1] index perm, which lists the
// slots routed to expert e in ascending slot order. Slots whose id is not an expert (negative: computed elsewhere,
// the CPU's in hybrid decode; or E and above) are left out (offsets[E] counts the others). With `active`, also the
// experts that have slots, in id order, in active[0 .. count), and -1 in active[count .. min(E, slots)) (the grid
// of a grouped launch: moe_gemvqg_*). One block of 1024 threads; E <= 1024. Counts by shared atomics, offsets and
// the active list by block scans; the slots are placed blockDim at a time, warp after warp, each warp ranking its
// lanes of one expert with __match_any_sync, so the order within an expert is the slot order.
extern "C" __global__ void moe_sort(const int* __restrict__ ids, int slots, int E, int* offsets, int* perm,
                                    int* active) {
    pdl_entry();
    __shared__ int cnt[1024];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    for (int e = tid; e < 1024; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int s = tid; s < slots; s += blockDim.x) {
        const int e = ids[s];
        if (e >= 0 && e < E) atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    const int c = tid < E ? cnt[tid] : 0;
    int total, used;
    const int at = block_exclusive_scan_(c, total);
    const int act = block_exclusive_scan_(c > 0 ? 1 : 0, used);
    if (tid < E) {
        offsets[tid] = at;
        cnt[tid] = at;  // from here on: expert tid's next free place in perm
        if (active && c > 0) active[act] = tid;
    }
    if (tid == 0) offsets[E] = total;
    if (active) {
        for (int j = used + tid; j < min(E, slots); j += blockDim.x) active[j] = -1;
    }
    __syncthreads();
    for (int base = 0; base < slots; base += blockDim.x) {
        const int s = base + tid;
        const int e = s < slots ? ids[s] : -1;
        const bool valid = e >= 0 && e < E;
        const unsigned int peers = __match_any_sync(0xffffffffu, valid ? e : -1);
        for (int w = 0; w < nwarps; w++) {
            if (warp == w) {
                int pos = 0;
                if (valid) pos = cnt[e] + __popc(peers & ((1u << lane) - 1u));
                __syncwarp();  // every lane has read its expert's place before the first of them moves it
                if (valid) {
                    perm[pos] = s;
                    if (lane == __ffs(peers) - 1) cnt[e] += __popc(peers);
                }
            }
            __syncthreads();
        }
    }
}
