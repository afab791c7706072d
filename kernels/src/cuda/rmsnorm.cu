// RMSNorm: y[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w. One CTA per row, float accumulation.
// When dim is a multiple of 8 and the buffers are 16-byte aligned, each thread reads and writes
// 8 elements at a time (uint4): the scalar loop's 2-byte accesses left the norm well short of the
// memory bandwidth at the prefill step's 8K x 4K rows. Each output element is computed as in the
// scalar loop; only the order of the sum of squares differs.
__device__ __forceinline__ float rms_inv(float ss, int dim, float eps) {
    __shared__ float partial[32];
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        float t = threadIdx.x < (blockDim.x + 31) / 32 ? partial[threadIdx.x] : 0.f;
        t = warp_sum(t);
        if (threadIdx.x == 0) partial[0] = t;
    }
    __syncthreads();
    return rsqrtf(partial[0] / (float)dim + eps);
}

extern "C" __global__ void rmsnorm(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,
                                   bf16_t* __restrict__ y, int dim, float eps) {
    const bf16_t* xr = x + (i64)blockIdx.x * dim;
    bf16_t* yr = y + (i64)blockIdx.x * dim;
    const bool vec = (dim & 7) == 0 &&
                     ((((unsigned long long)x) | ((unsigned long long)w) | ((unsigned long long)y)) & 15) == 0;
    float ss = 0.f;
    if (vec) {
        const uint4* x4 = reinterpret_cast<const uint4*>(xr);
        for (int c = threadIdx.x; c < dim / 8; c += blockDim.x) {
            float f[8];
            unpack8(x4[c], f);
#pragma unroll
            for (int e = 0; e < 8; ++e) ss = fmaf(f[e], f[e], ss);
        }
        const float inv = rms_inv(ss, dim, eps);
        const uint4* w4 = reinterpret_cast<const uint4*>(w);
        for (int c = threadIdx.x; c < dim / 8; c += blockDim.x) {
            float f[8], g[8];
            unpack8(x4[c], f);
            unpack8(w4[c], g);
            unsigned int o[4];
#pragma unroll
            for (int e = 0; e < 4; ++e)
                o[e] = (unsigned int)f2bf(f[2 * e] * inv * g[2 * e]) |
                       ((unsigned int)f2bf(f[2 * e + 1] * inv * g[2 * e + 1]) << 16);
            reinterpret_cast<uint4*>(yr)[c] = make_uint4(o[0], o[1], o[2], o[3]);
        }
        return;
    }
    for (int i = threadIdx.x; i < dim; i += blockDim.x) { const float f = bf2f(xr[i]); ss = fmaf(f, f, ss); }
    const float inv = rms_inv(ss, dim, eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) yr[i] = f2bf(bf2f(xr[i]) * inv * bf2f(w[i]));
}
