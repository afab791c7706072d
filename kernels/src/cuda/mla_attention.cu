// MLA-shaped decode attention on tensor cores: one latent row of D_QK (576) per token and
// latent head, whose first D_V (512) elements are also the value; GROUP query heads (16) share
// each latent. Work unit: one CTA = one split of the key range of one query group (1..QT
// consecutive causal tokens of one sequence, DSpark verification) x one latent head x one chunk
// of MT * 16 (token, head) rows. Row r of the group is token r / GROUP, head r % GROUP.
//
// Why this shape of work: a latent row is 1,152 bytes and is shared by every query head, so the
// whole CTA streams each key tile once through shared memory (cp.async, STAGES tiles in flight)
// and all NW warps consume it:
//  * S = Q·Kᵀ (mma.sync m16n8k16, bf16 in, f32 accumulate): warp w takes keys
//    [w * TK / NW, (w + 1) * TK / NW) of the tile for every row; Q's A fragments come from
//    shared memory with ldmatrix, K's B fragments with ldmatrix (keys x dims is already the
//    "col" layout B wants).
//  * The online softmax needs one running max per row over the whole tile, so the warps trade
//    their per-row tile maxima through shared memory; every warp then computes the same new max
//    and writes its P (bf16) to a shared tile.
//  * O += P·V: warp w owns value dims [w * D_V / NW, (w + 1) * D_V / NW) for every row (the f32
//    output of 16 rows x 512 dims would not fit one warp's registers); P's A fragments by
//    ldmatrix, V's B fragments by ldmatrix.trans of the same key rows.
// The split partials (max, sum, weighted values) are merged by mla_reduce, as in the GQA path.
//
// Compile-time (NVRTC -D): D_QK, D_V (D_V % (16 * NW) == 0), GROUP, MT (16-row m-tiles per
// CTA), TK (keys per tile, TK / NW 8 or a multiple of 16, TK <= block_size so that a tile spans
// at most two pool blocks), NW (warps), STAGES (>= 2), MINB (CTAs per SM for __launch_bounds__),
// ROWP (shared latent row in bf16: an odd number of 16-byte chunks, so the eight rows of one
// ldmatrix phase fall in distinct bank groups), PROWP (shared P row, likewise); optional QREG,
// QG and PF (below).
#define THREADS (NW * 32)
#define NCH16 (D_QK / 8)
#define KPW (TK / NW)
#define NKT (KPW / 8)
#define DPW (D_V / NW)
#define NVT (DPW / 8)
#define KSTEPS_QK (D_QK / 16)
#define KSTEPS_PV (TK / 16)
#define ROWS (MT * 16)
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
#ifndef MINB
#define MINB 1
#endif
// Independent S accumulators per warp: enough MMA chains in flight at any m-tile count.
#define KACC ((MT * NKT) >= 4 ? 1 : 4 / (MT * NKT))
// QREG (MT == 1 only): Q's A fragments stay in registers for the whole split instead of being
// re-read from shared memory for every key tile (each warp reads all of Q once per tile).
#ifndef QREG
#define QREG 0
#endif
// k-steps of Q·Kᵀ whose fragments are loaded together (divides D_QK / 16; even).
#ifndef QG
#define QG (MT >= 2 ? 2 : 4)
#endif

__device__ __forceinline__ unsigned int smem_addr(const void* p) {
    unsigned int a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

#ifndef PF
#define PF 0
#endif
// GC = 1: every tile through the general copy (for comparing it with issue_contiguous).
#ifndef GC
#define GC 0
#endif
__device__ __forceinline__ void cp_async16(unsigned int dst, const void* src, int src_bytes) {
#if PF
    // also ask L2 to fetch the whole 256-byte segment around the chunk (PF = 1)
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
#endif
}

// A whole tile of TK latent rows that are contiguous in the pool (one latent head, so the row
// stride is D_QK; the tile inside one pool block; no key past the split) into a ring stage at
// shared address `base`. This is the common case of long decode splits: a thread's chunks then
// lie a fixed stride apart in global memory, so a copy costs an address increment instead of
// the general path's division, block choice and bounds check, which otherwise make up most of
// the instructions a thread issues per tile. Chunk f is row f / NCH16, column f % NCH16; its
// shared offset kk * ROWP + c * 8 equals 8 f + kk * (ROWP - D_QK).
__device__ __forceinline__ void issue_contiguous(unsigned int base, const bf16_t* tile, int tid) {
    const bf16_t* src = tile + tid * 8;
#pragma unroll
    for (int j = 0; j < (TK * NCH16 + THREADS - 1) / THREADS; ++j) {
        const int f = tid + THREADS * j;
        if ((TK * NCH16) % THREADS == 0 || f < TK * NCH16)
            cp_async16(base + (8 * f + (f / NCH16) * (ROWP - D_QK)) * 2, src + THREADS * 8 * j, 16);
    }
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

// Two floats -> packed bf16x2 (lo in the low half), round to nearest even.
__device__ __forceinline__ unsigned int pack_bf16x2(float lo, float hi) {
    unsigned int r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

#ifndef SWAPPED
#define SWAPPED 0
#endif
#if !SWAPPED
extern "C" __global__ void __launch_bounds__(THREADS, MINB)
mla_decode_split(const bf16_t* __restrict__ q, const bf16_t* __restrict__ kv,
                 const int* __restrict__ block_tables, int max_blocks_per_row,
                 const int* __restrict__ g_row, const int* __restrict__ g_start,
                 const int* __restrict__ g_end, const int* __restrict__ g_q0,
                 const int* __restrict__ g_qn, i64 block_stride, int row_stride, int num_kv_heads,
                 int block_size, int tokens_per_split, int max_splits, float scale,
                 float* __restrict__ part_m, float* __restrict__ part_l, float* __restrict__ part_acc) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16_t* qs = reinterpret_cast<bf16_t*>(smem_raw);   // [ROWS][ROWP]
    bf16_t* tiles = qs + ROWS * ROWP;                    // [STAGES][TK][ROWP]
    bf16_t* ps = tiles + STAGES * TK * ROWP;             // [ROWS][PROWP]
    float* red = reinterpret_cast<float*>(ps + ROWS * PROWP);  // [NW][ROWS]

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int chunk = blockIdx.x, split = blockIdx.y;
    const int gi = blockIdx.z / num_kv_heads, kvh = blockIdx.z % num_kv_heads;
    const int num_heads = num_kv_heads * GROUP;
    const int qn = g_qn[gi], q0 = g_q0[gi];
    const int row0 = chunk * ROWS;
    const int nrow = qn * GROUP - row0;  // live rows of this CTA
    const int start = g_start[gi], end = g_end[gi];
    const int s0 = start + split * tokens_per_split;
    // The whole CTA leaves together; the reduce never reads a split with no key for a row.
    if (nrow <= 0 || split >= max_splits || s0 >= end) return;
    const int s1 = min(end, s0 + tokens_per_split);
    const int* table = block_tables + (i64)g_row[gi] * max_blocks_per_row;
    const bf16_t* kv_h = kv + kvh * D_QK;
    const int g = lane >> 2, qd = lane & 3;
    const int mi = lane >> 3, rr = lane & 7;
    const float sl2 = scale * LOG2E;

    // Q rows of this chunk (rows past the group are zero).
    for (int i = tid; i < ROWS * NCH16; i += THREADS) {
        const int r = i / NCH16, c = i - (i / NCH16) * NCH16;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r < nrow) {
            const int R = row0 + r;
            v = *reinterpret_cast<const uint4*>(
                q + ((i64)(q0 + R / GROUP) * num_heads + kvh * GROUP + R % GROUP) * D_QK + c * 8);
        }
        *reinterpret_cast<uint4*>(qs + r * ROWP + c * 8) = v;
    }

    // Key limit (exclusive) of this lane's rows mt * 16 + g (+ 8): causal inside the group;
    // padding rows see the whole split (their Q is zero and their output is never written).
    int lim[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = mt * 16 + g + 8 * h;
            lim[mt][h] = r < nrow ? min(s1, end - (qn - 1 - (row0 + r) / GROUP)) : s1;
        }

    const unsigned int qs_s = smem_addr(qs);
    const unsigned int tiles_s = smem_addr(tiles);
    const unsigned int ps_s = smem_addr(ps);
#if QREG
    __syncthreads();
    unsigned int qf[KSTEPS_QK][4];
#pragma unroll
    for (int k = 0; k < KSTEPS_QK; ++k)
        ldsm_x4(qs_s + ((rr + 8 * (mi & 1)) * ROWP + 16 * k + 8 * (mi >> 1)) * 2, qf[k][0], qf[k][1], qf[k][2],
                qf[k][3]);
#endif

    // A tile starts inside one pool block and, as TK <= block_size, ends in it or the next.
    // The two block ids are loaded one tile ahead of the copies that use them, so the copy
    // issue never waits on a dependent global load.
    auto blocks_of = [&](int ts, int& pa, int& pb) {
        const int b0 = ts / block_size, o0 = ts - b0 * block_size;
        pa = table[b0];
        pb = (o0 + TK > block_size && (b0 + 1) * block_size < s1) ? table[b0 + 1] : pa;
    };
    auto issue = [&](int ts, int stage, int pa, int pb) {
        const unsigned int base = tiles_s + stage * (TK * ROWP * 2);
        const int o0 = ts % block_size;
        if (!GC && row_stride == D_QK && o0 + TK <= block_size && ts + TK <= s1) {
            issue_contiguous(base, kv_h + (i64)pa * block_stride + (i64)o0 * D_QK, tid);
            return;
        }
#pragma unroll
        for (int j = 0; j < (TK * NCH16 + THREADS - 1) / THREADS; ++j) {
            const int f = tid + THREADS * j;
            if ((TK * NCH16) % THREADS == 0 || f < TK * NCH16) {
                const int kk = f / NCH16, c = f - (f / NCH16) * NCH16;
                const int t = ts + kk;
                const bf16_t* src = kv_h;
                int bytes = 0;
                if (t < s1) {
                    const int o = o0 + kk;
                    const int phys = o < block_size ? pa : pb;
                    const int slot = o < block_size ? o : o - block_size;
                    src = kv_h + (i64)phys * block_stride + (i64)slot * row_stride + c * 8;
                    bytes = 16;
                }
                cp_async16(base + (kk * ROWP + c * 8) * 2, src, bytes);  // zero-fill past the split
            }
        }
    };

    float o[MT][NVT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < NVT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[mt][n][e] = 0.f;
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        m[mt][0] = m[mt][1] = -INFINITY;
        l[mt][0] = l[mt][1] = 0.f;
    }

    const int ntiles = (s1 - s0 + TK - 1) / TK;
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (st < ntiles) {
            int pa, pb;
            blocks_of(s0 + st * TK, pa, pb);
            issue(s0 + st * TK, st, pa, pb);
        }
        asm volatile("cp.async.commit_group;");
    }
    int npa = 0, npb = 0;  // block ids of the next tile to issue
    if (STAGES - 1 < ntiles) blocks_of(s0 + (STAGES - 1) * TK, npa, npb);
    for (int it = 0; it < ntiles; ++it) {
        asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2));
        // Tile `it` has landed for every thread, and every warp is done with tile it - 1 (its
        // stage, the P tile and the max exchange), so its stage can be refilled.
        __syncthreads();
        {
            const int nt = it + STAGES - 1;
            if (nt < ntiles) issue(s0 + nt * TK, nt % STAGES, npa, npb);
            asm volatile("cp.async.commit_group;");
            if (nt + 1 < ntiles) blocks_of(s0 + (nt + 1) * TK, npa, npb);
        }
        const unsigned int buf = tiles_s + (it % STAGES) * (TK * ROWP * 2);
        const int tb = s0 + it * TK;
        const int kw = warp * KPW;  // this warp's first key in the tile

        // S = Q · Kᵀ for this warp's KPW keys, every row. The inline assembly is volatile, so
        // it runs in program order: the fragments of QG k-steps are loaded before their MMAs
        // (rather than each MMA waiting on the ldmatrix just before it), and the k-steps rotate
        // over KACC independent accumulators so that the MMAs do not form one dependent chain.
        float sa[KACC][MT][NKT][4];
#pragma unroll
        for (int a = 0; a < KACC; ++a)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int n = 0; n < NKT; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) sa[a][mt][n][e] = 0.f;
#pragma unroll
        for (int g0 = 0; g0 < KSTEPS_QK; g0 += QG) {
            unsigned int bf[QG][NKT][2];
            unsigned int af[QG][MT][4];
#pragma unroll
            for (int j = 0; j < QG; ++j) {
                const int k = g0 + j;
#if NKT == 1
                // One ldmatrix.x4 gives the B fragments of 8 keys for two k-steps (32 dims).
                if ((j & 1) == 0)
                    ldsm_x4(buf + ((kw + rr) * ROWP + 16 * k + 8 * mi) * 2, bf[j][0][0], bf[j][0][1], bf[j + 1][0][0],
                            bf[j + 1][0][1]);
#else
#pragma unroll
                for (int n = 0; n < NKT; n += 2)
                    ldsm_x4(buf + ((kw + n * 8 + rr + 8 * (mi >> 1)) * ROWP + 16 * k + 8 * (mi & 1)) * 2, bf[j][n][0],
                            bf[j][n][1], bf[j][n + 1][0], bf[j][n + 1][1]);
#endif
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    if (mt == 0 || mt * 16 < nrow) {
#if QREG
                        af[j][mt][0] = qf[k][0];
                        af[j][mt][1] = qf[k][1];
                        af[j][mt][2] = qf[k][2];
                        af[j][mt][3] = qf[k][3];
#else
                        ldsm_x4(qs_s + ((mt * 16 + rr + 8 * (mi & 1)) * ROWP + 16 * k + 8 * (mi >> 1)) * 2,
                                af[j][mt][0], af[j][mt][1], af[j][mt][2], af[j][mt][3]);
#endif
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < QG; ++j)
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    if (mt == 0 || mt * 16 < nrow) {
#pragma unroll
                        for (int n = 0; n < NKT; ++n)
                            mma16816(sa[(g0 + j) % KACC][mt][n], af[j][mt][0], af[j][mt][1], af[j][mt][2],
                                     af[j][mt][3], bf[j][n][0], bf[j][n][1]);
                    }
        }
        float s[MT][NKT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int n = 0; n < NKT; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float v = sa[0][mt][n][e];
#pragma unroll
                    for (int a = 1; a < KACC; ++a) v += sa[a][mt][n][e];
                    s[mt][n][e] = v;
                }
        // Mask (split end, causal limit) and this warp's per-row maxima of the tile.
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
            for (int n = 0; n < NKT; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int t = tb + kw + n * 8 + 2 * qd + (e & 1);
                    const bool vis = t < lim[mt][e >> 1];
                    s[mt][n][e] = vis ? s[mt][n][e] * sl2 : -INFINITY;
                    if (e < 2) mx0 = fmaxf(mx0, s[mt][n][e]);
                    else mx1 = fmaxf(mx1, s[mt][n][e]);
                }
#pragma unroll
            for (int x = 1; x <= 2; x <<= 1) {
                mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, x));
                mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, x));
            }
            if (qd == 0) {
                red[warp * ROWS + mt * 16 + g] = mx0;
                red[warp * ROWS + mt * 16 + g + 8] = mx1;
            }
        }
        __syncthreads();
        // Every warp reads the same maxima, so all agree on the new running max of each row.
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = mt * 16 + g + 8 * h;
                float tmax = -INFINITY;
#pragma unroll
                for (int w = 0; w < NW; ++w) tmax = fmaxf(tmax, red[w * ROWS + r]);
                const float mn = fmaxf(m[mt][h], tmax);
                const float base = mn == -INFINITY ? 0.f : mn;
                const float c = exp2f(m[mt][h] - base);
                m[mt][h] = mn;
                float ps_sum = 0.f;
#pragma unroll
                for (int n = 0; n < NKT; ++n) {
                    s[mt][n][2 * h] = exp2f(s[mt][n][2 * h] - base);
                    s[mt][n][2 * h + 1] = exp2f(s[mt][n][2 * h + 1] - base);
                    ps_sum += s[mt][n][2 * h] + s[mt][n][2 * h + 1];
                }
                l[mt][h] = l[mt][h] * c + ps_sum;  // this lane's keys only; summed at the end
                // c is exactly 1 when the max did not move, the common case after a few tiles.
                if (c != 1.f) {
#pragma unroll
                    for (int n = 0; n < NVT; ++n) {
                        o[mt][n][2 * h] *= c;
                        o[mt][n][2 * h + 1] *= c;
                    }
                }
            }
#pragma unroll
            for (int n = 0; n < NKT; ++n) {
                const int col = kw + n * 8 + 2 * qd;
                *reinterpret_cast<unsigned int*>(ps + (mt * 16 + g) * PROWP + col) =
                    pack_bf16x2(s[mt][n][0], s[mt][n][1]);
                *reinterpret_cast<unsigned int*>(ps + (mt * 16 + g + 8) * PROWP + col) =
                    pack_bf16x2(s[mt][n][2], s[mt][n][3]);
            }
        }
        __syncthreads();
        // O += P · V over this warp's value dims, 16 keys per step; every fragment of a step is
        // loaded before its MMAs (program order, as above).
#pragma unroll
        for (int ks = 0; ks < KSTEPS_PV; ++ks) {
            unsigned int pa[MT][4];
            unsigned int vf[NVT / 2][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                if (mt == 0 || mt * 16 < nrow)
                    ldsm_x4(ps_s + ((mt * 16 + rr + 8 * (mi & 1)) * PROWP + 16 * ks + 8 * (mi >> 1)) * 2, pa[mt][0],
                            pa[mt][1], pa[mt][2], pa[mt][3]);
#pragma unroll
            for (int n = 0; n < NVT; n += 2)
                ldsm_x4_t(buf + ((16 * ks + rr + 8 * (mi & 1)) * ROWP + warp * DPW + n * 8 + 8 * (mi >> 1)) * 2,
                          vf[n / 2][0], vf[n / 2][1], vf[n / 2][2], vf[n / 2][3]);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                if (mt == 0 || mt * 16 < nrow) {
#pragma unroll
                    for (int n = 0; n < NVT; n += 2) {
                        mma16816(o[mt][n], pa[mt][0], pa[mt][1], pa[mt][2], pa[mt][3], vf[n / 2][0], vf[n / 2][1]);
                        mma16816(o[mt][n + 1], pa[mt][0], pa[mt][1], pa[mt][2], pa[mt][3], vf[n / 2][2],
                                 vf[n / 2][3]);
                    }
                }
            }
        }
    }
    asm volatile("cp.async.wait_group 0;");
    // Row sums: over the quad, then over the warps (each warp summed only its own keys).
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float v = l[mt][h];
            v += __shfl_xor_sync(0xffffffffu, v, 1);
            v += __shfl_xor_sync(0xffffffffu, v, 2);
            if (qd == 0) red[warp * ROWS + mt * 16 + g + 8 * h] = v;
        }
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = mt * 16 + g + 8 * h;
            if (r >= nrow) continue;
            const int R = row0 + r;
            const i64 slot = ((i64)(q0 + R / GROUP) * num_heads + kvh * GROUP + R % GROUP) * max_splits + split;
            if (warp == 0 && qd == 0) {
                float sum = 0.f;
#pragma unroll
                for (int w = 0; w < NW; ++w) sum += red[w * ROWS + r];
                part_m[slot] = m[mt][h] * LN2;  // back to the natural-log domain of the reduce
                part_l[slot] = sum;
            }
            float* dst = part_acc + slot * D_V + warp * DPW + 2 * qd;
#pragma unroll
            for (int n = 0; n < NVT; ++n)
                *reinterpret_cast<float2*>(dst + n * 8) = make_float2(o[mt][n][2 * h], o[mt][n][2 * h + 1]);
        }
}

#else  // SWAPPED

// Swapped-operand variant (SWAPPED = 1, kernel mla_decode_swapped): no exchange between warps
// inside a tile. Each warp owns 8 (token, head) rows of the chunk (the MMA's N dimension), all
// keys of every tile and all D_V value dims, so the online softmax of its rows stays in the
// warp and the only barrier per tile is the one that recycles a ring stage:
//  * Sᵀ = K·Qᵀ (m16n8k16): the keys are the M dimension (A fragments of 16 keys x 16 dims by
//    ldmatrix of the shared tile), Qᵀ the B operand (8 rows; in registers with QREG, else by
//    ldmatrix from a shared copy of Q). KACC-like independent accumulators keep several MMA
//    chains in flight.
//  * The per-row max over the tile's keys is a reduction over the lanes of equal qd (three
//    shuffles); P is packed to bf16 and transposed in registers with movmatrix, which turns
//    the accumulator layout of Sᵀ (key rows) into the B fragments of P·V (key columns).
//  * Oᵀ += Vᵀ·Pᵀ: the value dims are the M dimension (A fragments by ldmatrix.trans of the same
//    key rows), so one warp's accumulators are D_V x 8 rows = D_V / 4 floats per lane.
// Compile-time: TK (keys per tile, a multiple of 16, at most block_size), NW (warps = 8-row
// n-tiles per CTA), STAGES, MINB, ROWP, QREG, PF as above; QG (k-steps of Sᵀ whose fragments
// are loaded together, divides D_QK / 16) and VG (dim m-tiles of Oᵀ loaded together, divides
// D_V / 16).
#define SROWS (NW * 8)
#define NMT (TK / 16)
#define NDT (D_V / 16)
#define SACC (NMT >= 4 ? 1 : 4 / NMT)
#ifndef QG
#define QG 2
#endif
#ifndef VG
#define VG 4
#endif

__device__ __forceinline__ unsigned int movm_t(unsigned int x) {
    unsigned int y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
    return y;
}

extern "C" __global__ void __launch_bounds__(THREADS, MINB)
mla_decode_swapped(const bf16_t* __restrict__ q, const bf16_t* __restrict__ kv,
                   const int* __restrict__ block_tables, int max_blocks_per_row,
                   const int* __restrict__ g_row, const int* __restrict__ g_start,
                   const int* __restrict__ g_end, const int* __restrict__ g_q0,
                   const int* __restrict__ g_qn, i64 block_stride, int row_stride, int num_kv_heads,
                   int block_size, int tokens_per_split, int max_splits, float scale,
                   float* __restrict__ part_m, float* __restrict__ part_l, float* __restrict__ part_acc) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16_t* tiles = reinterpret_cast<bf16_t*>(smem_raw);  // [STAGES][TK][ROWP]

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int chunk = blockIdx.x, split = blockIdx.y;
    const int gi = blockIdx.z / num_kv_heads, kvh = blockIdx.z % num_kv_heads;
    const int num_heads = num_kv_heads * GROUP;
    const int qn = g_qn[gi], q0 = g_q0[gi];
    const int row0 = chunk * SROWS;
    const int nrow = qn * GROUP - row0;  // live rows of this CTA
    const int start = g_start[gi], end = g_end[gi];
    const int s0 = start + split * tokens_per_split;
    if (nrow <= 0 || split >= max_splits || s0 >= end) return;
    const int s1 = min(end, s0 + tokens_per_split);
    const int* table = block_tables + (i64)g_row[gi] * max_blocks_per_row;
    const bf16_t* kv_h = kv + kvh * D_QK;
    const int g = lane >> 2, qd = lane & 3;
    const int mi = lane >> 3, rr = lane & 7;
    const float sl2 = scale * LOG2E;
    const int wr = warp * 8;  // this warp's first row in the chunk
    // Warp-uniform: a warp past the chunk's live rows still copies and meets every barrier.
    const bool live = wr < nrow;
    const unsigned int tiles_s = smem_addr(tiles);

#if QREG
    // Qᵀ's B fragments straight from global memory: row g of this warp, dims 2qd, 2qd + 1
    // (and + 8) of every k-step.
    unsigned int qf[KSTEPS_QK][2];
    {
        const int r = wr + g;
        const bool v = r < nrow;
        const bf16_t* qrow = q;
        if (v) {
            const int R = row0 + r;
            qrow = q + ((i64)(q0 + R / GROUP) * num_heads + kvh * GROUP + R % GROUP) * D_QK;
        }
#pragma unroll
        for (int k = 0; k < KSTEPS_QK; ++k) {
            qf[k][0] = v ? *reinterpret_cast<const unsigned int*>(qrow + 16 * k + 2 * qd) : 0u;
            qf[k][1] = v ? *reinterpret_cast<const unsigned int*>(qrow + 16 * k + 8 + 2 * qd) : 0u;
        }
    }
#else
    bf16_t* qs = tiles + STAGES * TK * ROWP;  // [SROWS][ROWP]; read after the first barrier
    for (int i = tid; i < SROWS * NCH16; i += THREADS) {
        const int r = i / NCH16, c = i - (i / NCH16) * NCH16;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r < nrow) {
            const int R = row0 + r;
            v = *reinterpret_cast<const uint4*>(
                q + ((i64)(q0 + R / GROUP) * num_heads + kvh * GROUP + R % GROUP) * D_QK + c * 8);
        }
        *reinterpret_cast<uint4*>(qs + r * ROWP + c * 8) = v;
    }
    const unsigned int qs_s = smem_addr(qs);
#endif

    // Key limit (exclusive) of this lane's two rows wr + 2qd (+ 1): causal inside the group;
    // padding rows see the whole split (their Q is zero and their output is never written).
    int lim[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        const int r = wr + 2 * qd + c;
        lim[c] = r < nrow ? min(s1, end - (qn - 1 - (row0 + r) / GROUP)) : s1;
    }

    auto blocks_of = [&](int ts, int& pa, int& pb) {
        const int b0 = ts / block_size, o0 = ts - b0 * block_size;
        pa = table[b0];
        pb = (o0 + TK > block_size && (b0 + 1) * block_size < s1) ? table[b0 + 1] : pa;
    };
    auto issue = [&](int ts, int stage, int pa, int pb) {
        const unsigned int base = tiles_s + stage * (TK * ROWP * 2);
        const int o0 = ts % block_size;
        if (!GC && row_stride == D_QK && o0 + TK <= block_size && ts + TK <= s1) {
            issue_contiguous(base, kv_h + (i64)pa * block_stride + (i64)o0 * D_QK, tid);
            return;
        }
#pragma unroll
        for (int j = 0; j < (TK * NCH16 + THREADS - 1) / THREADS; ++j) {
            const int f = tid + THREADS * j;
            if ((TK * NCH16) % THREADS == 0 || f < TK * NCH16) {
                const int kk = f / NCH16, c = f - (f / NCH16) * NCH16;
                const int t = ts + kk;
                const bf16_t* src = kv_h;
                int bytes = 0;
                if (t < s1) {
                    const int o = o0 + kk;
                    const int phys = o < block_size ? pa : pb;
                    const int slot = o < block_size ? o : o - block_size;
                    src = kv_h + (i64)phys * block_stride + (i64)slot * row_stride + c * 8;
                    bytes = 16;
                }
                cp_async16(base + (kk * ROWP + c * 8) * 2, src, bytes);  // zero-fill past the split
            }
        }
    };

    // Oᵀ: dims 16 i + g (+ 8) x rows wr + 2qd (+ 1).
    float o[NDT][4];
#pragma unroll
    for (int i = 0; i < NDT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[i][e] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

    const int ntiles = (s1 - s0 + TK - 1) / TK;
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (st < ntiles) {
            int pa, pb;
            blocks_of(s0 + st * TK, pa, pb);
            issue(s0 + st * TK, st, pa, pb);
        }
        asm volatile("cp.async.commit_group;");
    }
    int npa = 0, npb = 0;  // block ids of the next tile to issue
    if (STAGES - 1 < ntiles) blocks_of(s0 + (STAGES - 1) * TK, npa, npb);
    for (int it = 0; it < ntiles; ++it) {
        asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2));
        // Tile `it` has landed for every thread and every warp is done with tile it - 1, whose
        // stage is refilled now: the one barrier per tile.
        __syncthreads();
        {
            const int nt = it + STAGES - 1;
            if (nt < ntiles) issue(s0 + nt * TK, nt % STAGES, npa, npb);
            asm volatile("cp.async.commit_group;");
            if (nt + 1 < ntiles) blocks_of(s0 + (nt + 1) * TK, npa, npb);
        }
        if (!live) continue;
        const unsigned int buf = tiles_s + (it % STAGES) * (TK * ROWP * 2);
        const int tb = s0 + it * TK;

        // Sᵀ = K · Qᵀ: the fragments of QG k-steps are loaded before their MMAs (the inline
        // assembly is volatile and keeps program order), and the k-steps rotate over SACC
        // accumulators.
        float sa[SACC][NMT][4];
#pragma unroll
        for (int a = 0; a < SACC; ++a)
#pragma unroll
            for (int mt = 0; mt < NMT; ++mt)
#pragma unroll
                for (int e = 0; e < 4; ++e) sa[a][mt][e] = 0.f;
#pragma unroll
        for (int g0 = 0; g0 < KSTEPS_QK; g0 += QG) {
            unsigned int kf[QG][NMT][4];
            unsigned int qb[QG][2];
#pragma unroll
            for (int j = 0; j < QG; ++j) {
                const int k = g0 + j;
#pragma unroll
                for (int mt = 0; mt < NMT; ++mt)
                    ldsm_x4(buf + ((mt * 16 + 8 * (mi & 1) + rr) * ROWP + 16 * k + 8 * (mi >> 1)) * 2, kf[j][mt][0],
                            kf[j][mt][1], kf[j][mt][2], kf[j][mt][3]);
#if QREG
                qb[j][0] = qf[k][0];
                qb[j][1] = qf[k][1];
#else
                if ((j & 1) == 0)
                    ldsm_x4(qs_s + ((wr + rr) * ROWP + 16 * k + 8 * mi) * 2, qb[j][0], qb[j][1], qb[j + 1][0],
                            qb[j + 1][1]);
#endif
            }
#pragma unroll
            for (int j = 0; j < QG; ++j)
#pragma unroll
                for (int mt = 0; mt < NMT; ++mt)
                    mma16816(sa[(g0 + j) % SACC][mt], kf[j][mt][0], kf[j][mt][1], kf[j][mt][2], kf[j][mt][3],
                             qb[j][0], qb[j][1]);
        }
        float s[NMT][4];
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int mt = 0; mt < NMT; ++mt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float v = sa[0][mt][e];
#pragma unroll
                for (int a = 1; a < SACC; ++a) v += sa[a][mt][e];
                // key tb + mt * 16 + g (+ 8 for e >= 2), row wr + 2qd + (e & 1)
                const int t = tb + mt * 16 + g + 8 * (e >> 1);
                v = t < lim[e & 1] ? v * sl2 : -INFINITY;
                s[mt][e] = v;
                mx[e & 1] = fmaxf(mx[e & 1], v);
            }
        float base[2], corr[2], psum[2] = {0.f, 0.f};
#pragma unroll
        for (int c = 0; c < 2; ++c) {
#pragma unroll
            for (int x = 4; x <= 16; x <<= 1) mx[c] = fmaxf(mx[c], __shfl_xor_sync(0xffffffffu, mx[c], x));
            const float mn = fmaxf(m[c], mx[c]);
            base[c] = mn == -INFINITY ? 0.f : mn;
            corr[c] = exp2f(m[c] - base[c]);
            m[c] = mn;
        }
#pragma unroll
        for (int mt = 0; mt < NMT; ++mt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[mt][e] = exp2f(s[mt][e] - base[e & 1]);
                psum[e & 1] += s[mt][e];
            }
#pragma unroll
        for (int c = 0; c < 2; ++c) l[c] = l[c] * corr[c] + psum[c];  // this lane's keys only
        // The correction is exactly 1 when no row's max moved, the common case after a few
        // tiles; the vote keeps the branch uniform across the warp.
        if (__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) {
#pragma unroll
            for (int i = 0; i < NDT; ++i) {
                o[i][0] *= corr[0];
                o[i][1] *= corr[1];
                o[i][2] *= corr[0];
                o[i][3] *= corr[1];
            }
        }
        // Pᵀ's B fragments: keys 2qd, 2qd + 1 (+ 8) of row g, by transposing the packed
        // accumulator tiles (key g, rows 2qd, 2qd + 1).
        unsigned int pb[NMT][2];
#pragma unroll
        for (int mt = 0; mt < NMT; ++mt) {
            pb[mt][0] = movm_t(pack_bf16x2(s[mt][0], s[mt][1]));
            pb[mt][1] = movm_t(pack_bf16x2(s[mt][2], s[mt][3]));
        }
        // Oᵀ += Vᵀ · Pᵀ, 16 keys per k-step, VG dim tiles' fragments loaded before their MMAs.
#pragma unroll
        for (int mt = 0; mt < NMT; ++mt)
#pragma unroll
            for (int i0 = 0; i0 < NDT; i0 += VG) {
                unsigned int vf[VG][4];
#pragma unroll
                for (int j = 0; j < VG; ++j)
                    ldsm_x4_t(buf + ((mt * 16 + 8 * (mi >> 1) + rr) * ROWP + 16 * (i0 + j) + 8 * (mi & 1)) * 2,
                              vf[j][0], vf[j][1], vf[j][2], vf[j][3]);
#pragma unroll
                for (int j = 0; j < VG; ++j)
                    mma16816(o[i0 + j], vf[j][0], vf[j][1], vf[j][2], vf[j][3], pb[mt][0], pb[mt][1]);
            }
    }
    asm volatile("cp.async.wait_group 0;");
    if (!live) return;
    // Row sums over the lanes of equal qd (each lane summed keys g and g + 8 of every tile).
#pragma unroll
    for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int x = 4; x <= 16; x <<= 1) l[c] += __shfl_xor_sync(0xffffffffu, l[c], x);
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        const int r = wr + 2 * qd + c;
        if (r >= nrow) continue;
        const int R = row0 + r;
        const i64 slot = ((i64)(q0 + R / GROUP) * num_heads + kvh * GROUP + R % GROUP) * max_splits + split;
        if (g == 0) {
            part_m[slot] = m[c] * LN2;  // back to the natural-log domain of the reduce
            part_l[slot] = l[c];
        }
        float* dst = part_acc + slot * D_V + g;
#pragma unroll
        for (int i = 0; i < NDT; ++i) {
            dst[16 * i] = o[i][c];
            dst[16 * i + 8] = o[i][2 + c];
        }
    }
}
#endif  // SWAPPED

// Merges the split partials of each (query row, head): grid (rows, heads), any block size.
extern "C" __global__ void mla_reduce(const int* __restrict__ kv_start, const int* __restrict__ kv_end,
                                      int tokens_per_split, int max_splits, int num_heads,
                                      const float* __restrict__ part_m, const float* __restrict__ part_l,
                                      const float* __restrict__ part_acc, bf16_t* __restrict__ out) {
    const int qi = blockIdx.x, h = blockIdx.y;
    const int len = kv_end[qi] - kv_start[qi];
    const int nsplit = len > 0 ? min(max_splits, (len + tokens_per_split - 1) / tokens_per_split) : 0;
    const i64 base = ((i64)qi * num_heads + h) * max_splits;
    float mx = -INFINITY;
    for (int i = 0; i < nsplit; ++i) mx = fmaxf(mx, part_m[base + i]);
    float den = 0.f;
    for (int i = 0; i < nsplit; ++i) den += part_l[base + i] * __expf(part_m[base + i] - mx);
    const float inv = den > 0.f ? 1.f / den : 0.f;
    bf16_t* o = out + ((i64)qi * num_heads + h) * D_V;
    for (int d = 4 * threadIdx.x; d < D_V; d += 4 * blockDim.x) {
        float4 num = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int i = 0; i < nsplit; ++i) {
            const float w = __expf(part_m[base + i] - mx);
            const float4 a = *reinterpret_cast<const float4*>(part_acc + (base + i) * D_V + d);
            num.x += a.x * w;
            num.y += a.y * w;
            num.z += a.z * w;
            num.w += a.w * w;
        }
        o[d] = f2bf(num.x * inv);
        o[d + 1] = f2bf(num.y * inv);
        o[d + 2] = f2bf(num.z * inv);
        o[d + 3] = f2bf(num.w * inv);
    }
}
