/*
 * bng_harness.c: runs BatchNormGrad on bngrad's golden vectors and writes what it computed.
 *
 *     bng_harness [-k] DIR...
 *
 * Each DIR is a case (it holds case.txt) or a suite (it holds index.txt, one case directory
 * name per line). For each case the harness reads case.txt and the inputs x.bin, dy.bin,
 * mean.bin, invar.bin, scale.bin, builds long long params[12], calls the function case.txt
 * names (with its core_mask for the _s functions), and writes dx.out.bin, dbias.out.bin and
 * dscale.out.bin beside them; `bngrad dsp-check SUITE` (or `bngrad compare`) judges those.
 *
 * Before running any case, the harness removes the outputs (and broke.txt) an earlier run left
 * in every case it was given, so that a case it skips, or never reaches because the library
 * crashed, has no outputs and dsp-check says MISSING instead of judging stale files. -k keeps
 * them for the hp_ cases of the other parameter type (see batchnormgrad.h): `make run` runs
 * the second build with -k, so that it leaves the first build's outputs in place.
 *
 * Files are raw little-endian IEEE 754 without a header, row-major [batch][channel]; the
 * harness converts on a big-endian target. Every size is checked: a file that is shorter or
 * longer than case.txt says, or a malformed case.txt, is an error naming the file.
 *
 * Outputs start as NaN, so an element the function never writes shows up in the comparison,
 * and a guard zone after every output and a copy of every input catch a write past the end
 * or into an input. Such a case also gets broke.txt, one line per buffer (e.g.
 * "fp_batch_norm_grad_s wrote past the end of dx"), which dsp-check reports as BROKE: on a
 * board only the files come back, not what the harness printed.
 *
 * Exit status: 0 every case ran (or was skipped, said on stdout), 1 a function wrote past an
 * output or into an input, 2 unusable input (the message names the case and file).
 *
 * Build options (-D): BNG_HP_PARAMS_FLOAT (see batchnormgrad.h); BNG_NO_FP / BNG_NO_HP for a
 * library without the fp_ / hp_ functions (their cases are skipped); BNG_CALL_*_S / _P to
 * call your library differently.
 */
#include "batchnormgrad.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(BNG_NO_FP) && defined(BNG_NO_HP)
#error "BNG_NO_FP and BNG_NO_HP together leave nothing to call"
#endif

#ifndef BNG_CALL_FP_S
#define BNG_CALL_FP_S(x, dy, dx, params, mask) fp_batch_norm_grad_s(x, dy, dx, params, mask)
#endif
#ifndef BNG_CALL_HP_S
#define BNG_CALL_HP_S(x, dy, dx, params, mask) hp_batch_norm_grad_s(x, dy, dx, params, mask)
#endif
#ifndef BNG_CALL_FP_P
#define BNG_CALL_FP_P(x, dy, dx, params) fp_batch_norm_grad_p(x, dy, dx, params)
#endif
#ifndef BNG_CALL_HP_P
#define BNG_CALL_HP_P(x, dy, dx, params) hp_batch_norm_grad_p(x, dy, dx, params)
#endif

#define CASE_FORMAT "bngrad-dsp-case/1"
#define MAX_ELEMENTS (1LL << 26)    /* bngrad's limit per (batch, channel) array */
#define GUARD 64                    /* elements after every output buffer */
#define GUARD_BYTE 0xa5
#define LINE_MAX_LEN 512
#define BROKE_FILE "broke.txt"      /* what a function broke, for dsp-check */

enum { OK = 0, BROKE = 1, UNUSABLE = 2 };

static long cases_ran, cases_skipped;   /* for the summary line */
static int keep_other;  /* -k: leave the outputs of the other hp_ parameter type's cases */
static int quiet;       /* while clearing before the run: its errors are said by the run */

struct bng_case {
    const char *dir;
    char name[128], function[32], dtype[8], param_dtype[8];
    long long batch, channel, is_train, core_mask;
    int have_format, have_core_mask;
};

static int fail(const char *dir, const char *what, const char *message)
{
    if (!quiet)
        fprintf(stderr, "error  %s: %s: %s\n", dir, what, message);
    return UNUSABLE;
}

static char *join(const char *dir, const char *name)
{
    size_t n = strlen(dir) + strlen(name) + 2;
    char *path = malloc(n);
    if (path)
        sprintf(path, "%s/%s", dir, name);
    return path;
}

static int plain_name(const char *s)
{
    size_t i, n = strlen(s);
    if (n == 0 || n > 100 || strcmp(s, ".") == 0 || strcmp(s, "..") == 0)
        return 0;
    for (i = 0; i < n; i++) {
        char ch = s[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9')
              || ch == '_' || ch == '-' || ch == '.'))
            return 0;
    }
    return 1;
}

/* one line, without its newline; 0 at the end of the file, -1 for an over-long line */
static int read_line(FILE *f, char *buf, size_t size)
{
    size_t n;
    if (!fgets(buf, (int)size, f))
        return 0;
    n = strlen(buf);
    if (n > 0 && buf[n - 1] == '\n')
        buf[--n] = '\0';
    else if (!feof(f))
        return -1;
    if (n > 0 && buf[n - 1] == '\r')
        buf[--n] = '\0';
    return 1;
}

/* splits "key value" (blank and # lines give key ""); 0 if malformed */
static int split(char *line, char **key, char **value)
{
    char *p = line, *end;
    while (*p == ' ' || *p == '\t')
        p++;
    *key = p;
    *value = p + strlen(p);
    if (*p == '\0' || *p == '#') {
        *key = *value;
        return 1;
    }
    while (*p && *p != ' ' && *p != '\t')
        p++;
    if (*p == '\0')
        return 0;           /* a key without a value */
    *p++ = '\0';
    while (*p == ' ' || *p == '\t')
        p++;
    end = p + strlen(p);
    while (end > p && (end[-1] == ' ' || end[-1] == '\t'))
        *--end = '\0';
    *value = p;
    return *p != '\0' && strchr(p, ' ') == NULL && strchr(p, '\t') == NULL;
}

/* decimal; hexadecimal too (0x...) where hex is set, for core_mask */
static int parse_int(const char *text, int hex, long long lo, long long hi, long long *out)
{
    char *end;
    long long v;
    errno = 0;
    v = strtoll(text, &end, hex && (text[0] == '0' && (text[1] == 'x' || text[1] == 'X')) ? 16
                                                                                         : 10);
    if (errno || end == text || *end != '\0' || v < lo || v > hi)
        return 0;
    *out = v;
    return 1;
}

static int copy_text(char *dst, size_t size, const char *src)
{
    if (strlen(src) >= size)
        return 0;
    strcpy(dst, src);
    return 1;
}

static int read_case(const char *dir, struct bng_case *k)
{
    char line[LINE_MAX_LEN], msg[LINE_MAX_LEN + 64], *key, *value, *path;
    int got, lineno = 0, status = OK, seen[9] = {0};
    static const char *const keys[9] = {"format", "name", "function", "dtype", "param_dtype",
                                        "batch", "channel", "is_train", "core_mask"};
    FILE *f;

    memset(k, 0, sizeof *k);
    k->dir = dir;
    if (!(path = join(dir, "case.txt")))
        return fail(dir, "case.txt", "out of memory");
    f = fopen(path, "r");
    free(path);
    if (!f)
        return fail(dir, "case.txt", strerror(errno));
    while (status == OK && (got = read_line(f, line, sizeof line)) != 0) {
        int i, ok = 1;
        lineno++;
        if (got < 0 || !split(line, &key, &value)) {
            sprintf(msg, "line %d: expected `key value`%s", lineno,
                    got < 0 ? " (line too long)" : "");
            status = fail(dir, "case.txt", msg);
            break;
        }
        if (*key == '\0')
            continue;
        for (i = 0; i < 9 && strcmp(key, keys[i]) != 0; i++)
            ;
        if (i == 9 || seen[i]++) {
            sprintf(msg, "line %d: %s key %.64s", lineno, i == 9 ? "unknown" : "repeated", key);
            status = fail(dir, "case.txt", msg);
            break;
        }
        switch (i) {
        case 0: ok = strcmp(value, CASE_FORMAT) == 0; k->have_format = ok; break;
        case 1: ok = copy_text(k->name, sizeof k->name, value); break;
        case 2: ok = copy_text(k->function, sizeof k->function, value); break;
        case 3: ok = copy_text(k->dtype, sizeof k->dtype, value); break;
        case 4: ok = copy_text(k->param_dtype, sizeof k->param_dtype, value); break;
        case 5: ok = parse_int(value, 0, 1, MAX_ELEMENTS, &k->batch); break;
        case 6: ok = parse_int(value, 0, 1, MAX_ELEMENTS, &k->channel); break;
        case 7: ok = parse_int(value, 0, 0, 1, &k->is_train); break;
        default: ok = parse_int(value, 1, 1, 0x7fffffff, &k->core_mask); k->have_core_mask = 1;
        }
        if (!ok) {
            sprintf(msg, "line %d: unusable value for %s: %.64s", lineno, key, value);
            status = fail(dir, "case.txt", msg);
        }
    }
    if (status == OK && ferror(f))
        status = fail(dir, "case.txt", "read error");
    fclose(f);
    if (status != OK)
        return status;
    for (got = 0; got < 9; got++)
        if (!seen[got] && got != 8) {
            sprintf(msg, "no %s line", keys[got]);
            return fail(dir, "case.txt", msg);
        }
    if (strcmp(k->function, "fp_batch_norm_grad_s") && strcmp(k->function, "fp_batch_norm_grad_p")
        && strcmp(k->function, "hp_batch_norm_grad_s")
        && strcmp(k->function, "hp_batch_norm_grad_p"))
        return fail(dir, "case.txt", "function: expected fp_ or hp_batch_norm_grad_s or _p");
    if (strcmp(k->dtype, k->function[0] == 'f' ? "fp32" : "fp16") != 0)
        return fail(dir, "case.txt", "dtype: expected fp32 for fp_ functions, fp16 for hp_");
    if (strcmp(k->param_dtype, "fp32") != 0
        && (k->function[0] == 'f' || strcmp(k->param_dtype, "fp16") != 0))
        return fail(dir, "case.txt", "param_dtype: expected fp32 (or fp16 for hp_ functions)");
    if (k->batch * k->channel > MAX_ELEMENTS)
        return fail(dir, "case.txt", "batch * channel: more than 2^26 elements");
    if ((k->function[strlen(k->function) - 1] == 's') != k->have_core_mask)
        return fail(dir, "case.txt", "core_mask: expected for the _s functions, and only there");
    return OK;
}

/* little-endian bytes <-> native elements of 2 or 4 bytes */
static void from_le(unsigned char *buf, size_t count, size_t size)
{
    size_t i;
    for (i = 0; i < count; i++) {
        unsigned char *p = buf + i * size;
        if (size == 2) {
            uint16_t v = (uint16_t)(p[0] | (p[1] << 8));
            memcpy(p, &v, 2);
        } else {
            uint32_t v = (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16)
                         | ((uint32_t)p[3] << 24);
            memcpy(p, &v, 4);
        }
    }
}

static int write_le(const char *dir, const char *name, const unsigned char *buf, size_t count,
                    size_t size)
{
    unsigned char le[4];
    size_t i, j;
    char *path = join(dir, name);
    FILE *f = path ? fopen(path, "wb") : NULL;
    int status = OK;

    if (!f) {
        status = fail(dir, name, path ? strerror(errno) : "out of memory");
        free(path);
        return status;
    }
    free(path);
    for (i = 0; i < count && status == OK; i++) {
        uint32_t v = 0;
        if (size == 2) {
            uint16_t h;
            memcpy(&h, buf + 2 * i, 2);
            v = h;
        } else {
            memcpy(&v, buf + 4 * i, 4);
        }
        for (j = 0; j < size; j++)
            le[j] = (unsigned char)(v >> (8 * j));
        if (fwrite(le, 1, size, f) != size)
            status = fail(dir, name, "write error");
    }
    if (fclose(f) != 0 && status == OK)
        status = fail(dir, name, "write error");
    return status;
}

/* exactly count elements of size bytes from dir/name into buf (native order) */
static int read_le(const char *dir, const char *name, unsigned char *buf, size_t count,
                   size_t size)
{
    char msg[160];
    char *path = join(dir, name);
    FILE *f = path ? fopen(path, "rb") : NULL;
    size_t got;
    int extra;

    if (!f) {
        int status = fail(dir, name, path ? strerror(errno) : "out of memory");
        free(path);
        return status;
    }
    free(path);
    got = fread(buf, 1, count * size, f);
    extra = got == count * size ? fgetc(f) : EOF;
    if (ferror(f)) {
        fclose(f);
        return fail(dir, name, "read error");
    }
    fclose(f);
    if (got != count * size || extra != EOF) {
        if (extra != EOF)
            sprintf(msg, "has more than %lu bytes, ", (unsigned long)got);
        else
            sprintf(msg, "has %lu bytes, ", (unsigned long)got);
        sprintf(msg + strlen(msg), "expected %lu (%lu values of %lu bytes, little-endian)",
                (unsigned long)(count * size), (unsigned long)count, (unsigned long)size);
        return fail(dir, name, msg);
    }
    from_le(buf, count, size);
    return OK;
}

/* an output buffer: count NaN elements, then GUARD bytes of GUARD_BYTE per element */
static unsigned char *output_buffer(size_t count, size_t size)
{
    unsigned char *buf = malloc((count + GUARD) * size);
    size_t i;
    if (!buf)
        return NULL;
    for (i = 0; i < count; i++) {
        if (size == 2) {
            uint16_t nan16 = 0x7e5a;
            memcpy(buf + 2 * i, &nan16, 2);
        } else {
            uint32_t nan32 = 0x7fc05a5a;
            memcpy(buf + 4 * i, &nan32, 4);
        }
    }
    memset(buf + count * size, GUARD_BYTE, GUARD * size);
    return buf;
}

static int guard_intact(const unsigned char *buf, size_t count, size_t size)
{
    size_t i;
    for (i = count * size; i < (count + GUARD) * size; i++)
        if (buf[i] != GUARD_BYTE)
            return 0;
    return 1;
}

enum { X, DY, MEAN, INVAR, SCALE, DX, DBIAS, DSCALE, NBUF };
static const char *const files[NBUF] = {"x.bin", "dy.bin", "mean.bin", "invar.bin",
                                        "scale.bin", "dx.out.bin", "dbias.out.bin",
                                        "dscale.out.bin"};
static const char *const names[NBUF] = {"x", "dy", "mean", "invar", "scale", "dx", "dbias",
                                        "dscale"};

/* an hp_ case of the parameter type this build does not take: the other build runs it */
static int other_params(const struct bng_case *k)
{
    return k->function[0] == 'h' && strcmp(k->param_dtype, BNG_HP_PARAM_DTYPE) != 0;
}

/* Removes the outputs and broke.txt of an earlier run (k: the case, NULL if unusable), so that
 * dsp-check finds none where this run writes none. With -k, a case of the other hp_ parameter
 * type keeps them: the other build of `make run` wrote them just before. */
static int clear_case(const char *dir, const struct bng_case *k)
{
    int i, status = OK;
    if (keep_other && k && other_params(k))
        return OK;
    for (i = DX; i <= NBUF; i++) {
        const char *name = i < NBUF ? files[i] : BROKE_FILE;
        char *path = join(dir, name), msg[160];
        if (!path)
            return fail(dir, name, "out of memory");
        if (remove(path) != 0 && errno != ENOENT) {
            sprintf(msg, "cannot remove this file of an earlier run: %.100s", strerror(errno));
            status = fail(dir, name, msg);
        }
        free(path);
    }
    return status;
}

/* writes text as dir/BROKE_FILE */
static int write_broke(const char *dir, const char *text)
{
    char *path = join(dir, BROKE_FILE);
    FILE *f = path ? fopen(path, "w") : NULL;
    int status = OK;
    if (!f) {
        status = fail(dir, BROKE_FILE, path ? strerror(errno) : "out of memory");
    } else {
        int bad = fputs(text, f) == EOF;
        if (fclose(f) != 0 || bad)
            status = fail(dir, BROKE_FILE, "write error");
    }
    free(path);
    return status;
}

static int run_case(const char *dir)
{
    struct bng_case k;
    unsigned char *buf[NBUF] = {0}, *copy[DX] = {0};
    size_t count[NBUF], size[NBUF], i;
    long long params[BNG_PARAMS_LEN];
    int status, cleared, hp, shared;
    char broke[NBUF * 96] = "";

    status = read_case(dir, &k);
    cleared = clear_case(dir, status == OK ? &k : NULL);  /* again: now its errors are said */
    if (status != OK || cleared != OK)
        return status != OK ? status : cleared;
    hp = k.function[0] == 'h';
    shared = k.function[strlen(k.function) - 1] == 's';
#ifdef BNG_NO_FP
    if (!hp) {
        printf("skip   %s: this build has no fp_ functions (BNG_NO_FP)\n", dir);
        cases_skipped++;
        return OK;
    }
#endif
#ifdef BNG_NO_HP
    if (hp) {
        printf("skip   %s: this build has no hp_ functions (BNG_NO_HP)\n", dir);
        cases_skipped++;
        return OK;
    }
#endif
    if (other_params(&k)) {
        printf("skip   %s: hp_ parameters in %s; this build's hp_ takes %s (%s)\n", dir,
               k.param_dtype, BNG_HP_PARAM_DTYPE,
               hp && strcmp(k.param_dtype, "fp32") == 0 ? "build with -DBNG_HP_PARAMS_FLOAT"
                                                        : "build without -DBNG_HP_PARAMS_FLOAT");
        cases_skipped++;
        return OK;
    }
    for (i = 0; i < NBUF; i++) {
        int data = i == X || i == DY || i == DX;
        count[i] = data ? (size_t)(k.batch * k.channel) : (size_t)k.channel;
        size[i] = (data ? strcmp(k.dtype, "fp16") : strcmp(k.param_dtype, "fp16")) == 0 ? 2 : 4;
        buf[i] = i < DX ? malloc(count[i] * size[i]) : output_buffer(count[i], size[i]);
        if (!buf[i] || (i < DX && !(copy[i] = malloc(count[i] * size[i])))) {
            status = fail(dir, names[i], "out of memory");
            goto done;
        }
        if (i < DX) {
            if ((status = read_le(dir, files[i], buf[i], count[i], size[i])) != OK)
                goto done;
            memcpy(copy[i], buf[i], count[i] * size[i]);
        }
    }

    for (i = 0; i < BNG_PARAMS_LEN; i++)
        params[i] = 0;
    params[0] = (long long)(intptr_t)buf[MEAN];
    params[1] = (long long)(intptr_t)buf[INVAR];
    params[2] = (long long)(intptr_t)buf[SCALE];
    params[3] = (long long)(intptr_t)buf[DBIAS];
    params[4] = (long long)(intptr_t)buf[DSCALE];
    params[5] = k.batch;
    params[6] = k.channel;
    params[7] = k.is_train;
#ifndef BNG_NO_FP
    if (!hp && shared)
        BNG_CALL_FP_S((float *)(void *)buf[X], (float *)(void *)buf[DY],
                      (float *)(void *)buf[DX], params, (int)k.core_mask);
    else if (!hp)
        BNG_CALL_FP_P((float *)(void *)buf[X], (float *)(void *)buf[DY],
                      (float *)(void *)buf[DX], params);
#endif
#ifndef BNG_NO_HP
    if (hp && shared)
        BNG_CALL_HP_S((half *)(void *)buf[X], (half *)(void *)buf[DY], (half *)(void *)buf[DX],
                      params, (int)k.core_mask);
    else if (hp)
        BNG_CALL_HP_P((half *)(void *)buf[X], (half *)(void *)buf[DY], (half *)(void *)buf[DX],
                      params);
#endif
    (void)shared;

    for (i = 0; i < NBUF; i++) {
        if (i >= DX ? !guard_intact(buf[i], count[i], size[i])
                    : memcmp(copy[i], buf[i], count[i] * size[i]) != 0) {
            char *line = broke + strlen(broke);
            sprintf(line, "%s wrote %s %s\n", k.function,
                    i >= DX ? "past the end of" : "into input", names[i]);
            printf("broke  %s: %s", dir, line);
            status = BROKE;
        }
    }
    /* broke.txt before the outputs: outputs without it would read as a clean run */
    if (status == BROKE && write_broke(dir, broke) != OK) {
        status = UNUSABLE;
        goto done;
    }
    for (i = DX; i < NBUF; i++) {
        int wrote = write_le(dir, files[i], buf[i], count[i], size[i]);
        if (wrote != OK) {
            status = wrote;
            goto done;
        }
    }
    cases_ran++;
    if (status == OK)
        printf("ran    %s: %s%s\n", dir, k.function, shared ? "" : " (private storage)");
done:
    for (i = 0; i < NBUF; i++) {
        free(buf[i]);
        if (i < DX)
            free(copy[i]);
    }
    return status;
}

static int exists(const char *dir, const char *name)
{
    char *path = join(dir, name);
    FILE *f = path ? fopen(path, "r") : NULL;
    free(path);
    if (f)
        fclose(f);
    return f != NULL;
}

/* each(case directory) for every case index.txt lists, in its order */
static int walk_suite(const char *dir, int (*each)(const char *))
{
    char line[LINE_MAX_LEN], msg[LINE_MAX_LEN + 64], *key, *value, *path;
    int got, lineno = 0, status = OK, cases = 0;
    FILE *f;

    key = value = line;
    line[0] = '\0';

    if (!(path = join(dir, "index.txt")))
        return fail(dir, "index.txt", "out of memory");
    f = fopen(path, "r");
    free(path);
    if (!f)
        return fail(dir, "index.txt", strerror(errno));
    while ((got = read_line(f, line, sizeof line)) != 0) {
        char *case_dir;
        int one;
        lineno++;
        if (got > 0) {      /* "name" or "name # what it exercises" */
            char *hash = strchr(line, '#');
            if (hash)
                *hash = '\0';
        }
        if (got > 0)
            split(line, &key, &value);  /* a lone name has no value: the result is 0 */
        if (got < 0 || (*key && (*value || !plain_name(key)))) {
            sprintf(msg, "line %d: expected a case directory name", lineno);
            one = fail(dir, "index.txt", msg);
            status = one > status ? one : status;
            break;
        }
        if (*key == '\0')
            continue;
        if (!(case_dir = join(dir, key))) {
            status = fail(dir, "index.txt", "out of memory");
            break;
        }
        one = each(case_dir);
        status = one > status ? one : status;
        cases++;
        free(case_dir);
    }
    if (ferror(f))
        status = fail(dir, "index.txt", "read error");
    fclose(f);
    if (status == OK && cases == 0)
        status = fail(dir, "index.txt", "lists no cases");
    return status;
}

/* each(case directory) for dir, a case or a suite */
static int walk(const char *dir, int (*each)(const char *))
{
    return exists(dir, "case.txt") ? each(dir)
           : exists(dir, "index.txt") ? walk_suite(dir, each)
           : fail(dir, "case.txt", "no case.txt (a case) or index.txt (a suite)");
}

/* clear_case for a case as run_case will see it */
static int prepare_case(const char *dir)
{
    struct bng_case k;
    return clear_case(dir, read_case(dir, &k) == OK ? &k : NULL);
}

int main(int argc, char *argv[])
{
    int i, first = 1, status = OK;

    if (argc > 1 && strcmp(argv[1], "-k") == 0) {
        keep_other = 1;
        first = 2;
    }
    if (argc <= first) {
        fprintf(stderr, "usage: %s [-k] DIR...  (a case directory with case.txt, or a suite "
                        "with index.txt; -k keeps the outputs of the hp_ cases of the other "
                        "parameter type)\n", argv[0]);
        return UNUSABLE;
    }
    /* every case's old outputs go first, so that a crash leaves the cases after it MISSING;
       quietly, as the run says the same errors again */
    quiet = 1;
    for (i = first; i < argc; i++)
        walk(argv[i], prepare_case);
    quiet = 0;
    for (i = first; i < argc; i++) {
        int one = walk(argv[i], run_case);
        status = one > status ? one : status;
    }
    printf("%ld cases ran, %ld skipped%s\n", cases_ran, cases_skipped,
           status == OK ? "" : status == BROKE ? "; some broke a buffer (above)"
                                               : "; some were unusable (stderr)");
    return status;
}
