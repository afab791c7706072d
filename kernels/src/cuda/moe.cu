// MoE routing: softmax over expert logits, top-k, then a deterministic expert-major permutation
// (assignments of one expert keep token order), gather of token rows into that order, and a
// weighted combine back. Ties in top-k go to the lower expert index.

// One warp per token. logits [n, E] f32 -> ids [n, k] i32, weights [n, k] f32 (renormalised over
// the chosen k when `renorm` != 0). Dynamic shared memory: warps_per_block * E floats.
extern "C" __global__ void moe_topk_softmax(const float* __restrict__ logits, int n, int num_experts,
                                            int top_k, int renorm, int* __restrict__ ids,
                                            float* __restrict__ weights) {
    extern __shared__ float probs_smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t = blockIdx.x * (blockDim.x >> 5) + warp;
    if (t >= n) return;
    float* pr = probs_smem + warp * num_experts;
    const float* lr = logits + (i64)t * num_experts;
    float mx = -INFINITY;
    for (int e = lane; e < num_experts; e += 32) mx = fmaxf(mx, lr[e]);
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.f;
    for (int e = lane; e < num_experts; e += 32) { const float p = __expf(lr[e] - mx); pr[e] = p; sum += p; }
    sum = warp_sum(sum);
    __syncwarp();
    float chosen_sum = 0.f;
    for (int j = 0; j < top_k; ++j) {
        float best = -1.f;
        int bi = 0x7fffffff;
        for (int e = lane; e < num_experts; e += 32) {
            const float p = pr[e];
            if (p > best || (p == best && e < bi)) { best = p; bi = e; }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ob > best || (ob == best && oi < bi)) { best = ob; bi = oi; }
        }
        if (lane == 0) {
            ids[(i64)t * top_k + j] = bi;
            weights[(i64)t * top_k + j] = best / sum;
            pr[bi] = -2.f;  // never chosen again (probabilities are >= 0)
        }
        chosen_sum += best / sum;
        __syncwarp();
    }
    if (renorm && lane < top_k) {
        // lane j rescales weight j (top_k <= 32 is checked on the host)
        weights[(i64)t * top_k + lane] /= chosen_sum;
    }
}

// counts[e] = number of assignments (token, slot) routed to expert e. grid E, block 256.
extern "C" __global__ void moe_count(const int* __restrict__ ids, int num_assign, int* __restrict__ counts) {
    __shared__ int partial[32];
    const int e = blockIdx.x;
    int c = 0;
    for (int a = threadIdx.x; a < num_assign; a += blockDim.x) c += ids[a] == e;
    for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = c;
    __syncthreads();
    if (threadIdx.x == 0) {
        int s = 0;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) s += partial[w];
        counts[e] = s;
    }
}

// offsets[0] = 0, offsets[e + 1] = offsets[e] + counts[e]. One thread; E is small.
extern "C" __global__ void moe_offsets(const int* __restrict__ counts, int num_experts, int* __restrict__ offsets) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    int s = 0;
    offsets[0] = 0;
    for (int e = 0; e < num_experts; ++e) { s += counts[e]; offsets[e + 1] = s; }
}

// Ordered ranking: assignment a (= token * k + slot) routed to e lands at
// offsets[e] + (number of earlier assignments routed to e). grid E, block 1024 (whole warps).
// sorted_token[pos] = token; slot_pos[a] = pos.
extern "C" __global__ void moe_rank(const int* __restrict__ ids, int num_assign, int top_k,
                                    const int* __restrict__ offsets, int* __restrict__ sorted_token,
                                    int* __restrict__ slot_pos) {
    __shared__ int warp_counts[32];
    __shared__ int running;
    const int e = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int nwarps = blockDim.x >> 5;
    if (threadIdx.x == 0) running = offsets[e];
    __syncthreads();
    for (int base = 0; base < num_assign; base += blockDim.x) {
        const int a = base + threadIdx.x;
        const bool hit = a < num_assign && ids[a] == e;
        const unsigned int mask = __ballot_sync(0xffffffffu, hit);
        if (lane == 0) warp_counts[warp] = __popc(mask);
        __syncthreads();
        int before = running;
        for (int w = 0; w < warp; ++w) before += warp_counts[w];
        before += __popc(mask & ((1u << lane) - 1u));
        if (hit) { sorted_token[before] = a / top_k; slot_pos[a] = before; }
        __syncthreads();
        if (threadIdx.x == 0) {
            int s = 0;
            for (int w = 0; w < nwarps; ++w) s += warp_counts[w];
            running += s;
        }
        __syncthreads();
    }
}

// The padded layout of the same permutation: expert e owns positions [e * cap, (e + 1) * cap),
// its assignments first in index order (as moe_rank orders them), then unused positions marked
// -1 in sorted_token. cap must be at least the largest count (the token count suffices: top-k
// picks distinct experts). The expert GEMMs can then run at a fixed size, cap rows each, with
// no count read back by the host. Also writes counts[e]. grid E, block 1024 (whole warps).
extern "C" __global__ void moe_rank_padded(const int* __restrict__ ids, int num_assign, int top_k,
                                           int cap, int* __restrict__ counts,
                                           int* __restrict__ sorted_token,
                                           int* __restrict__ slot_pos) {
    __shared__ int warp_counts[32];
    __shared__ int running;
    const int e = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int nwarps = blockDim.x >> 5;
    const int base_pos = e * cap;
    if (threadIdx.x == 0) running = 0;
    __syncthreads();
    for (int base = 0; base < num_assign; base += blockDim.x) {
        const int a = base + threadIdx.x;
        const bool hit = a < num_assign && ids[a] == e;
        const unsigned int mask = __ballot_sync(0xffffffffu, hit);
        if (lane == 0) warp_counts[warp] = __popc(mask);
        __syncthreads();
        int before = running;
        for (int w = 0; w < warp; ++w) before += warp_counts[w];
        before += __popc(mask & ((1u << lane) - 1u));
        if (hit && before < cap) { sorted_token[base_pos + before] = a / top_k; slot_pos[a] = base_pos + before; }
        __syncthreads();
        if (threadIdx.x == 0) {
            int s = 0;
            for (int w = 0; w < nwarps; ++w) s += warp_counts[w];
            running += s;
        }
        __syncthreads();
    }
    const int used = running < cap ? running : cap;
    for (int i = used + threadIdx.x; i < cap; i += blockDim.x) sorted_token[base_pos + i] = -1;
    if (threadIdx.x == 0) counts[e] = running;
}

// xs[pos, :] = x[sorted_token[pos], :], or zeros where sorted_token[pos] < 0 (an unused position
// of the padded layout). grid = positions, any block size. Rows of a multiple of 8 elements at
// 16-byte aligned addresses move as uint4 (8 bf16 per load): the scalar 2-byte copy ran at a
// fraction of HBM bandwidth on the 8K-token prefill step.
extern "C" __global__ void moe_gather(const bf16_t* __restrict__ x, const int* __restrict__ sorted_token,
                                      int dim, bf16_t* __restrict__ xs) {
    const i64 pos = blockIdx.x;
    const int tok = sorted_token[pos];
    bf16_t* dst = xs + pos * dim;
    if (tok < 0) {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = f2bf(0.f);
        return;
    }
    const bf16_t* src = x + (i64)tok * dim;
    if ((dim & 7) == 0 && ((((unsigned long long)src) | ((unsigned long long)dst)) & 15) == 0) {
        const uint4* s4 = reinterpret_cast<const uint4*>(src);
        uint4* d4 = reinterpret_cast<uint4*>(dst);
        for (int i = threadIdx.x; i < (dim >> 3); i += blockDim.x) d4[i] = s4[i];
        return;
    }
    for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = src[i];
}

// out[t, :] = sum_j weights[t, j] * ys[slot_pos[t * k + j], :], slots summed in order j = 0..k.
// grid n, any block size. Vectorised like moe_gather (8 elements per thread and load) when the
// rows allow; each element sees the same fmaf sequence either way, so results are identical.
extern "C" __global__ void moe_combine(const bf16_t* __restrict__ ys, const int* __restrict__ slot_pos,
                                       const float* __restrict__ weights, int top_k, int dim,
                                       bf16_t* __restrict__ out) {
    const i64 t = blockIdx.x;
    const bool vec = (dim & 7) == 0 && ((((unsigned long long)ys) | ((unsigned long long)out)) & 15) == 0;
    if (vec) {
        for (int i = threadIdx.x; i < (dim >> 3); i += blockDim.x) {
            float s[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) s[e] = 0.f;
            for (int j = 0; j < top_k; ++j) {
                const float w = weights[t * top_k + j];
                const uint4 v = reinterpret_cast<const uint4*>(ys + (i64)slot_pos[t * top_k + j] * dim)[i];
                const unsigned int u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    s[2 * e] = fmaf(w, bf2f((bf16_t)(u[e] & 0xffffu)), s[2 * e]);
                    s[2 * e + 1] = fmaf(w, bf2f((bf16_t)(u[e] >> 16)), s[2 * e + 1]);
                }
            }
            uint4 o;
            o.x = (unsigned int)f2bf(s[0]) | ((unsigned int)f2bf(s[1]) << 16);
            o.y = (unsigned int)f2bf(s[2]) | ((unsigned int)f2bf(s[3]) << 16);
            o.z = (unsigned int)f2bf(s[4]) | ((unsigned int)f2bf(s[5]) << 16);
            o.w = (unsigned int)f2bf(s[6]) | ((unsigned int)f2bf(s[7]) << 16);
            reinterpret_cast<uint4*>(out + t * dim)[i] = o;
        }
        return;
    }
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float s = 0.f;
        for (int j = 0; j < top_k; ++j)
            s = fmaf(weights[t * top_k + j], bf2f(ys[(i64)slot_pos[t * top_k + j] * dim + i]), s);
        out[t * dim + i] = f2bf(s);
    }
}
