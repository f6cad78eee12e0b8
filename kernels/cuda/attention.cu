// Gated attention with the QSA indexer (engine/src/model/self_attn.rs; reference `Qwen4ExpTextQSAIndexer`).
//
// The caches (K, V, the indexer's raw keys, its pooled block keys) hold rows in a KV cache type (ggml type ids
// T_F32, T_F16, T_Q8_0, T_Q4_0; layouts in engine/src/model/kv_cache.rs: ggml blocks of 32 along each row, so a
// head's slice of a row is whole blocks). The kernels of a family are instantiated per type; the f32 ones compute
// exactly what they did before the types existed.
//
// A sequence's K, V and raw indexer keys may live in a ring of `ring_len` rows in VRAM (row j in slot j %
// ring_len) with every row also in pinned host memory (engine/src/backend/cuda/kv_cache.rs). A pass over n rows
// at positions [pos, pos + n) then reads the keys below cold_end = kv_cold_end(pos + n, window, r) from a
// position-indexed staging buffer (`Kcold`, `Vcold`) that kv_cold_gather (decode) or a bulk copy (prefill) filled
// from the host, and the others from the ring; `window` = 0 (every row in VRAM, ring_len = the capacity) reads
// the ring only, at row j.
#include "common.cuh"

// f32 to IEEE half bits, round to nearest even (the CPU's `half::f16::from_f32`).
__device__ __forceinline__ unsigned short f32_to_half_bits(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Bytes of `w` values (a whole number of blocks) of KV type T.
template <int T>
__device__ __forceinline__ long long kv_bytes(long long w) {
    if constexpr (T == T_F32) return 4 * w;
    else if constexpr (T == T_F16) return 2 * w;
    else if constexpr (T == T_Q8_0) return (w >> 5) * 34;
    else return (w >> 5) * 18;
}

// Value i of a row of KV type T (ggml's dequantization: q * d for Q8_0, d * (u - 8) for Q4_0).
template <int T>
__device__ __forceinline__ float kv_get(const uint8_t* __restrict__ row, int i) {
    if constexpr (T == T_F32) return reinterpret_cast<const float*>(row)[i];
    else if constexpr (T == T_F16) return half_bits_to_f32(reinterpret_cast<const unsigned short*>(row)[i]);
    else if constexpr (T == T_Q8_0) {
        const uint8_t* b = row + (i >> 5) * 34;
        return (float)(signed char)b[2 + (i & 31)] * ld_f16(b);
    } else {
        const uint8_t* b = row + (i >> 5) * 18;
        const int j = i & 31;
        const int u = j < 16 ? (b[2 + j] & 15) : (b[2 + j - 16] >> 4);
        return ld_f16(b) * (float)(u - 8);
    }
}

// Writes a ggml block of an f16 scale `d` and bytes (lane j's `byte` at 2 + j) as `words` 16-bit stores, one per
// lane 0 .. words - 1 in a single instruction (lane 0 the scale, lane l the bytes of lanes 2l - 2 and 2l - 1). The
// block is written by one store instruction of the warp: with the scale and the bytes written by separate byte
// stores, the KV host copy (mapped pinned memory) read back with each block's first byte zero on the H200
// (kernel_types_kv_cache_rows_match_the_cpu). Every lane of the warp must call it.
__device__ __forceinline__ void kv_put_block_u16(uint8_t* b, int lane, unsigned short d, unsigned int byte, int words) {
    const int src = max(2 * lane - 2, 0);
    const unsigned int lo = __shfl_sync(0xffffffffu, byte, src & 31);
    const unsigned int hi = __shfl_sync(0xffffffffu, byte, (src + 1) & 31);
    if (lane < words) reinterpret_cast<unsigned short*>(b)[lane] = lane == 0 ? d : (unsigned short)(lo | (hi << 8));
}

// Stores x as value i of a row of KV type T, for a warp whose 32 lanes store values 32b .. 32b + 31 of the row
// together (lane l value 32b + l): the quantized types form one ggml block from them, bit-exact with the CPU's
// quantizers (engine/src/quant: Q8_0 d = max|x| / 127, q = round-half-away(x / d); Q4_0 d = max / -8 with max the
// first value of largest magnitude, u = min(15, trunc(x / d + 8.5))). Products and sums are rounded one by one
// (no fused multiply-add), as on the CPU.
template <int T>
__device__ __forceinline__ void kv_put(uint8_t* row, int i, float x) {
    if constexpr (T == T_F32) reinterpret_cast<float*>(row)[i] = x;
    else if constexpr (T == T_F16) reinterpret_cast<unsigned short*>(row)[i] = f32_to_half_bits(x);
    else if constexpr (T == T_Q8_0) {
        const int lane = i & 31;
        const float amax = warp_max(fabsf(x));
        const float d = __fdiv_rn(amax, 127.f);
        const float id = d == 0.f ? 0.f : __fdiv_rn(1.f, d);
        const unsigned int q = (unsigned int)(uint8_t)(signed char)(int)roundf(__fmul_rn(x, id));
        kv_put_block_u16(row + (i >> 5) * 34, lane, f32_to_half_bits(d), q, 17);
    } else {
        const int lane = i & 31;
        // The value of largest magnitude, the first (lowest lane) among equals.
        float best = x, amax = fabsf(x);
        int at = lane;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const float oa = __shfl_xor_sync(0xffffffffu, amax, o);
            const int oat = __shfl_xor_sync(0xffffffffu, at, o);
            if (oa > amax || (oa == amax && oat < at)) {
                best = ob;
                amax = oa;
                at = oat;
            }
        }
        const float d = __fdiv_rn(best, -8.f);
        const float id = d == 0.f ? 0.f : __fdiv_rn(1.f, d);
        const int u = min(15, (int)truncf(__fadd_rn(__fmul_rn(x, id), 8.5f)));
        const int hi = __shfl_down_sync(0xffffffffu, u, 16);
        kv_put_block_u16(row + (i >> 5) * 18, lane, f32_to_half_bits(d), (unsigned int)(u | (hi << 4)) & 255, 9);
    }
}

// The first key of a pass ending at position `end` (exclusive) that the ring still holds, rounded up to a whole
// block of r keys (0 when nothing is offloaded: window 0).
__device__ __forceinline__ int kv_cold_end(int end, int window, int r) {
    if (window <= 0 || end <= window) return 0;
    const int c = end - window;
    return r > 1 ? (c + r - 1) / r * r : c;
}

// Row j of a cache: the staging copy below cold_end, else ring slot j % ring_len.
__device__ __forceinline__ const uint8_t* kv_row(const uint8_t* ring, const uint8_t* cold, long long rb, int ring_len,
                                                 int cold_end, int j) {
    return j < cold_end ? cold + (long long)j * rb : ring + (long long)(j % ring_len) * rb;
}

// Writes the n rows src[t] (f32, `width` values each, width a whole number of blocks) at positions pos + t of a
// cache of type T: into ring slot (pos + t) % ring_len and, when `host` is given, also at row pos + t of the host
// copy (pinned memory mapped into the device's address space). pos = *pos_dev. One thread per value (the
// quantized types: each warp one block).
template <int T>
__device__ __forceinline__ void kv_store_rows_body(const float* __restrict__ src, uint8_t* ring, uint8_t* host,
                                                   const int* pos_dev, int n, int width, int ring_len) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * width) return;  // whole warps for the quantized types (n * width % 32 == 0)
    const int t = (int)(idx / width), i = (int)(idx % width);
    const int pos = *pos_dev + t;
    const float x = src[idx];
    const long long rb = kv_bytes<T>(width);
    kv_put<T>(ring + (long long)(pos % ring_len) * rb, i, x);
    if (host) kv_put<T>(host + (long long)pos * rb, i, x);
}

#define KV_STORE(NAME, T)                                                                                          \
    extern "C" __global__ void kv_store_rows_##NAME(const float* __restrict__ src, uint8_t* ring, uint8_t* host, \
                                                    const int* pos_dev, int n, int width, int ring_len) {        \
        pdl_entry();                                                                                               \
        kv_store_rows_body<T>(src, ring, host, pos_dev, n, width, ring_len);                                      \
    }
KV_STORE(f32, T_F32)
KV_STORE(f16, T_F16)
KV_STORE(q8_0, T_Q8_0)
KV_STORE(q4_0, T_Q4_0)

// Copies, for the n queries of a decode-sized pass, the selected key blocks below cold_end (all r keys of a block
// are cold or none are) from the host copies of K and V to the same rows of the staging buffers, so attention
// reads them as if they were in VRAM. One warp per (query t, block entry e of its list: tokens e*r .. e*r + r -
// 1, which begin at a multiple of r for a selected block); a block an earlier query of the pass also selected is
// copied by that query only (the lists are ascending: binary search). `rb` bytes a row; 16-byte words when a
// block's bytes allow.
extern "C" __global__ void kv_cold_gather(const int* __restrict__ sel, const int* __restrict__ count, int cap, int n,
                                          int entries, int pos0, const int* pos_dev, int window, int r,
                                          const uint8_t* __restrict__ host_k, const uint8_t* __restrict__ host_v,
                                          uint8_t* cold_k, uint8_t* cold_v, int rb) {
    pdl_entry();
    if (pos_dev) pos0 = *pos_dev;
    const long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (w >= (long long)n * entries) return;  // uniform over the warp
    const int t = (int)(w / entries), e = (int)(w % entries);
    const int cold_end = kv_cold_end(pos0 + n, window, r);
    const int idx = e * r;
    if (idx >= count[t]) return;
    const int j0 = sel[(long long)t * cap + idx];
    if (j0 % r != 0 || j0 + r > cold_end) return;
    for (int u = 0; u < t; u++) {
        const int* l = sel + (long long)u * cap;
        int lo = 0, hi = count[u];
        while (lo < hi) {
            const int mid = (lo + hi) >> 1;
            if (l[mid] < j0) lo = mid + 1;
            else hi = mid;
        }
        if (lo < count[u] && l[lo] == j0) return;
    }
    const long long bytes = (long long)r * rb, at = (long long)j0 * rb;
    if ((bytes & 15) == 0) {
        const uint4* sk = reinterpret_cast<const uint4*>(host_k + at);
        const uint4* sv = reinterpret_cast<const uint4*>(host_v + at);
        uint4* dk = reinterpret_cast<uint4*>(cold_k + at);
        uint4* dv = reinterpret_cast<uint4*>(cold_v + at);
        for (long long i = lane; i < bytes / 16; i += 32) {
            dk[i] = sk[i];
            dv[i] = sv[i];
        }
    } else {
        for (long long i = lane; i < bytes; i += 32) {
            cold_k[at + i] = host_k[at + i];
            cold_v[at + i] = host_v[at + i];
        }
    }
}

// Rows [first, first + count) of a ring of ring_len slots from their host copies, for K, V (rb_kv bytes a row)
// and the raw indexer keys (rb_ik): what a cut-back sequence (restore, rollback) needs where later rows
// overwrote their slots. One block per row.
extern "C" __global__ void kv_ring_fill(const uint8_t* __restrict__ host_k, uint8_t* ring_k,
                                        const uint8_t* __restrict__ host_v, uint8_t* ring_v, int rb_kv,
                                        const uint8_t* __restrict__ host_ik, uint8_t* ring_ik, int rb_ik, int first,
                                        int ring_len) {
    pdl_entry();
    const long long j = first + (long long)blockIdx.x;
    const long long slot = j % ring_len;
    for (int i = threadIdx.x; i < rb_kv; i += blockDim.x) {
        ring_k[slot * rb_kv + i] = host_k[j * rb_kv + i];
        ring_v[slot * rb_kv + i] = host_v[j * rb_kv + i];
    }
    if (host_ik)
        for (int i = threadIdx.x; i < rb_ik; i += blockDim.x) ring_ik[slot * rb_ik + i] = host_ik[j * rb_ik + i];
}


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
// raw indexer keys (type T, ring slot tok % ring_len) are averaged, RMS-normed with kn_w and rotated at the
// block's first position b*r (dims [0, rope_dim) in rotate-half pairs; with `thw`, the sequence's M-RoPE table
// [cache index][3], token b*r's position of each slot's stream, sections sec1/sec2 as rope_heads), and stored
// as row b of `pooled` (type T).
// Block i of the grid handles block pos/r + i when it is complete. 128 threads (whole warps over each 32 values,
// as the quantized store needs).
template <int T>
__device__ __forceinline__ void qsa_pool_new_body(const uint8_t* __restrict__ raw, uint8_t* pooled, int pos0,
                                                  const int* pos_dev, int n, int r, int ihd,
                                                  const float* __restrict__ kn_w, float eps, int rope_dim,
                                                  float theta, int ring_len, const int* __restrict__ thw, int sec1,
                                                  int sec2) {
    const int pos = pos_dev ? *pos_dev : pos0;
    const int b = pos / r + blockIdx.x;
    if ((b + 1) * r > pos + n || (b + 1) * r <= pos) return;
    __shared__ float mean[256];
    const long long rb = kv_bytes<T>(ihd);
    float ss = 0.f;
    for (int i = threadIdx.x; i < ihd; i += blockDim.x) {
        float acc = 0.f;
        for (int tok = b * r; tok < (b + 1) * r; tok++) acc += kv_get<T>(raw + (long long)(tok % ring_len) * rb, i);
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
    uint8_t* out = pooled + (long long)b * rb;
    // Whole warps through the row (a quantized store forms each 32-value block from one warp's lanes).
    const int span = (ihd + 31) / 32 * 32;
    for (int i = threadIdx.x; i < span; i += blockDim.x) {
        float v = i < ihd ? mean[i] : 0.f;
        if (i < rope_dim) {
            const int k = i < half ? i : i - half;
            const float inv_freq = 1.f / powf(theta, (float)(2 * k) / (float)rope_dim);
            // The block's first token's position: b * r for text, its M-RoPE position of slot k's stream.
            int p = b * r;
            if (thw) {
                const int axis = (k % 3 == 1 && k < 3 * sec1) ? 1 : (k % 3 == 2 && k < 3 * sec2) ? 2 : 0;
                p = thw[(long long)b * r * 3 + axis];
            }
            const float a = (float)p * inv_freq;
            const float c = (float)cos((double)a), sn = (float)sin((double)a);
            v = i < half ? mean[i] * c - mean[i + half] * sn : mean[i] * c + mean[i - half] * sn;
        }
        if constexpr (T == T_F32 || T == T_F16) {
            if (i < ihd) kv_put<T>(out, i, v);
        } else {
            kv_put<T>(out, i, v);  // ihd is whole blocks for the quantized types
        }
    }
}

#define QSA_POOL(NAME, T)                                                                                          \
    extern "C" __global__ void qsa_pool_new_##NAME(const uint8_t* __restrict__ raw, uint8_t* pooled, int pos0,  \
                                                   const int* pos_dev, int n, int r, int ihd,                     \
                                                   const float* __restrict__ kn_w, float eps, int rope_dim,       \
                                                   float theta, int ring_len, const int* __restrict__ thw,        \
                                                   int sec1, int sec2) {                                          \
        pdl_entry();                                                                                               \
        qsa_pool_new_body<T>(raw, pooled, pos0, pos_dev, n, r, ihd, kn_w, eps, rope_dim, theta, ring_len, thw,    \
                             sec1, sec2);                                                                          \
    }
QSA_POOL(f32, T_F32)
QSA_POOL(f16, T_F16)
QSA_POOL(q8_0, T_Q8_0)

// scores[t][b] = sum_h relu(<qI[t][h], pooled[b]>) / sqrt(ihd) for the complete blocks b < (pos0+t+1)/r; -inf
// after. One warp per (t, b): lanes stride the head dims, each head's dot product a shuffle-tree sum. `pooled`
// rows of type T.
template <int T>
__device__ __forceinline__ void qsa_scores_body(const float* __restrict__ qI, const uint8_t* __restrict__ pooled,
                                                float* scores, int n, int pos0, const int* pos_dev, int r, int nih,
                                                int ihd, int max_blocks) {
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
    const uint8_t* krow = pooled + (long long)b * kv_bytes<T>(ihd);
    float s = 0.f;
    for (int h = 0; h < nih; h++) {
        const float* q = qI + ((long long)t * nih + h) * ihd;
        float d = 0.f;
        if constexpr (T == T_F32) {
            const float* k = reinterpret_cast<const float*>(krow);
            for (int i = lane; i < ihd; i += 32) d += q[i] * __ldg(k + i);
        } else {
            for (int i = lane; i < ihd; i += 32) d += q[i] * kv_get<T>(krow, i);
        }
        s += fmaxf(warp_sum(d), 0.f);
    }
    if (lane == 0) scores[w] = s * rsqrtf((float)ihd);
}

#define QSA_SCORES(NAME, T)                                                                                       \
    extern "C" __global__ void qsa_scores_##NAME(const float* __restrict__ qI, const uint8_t* __restrict__ pooled, \
                                                 float* scores, int n, int pos0, const int* pos_dev, int r,       \
                                                 int nih, int ihd, int max_blocks) {                              \
        pdl_entry();                                                                                              \
        qsa_scores_body<T>(qI, pooled, scores, n, pos0, pos_dev, r, nih, ihd, max_blocks);                        \
    }
QSA_SCORES(f32, T_F32)
QSA_SCORES(f16, T_F16)
QSA_SCORES(q8_0, T_Q8_0)

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
// K/V rows are [nkv*hd] values of type T (`kv` the ring and staging addresses, see the file's head); head h reads
// kv head h / (nh/nkv). VEC4 (f32 only) scores with 16-byte loads (hd % 4 == 0). block = 128 threads (4 warps),
// hd <= 512. Every thread of the block must call it.
struct KvView {
    const uint8_t* k;
    const uint8_t* v;
    const uint8_t* k_cold;
    const uint8_t* v_cold;
    long long rb;
    int ring_len;
    int cold_end;
};

template <bool VEC4, int T>
__device__ __forceinline__ void attend_keys(const float* __restrict__ qh, const KvView& kv, const int* list, int k0,
                                            int k1, int kvh, int hd, float scale, float& m, float& l,
                                            float (&acc)[4]) {
    __shared__ float qs[512];
    __shared__ float ps[32];
    __shared__ int ks[32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const long long head = kv_bytes<T>((long long)kvh * hd);
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
                const uint8_t* krow = kv_row(kv.k, kv.k_cold, kv.rb, kv.ring_len, kv.cold_end, key[u]) + head;
                if constexpr (T == T_F32) {
                    const float* k = reinterpret_cast<const float*>(krow);
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
                } else {
                    for (int i = lane; i < hd; i += 32) d[u] += qs[i] * kv_get<T>(krow, i);
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
            const uint8_t* vrow = kv_row(kv.v, kv.v_cold, kv.rb, kv.ring_len, kv.cold_end, ks[j]) + head;
            for (int c = 0; c < 4; c++) {
                const int i = tid + 128 * c;
                if constexpr (T == T_F32) {
                    if (i < hd) acc[c] += p * reinterpret_cast<const float*>(vrow)[i];
                } else {
                    if (i < hd) acc[c] += p * kv_get<T>(vrow, i);
                }
            }
        }
        m = m_new;
        __syncthreads();
    }
}

// The KV view of a pass over n rows ending at pos0 + n (see the file's head).
template <int T>
__device__ __forceinline__ KvView kv_view(const uint8_t* Kc, const uint8_t* Vc, const uint8_t* Kcold,
                                          const uint8_t* Vcold, int ring_len, int window, int r, int end, int width) {
    return KvView{Kc, Vc, Kcold, Vcold, kv_bytes<T>(width), ring_len, kv_cold_end(end, window, r)};
}

// The arguments every attention kernel takes first: the queries, the K and V rings and staging, the ring's rows,
// the window and block size (for cold_end), the pass's row count, the key lists, the position.
#define ATTN_KV_ARGS                                                                                               \
    const float *__restrict__ q, const uint8_t *__restrict__ Kc, const uint8_t *__restrict__ Vc,                \
        const uint8_t *__restrict__ Kcold, const uint8_t *__restrict__ Vcold, int ring_len, int window, int r,    \
        int n, const int *__restrict__ sel, const int *__restrict__ count, int cap, int pos0, const int *pos_dev

// Attention for query (t, h) = blockIdx.x over all its keys (prefill). block = 128 threads, hd <= 512.
template <int T>
__device__ __forceinline__ void attention_body(ATTN_KV_ARGS, float* out, int nh, int nkv, int hd, float scale) {
    if (pos_dev) pos0 = *pos_dev;
    const KvView kv = kv_view<T>(Kc, Vc, Kcold, Vcold, ring_len, window, r, pos0 + n, nkv * hd);
    const int t = blockIdx.x / nh, h = blockIdx.x % nh;
    const int nkeys = sel ? count[t] : pos0 + t + 1;
    const int* list = sel ? sel + (long long)t * cap : nullptr;
    float m, l, acc[4];
    attend_keys<false, T>(q + ((long long)t * nh + h) * hd, kv, list, 0, nkeys, h / (nh / nkv), hd, scale, m, l,
                          acc);
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
template <int T>
__device__ __forceinline__ void attention_gqa_body(ATTN_KV_ARGS, float* out, int nh, int nkv, int hd, float scale) {
    if (pos_dev) pos0 = *pos_dev;
    const KvView kv = kv_view<T>(Kc, Vc, Kcold, Vcold, ring_len, window, r, pos0 + n, nkv * hd);
    __shared__ float qs[AG_MAXG * 256];
    __shared__ float ps[AG_MAXG][32];
    __shared__ int ks[32];
    __shared__ float m_sh[AG_MAXG], corr_sh[AG_MAXG], l_sh[AG_MAXG];
    const int G = nh / nkv;
    const int t = blockIdx.x / nkv, kvh = blockIdx.x % nkv;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nkeys = sel ? count[t] : pos0 + t + 1;
    const int* list = sel ? sel + (long long)t * cap : nullptr;
    const int per_lane = hd / 32;
    const long long head = kv_bytes<T>((long long)kvh * hd);
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
                const uint8_t* krow = kv_row(kv.k, kv.k_cold, kv.rb, kv.ring_len, kv.cold_end, key[v]) + head;
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    if constexpr (T == T_F32) {
                        const float* k = reinterpret_cast<const float*>(krow);
                        kr[v][i] = (j < tile && i < per_lane) ? __ldg(k + lane + 32 * i) : 0.f;
                    } else {
                        kr[v][i] = (j < tile && i < per_lane) ? kv_get<T>(krow, lane + 32 * i) : 0.f;
                    }
                }
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
            const uint8_t* vrow = kv_row(kv.v, kv.v_cold, kv.rb, kv.ring_len, kv.cold_end, ks[j]) + head;
            float v0, v1;
            if constexpr (T == T_F32) {
                const float* vf = reinterpret_cast<const float*>(vrow);
                v0 = tid < hd ? __ldg(vf + tid) : 0.f;
                v1 = tid + 128 < hd ? __ldg(vf + tid + 128) : 0.f;
            } else {
                v0 = tid < hd ? kv_get<T>(vrow, tid) : 0.f;
                v1 = tid + 128 < hd ? kv_get<T>(vrow, tid + 128) : 0.f;
            }
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
template <int T>
__device__ __forceinline__ void attention_part_body(ATTN_KV_ARGS, float* part_m, float* part_l, float* part_acc,
                                                    int nh, int nkv, int hd, float scale) {
    if (pos_dev) pos0 = *pos_dev;
    const KvView kv = kv_view<T>(Kc, Vc, Kcold, Vcold, ring_len, window, r, pos0 + n, nkv * hd);
    const int S = gridDim.y, s = blockIdx.y;
    const int t = blockIdx.x / nh, h = blockIdx.x % nh;
    const int nkeys = sel ? count[t] : pos0 + t + 1;
    const int* list = sel ? sel + (long long)t * cap : nullptr;
    const int per = ((nkeys + S - 1) / S + 31) / 32 * 32;
    const int k0 = min(nkeys, s * per), k1 = min(nkeys, k0 + per);
    float m, l, acc[4];
    attend_keys<true, T>(q + ((long long)t * nh + h) * hd, kv, list, k0, k1, h / (nh / nkv), hd, scale, m, l, acc);
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

#define ATTENTION(NAME, T)                                                                                        \
    extern "C" __global__ void attention_##NAME(ATTN_KV_ARGS, float* out, int nh, int nkv, int hd, float scale) { \
        pdl_entry();                                                                                              \
        attention_body<T>(q, Kc, Vc, Kcold, Vcold, ring_len, window, r, n, sel, count, cap, pos0, pos_dev, out,  \
                          nh, nkv, hd, scale);                                                                    \
    }                                                                                                             \
    extern "C" __global__ void attention_gqa_##NAME(ATTN_KV_ARGS, float* out, int nh, int nkv, int hd,            \
                                                    float scale) {                                                \
        pdl_entry();                                                                                              \
        attention_gqa_body<T>(q, Kc, Vc, Kcold, Vcold, ring_len, window, r, n, sel, count, cap, pos0, pos_dev,   \
                              out, nh, nkv, hd, scale);                                                           \
    }                                                                                                             \
    extern "C" __global__ void attention_part_##NAME(ATTN_KV_ARGS, float* part_m, float* part_l, float* part_acc, \
                                                     int nh, int nkv, int hd, float scale) {                      \
        pdl_entry();                                                                                              \
        attention_part_body<T>(q, Kc, Vc, Kcold, Vcold, ring_len, window, r, n, sel, count, cap, pos0, pos_dev,  \
                               part_m, part_l, part_acc, nh, nkv, hd, scale);                                     \
    }
ATTENTION(f32, T_F32)
ATTENTION(f16, T_F16)
ATTENTION(q8_0, T_Q8_0)
ATTENTION(q4_0, T_Q4_0)

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
