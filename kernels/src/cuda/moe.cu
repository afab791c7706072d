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

// xs[pos, :] = x[sorted_token[pos], :]. grid num_assign, any block size.
extern "C" __global__ void moe_gather(const bf16_t* __restrict__ x, const int* __restrict__ sorted_token,
                                      int dim, bf16_t* __restrict__ xs) {
    const i64 pos = blockIdx.x;
    const bf16_t* src = x + (i64)sorted_token[pos] * dim;
    bf16_t* dst = xs + pos * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = src[i];
}

// out[t, :] = sum_j weights[t, j] * ys[slot_pos[t * k + j], :], slots summed in order j = 0..k.
// grid n, any block size.
extern "C" __global__ void moe_combine(const bf16_t* __restrict__ ys, const int* __restrict__ slot_pos,
                                       const float* __restrict__ weights, int top_k, int dim,
                                       bf16_t* __restrict__ out) {
    const i64 t = blockIdx.x;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float s = 0.f;
        for (int j = 0; j < top_k; ++j)
            s = fmaf(weights[t * top_k + j], bf2f(ys[(i64)slot_pos[t * top_k + j] * dim + i]), s);
        out[t * dim + i] = f2bf(s);
    }
}
