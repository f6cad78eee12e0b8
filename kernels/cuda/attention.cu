// Gated attention with the QSA indexer (engine/src/model/self_attn.rs; reference `Qwen4ExpTextQSAIndexer`).
#include "common.cuh"

// q[t][h] = P[t][h][0:hd] and gate[t][h] = P[t][h][hd:2hd] (q_proj packs query and output gate per head).
extern "C" __global__ void attn_split_q(const float* __restrict__ P, float* q, float* gate, int n, int nh, int hd) {
    pdl_entry();
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * nh * hd) return;
    const int i = idx % hd;
    const long long th = idx / hd;
    q[idx] = P[th * 2 * hd + i];
    gate[idx] = P[th * 2 * hd + hd + i];
}

// Pools the blocks completed by the n tokens appended at [pos, pos + n) (pos = *pos_dev when given): block b's
// raw indexer keys are averaged, RMS-normed with kn_w and rotated at the block's first position b*r (dims [0,
// rope_dim) in rotate-half pairs). Block i of the grid handles block pos/r + i when it is complete.
extern "C" __global__ void qsa_pool_new(const float* __restrict__ raw, float* pooled, int pos0, const int* pos_dev, int n,
                                        int r, int ihd, const float* __restrict__ kn_w, float eps, int rope_dim,
                                        float theta) {
    pdl_entry();
    const int pos = pos_dev ? *pos_dev : pos0;
    const int b = pos / r + blockIdx.x;
    if ((b + 1) * r > pos + n || (b + 1) * r <= pos) return;
    __shared__ float mean[256];
    float ss = 0.f;
    for (int i = threadIdx.x; i < ihd; i += blockDim.x) {
        float acc = 0.f;
        for (int tok = b * r; tok < (b + 1) * r; tok++) acc += raw[(long long)tok * ihd + i];
        acc /= (float)r;
        mean[i] = acc;
        ss += acc * acc;
    }
    ss = block_sum(ss);
    const float inv = rsqrtf(ss / ihd + eps);
    __syncthreads();
    for (int i = threadIdx.x; i < ihd; i += blockDim.x) mean[i] = mean[i] * inv * kn_w[i];
    __syncthreads();
    const int half = rope_dim / 2;
    float* out = pooled + (long long)b * ihd;
    for (int i = threadIdx.x; i < ihd; i += blockDim.x) {
        float v = mean[i];
        if (i < rope_dim) {
            const int k = i < half ? i : i - half;
            const float inv_freq = 1.f / powf(theta, (float)(2 * k) / (float)rope_dim);
            const float a = (float)(b * r) * inv_freq;
            const float c = (float)cos((double)a), sn = (float)sin((double)a);
            v = i < half ? mean[i] * c - mean[i + half] * sn : mean[i] * c + mean[i - half] * sn;
        }
        out[i] = v;
    }
}

// scores[t][b] = sum_h relu(<qI[t][h], pooled[b]>) / sqrt(ihd) for the complete blocks b < (pos0+t+1)/r; -inf
// after. One warp per (t, b): lanes stride the head dims, each head's dot product a shuffle-tree sum.
extern "C" __global__ void qsa_scores(const float* __restrict__ qI, const float* __restrict__ pooled, float* scores,
                                      int n, int pos0, const int* pos_dev, int r, int nih, int ihd, int max_blocks) {
    pdl_entry();
    if (pos_dev) pos0 = *pos_dev;
    const long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (w >= (long long)n * max_blocks) return;  // uniform over the warp
    const int b = w % max_blocks, t = w / max_blocks;
    const int complete = (pos0 + t + 1) / r;
    if (b >= complete) {
        if (lane == 0) scores[w] = -INFINITY;
        return;
    }
    const float* k = pooled + (long long)b * ihd;
    float s = 0.f;
    for (int h = 0; h < nih; h++) {
        const float* q = qI + ((long long)t * nih + h) * ihd;
        float d = 0.f;
        for (int i = lane; i < ihd; i += 32) d += q[i] * __ldg(k + i);
        s += fmaxf(warp_sum(d), 0.f);
    }
    if (lane == 0) scores[w] = s * rsqrtf((float)ihd);
}

__device__ __forceinline__ unsigned int order_key(float f) {
    const unsigned int u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The keys query t attends to, ascending (selected blocks' tokens in block order, then the tail), into
// sel[t][0..count[t]). With no more complete blocks than `keep`, every visible token. Otherwise the `keep`
// highest-scoring blocks (ties to the lower block), found by a 4-pass radix select on the score bits.
// One block of 256 threads per query.
extern "C" __global__ void qsa_select(const float* __restrict__ scores, int max_blocks, int keep, int pos0,
                                      const int* pos_dev, int r, int* sel, int* count, int cap) {
    pdl_entry();
    if (pos_dev) pos0 = *pos_dev;
    const int t = blockIdx.x;
    const int visible = pos0 + t + 1;
    const int complete = visible / r;
    int* out = sel + (long long)t * cap;
    const int tid = threadIdx.x, nt = blockDim.x;
    if (complete <= keep) {
        for (int i = tid; i < visible; i += nt) out[i] = i;
        if (tid == 0) count[t] = visible;
        return;
    }
    const float* sc = scores + (long long)t * max_blocks;
    __shared__ unsigned int hist[256];
    __shared__ unsigned int prefix, prefix_mask;
    __shared__ int remaining;
    if (tid == 0) {
        prefix = 0;
        prefix_mask = 0;
        remaining = keep;
    }
    __syncthreads();
    for (int pass = 0; pass < 4; pass++) {
        const int shift = 24 - 8 * pass;
        for (int i = tid; i < 256; i += nt) hist[i] = 0;
        __syncthreads();
        for (int b = tid; b < complete; b += nt) {
            const unsigned int k = order_key(sc[b]);
            if ((k & prefix_mask) == prefix) atomicAdd(&hist[(k >> shift) & 255], 1u);
        }
        __syncthreads();
        if (tid == 0) {
            int need = remaining;
            for (int bin = 255; bin >= 0; bin--) {
                if ((int)hist[bin] >= need) {
                    prefix |= ((unsigned int)bin) << shift;
                    prefix_mask |= 255u << shift;
                    remaining = need;
                    break;
                }
                need -= hist[bin];
            }
        }
        __syncthreads();
    }
    // prefix is the keep-th largest key; `remaining` of the blocks equal to it are taken, lowest index first.
    const unsigned int thr = prefix;
    const int take_eq = remaining;
    __shared__ int cnt_gt[256], cnt_eq[256];
    const int per = (complete + nt - 1) / nt;
    const int lo = min(tid * per, complete), hi = min(lo + per, complete);
    int g = 0, e = 0;
    for (int b = lo; b < hi; b++) {
        const unsigned int k = order_key(sc[b]);
        g += k > thr;
        e += k == thr;
    }
    cnt_gt[tid] = g;
    cnt_eq[tid] = e;
    __syncthreads();
    if (tid == 0) {
        int ag = 0, ae = 0;
        for (int i = 0; i < nt; i++) {
            const int tg = cnt_gt[i], te = cnt_eq[i];
            cnt_gt[i] = ag;
            cnt_eq[i] = ae;
            ag += tg;
            ae += te;
        }
    }
    __syncthreads();
    int eq_rank = cnt_eq[tid];
    int pos = cnt_gt[tid] + min(eq_rank, take_eq);
    for (int b = lo; b < hi; b++) {
        const unsigned int k = order_key(sc[b]);
        bool take = k > thr;
        if (k == thr) {
            take = eq_rank < take_eq;
            eq_rank++;
        }
        if (take) {
            for (int j = 0; j < r; j++) out[pos * r + j] = b * r + j;
            pos++;
        }
    }
    __syncthreads();
    const int tail0 = complete * r;
    for (int i = tail0 + tid; i < visible; i += nt) out[keep * r + (i - tail0)] = i;
    if (tid == 0) count[t] = keep * r + (visible - tail0);
}

// Online softmax of query (t, h) over keys [k0, k1) of its list (sel/count) or, when sel is null, of keys
// 0..pos0+t, in tiles of 32: m (running max), l (running sum) and acc (unnormalised output, dims tid + 128 c).
// K/V caches are [len][nkv*hd]; head h reads kv head h / (nh/nkv). VEC4 scores with 16-byte loads (hd % 4 == 0).
// block = 128 threads (4 warps), hd <= 512. Every thread of the block must call it.
template <bool VEC4>
__device__ __forceinline__ void attend_keys(const float* __restrict__ qh, const float* __restrict__ Kc,
                                            const float* __restrict__ Vc, const int* list, int k0, int k1, int kvh,
                                            int kvw, int hd, float scale, float& m, float& l, float (&acc)[4]) {
    __shared__ float qs[512];
    __shared__ float ps[32];
    __shared__ int ks[32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (int i = tid; i < hd; i += blockDim.x) qs[i] = qh[i];
    m = -INFINITY;
    l = 0.f;
    for (int c = 0; c < 4; c++) acc[c] = 0.f;
    __syncthreads();
    for (int base = k0; base < k1; base += 32) {
        const int tile = min(32, k1 - base);
        // Each warp scores 8 keys (j = warp + 4u), all eight keys' loads in flight before the reductions.
        float d[8];
        int key[8];
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const int j = warp + 4 * u;
            d[u] = 0.f;
            key[u] = 0;
            if (j < tile) {
                key[u] = list ? list[base + j] : base + j;
                const float* k = Kc + (long long)key[u] * kvw + kvh * hd;
                if constexpr (VEC4) {
                    const float4* k4 = reinterpret_cast<const float4*>(k);
                    const float4* q4 = reinterpret_cast<const float4*>(qs);
                    for (int i = lane; i < hd / 4; i += 32) {
                        const float4 a = q4[i], b = __ldg(k4 + i);
                        d[u] += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
                    }
                } else {
                    for (int i = lane; i < hd; i += 32) d[u] += qs[i] * k[i];
                }
            }
        }
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const int j = warp + 4 * u;
            const float dj = warp_sum(d[u]);
            if (lane == 0 && j < tile) {
                ps[j] = dj * scale;
                ks[j] = key[u];
            }
        }
        __syncthreads();
        float tmax = -INFINITY;
        for (int j = 0; j < tile; j++) tmax = fmaxf(tmax, ps[j]);
        const float m_new = fmaxf(m, tmax);
        const float corr = expf(m - m_new);
        l *= corr;
        for (int c = 0; c < 4; c++) acc[c] *= corr;
#pragma unroll 8
        for (int j = 0; j < tile; j++) {
            const float p = expf(ps[j] - m_new);
            l += p;
            const float* v = Vc + (long long)ks[j] * kvw + kvh * hd;
            for (int c = 0; c < 4; c++) {
                const int i = tid + 128 * c;
                if (i < hd) acc[c] += p * v[i];
            }
        }
        m = m_new;
        __syncthreads();
    }
}

// Attention for query (t, h) = blockIdx.x over all its keys (prefill). block = 128 threads, hd <= 512.
extern "C" __global__ void attention(const float* __restrict__ q, const float* __restrict__ Kc,
                                     const float* __restrict__ Vc, const int* __restrict__ sel,
                                     const int* __restrict__ count, int cap, int pos0, const int* pos_dev, float* out,
                                     int nh, int nkv, int hd, float scale) {
    pdl_entry();
    if (pos_dev) pos0 = *pos_dev;
    const int t = blockIdx.x / nh, h = blockIdx.x % nh;
    const int nkeys = sel ? count[t] : pos0 + t + 1;
    const int* list = sel ? sel + (long long)t * cap : nullptr;
    float m, l, acc[4];
    attend_keys<false>(q + ((long long)t * nh + h) * hd, Kc, Vc, list, 0, nkeys, h / (nh / nkv), nkv * hd, hd,
                       scale, m, l, acc);
    float* o = out + ((long long)t * nh + h) * hd;
    for (int c = 0; c < 4; c++) {
        const int i = threadIdx.x + 128 * c;
        if (i < hd) o[i] = acc[c] / l;
    }
}

// Attention for all G = nh / nkv query heads of kv head blockIdx.x % nkv and query t = blockIdx.x / nkv
// (prefill): the heads share their token's key list, so each key and value row is read once per block instead of
// once per head. Same arithmetic, in the same order, as `attention` (scores: lane-strided products and a shuffle
// tree; tiles of 32 keys; per head the running max, correction, sum and accumulator updated key by key), so the
// output equals it bit for bit. block = 128 threads; G <= 16, hd <= 256 and hd % 32 == 0.
#define AG_MAXG 16
extern "C" __global__ void attention_gqa(const float* __restrict__ q, const float* __restrict__ Kc,
                                         const float* __restrict__ Vc, const int* __restrict__ sel,
                                         const int* __restrict__ count, int cap, int pos0, const int* pos_dev,
                                         float* out, int nh, int nkv, int hd, float scale) {
    pdl_entry();
    if (pos_dev) pos0 = *pos_dev;
    __shared__ float qs[AG_MAXG * 256];
    __shared__ float ps[AG_MAXG][32];
    __shared__ int ks[32];
    __shared__ float m_sh[AG_MAXG], corr_sh[AG_MAXG], l_sh[AG_MAXG];
    const int G = nh / nkv;
    const int t = blockIdx.x / nkv, kvh = blockIdx.x % nkv;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nkeys = sel ? count[t] : pos0 + t + 1;
    const int* list = sel ? sel + (long long)t * cap : nullptr;
    const int kvw = nkv * hd, per_lane = hd / 32;
    const float* qt = q + ((long long)t * nh + (long long)kvh * G) * hd;
    for (int i = tid; i < G * hd; i += blockDim.x) qs[i] = qt[i];
    if (tid < G) {
        m_sh[tid] = -INFINITY;
        l_sh[tid] = 0.f;
    }
    float acc[AG_MAXG][2];
#pragma unroll
    for (int h = 0; h < AG_MAXG; h++) acc[h][0] = acc[h][1] = 0.f;
    __syncthreads();
    for (int base = 0; base < nkeys; base += 32) {
        const int tile = min(32, nkeys - base);
        // Scores: warp w takes keys j = w + 4u (u < 8), two keys' rows in registers at a time.
        for (int u0 = 0; u0 < 8; u0 += 2) {
            float kr[2][8];
            int key[2];
#pragma unroll
            for (int v = 0; v < 2; v++) {
                const int j = warp + 4 * (u0 + v);
                key[v] = j < tile ? (list ? list[base + j] : base + j) : 0;
                const float* k = Kc + (long long)key[v] * kvw + kvh * hd;
#pragma unroll
                for (int i = 0; i < 8; i++) kr[v][i] = (j < tile && i < per_lane) ? __ldg(k + lane + 32 * i) : 0.f;
            }
#pragma unroll
            for (int v = 0; v < 2; v++) {
                const int j = warp + 4 * (u0 + v);
                if (j >= tile) continue;  // uniform over the warp
                for (int h = 0; h < G; h++) {
                    float d = 0.f;
#pragma unroll
                    for (int i = 0; i < 8; i++)
                        if (i < per_lane) d += qs[h * hd + lane + 32 * i] * kr[v][i];
                    d = warp_sum(d);
                    if (lane == 0) ps[h][j] = d * scale;
                }
                if (lane == 0) ks[j] = key[v];
            }
        }
        __syncthreads();
        if (tid < G) {
            float tmax = -INFINITY;
            for (int j = 0; j < tile; j++) tmax = fmaxf(tmax, ps[tid][j]);
            const float m_new = fmaxf(m_sh[tid], tmax);
            corr_sh[tid] = expf(m_sh[tid] - m_new);
            m_sh[tid] = m_new;
        }
        __syncthreads();
        // p = exp(score - m_new) in place, then each head's sum in key order (thread h).
        for (int i = tid; i < G * 32; i += blockDim.x) {
            const int h = i / 32, j = i % 32;
            if (j < tile) ps[h][j] = expf(ps[h][j] - m_sh[h]);
        }
        __syncthreads();
        if (tid < G) {
            float l = l_sh[tid] * corr_sh[tid];
            for (int j = 0; j < tile; j++) l += ps[tid][j];
            l_sh[tid] = l;
        }
#pragma unroll
        for (int h = 0; h < AG_MAXG; h++) {
            if (h < G) {
                acc[h][0] *= corr_sh[h];
                acc[h][1] *= corr_sh[h];
            }
        }
        for (int j = 0; j < tile; j++) {
            const float* v = Vc + (long long)ks[j] * kvw + kvh * hd;
            const float v0 = tid < hd ? __ldg(v + tid) : 0.f;
            const float v1 = tid + 128 < hd ? __ldg(v + tid + 128) : 0.f;
#pragma unroll
            for (int h = 0; h < AG_MAXG; h++) {
                if (h < G) {
                    const float p = ps[h][j];
                    acc[h][0] += p * v0;
                    acc[h][1] += p * v1;
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int h = 0; h < AG_MAXG; h++) {
        if (h < G) {
            float* o = out + ((long long)t * nh + (long long)kvh * G + h) * hd;
            if (tid < hd) o[tid] = acc[h][0] / l_sh[h];
            if (tid + 128 < hd) o[tid + 128] = acc[h][1] / l_sh[h];
        }
    }
}

// Split-key attention for decode (flash-decoding): grid (n * nh, S); split s of query (t, h) takes keys
// [s * per, min((s + 1) * per, nkeys)) of its list, per = ceil(nkeys / S) rounded up to 32, and writes its running
// max m, sum l and unnormalised accumulator to part_m/part_l [n * nh][S] and part_acc [n * nh][S][hd].
// attention_combine then merges the S parts. block = 128 threads, hd <= 512, hd % 4 == 0.
extern "C" __global__ void attention_part(const float* __restrict__ q, const float* __restrict__ Kc,
                                          const float* __restrict__ Vc, const int* __restrict__ sel,
                                          const int* __restrict__ count, int cap, int pos0, const int* pos_dev,
                                          float* part_m, float* part_l, float* part_acc, int nh, int nkv, int hd,
                                          float scale) {
    pdl_entry();
    if (pos_dev) pos0 = *pos_dev;
    const int S = gridDim.y, s = blockIdx.y;
    const int t = blockIdx.x / nh, h = blockIdx.x % nh;
    const int nkeys = sel ? count[t] : pos0 + t + 1;
    const int* list = sel ? sel + (long long)t * cap : nullptr;
    const int per = ((nkeys + S - 1) / S + 31) / 32 * 32;
    const int k0 = min(nkeys, s * per), k1 = min(nkeys, k0 + per);
    float m, l, acc[4];
    attend_keys<true>(q + ((long long)t * nh + h) * hd, Kc, Vc, list, k0, k1, h / (nh / nkv), nkv * hd, hd, scale,
                      m, l, acc);
    const long long part = (long long)blockIdx.x * S + s;
    if (threadIdx.x == 0) {
        part_m[part] = m;
        part_l[part] = l;
    }
    for (int c = 0; c < 4; c++) {
        const int i = threadIdx.x + 128 * c;
        if (i < hd) part_acc[part * hd + i] = acc[c];
    }
}

// out[(t, h)] = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s over the S parts (empty parts have m = -inf).
// grid n * nh, block 128.
extern "C" __global__ void attention_combine(const float* __restrict__ part_m, const float* __restrict__ part_l,
                                             const float* __restrict__ part_acc, float* out, int S, int hd) {
    pdl_entry();
    const long long qh = blockIdx.x;
    float M = -INFINITY;
    for (int s = 0; s < S; s++) M = fmaxf(M, part_m[qh * S + s]);
    float L = 0.f;
    for (int s = 0; s < S; s++) {
        const float ms = part_m[qh * S + s];
        if (ms != -INFINITY) L += expf(ms - M) * part_l[qh * S + s];
    }
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float a = 0.f;
        for (int s = 0; s < S; s++) {
            const float ms = part_m[qh * S + s];
            if (ms != -INFINITY) a += expf(ms - M) * part_acc[(qh * S + s) * hd + i];
        }
        out[qh * hd + i] = a / L;
    }
}
