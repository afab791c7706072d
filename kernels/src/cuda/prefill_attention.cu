// Causal prefill attention on tensor cores (FlashAttention-2 style) over the paged global KV.
//
// Work unit: one CTA = one query *group* (up to QTOK consecutive query tokens of one sequence;
// token j of n sees keys [kv_start, kv_end - (n - 1 - j)), i.e. causal over the cached prefix
// plus the chunk's own keys, which are already in the pool) x HPC query heads of one KV head.
// The CTA's BM = 16 * MT * WARPS rows are (head r / QTOK, token r % QTOK), QTOK * HPC = BM, so
// one key tile in shared memory serves every head of the group that shares it (GQA).
// Each warp owns MT 16-row MMA tiles: S = Q·Kᵀ and O += P·V on mma.sync.m16n8k16 (bf16 in,
// f32 accumulate), online softmax in the log2 domain, P re-used from the S accumulators as the
// A fragments of the P·V MMA. Every K and V fragment a warp loads from shared memory feeds its
// MT tiles (with MT = 2 the ldmatrix traffic per MMA, which bounds MT = 1, falls by a third). Keys stream through a STAGES-deep cp.async ring of BN-key tiles,
// one __syncthreads per tile. Values are the first D_V elements of each key row (the pool's
// MLA-like layout, the same rows the decode kernels read).
// Key tiles start at multiples of BN from position 0, and a row's softmax sees only its own
// scores, so a row's result does not depend on how the chunk was split into groups or launches
// (a warm two-chunk prefill equals the one-chunk run bit for bit).
// `window` (sliding-window attention): a row whose keys end at `lim` sees only
// [max(kv_start, lim - window), lim); pass INT_MAX for none. Tiles wholly below a warp's rows'
// windows are skipped, and the CTA starts at its first token's window.
// Compile-time (NVRTC -D): D_QK, D_V (multiples of 16, D_V <= D_QK), GROUP, HPC (heads per CTA,
// divides GROUP), QTOK, BN (keys per tile, multiple of 16), WARPS, MT (16-row MMA tiles per warp),
// STAGES (>= 2), MINB, ROWP (shared row in bf16: an odd number of 16-byte chunks, so the 8 rows
// of an ldmatrix phase hit distinct bank groups).
#define BM (WARPS * 16 * MT)
#define NTHREADS (WARPS * 32)
#define QCH (D_QK / 8)
#define LOG2E 1.4426950408889634f

__device__ __forceinline__ unsigned int smem_addr(const void* p) {
    unsigned int a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void cp_async16(unsigned int dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void mma16816(float* c, unsigned int a0, unsigned int a1, unsigned int a2,
                                         unsigned int a3, unsigned int b0, unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

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

// 2^x on the SFU (ex2.approx.ftz: ~2 ulp, -inf -> +0), without exp2f's denormal handling.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Two floats -> packed bf16x2 (lo in the low half), round to nearest even.
__device__ __forceinline__ unsigned int pack_bf16x2(float lo, float hi) {
    unsigned int r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

extern "C" __global__ void __launch_bounds__(NTHREADS, MINB)
prefill_attention(const bf16_t* __restrict__ q, const bf16_t* __restrict__ kv,
                  const int* __restrict__ block_tables, int max_blocks_per_row,
                  const int* __restrict__ g_row, const int* __restrict__ g_start,
                  const int* __restrict__ g_end, const int* __restrict__ g_q0,
                  const int* __restrict__ g_qn, i64 block_stride, int row_stride, int num_kv_heads,
                  int block_size, float scale, int window, bf16_t* __restrict__ out) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16_t* qs = reinterpret_cast<bf16_t*>(smem_raw);  // [BM][ROWP]
    bf16_t* ks = qs + BM * ROWP;                        // [STAGES][BN][ROWP]
    const int tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31;
    const int gi = blockIdx.x;
    const int chunks = GROUP / HPC;
    const int kvh = blockIdx.y / chunks;
    const int h0 = kvh * GROUP + (blockIdx.y % chunks) * HPC;  // first query head of the CTA
    const int num_heads = num_kv_heads * GROUP;
    const int qn = g_qn[gi], q0 = g_q0[gi];
    const int start = g_start[gi], end = g_end[gi];
    const int* table = block_tables + (i64)g_row[gi] * max_blocks_per_row;
    const unsigned int qs_s = smem_addr(qs);
    const unsigned int ks_s = smem_addr(ks);

    // Q rows (zero past the group's tokens), in the first cp.async group with the first tile.
    for (int i = tid; i < BM * QCH; i += NTHREADS) {
        const int r = i / QCH, c = i % QCH;
        const int tok = r % QTOK, h = r / QTOK;
        const bf16_t* src = q;
        int bytes = 0;
        if (tok < qn) {
            src = q + ((i64)(q0 + tok) * num_heads + h0 + h) * D_QK + c * 8;
            bytes = 16;
        }
        cp_async16(qs_s + (r * ROWP + c * 8) * 2, src, bytes);
    }

    // keys below the first token's window are seen by no row of the group
    const int lo_cta = max(start, (end - (qn - 1)) - window);
    const int kt0 = (lo_cta / BN) * BN;
    const int ntiles = end > kt0 ? (end - kt0 + BN - 1) / BN : 0;
    const bf16_t* kv_h = kv + kvh * D_QK;
    auto issue = [&](int tile, int stage) {
        const int tb = kt0 + tile * BN;
        const unsigned int base = ks_s + stage * (BN * ROWP * 2);
#pragma unroll
        for (int j = 0; j < (BN * QCH + NTHREADS - 1) / NTHREADS; ++j) {
            const int i = tid + j * NTHREADS;
            if (i < BN * QCH) {
                const int kk = i / QCH, c = i % QCH;
                const int t = tb + kk;
                const bf16_t* src = kv_h;
                int bytes = 0;
                if (t >= lo_cta && t < end) {
                    const int phys = table[t / block_size];
                    src = kv_h + (i64)phys * block_stride + (i64)(t % block_size) * row_stride + c * 8;
                    bytes = 16;
                }
                cp_async16(base + (kk * ROWP + c * 8) * 2, src, bytes);  // zero-fill outside the range
            }
        }
    };
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (st < ntiles) issue(st, st);
        asm volatile("cp.async.commit_group;");
    }

    // This lane's rows g and g + 8 of each of the warp's MT 16-row m-tiles; row (mt, half)
    // sees keys [lo[mt][half], lim[mt][half]).
    const int g = lane >> 2, qd = lane & 3;
    int lim[MT][2], lo[MT][2];
    int warp_lim = start, warp_lo = 0x7fffffff, full_lo = start, full_hi = 0x7fffffff;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int r = (warp * MT + mt) * 16 + g + hf * 8;
            const int t = r % QTOK;
            const bool real = t < qn;
            lim[mt][hf] = real ? end - (qn - 1 - t) : start;  // padding rows see no key
            lo[mt][hf] = max(start, lim[mt][hf] - window);
            warp_lim = max(warp_lim, lim[mt][hf]);
            // lowest key any real row of the warp sees (padding rows do not count)
            warp_lo = min(warp_lo, real ? lo[mt][hf] : 0x7fffffff);
            full_lo = max(full_lo, lo[mt][hf]);
            full_hi = min(full_hi, real ? lim[mt][hf] : -1);
        }
    warp_lim = __reduce_max_sync(0xffffffffu, warp_lim);
    warp_lo = __reduce_min_sync(0xffffffffu, warp_lo);
    // keys [full_lo, full_hi) are visible to every row of the warp (empty if any row is padding)
    full_lo = __reduce_max_sync(0xffffffffu, full_lo);
    full_hi = __reduce_min_sync(0xffffffffu, full_hi);
    const float sl2 = scale * LOG2E;
    // ldmatrix row addresses: lane gives row (lane & 7) of matrix (lane >> 3).
    const int mi = lane >> 3, rr = lane & 7;

    float o[MT][D_V / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < D_V / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[mt][n][e] = 0.f;
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            m[mt][hf] = -INFINITY;
            l[mt][hf] = 0.f;
        }

    for (int it = 0; it < ntiles; ++it) {
        asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2));
        __syncthreads();  // tile `it` landed for every thread; every warp is done with tile it-1
        {
            const int nt = it + STAGES - 1;
            if (nt < ntiles) issue(nt, nt % STAGES);
            asm volatile("cp.async.commit_group;");
        }
        const int tb = kt0 + it * BN;
        // causal (and window): no row of this warp sees this tile (warp-uniform)
        if (tb >= warp_lim || tb + BN <= warp_lo) continue;
        const unsigned int buf = ks_s + (it % STAGES) * (BN * ROWP * 2);

        // S = Q · Kᵀ: MT x 16 rows x BN keys; each K fragment serves every m-tile of the warp.
        float s[MT][BN / 8][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int n = 0; n < BN / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][n][e] = 0.f;
#pragma unroll
        for (int k = 0; k < D_QK / 16; ++k) {
            // A: (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15)
            unsigned int a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                ldsm_x4(qs_s + (((warp * MT + mt) * 16 + (lane & 15)) * ROWP + k * 16 + (lane >> 4) * 8) * 2,
                        a[mt][0], a[mt][1], a[mt][2], a[mt][3]);
#pragma unroll
            for (int np = 0; np < BN / 16; ++np) {
                // B: (keys 0-7, k 0-7), (keys 0-7, k 8-15), (keys 8-15, k 0-7), (keys 8-15, k 8-15)
                unsigned int b0, b1, b2, b3;
                const int key = np * 16 + rr + ((mi >> 1) << 3);
                ldsm_x4(buf + (key * ROWP + k * 16 + (mi & 1) * 8) * 2, b0, b1, b2, b3);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma16816(s[mt][2 * np], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b0, b1);
                    mma16816(s[mt][2 * np + 1], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b2, b3);
                }
            }
        }
        // Online softmax per row, log2 domain, one rescale per tile.
        if (tb >= full_lo && tb + BN <= full_hi) {  // warp-uniform: a tile every row sees whole
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int n = 0; n < BN / 8; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[mt][n][e] *= sl2;
        } else {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int n = 0; n < BN / 8; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int t = tb + n * 8 + qd * 2 + (e & 1);
                        const int hf = e >> 1;
                        const bool vis = t >= lo[mt][hf] && t < lim[mt][hf];
                        s[mt][n][e] = vis ? s[mt][n][e] * sl2 : -INFINITY;
                    }
        }
        float bias[MT][2], corr[MT][2];
        bool moved = false;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            float mt0 = -INFINITY, mt1 = -INFINITY;
#pragma unroll
            for (int n = 0; n < BN / 8; ++n) {
                mt0 = fmaxf(mt0, fmaxf(s[mt][n][0], s[mt][n][1]));
                mt1 = fmaxf(mt1, fmaxf(s[mt][n][2], s[mt][n][3]));
            }
#pragma unroll
            for (int x = 1; x <= 2; x <<= 1) {
                mt0 = fmaxf(mt0, __shfl_xor_sync(0xffffffffu, mt0, x));
                mt1 = fmaxf(mt1, __shfl_xor_sync(0xffffffffu, mt1, x));
            }
            const float mn0 = fmaxf(m[mt][0], mt0), mn1 = fmaxf(m[mt][1], mt1);
            // a row with no visible key yet keeps m = -inf; subtract 0 so exp2 gives exact zeros
            bias[mt][0] = mn0 == -INFINITY ? 0.f : mn0;
            bias[mt][1] = mn1 == -INFINITY ? 0.f : mn1;
            // exactly 1 when the max did not move (the lazy rescale below relies on it)
            corr[mt][0] = mn0 == m[mt][0] ? 1.f : fast_exp2(m[mt][0] - bias[mt][0]);
            corr[mt][1] = mn1 == m[mt][1] ? 1.f : fast_exp2(m[mt][1] - bias[mt][1]);
            moved = moved || mn0 != m[mt][0] || mn1 != m[mt][1];
            m[mt][0] = mn0;
            m[mt][1] = mn1;
        }
        // no row of the warp raised its max: every factor is exactly 1 (or the accumulators
        // are still 0), so the rescale is skipped, bit-identically (warp-uniform vote)
        const bool same = __all_sync(0xffffffffu, !moved);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
            for (int n = 0; n < BN / 8; ++n) {
                s[mt][n][0] = fast_exp2(s[mt][n][0] - bias[mt][0]);
                s[mt][n][1] = fast_exp2(s[mt][n][1] - bias[mt][0]);
                s[mt][n][2] = fast_exp2(s[mt][n][2] - bias[mt][1]);
                s[mt][n][3] = fast_exp2(s[mt][n][3] - bias[mt][1]);
                ps0 += s[mt][n][0] + s[mt][n][1];
                ps1 += s[mt][n][2] + s[mt][n][3];
            }
            // per-thread partial row sums; the quad is summed at the end
            l[mt][0] = l[mt][0] * corr[mt][0] + ps0;
            l[mt][1] = l[mt][1] * corr[mt][1] + ps1;
            if (!same) {
#pragma unroll
                for (int n = 0; n < D_V / 8; ++n) {
                    o[mt][n][0] *= corr[mt][0];
                    o[mt][n][1] *= corr[mt][0];
                    o[mt][n][2] *= corr[mt][1];
                    o[mt][n][3] *= corr[mt][1];
                }
            }
        }
        // O += P · V, 16 keys per MMA step; P's A fragments are the S accumulators, and each V
        // fragment serves every m-tile of the warp.
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            unsigned int pa[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                pa[mt][0] = pack_bf16x2(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                pa[mt][1] = pack_bf16x2(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                pa[mt][2] = pack_bf16x2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                pa[mt][3] = pack_bf16x2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
            const int key = kk * 16 + rr + ((mi & 1) << 3);
#pragma unroll
            for (int dp = 0; dp < D_V / 16; ++dp) {
                // B (transposed): (keys 0-7, dv 0-7), (keys 8-15, dv 0-7), (keys 0-7, dv 8-15),
                // (keys 8-15, dv 8-15)
                unsigned int v0, v1, v2, v3;
                ldsm_x4_t(buf + (key * ROWP + dp * 16 + (mi >> 1) * 8) * 2, v0, v1, v2, v3);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma16816(o[mt][2 * dp], pa[mt][0], pa[mt][1], pa[mt][2], pa[mt][3], v0, v1);
                    mma16816(o[mt][2 * dp + 1], pa[mt][0], pa[mt][1], pa[mt][2], pa[mt][3], v2, v3);
                }
            }
        }
    }
    asm volatile("cp.async.wait_group 0;");
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            float lt = l[mt][hf];
#pragma unroll
            for (int x = 1; x <= 2; x <<= 1) lt += __shfl_xor_sync(0xffffffffu, lt, x);
            const int r = (warp * MT + mt) * 16 + g + hf * 8;
            const int tok = r % QTOK;
            if (tok >= qn) continue;
            const float inv = lt > 0.f ? 1.f / lt : 0.f;  // a row with no visible key gives zeros
            bf16_t* dst = out + ((i64)(q0 + tok) * num_heads + h0 + r / QTOK) * D_V + qd * 2;
#pragma unroll
            for (int n = 0; n < D_V / 8; ++n)
                *reinterpret_cast<unsigned int*>(dst + n * 8) =
                    pack_bf16x2(o[mt][n][2 * hf] * inv, o[mt][n][2 * hf + 1] * inv);
        }
}
