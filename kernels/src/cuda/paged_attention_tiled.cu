// Tiled variant of paged_attention_split (same arguments and partial outputs, merged by the
// same reduce kernel). Each warp stages TILE tokens' rows in shared memory with 16-byte loads
// (many in flight), then scores them one token per lane pair (QK from the tile and q in shared
// memory), does one online-softmax update per tile instead of per token, and accumulates P·V
// with lanes owning value dimensions. Compile-time: D_QK, D_V (multiple of 32), GROUP, WARPS,
// TILE (32 or 16).
#define NCH (D_QK / 8)
#define ROW (D_QK + 8)           /* padded smem row (bf16): 16 B pad keeps lanes off one bank */
#define LPT2 (32 / TILE)         /* lanes per token in the score phase */
#define DPL (D_V / 32)           /* value dims per lane */
#define LOADS ((TILE * NCH + 31) / 32)

extern "C" __global__ void __launch_bounds__(WARPS * 32)
paged_attention_tiled(const bf16_t* __restrict__ q, const bf16_t* __restrict__ kv,
                      const int* __restrict__ block_tables, int max_blocks_per_row,
                      const int* __restrict__ q_row, const int* __restrict__ kv_start,
                      const int* __restrict__ kv_end, i64 block_stride, int row_stride,
                      int num_kv_heads, int block_size, int tokens_per_split, int max_splits,
                      float scale, float* __restrict__ part_m, float* __restrict__ part_l,
                      float* __restrict__ part_acc) {
    __shared__ float qs[GROUP * D_QK];
    __shared__ __align__(16) bf16_t tile[WARPS][TILE * ROW];
    __shared__ float ps[WARPS][TILE * GROUP];
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int qi = blockIdx.y;
    const int kvh = blockIdx.z;
    const int num_heads = num_kv_heads * GROUP;
    for (int i = threadIdx.x; i < GROUP * D_QK; i += blockDim.x)
        qs[i] = bf2f(q[((i64)qi * num_heads + kvh * GROUP) * D_QK + i]) * scale;
    __syncthreads();
    const int split = blockIdx.x * WARPS + warp;
    const int start = kv_start[qi];
    const int end = kv_end[qi];
    const int s0 = start + split * tokens_per_split;
    if (split >= max_splits || s0 >= end) return;
    const int s1 = min(end, s0 + tokens_per_split);
    const int* table = block_tables + (i64)q_row[qi] * max_blocks_per_row;
    bf16_t* tl = tile[warp];
    float* pw = ps[warp];
    const int my_t = lane / LPT2;   // token of this lane in the score phase
    const int my_h = lane % LPT2;   // which part of the row it sums

    float acc[GROUP][DPL];
    float m[GROUP], l[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < DPL; ++e) acc[g][e] = 0.f;
    }

    for (int b = s0; b < s1; b += TILE) {
        // stage the tile: chunk i = token i / NCH, 16-byte chunk i % NCH
        uint4 w[LOADS];
#pragma unroll
        for (int j = 0; j < LOADS; ++j) {
            const int i = lane + 32 * j;
            const int tt = i / NCH, c = i % NCH;
            const int t = b + tt;
            w[j] = make_uint4(0, 0, 0, 0);
            if (i < TILE * NCH && t < s1) {
                const int phys = table[t / block_size];
                w[j] = __ldg(reinterpret_cast<const uint4*>(kv + (i64)phys * block_stride + (i64)(t % block_size) * row_stride + kvh * D_QK + c * 8));
            }
        }
#pragma unroll
        for (int j = 0; j < LOADS; ++j) {
            const int i = lane + 32 * j;
            if (i < TILE * NCH) *reinterpret_cast<uint4*>(tl + (i / NCH) * ROW + (i % NCH) * 8) = w[j];
        }
        __syncwarp();
        // scores: lane pair (or single lane) per token
        float s[GROUP];
#pragma unroll
        for (int g = 0; g < GROUP; ++g) s[g] = 0.f;
        for (int c = my_h; c < NCH; c += LPT2) {
            float kf[8];
            unpack8(*reinterpret_cast<const uint4*>(tl + my_t * ROW + c * 8), kf);
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                const float4 qa = *reinterpret_cast<const float4*>(qs + g * D_QK + c * 8);
                const float4 qb = *reinterpret_cast<const float4*>(qs + g * D_QK + c * 8 + 4);
                s[g] = fmaf(qa.x, kf[0], s[g]); s[g] = fmaf(qa.y, kf[1], s[g]);
                s[g] = fmaf(qa.z, kf[2], s[g]); s[g] = fmaf(qa.w, kf[3], s[g]);
                s[g] = fmaf(qb.x, kf[4], s[g]); s[g] = fmaf(qb.y, kf[5], s[g]);
                s[g] = fmaf(qb.z, kf[6], s[g]); s[g] = fmaf(qb.w, kf[7], s[g]);
            }
        }
        const bool valid = b + my_t < s1;
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            if (LPT2 == 2) s[g] += __shfl_xor_sync(0xffffffffu, s[g], 1);
            float x = valid ? s[g] : -INFINITY;
            float mt = x;
            for (int o = 16; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
            const float mn = fmaxf(m[g], mt);  // finite: the tile has a valid token
            const float corr = __expf(m[g] - mn);
            const float p = valid ? __expf(x - mn) : 0.f;
            float ps_sum = (my_h == 0) ? p : 0.f;
            ps_sum = warp_sum(ps_sum);
            l[g] = l[g] * corr + ps_sum;
            m[g] = mn;
            if (my_h == 0) pw[my_t * GROUP + g] = p;
#pragma unroll
            for (int e = 0; e < DPL; ++e) acc[g][e] *= corr;
        }
        __syncwarp();
        // P·V: lane owns value dims [lane * DPL, lane * DPL + DPL)
        const int tn = min(TILE, s1 - b);
        for (int tt = 0; tt < tn; ++tt) {
            float vf[DPL];
            const bf16_t* vr = tl + tt * ROW + lane * DPL;
#pragma unroll
            for (int e = 0; e < DPL; ++e) vf[e] = bf2f(vr[e]);
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                const float p = pw[tt * GROUP + g];
#pragma unroll
                for (int e = 0; e < DPL; ++e) acc[g][e] = fmaf(p, vf[e], acc[g][e]);
            }
        }
        __syncwarp();
    }
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        const i64 slot = ((i64)qi * num_heads + kvh * GROUP + g) * max_splits + split;
        if (lane == 0) { part_m[slot] = m[g]; part_l[slot] = l[g]; }
#pragma unroll
        for (int e = 0; e < DPL; ++e) part_acc[slot * D_V + lane * DPL + e] = acc[g][e];
    }
}
