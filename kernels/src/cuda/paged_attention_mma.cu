// Tensor-core variant of paged_attention_split (same split partials, merged by the same reduce
// kernel). Decode attention is memory-bound, but the CUDA-core kernels were instruction-bound:
// here the dot products and P·V run on mma.sync.m16n8k16 (bf16 in, f32 accumulate) and keys are
// streamed into shared memory with cp.async (16-byte chunks, STAGES tiles in flight per warp).
//
// Work unit: one warp = one split of the key range of one query *group* and one KV head. A group
// is up to QT consecutive query tokens of one sequence (decode verification: 1 + drafts tokens;
// token i of n sees keys [kv_start, kv_end - (n - 1 - i)), i.e. causal). The M = 16 rows of the
// MMA are (token, head-in-group) pairs: row r = token (r / GROUP), head (r % GROUP); QT = 16 / GROUP.
//
// Layout tricks (no ldmatrix needed):
//  * Q·Kᵀ: a dot product does not care about the order of its k index, so each thread reads 16
//    contiguous bytes of a key row (dims 8q..8q+7 of a 32-dim chunk) and uses them as the B
//    fragments of two k16 MMAs; Q is read with the same permutation.
//  * P·V: the S accumulators are the A fragment of the next MMA (FlashAttention-2). V's B
//    fragment needs keys along k, so the 16-byte row chunks are transposed in registers with
//    movmatrix.m8n8.trans; the resulting dim permutation makes each thread own 8 contiguous
//    output dims, written with two float4 stores.
// Compile-time (NVRTC -D): D_QK, D_V (multiples of 32, D_V <= D_QK), GROUP (<= 16), QT, TK (keys
// per tile: 16 or 32), STAGES, WARPS, MINB (blocks per SM for __launch_bounds__), SWZ, PF (L2
// 256-byte prefetch hint), ROWP (padded shared row in bf16: row bytes / 4 = 16 mod 32
// banks, so the 8 lanes of a 16-byte phase hit distinct banks), LAZY (skip the rescale of the
// output accumulators when no row's running max moved in this tile: the factor would be exactly
// 1, or 0 on an all-padding row whose accumulators are 0, so the result is bit-identical; after
// the first few tiles of random-ish scores the max rarely moves, and the rescale is 64 FMULs of
// a ~300-instruction tile at d 128).
#define KCH (D_QK / 32)
#define VCH (D_V / 32)
#define NCH16 (D_QK / 8)
#define NG (TK / 8)
#define KSTEPS (TK / 16)
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

#ifndef SWZ
#define SWZ 0
#endif
#ifndef PF
#define PF 0
#endif
#ifndef LAZY
#define LAZY 0
#endif
#ifndef SWAP
#define SWAP 0
#endif
// 16-byte chunk `chunk` of shared row `row`: with SWZ the rows are unpadded and odd rows swap
// the halves of each 128-byte group, so the two keys of one 8-lane access phase never share a
// bank (needs D_QK % 64 == 0); without it, ROWP's padding does that.
__device__ __forceinline__ int swz(int row, int chunk) { return SWZ ? (chunk ^ ((row & 1) << 2)) : chunk; }

__device__ __forceinline__ unsigned int smem_addr(const void* p) {
    unsigned int a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void cp_async16(unsigned int dst, const void* src, int src_bytes) {
#if PF
    // also ask L2 to fetch the whole 256-byte segment (one key row of a head is 256 B at d 128)
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
#endif
}

__device__ __forceinline__ uint4 lds128(unsigned int a) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}

__device__ __forceinline__ void mma16816(float* c, unsigned int a0, unsigned int a1, unsigned int a2,
                                         unsigned int a3, unsigned int b0, unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned int movm_t(unsigned int x) {
    unsigned int y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
    return y;
}

// Two floats -> packed bf16x2 (lo in the low half), round to nearest even.
__device__ __forceinline__ unsigned int pack_bf16x2(float lo, float hi) {
    unsigned int r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ unsigned int u4_get(const uint4& v, int j) {
    return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

#ifndef MINB
#define MINB 1
#endif
#if !SWAP
extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB)
paged_attention_mma(const bf16_t* __restrict__ q, const bf16_t* __restrict__ kv,
                    const int* __restrict__ block_tables, int max_blocks_per_row,
                    const int* __restrict__ g_row, const int* __restrict__ g_start,
                    const int* __restrict__ g_end, const int* __restrict__ g_q0,
                    const int* __restrict__ g_qn, i64 block_stride, int row_stride, int num_kv_heads,
                    int block_size, int tokens_per_split, int max_splits, float scale,
                    float* __restrict__ part_m, float* __restrict__ part_l, float* __restrict__ part_acc) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16_t* qs = reinterpret_cast<bf16_t*>(smem_raw);                 // [16][ROWP]
    bf16_t* tiles = qs + 16 * ROWP;                                    // [WARPS][STAGES][TK][ROWP]
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int gi = blockIdx.y;
    const int kvh = blockIdx.z;
    const int num_heads = num_kv_heads * GROUP;
    const int qn = g_qn[gi];
    const int q0 = g_q0[gi];
    // Q rows of this group and KV head into shared memory (rows past the group are zero).
    for (int i = threadIdx.x; i < 16 * (D_QK / 8); i += blockDim.x) {
        const int r = i / (D_QK / 8), c = i % (D_QK / 8);
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r < qn * GROUP)
            v = *reinterpret_cast<const uint4*>(q + ((i64)(q0 + r / GROUP) * num_heads + kvh * GROUP + r % GROUP) * D_QK + c * 8);
        *reinterpret_cast<uint4*>(qs + r * ROWP + swz(r, c) * 8) = v;
    }
    __syncthreads();
    const int split = blockIdx.x * WARPS + warp;
    const int start = g_start[gi];
    const int end = g_end[gi];  // key range end of the group's last token
    const int s0 = start + split * tokens_per_split;
    if (split >= max_splits || s0 >= end) return;  // whole warp leaves together
    const int s1 = min(end, s0 + tokens_per_split);
    const int* table = block_tables + (i64)g_row[gi] * max_blocks_per_row;
    const int g = lane >> 2, qd = lane & 3;
    // Key limit (exclusive) of rows g and g + 8: causal inside the group; padding rows see all.
    const int r0 = g, r1 = g + 8;
    const int lim0 = min(s1, r0 < qn * GROUP ? end - (qn - 1 - r0 / GROUP) : end);
    const int lim1 = min(s1, r1 < qn * GROUP ? end - (qn - 1 - r1 / GROUP) : end);
    const float sl2 = scale * LOG2E;

    // The split's block ids, one per lane (a split of up to 32 blocks needs no table loads in
    // the copy loop: the ids come by shuffle, off the critical path of the cp.async issue).
    const int blk0 = s0 / block_size;
    const int nblk = (s1 - 1) / block_size - blk0 + 1;
    const int my_phys = lane < nblk ? table[blk0 + lane] : 0;
    bf16_t* my_tiles = tiles + (i64)warp * STAGES * TK * ROWP;
    const unsigned int tiles_s = smem_addr(my_tiles);
    const unsigned int qs_s = smem_addr(qs);
    const bf16_t* kv_h = kv + kvh * D_QK;

    auto issue = [&](int tile_start, int stage) {
        const unsigned int base = tiles_s + stage * (TK * ROWP * 2);
#pragma unroll
        for (int j = 0; j < (TK * NCH16 + 31) / 32; ++j) {
            const int i = lane + 32 * j;
            if (i < TK * NCH16) {  // TK * NCH16 is a multiple of 32: uniform, so the shuffle is safe
                const int kk = i / NCH16, c = i % NCH16;
                const int t = tile_start + kk;
                const int rb = t / block_size - blk0;
                int phys = __shfl_sync(0xffffffffu, my_phys, rb & 31);
                const bf16_t* src = kv_h;
                int bytes = 0;
                if (t < s1) {
                    if (rb >= 32) phys = table[t / block_size];
                    src = kv_h + (i64)phys * block_stride + (i64)(t % block_size) * row_stride + c * 8;
                    bytes = 16;
                }
                cp_async16(base + (kk * ROWP + swz(kk, c) * 8) * 2, src, bytes);  // zero-fill past the split
            }
        }
    };

    float o[VCH][4][4];
#pragma unroll
    for (int c = 0; c < VCH; ++c)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[c][j][e] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

    const int ntiles = (s1 - s0 + TK - 1) / TK;
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (st < ntiles) issue(s0 + st * TK, st);
        asm volatile("cp.async.commit_group;");
    }
    for (int it = 0; it < ntiles; ++it) {
        {
            const int nt = it + STAGES - 1;
            if (nt < ntiles) issue(s0 + nt * TK, nt % STAGES);
            asm volatile("cp.async.commit_group;");
        }
        asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 1));
        __syncwarp();
        const unsigned int buf = tiles_s + (it % STAGES) * (TK * ROWP * 2);
        const int tb = s0 + it * TK;

        // S = Q · Kᵀ for TK keys (NG tiles of 8 keys).
        float s[NG][4];
#pragma unroll
        for (int n = 0; n < NG; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = 0.f;
#pragma unroll
        for (int c = 0; c < KCH; ++c) {
            const uint4 qa = lds128(qs_s + (g * ROWP + swz(g, c * 4 + qd) * 8) * 2);
            const uint4 qb = lds128(qs_s + ((g + 8) * ROWP + swz(g + 8, c * 4 + qd) * 8) * 2);
#pragma unroll
            for (int n = 0; n < NG; ++n) {
                const uint4 w = lds128(buf + ((n * 8 + g) * ROWP + swz(g, c * 4 + qd) * 8) * 2);
                mma16816(s[n], qa.x, qb.x, qa.y, qb.y, w.x, w.y);
                mma16816(s[n], qa.z, qb.z, qa.w, qb.w, w.z, w.w);
            }
        }
        // Online softmax (log2 domain), one rescale per tile.
        float mt0 = -INFINITY, mt1 = -INFINITY;
#pragma unroll
        for (int n = 0; n < NG; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int t = tb + n * 8 + qd * 2 + (e & 1);
                const bool vis = t < (e < 2 ? lim0 : lim1);
                s[n][e] = vis ? s[n][e] * sl2 : -INFINITY;
            }
            mt0 = fmaxf(mt0, fmaxf(s[n][0], s[n][1]));
            mt1 = fmaxf(mt1, fmaxf(s[n][2], s[n][3]));
        }
#pragma unroll
        for (int x = 1; x <= 2; x <<= 1) {
            mt0 = fmaxf(mt0, __shfl_xor_sync(0xffffffffu, mt0, x));
            mt1 = fmaxf(mt1, __shfl_xor_sync(0xffffffffu, mt1, x));
        }
        const float mn0 = fmaxf(m0, mt0), mn1 = fmaxf(m1, mt1);
        const float b0 = mn0 == -INFINITY ? 0.f : mn0, b1 = mn1 == -INFINITY ? 0.f : mn1;
        const float c0 = exp2f(m0 - b0), c1 = exp2f(m1 - b1);
#if LAZY
        const float mo0 = m0, mo1 = m1;
#endif
        m0 = mn0;
        m1 = mn1;
        float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
        for (int n = 0; n < NG; ++n) {
            s[n][0] = exp2f(s[n][0] - b0);
            s[n][1] = exp2f(s[n][1] - b0);
            s[n][2] = exp2f(s[n][2] - b1);
            s[n][3] = exp2f(s[n][3] - b1);
            ps0 += s[n][0] + s[n][1];
            ps1 += s[n][2] + s[n][3];
        }
        l0 = l0 * c0 + ps0;  // per-thread partial row sums; the quad is summed at the end
        l1 = l1 * c1 + ps1;
#if LAZY
        // (uniform branch: the vote covers the whole warp)
        if (!__all_sync(0xffffffffu, mn0 == mo0 && mn1 == mo1))
#endif
        {
#pragma unroll
            for (int c = 0; c < VCH; ++c)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    o[c][j][0] *= c0;
                    o[c][j][1] *= c0;
                    o[c][j][2] *= c1;
                    o[c][j][3] *= c1;
                }
        }
        // O += P · V, 16 keys per MMA step.
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            const unsigned int pa0 = pack_bf16x2(s[2 * ks][0], s[2 * ks][1]);
            const unsigned int pa1 = pack_bf16x2(s[2 * ks][2], s[2 * ks][3]);
            const unsigned int pa2 = pack_bf16x2(s[2 * ks + 1][0], s[2 * ks + 1][1]);
            const unsigned int pa3 = pack_bf16x2(s[2 * ks + 1][2], s[2 * ks + 1][3]);
#pragma unroll
            for (int c = 0; c < VCH; ++c) {
                const uint4 w0 = lds128(buf + ((ks * 16 + g) * ROWP + swz(g, c * 4 + qd) * 8) * 2);
                const uint4 w1 = lds128(buf + ((ks * 16 + 8 + g) * ROWP + swz(g, c * 4 + qd) * 8) * 2);
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    mma16816(o[c][j], pa0, pa1, pa2, pa3, movm_t(u4_get(w0, j)), movm_t(u4_get(w1, j)));
            }
        }
        __syncwarp();  // every lane is done with this stage before it is refilled
    }
    asm volatile("cp.async.wait_group 0;");
#pragma unroll
    for (int x = 1; x <= 2; x <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, x);
        l1 += __shfl_xor_sync(0xffffffffu, l1, x);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = g + 8 * half;
        if (r >= qn * GROUP) continue;
        const i64 slot = ((i64)(q0 + r / GROUP) * num_heads + kvh * GROUP + r % GROUP) * max_splits + split;
        const float mm = half ? m1 : m0;
        if (qd == 0) {
            part_m[slot] = mm * LN2;  // back to the natural-log domain the reduce kernel uses
            part_l[slot] = half ? l1 : l0;
        }
#pragma unroll
        for (int c = 0; c < VCH; ++c) {
            float4* dst = reinterpret_cast<float4*>(part_acc + slot * D_V + c * 32 + qd * 8);
            dst[0] = make_float4(o[c][0][2 * half], o[c][0][2 * half + 1], o[c][1][2 * half], o[c][1][2 * half + 1]);
            dst[1] = make_float4(o[c][2][2 * half], o[c][2][2 * half + 1], o[c][3][2 * half], o[c][3][2 * half + 1]);
        }
    }
}
#endif  // !SWAP

// ---------------------------------------------------------------------------------------------
// Swapped-operand variant (SWAP = 1, kernel paged_attention_mma_t): Sᵀ = K·Qᵀ with the keys as
// the M = 16 rows of the MMA and up to 8 query rows ((token, head) pairs, QT = 8 / GROUP) as
// N = 8. For decode with group 4 the plain kernel wastes 12 of 16 rows; here 4 of 8 columns,
// so each 16-key step takes D_QK/16 + D_V/16 MMAs instead of twice that.
//  * Q·Kᵀ: K's A fragments come straight from shared memory with ldmatrix.x4 (natural dim
//    order); Q's B fragments (dims 2qd.. of query row g) live in registers for the whole split.
//  * P·V: Oᵀ = Vᵀ·Pᵀ. Vᵀ's A fragments are ldmatrix.x4.trans of the same key rows (V is the
//    first D_V dims of a row); Pᵀ's B fragment is the S accumulator of the same 8 keys
//    transposed with movmatrix (two per 16 keys).
//  * Shared rows: padded to an odd number of 16-byte chunks (ROWP = D_QK + 8) or, with SWZ,
//    unpadded with chunk ^ (row & 7), so the 8 row addresses of one ldmatrix phase hit 8
//    distinct bank groups.
// The output accumulators are D_V / 4 floats per lane (32 at d 128, half the plain kernel's).
#if SWAP
__device__ __forceinline__ int swz8(int row, int chunk) { return SWZ ? (chunk ^ (row & 7)) : chunk; }

__device__ __forceinline__ void ldsm_x4(unsigned int a, unsigned int& r0, unsigned int& r1, unsigned int& r2,
                                        unsigned int& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(a));
}

__device__ __forceinline__ void ldsm_x4_t(unsigned int a, unsigned int& r0, unsigned int& r1, unsigned int& r2,
                                          unsigned int& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(a));
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB)
paged_attention_mma_t(const bf16_t* __restrict__ q, const bf16_t* __restrict__ kv,
                      const int* __restrict__ block_tables, int max_blocks_per_row,
                      const int* __restrict__ g_row, const int* __restrict__ g_start,
                      const int* __restrict__ g_end, const int* __restrict__ g_q0,
                      const int* __restrict__ g_qn, i64 block_stride, int row_stride, int num_kv_heads,
                      int block_size, int tokens_per_split, int max_splits, float scale,
                      float* __restrict__ part_m, float* __restrict__ part_l, float* __restrict__ part_acc) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16_t* tiles = reinterpret_cast<bf16_t*>(smem_raw);  // [WARPS][STAGES][TK][ROWP]
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int gi = blockIdx.y;
    const int kvh = blockIdx.z;
    const int num_heads = num_kv_heads * GROUP;
    const int split = blockIdx.x * WARPS + warp;
    const int start = g_start[gi];
    const int end = g_end[gi];
    const int s0 = start + split * tokens_per_split;
    if (split >= max_splits || s0 >= end) return;  // whole warp leaves together
    const int qn = g_qn[gi];
    const int q0 = g_q0[gi];
    const int nrow = qn * GROUP;
    const int s1 = min(end, s0 + tokens_per_split);
    const int* table = block_tables + (i64)g_row[gi] * max_blocks_per_row;
    const int g = lane >> 2, qd = lane & 3;
    // This lane's S/O columns are query rows 2qd and 2qd + 1 (token r / GROUP, head r % GROUP);
    // causal inside the group, padding columns see all keys (their Q is zero, never written).
    const int r0 = 2 * qd, r1 = 2 * qd + 1;
    const int lim0 = min(s1, r0 < nrow ? end - (qn - 1 - r0 / GROUP) : end);
    const int lim1 = min(s1, r1 < nrow ? end - (qn - 1 - r1 / GROUP) : end);
    const float sl2 = scale * LOG2E;

    // Q's B fragments: query row g, dims 16k + 2qd (+1) and 16k + 8 + 2qd (+1).
    unsigned int qf[D_QK / 16][2];
    {
        const bool live = g < nrow;
        const bf16_t* qp = q + ((i64)(q0 + g / GROUP) * num_heads + kvh * GROUP + g % GROUP) * D_QK;
#pragma unroll
        for (int k = 0; k < D_QK / 16; ++k) {
            qf[k][0] = live ? *reinterpret_cast<const unsigned int*>(qp + 16 * k + 2 * qd) : 0u;
            qf[k][1] = live ? *reinterpret_cast<const unsigned int*>(qp + 16 * k + 8 + 2 * qd) : 0u;
        }
    }

    const int blk0 = s0 / block_size;
    const int nblk = (s1 - 1) / block_size - blk0 + 1;
    const int my_phys = lane < nblk ? table[blk0 + lane] : 0;
    const unsigned int tiles_s = smem_addr(tiles + (i64)warp * STAGES * TK * ROWP);
    const bf16_t* kv_h = kv + kvh * D_QK;

    auto issue = [&](int tile_start, int stage) {
        const unsigned int base = tiles_s + stage * (TK * ROWP * 2);
#pragma unroll
        for (int j = 0; j < (TK * NCH16 + 31) / 32; ++j) {
            const int i = lane + 32 * j;
            if (i < TK * NCH16) {
                const int kk = i / NCH16, c = i % NCH16;
                const int t = tile_start + kk;
                const int rb = t / block_size - blk0;
                int phys = __shfl_sync(0xffffffffu, my_phys, rb & 31);
                const bf16_t* src = kv_h;
                int bytes = 0;
                if (t < s1) {
                    if (rb >= 32) phys = table[t / block_size];
                    src = kv_h + (i64)phys * block_stride + (i64)(t % block_size) * row_stride + c * 8;
                    bytes = 16;
                }
                cp_async16(base + (kk * ROWP + swz8(kk, c) * 8) * 2, src, bytes);
            }
        }
    };

    // ldmatrix row addresses: lane provides row (lane & 7) of matrix (lane >> 3).
    const int mi = lane >> 3, rr = lane & 7;
    float o[D_V / 16][4];
#pragma unroll
    for (int b = 0; b < D_V / 16; ++b)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[b][e] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

    const int ntiles = (s1 - s0 + TK - 1) / TK;
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (st < ntiles) issue(s0 + st * TK, st);
        asm volatile("cp.async.commit_group;");
    }
    for (int it = 0; it < ntiles; ++it) {
        {
            const int nt = it + STAGES - 1;
            if (nt < ntiles) issue(s0 + nt * TK, nt % STAGES);
            asm volatile("cp.async.commit_group;");
        }
        asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 1));
        __syncwarp();
        const unsigned int buf = tiles_s + (it % STAGES) * (TK * ROWP * 2);
        const int tb = s0 + it * TK;

        // Sᵀ = K · Qᵀ, 16 keys per step: s[ks] = keys (g, g + 8) x query rows (2qd, 2qd + 1).
        float s[KSTEPS][4];
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[ks][e] = 0.f;
            // matrices: (keys 0-7, dims 0-7), (keys 8-15, dims 0-7), (keys 0-7, 8-15), (keys 8-15, 8-15)
            const int key = ks * 16 + rr + ((mi & 1) << 3);
#pragma unroll
            for (int k = 0; k < D_QK / 16; ++k) {
                unsigned int a0, a1, a2, a3;
                ldsm_x4(buf + (key * ROWP + swz8(key, 2 * k + (mi >> 1)) * 8) * 2, a0, a1, a2, a3);
                mma16816(s[ks], a0, a1, a2, a3, qf[k][0], qf[k][1]);
            }
        }
        // Online softmax per column (query row), log2 domain.
        float mt0 = -INFINITY, mt1 = -INFINITY;
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int t = tb + ks * 16 + g + ((e >> 1) << 3);
                const bool vis = t < ((e & 1) ? lim1 : lim0);
                s[ks][e] = vis ? s[ks][e] * sl2 : -INFINITY;
            }
            mt0 = fmaxf(mt0, fmaxf(s[ks][0], s[ks][2]));
            mt1 = fmaxf(mt1, fmaxf(s[ks][1], s[ks][3]));
        }
#pragma unroll
        for (int x = 4; x <= 16; x <<= 1) {
            mt0 = fmaxf(mt0, __shfl_xor_sync(0xffffffffu, mt0, x));
            mt1 = fmaxf(mt1, __shfl_xor_sync(0xffffffffu, mt1, x));
        }
        const float mn0 = fmaxf(m0, mt0), mn1 = fmaxf(m1, mt1);
        const float b0 = mn0 == -INFINITY ? 0.f : mn0, b1 = mn1 == -INFINITY ? 0.f : mn1;
        const float c0 = exp2f(m0 - b0), c1 = exp2f(m1 - b1);
#if LAZY
        const float mo0 = m0, mo1 = m1;
#endif
        m0 = mn0;
        m1 = mn1;
        float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            s[ks][0] = exp2f(s[ks][0] - b0);
            s[ks][1] = exp2f(s[ks][1] - b1);
            s[ks][2] = exp2f(s[ks][2] - b0);
            s[ks][3] = exp2f(s[ks][3] - b1);
            ps0 += s[ks][0] + s[ks][2];
            ps1 += s[ks][1] + s[ks][3];
        }
        l0 = l0 * c0 + ps0;  // per-lane partial column sums; the 8 key lanes are summed at the end
        l1 = l1 * c1 + ps1;
#if LAZY
        if (!__all_sync(0xffffffffu, mn0 == mo0 && mn1 == mo1))
#endif
        {
#pragma unroll
            for (int b = 0; b < D_V / 16; ++b) {
                o[b][0] *= c0;
                o[b][1] *= c1;
                o[b][2] *= c0;
                o[b][3] *= c1;
            }
        }
        // Oᵀ += Vᵀ · Pᵀ, 16 keys per step.
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            const unsigned int pb0 = movm_t(pack_bf16x2(s[ks][0], s[ks][1]));
            const unsigned int pb1 = movm_t(pack_bf16x2(s[ks][2], s[ks][3]));
            // matrices (transposed): (keys 0-7, dv 0-7), (keys 0-7, dv 8-15), (keys 8-15, 0-7), (keys 8-15, 8-15)
            const int key = ks * 16 + rr + ((mi >> 1) << 3);
#pragma unroll
            for (int b = 0; b < D_V / 16; ++b) {
                unsigned int a0, a1, a2, a3;
                ldsm_x4_t(buf + (key * ROWP + swz8(key, 2 * b + (mi & 1)) * 8) * 2, a0, a1, a2, a3);
                mma16816(o[b], a0, a1, a2, a3, pb0, pb1);
            }
        }
        __syncwarp();  // every lane is done with this stage before it is refilled
    }
    asm volatile("cp.async.wait_group 0;");
#pragma unroll
    for (int x = 4; x <= 16; x <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, x);
        l1 += __shfl_xor_sync(0xffffffffu, l1, x);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = 2 * qd + half;
        if (r >= nrow) continue;
        const i64 slot = ((i64)(q0 + r / GROUP) * num_heads + kvh * GROUP + r % GROUP) * max_splits + split;
        if (g == 0) {
            part_m[slot] = (half ? m1 : m0) * LN2;
            part_l[slot] = half ? l1 : l0;
        }
        float* dst = part_acc + slot * D_V;
#pragma unroll
        for (int b = 0; b < D_V / 16; ++b) {
            dst[16 * b + g] = o[b][half];
            dst[16 * b + 8 + g] = o[b][2 + half];
        }
    }
}
#endif
