// Runs one CPU kernel on buffers read from a file and writes the buffers back: how the tests call
// a variant built for another architecture (the NEON build, under qemu-aarch64) with the same
// inputs and torch references as the variants loaded in-process (tests/cpu_qemu.py).
//
// Input file, little endian: int64 op; int64 nbuf, then per buffer int64 nbytes + bytes (an empty
// buffer is passed as NULL); int64 nint + int64s; int64 nfloat + float32s.
// Output file: every buffer again, in order, after the call.

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "../kernels/cpu_kernels.c"

#define MAX_BUF 24

static int64_t read_i64(FILE *f) {
    int64_t v;
    if (fread(&v, 8, 1, f) != 1) exit(3);
    return v;
}

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    FILE *in = fopen(argv[1], "rb");
    if (!in) return 2;
    int64_t op = read_i64(in), nbuf = read_i64(in);
    if (nbuf > MAX_BUF) return 2;
    void *b[MAX_BUF] = {0};
    int64_t size[MAX_BUF] = {0};
    for (int64_t i = 0; i < nbuf; i++) {
        size[i] = read_i64(in);
        if (size[i] == 0) continue;
        b[i] = aligned_alloc(64, ((size[i] + 63) / 64) * 64);
        if (fread(b[i], 1, (size_t)size[i], in) != (size_t)size[i]) return 3;
    }
    int64_t ni = read_i64(in), iv[32] = {0};
    for (int64_t i = 0; i < ni; i++) iv[i] = read_i64(in);
    int64_t nf = read_i64(in);
    float fv[8] = {0};
    if (nf > 8 || fread(fv, 4, (size_t)nf, in) != (size_t)nf) return 3;
    fclose(in);

    switch (op) {
    case 0: wb_gemv_bf16(b[0], b[1], NULL, b[2], b[3], iv[0], iv[1], iv[2], 0); break;
    case 1: wb_gemv_int8(b[0], b[1], b[2], b[3], b[4], iv[0], iv[1], iv[2], 0); break;
    case 2: wb_gemv_int4(b[0], b[1], b[2], b[3], b[4], iv[0], iv[1], iv[2], iv[3]); break;
    case 3: wb_add_rms_norm(b[0], b[1], b[2], b[3], iv[0], iv[1], fv[0]); break;
    case 4: wb_silu_mul(b[0], b[1], iv[0], iv[1]); break;
    case 5: wb_rope_write_kv(b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], iv[0], iv[1], iv[2], iv[3]); break;
    case 6: wb_paged_decode(b[0], b[1], b[2], b[3], b[4], b[5], iv[0], iv[1], iv[2], iv[3], iv[4], iv[5], fv[0]); break;
    case 8: wb_paged_extend(b[0], b[1], b[2], b[3], b[4], b[5], b[6], iv[0], iv[1], iv[2], iv[3], iv[4], iv[5], fv[0]);
        break;
    case 7: {  // one decoder layer, bf16 weights: qkv, o, gate_up, down, ln1, ln2, then the step's tensors
        int64_t T = iv[0], H = iv[1], Hq = iv[2], Hkv = iv[3], D = iv[4], I = iv[5];
        wb_layer L = {{0, b[0], NULL, NULL, (Hq + 2 * Hkv) * D, H, 0}, {0, b[1], NULL, NULL, H, Hq * D, 0},
                      {0, b[2], NULL, NULL, 2 * I, H, 0}, {0, b[3], NULL, NULL, H, I, 0}, b[4], b[5], fv[0]};
        int64_t widest = H > Hq * D ? H : Hq * D;
        widest = widest > I ? widest : I;
        bf16 *scratch = malloc(sizeof(bf16) * T * (H + (Hq + 2 * Hkv) * D + 2 * Hq * D + H + 3 * I));
        bf16 *p = scratch;
        wb_step S = {T, H, Hq, Hkv, D, I, b[6], b[7], b[8], b[9], iv[6], iv[7], b[10], b[11], fv[1]};
        S.h = p, p += T * H;
        S.qkv = p, p += T * (Hq + 2 * Hkv) * D;
        S.q = p, p += T * Hq * D;
        S.att = p, p += T * Hq * D;
        S.o = p, p += T * H;
        S.gu = p, p += T * 2 * I;
        S.act = p;
        S.xf = malloc(sizeof(float) * T * widest);
        wb_decode_layer(&L, &S, b[12], b[13], b[14], b[15], b[16]);
        free(scratch);
        free(S.xf);
        break;
    }
    default: return 2;
    }

    FILE *out = fopen(argv[2], "wb");
    if (!out) return 2;
    for (int64_t i = 0; i < nbuf; i++)
        if (size[i] && fwrite(b[i], 1, (size_t)size[i], out) != (size_t)size[i]) return 4;
    fclose(out);
    printf("%s\n", wb_variant());
    return 0;
}
