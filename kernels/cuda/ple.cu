// PLE (engine/src/model/ple.rs; reference `Qwen4ExpTextPLELayer`). The n-gram hashing runs on the host; the
// table rows are gathered with the `get_rows_*` kernels.
#include "common.cuh"

// U[t][s] = sigmoid(gamma) * V[t], gamma = sign(c) sqrt(max(|c|, 1e-6)), c = <Kn[t][s], Qn[t][s]> / sqrt(d).
// One block per (t, s).
extern "C" __global__ void ple_gate(const float* __restrict__ Kn, const float* __restrict__ Qn,
                                    const float* __restrict__ V, float* U, int streams, int d) {
    pdl_entry();
    const int t = blockIdx.x / streams, s = blockIdx.x % streams;
    const long long base = ((long long)t * streams + s) * d;
    float dot = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) dot += Kn[base + i] * Qn[base + i];
    dot = block_sum(dot);
    const float c = dot * rsqrtf((float)d);
    const float gamma = c == 0.f ? 0.f : copysignf(sqrtf(fmaxf(fabsf(c), 1e-6f)), c);
    const float gs = sigmoidf_(gamma);
    for (int i = threadIdx.x; i < d; i += blockDim.x) U[base + i] = gs * V[(long long)t * d + i];
}

// out[t][c] += silu(sum_k w[c][k] * N[t - dil*(K-1-k)][c]) with the last (K-1)*dil inputs kept in state
// ([hist][D], oldest first), updated. One thread per channel walks the tokens in order.
extern "C" __global__ void ple_conv(const float* __restrict__ N, float* state, const float* __restrict__ w, float* out,
                                    int n, int D, int K, int dil) {
    pdl_entry();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= D) return;
    const int hist = (K - 1) * dil;
    float win[32];  // hist + 1 <= 32
    for (int j = 0; j < hist; j++) win[j] = state[(long long)j * D + c];
    for (int t = 0; t < n; t++) {
        win[hist] = N[(long long)t * D + c];
        float acc = 0.f;
        for (int k = 0; k < K; k++) acc += w[(long long)c * K + k] * win[hist - (K - 1 - k) * dil];
        out[(long long)t * D + c] += siluf_(acc);
        for (int j = 0; j < hist; j++) win[j] = win[j + 1];
    }
    for (int j = 0; j < hist; j++) state[(long long)j * D + c] = win[j];
}
