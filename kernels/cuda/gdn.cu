// Gated DeltaNet (engine/src/model/linear_attn.rs; reference `torch_recurrent_gated_delta_rule`).
#include "common.cuh"

// Causal depthwise conv of kernel K over n tokens with the kept history, then SiLU, in place on qkv [n][C];
// state [K-1][C] (oldest first) is updated. One thread per channel walks the tokens in order, loading 16 tokens'
// inputs ahead (no other thread touches its channel, so the loads may run before the stores), with the window
// in registers when K is a compile-time constant (KC > 0; KC = 0: any K <= 8).
template <int KC>
__device__ __forceinline__ void gdn_conv_body(float* qkv, float* state, const float* __restrict__ w, int n, int C,
                                              int K_) {
    constexpr int B = 16;
    const int K = KC > 0 ? KC : K_;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float win[8], wk[8];  // K <= 8
#pragma unroll
    for (int k = 0; k < 8; k++) {
        win[k] = k < K - 1 ? state[(long long)k * C + c] : 0.f;
        wk[k] = k < K ? w[(long long)c * K + k] : 0.f;
    }
    for (int t0 = 0; t0 < n; t0 += B) {
        float in[B];
#pragma unroll
        for (int i = 0; i < B; i++) in[i] = t0 + i < n ? qkv[(long long)(t0 + i) * C + c] : 0.f;
#pragma unroll
        for (int i = 0; i < B; i++) {
            if (t0 + i >= n) break;
            float acc = 0.f;
            if constexpr (KC > 0) {
                win[KC - 1] = in[i];
#pragma unroll
                for (int k = 0; k < KC; k++) acc += wk[k] * win[k];
                qkv[(long long)(t0 + i) * C + c] = siluf_(acc);
#pragma unroll
                for (int k = 0; k < KC - 1; k++) win[k] = win[k + 1];
            } else {
                win[K - 1] = in[i];
                for (int k = 0; k < K; k++) acc += wk[k] * win[k];
                qkv[(long long)(t0 + i) * C + c] = siluf_(acc);
                for (int k = 0; k < K - 1; k++) win[k] = win[k + 1];
            }
        }
    }
#pragma unroll
    for (int k = 0; k < 8; k++)
        if (k < K - 1) state[(long long)k * C + c] = win[k];
}

extern "C" __global__ void gdn_conv(float* qkv, float* state, const float* __restrict__ w, int n, int C, int K) {
    pdl_entry();
    if (K == 4) gdn_conv_body<4>(qkv, state, w, n, C, K);
    else gdn_conv_body<0>(qkv, state, w, n, C, K);
}

__device__ __forceinline__ float softplus_(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// beta = sigmoid(b), g = A * softplus(a + dt_bias) for each (token, value head); A = -exp(A_log) as stored.
extern "C" __global__ void gdn_gates(const float* __restrict__ b, const float* __restrict__ a,
                                     const float* __restrict__ A, const float* __restrict__ dt_bias, float* beta,
                                     float* g, int n, int nv) {
    pdl_entry();
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n * nv) return;
    const int j = idx % nv;
    beta[idx] = sigmoidf_(b[idx]);
    g[idx] = A[j] * softplus_(a[idx] + dt_bias[j]);
}

// gdn_gates fused with the two f32 projections it reads: block (j, t) computes b = Wb[j] . m[t] (warp 0) and
// a = Wa[j] . m[t] (warp 1), each a fixed-order sum (lane-strided float4 products, then a shuffle tree), then
// beta[t][j] = sigmoid(b), g[t][j] = A[j] * softplus(a + dt_bias[j]). 64 threads; d a multiple of 4.
// beta[t][j] = sigmoid(Wb[j] . m[t]), g[t][j] = A[j] * softplus(Wa[j] . m[t] + dt_bias[j]) for value head j of
// token t: warp 0 computes the b dot product, warp 1 the a one (blockDim 64, d a multiple of 4).
__device__ __forceinline__ void gdn_ba_gate_body(int j, int t, const float* __restrict__ m,
                                                 const float* __restrict__ Wb, const float* __restrict__ Wa,
                                                 const float* __restrict__ A, const float* __restrict__ dt_bias,
                                                 float* beta, float* g, int nv, int d) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float4* w = reinterpret_cast<const float4*>((warp == 0 ? Wb : Wa) + (long long)j * d);
    const float4* x = reinterpret_cast<const float4*>(m + (long long)t * d);
    float acc = 0.f;
    for (int i = lane; i < d / 4; i += 32) {
        const float4 a = __ldg(w + i), b = __ldg(x + i);
        acc += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
    }
    acc = warp_sum(acc);
    __shared__ float ab[2];
    if (lane == 0) ab[warp] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        beta[t * nv + j] = sigmoidf_(ab[0]);
        g[t * nv + j] = A[j] * softplus_(ab[1] + dt_bias[j]);
    }
}

// The gates alone (NEBULA_CUDA_FUSE=0): value head j = blockIdx.x, token t = blockIdx.y.
extern "C" __global__ void gdn_ba_gates(const float* __restrict__ m, const float* __restrict__ Wb,
                                        const float* __restrict__ Wa, const float* __restrict__ A,
                                        const float* __restrict__ dt_bias, float* beta, float* g, int nv, int d) {
    pdl_entry();
    gdn_ba_gate_body(blockIdx.x, blockIdx.y, m, Wb, Wa, A, dt_bias, beta, g, nv, d);
}

// The conv (gdn_conv) and the gates (gdn_ba_gate_body) in one launch of 64-thread blocks (the gates read only m, not the projections the
// conv reads, so neither waits for the other): blocks [0, ceil(C / 64)) run the conv, the next nv * n blocks the
// gates of (head, token) = (i % nv, i / nv).
extern "C" __global__ void gdn_conv_gates(float* qkv, float* state, const float* __restrict__ w, int n, int C, int K,
                                          const float* __restrict__ m, const float* __restrict__ Wb,
                                          const float* __restrict__ Wa, const float* __restrict__ A,
                                          const float* __restrict__ dt_bias, float* beta, float* g, int nv, int d) {
    pdl_entry();
    const int conv_blocks = (C + 63) / 64;
    if ((int)blockIdx.x < conv_blocks) {
        if (K == 4) gdn_conv_body<4>(qkv, state, w, n, C, K);
        else gdn_conv_body<0>(qkv, state, w, n, C, K);
        return;
    }
    const int i = blockIdx.x - conv_blocks;
    gdn_ba_gate_body(i % nv, i / nv, m, Wb, Wa, A, dt_bias, beta, g, nv, d);
}

// The delta rule token by token. One warp per block: value head j = blockIdx.x, state columns
// [blockIdx.y * CPW, +CPW) of its S [dk][dv] (row-major per head, heads contiguous), CPW = 32 / P columns of P
// lanes each: lane (column e, part p) keeps rows [p * R, (p + 1) * R) of column e in registers (R = min(dk, 32),
// P = dk / R), so S^T k and S^T q are R-long local sums added over the P parts by shuffles (a fixed order). q and
// k come through the warp's shared memory, L2-normed here (q also scaled by 1/sqrt(dk); eps 1e-6 inside the
// square root, as the reference's l2norm): every lane loads dk / 32 of each and the squares meet in a shuffle
// tree. The next token's inputs are loaded while the current token is computed. qkv rows are
// [q (nk*dk) | k (nk*dk) | v (nv*dv)] (after the conv, not normed); value head j reads key head j % nk (GGUF
// tiled order). o: [n][nv*dv].
template <int DK>
__device__ void gdn_recurrent_body(const float* __restrict__ qkv, const float* __restrict__ beta,
                                   const float* __restrict__ g, float* S, float* o, int n, int nk, int nv, int C) {
    constexpr int R = DK < 32 ? DK : 32, P = DK / R, CPW = 32 / P, L = DK < 32 ? 1 : DK / 32;
    const int lane = threadIdx.x;
    const int j = blockIdx.x;
    const int e = blockIdx.y * CPW + lane / P, part = lane % P;
    const bool live = e < DK;  // dv = dk
    const int kh = j % nk;
    __shared__ float qs[DK], ks[DK];
    float col[R];
    float* Sj = S + (long long)j * DK * DK;
#pragma unroll
    for (int a = 0; a < R; a++) col[a] = live ? Sj[(long long)(part * R + a) * DK + e] : 0.f;
    // Inputs of token t: lane's share of q and k (element lane + 32 i), v of its column, decay and beta.
    float nq[L], nkv[L], nv_ = 0.f, ng = 0.f, nb = 0.f;
    auto load = [&](int t) {
        const float* row = qkv + (long long)t * C;
#pragma unroll
        for (int i = 0; i < L; i++) {
            const int a = lane + 32 * i;
            nq[i] = a < DK ? row[kh * DK + a] : 0.f;
            nkv[i] = a < DK ? row[nk * DK + kh * DK + a] : 0.f;
        }
        nv_ = live ? row[2 * nk * DK + j * DK + e] : 0.f;
        ng = g[t * nv + j];
        nb = beta[t * nv + j];
    };
    if (n > 0) load(0);
    for (int t = 0; t < n; t++) {
        float cq[L], ck[L];
#pragma unroll
        for (int i = 0; i < L; i++) {
            cq[i] = nq[i];
            ck[i] = nkv[i];
        }
        const float vt = nv_, gt = ng, bt = nb;
        if (t + 1 < n) load(t + 1);
        float sq = 0.f, sk = 0.f;
#pragma unroll
        for (int i = 0; i < L; i++) {
            sq += cq[i] * cq[i];
            sk += ck[i] * ck[i];
        }
        sq = warp_sum(sq);
        sk = warp_sum(sk);
        const float qn = rsqrtf(sq + 1e-6f) * rsqrtf((float)DK), kn = rsqrtf(sk + 1e-6f);
        __syncwarp();  // the previous token's reads of qs/ks are done
#pragma unroll
        for (int i = 0; i < L; i++) {
            const int a = lane + 32 * i;
            if (a < DK) {
                qs[a] = cq[i] * qn;
                ks[a] = ck[i] * kn;
            }
        }
        __syncwarp();
        const float decay = expf(gt);
        float kv = 0.f;
#pragma unroll
        for (int a = 0; a < R; a++) {
            col[a] *= decay;
            kv += col[a] * ks[part * R + a];
        }
#pragma unroll
        for (int off = 1; off < P; off <<= 1) kv += __shfl_xor_sync(0xffffffffu, kv, off);
        const float delta = (vt - kv) * bt;
        float out = 0.f;
#pragma unroll
        for (int a = 0; a < R; a++) {
            col[a] += ks[part * R + a] * delta;
            out += col[a] * qs[part * R + a];
        }
#pragma unroll
        for (int off = 1; off < P; off <<= 1) out += __shfl_xor_sync(0xffffffffu, out, off);
        if (live && part == 0) o[(long long)t * nv * DK + j * DK + e] = out;
    }
    if (live) {
#pragma unroll
        for (int a = 0; a < R; a++) Sj[(long long)(part * R + a) * DK + e] = col[a];
    }
}

extern "C" __global__ void gdn_recurrent_128(const float* qkv, const float* beta, const float* g, float* S, float* o,
                                             int n, int nk, int nv, int C) {
    pdl_entry();
    gdn_recurrent_body<128>(qkv, beta, g, S, o, n, nk, nv, C);
}
extern "C" __global__ void gdn_recurrent_64(const float* qkv, const float* beta, const float* g, float* S, float* o,
                                            int n, int nk, int nv, int C) {
    pdl_entry();
    gdn_recurrent_body<64>(qkv, beta, g, S, o, n, nk, nv, C);
}
extern "C" __global__ void gdn_recurrent_32(const float* qkv, const float* beta, const float* g, float* S, float* o,
                                            int n, int nk, int nv, int C) {
    pdl_entry();
    gdn_recurrent_body<32>(qkv, beta, g, S, o, n, nk, nv, C);
}
extern "C" __global__ void gdn_recurrent_16(const float* qkv, const float* beta, const float* g, float* S, float* o,
                                            int n, int nk, int nv, int C) {
    pdl_entry();
    gdn_recurrent_body<16>(qkv, beta, g, S, o, n, nk, nv, C);
}

// Gated RMS norm per (token, value head): o = w * (o / rms(o)) * act(z), act = sigmoid (silu when silu_gate).
extern "C" __global__ void gdn_gated_norm(float* o, const float* __restrict__ z, const float* __restrict__ w, int rows,
                                          int dv, float eps, int silu_gate) {
    pdl_entry();
    const int r = blockIdx.x;
    if (r >= rows) return;
    float* orow = o + (long long)r * dv;
    const float* zr = z + (long long)r * dv;
    float ss = 0.f;
    for (int i = threadIdx.x; i < dv; i += blockDim.x) ss += orow[i] * orow[i];
    ss = block_sum(ss);
    const float inv = rsqrtf(ss / dv + eps);
    for (int i = threadIdx.x; i < dv; i += blockDim.x) {
        const float gate = silu_gate ? siluf_(zr[i]) : sigmoidf_(zr[i]);
        orow[i] = w[i] * (orow[i] * inv) * gate;
    }
}
