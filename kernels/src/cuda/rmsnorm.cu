// RMSNorm: y[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w. One CTA per row, float accumulation.
extern "C" __global__ void rmsnorm(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,
                                   bf16_t* __restrict__ y, int dim, float eps) {
    __shared__ float partial[32];
    const bf16_t* xr = x + (i64)blockIdx.x * dim;
    bf16_t* yr = y + (i64)blockIdx.x * dim;
    float ss = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) { const float f = bf2f(xr[i]); ss = fmaf(f, f, ss); }
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        float t = threadIdx.x < (blockDim.x + 31) / 32 ? partial[threadIdx.x] : 0.f;
        t = warp_sum(t);
        if (threadIdx.x == 0) partial[0] = t;
    }
    __syncthreads();
    const float inv = rsqrtf(partial[0] / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) yr[i] = f2bf(bf2f(xr[i]) * inv * bf2f(w[i]));
}
