/* OTLP ExportTraceServiceRequest protobuf bytes -> Arrow-ready column buffers (rtxops spans).
 *
 * A fast path only: decode() returns None for anything it does not handle exactly like the
 * Python reference decoder (rtxops/telemetry/otlp.py) -- malformed input, repeated singular
 * fields, wrong wire types, links, duplicate attribute keys, typed attributes of another type,
 * deep nesting, invalid UTF-8 -- and the caller then runs the reference decoder, which either
 * produces the rows or raises the precise input error. It never accepts what the reference
 * rejects: every string field it meets is UTF-8 checked as upb would.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

#define FALLBACK (-1)
#define PYERR (-2)
#define MAX_DEPTH 32
#define MAX_SPAN_ATTRS 64  /* beyond: the reference (limit checks, duplicate keys) */
#define MAX_EVENTS 1024
#define N_TYPED_MAX 32

/* ---- growable buffers and columns ------------------------------------------------------ */

typedef struct { char *p; Py_ssize_t len, cap; } Buf;

static int buf_reserve(Buf *b, Py_ssize_t extra) {
    if (b->len + extra <= b->cap) return 0;
    Py_ssize_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + extra) cap *= 2;
    char *p = PyMem_Realloc(b->p, cap);
    if (!p) { PyErr_NoMemory(); return PYERR; }
    b->p = p; b->cap = cap;
    return 0;
}
static inline int buf_put(Buf *b, const void *s, Py_ssize_t n) {
    if (!n) return 0;  /* b->p may still be NULL */
    if (buf_reserve(b, n)) return PYERR;
    memcpy(b->p + b->len, s, n); b->len += n;
    return 0;
}
static inline int buf_putc(Buf *b, char c) {
    if (b->len >= b->cap && buf_reserve(b, 1)) return PYERR;
    b->p[b->len++] = c;
    return 0;
}
static void buf_free(Buf *b) { PyMem_Free(b->p); b->p = NULL; b->len = b->cap = 0; }

/* A column: values (int64/int32 data, or string bytes + int32 offsets) and one byte per row of
 * validity, packed into an Arrow bitmap at the end. */
typedef struct { Buf data, offsets, valid; Py_ssize_t n, nulls; int width; } Col;  /* width 0: string */

static int col_init(Col *c, int width) {
    memset(c, 0, sizeof *c);
    c->width = width;
    if (!width) { int32_t z = 0; return buf_put(&c->offsets, &z, 4); }
    return 0;
}
static inline int col_valid(Col *c, int v) {
    if (buf_putc(&c->valid, (char)v)) return PYERR;
    c->n++; c->nulls += !v;
    return 0;
}
static int col_str(Col *c, const char *s, Py_ssize_t n) {
    if (c->data.len + n > INT32_MAX) return FALLBACK;
    if (buf_put(&c->data, s, n)) return PYERR;
    int32_t off = (int32_t)c->data.len;
    if (buf_put(&c->offsets, &off, 4)) return PYERR;
    return col_valid(c, 1);
}
static int col_null(Col *c) {
    if (c->width) {
        if (buf_reserve(&c->data, c->width)) return PYERR;
        memset(c->data.p + c->data.len, 0, c->width); c->data.len += c->width;
    } else {
        int32_t off = (int32_t)c->data.len;
        if (buf_put(&c->offsets, &off, 4)) return PYERR;
    }
    return col_valid(c, 0);
}
static int col_i64(Col *c, int64_t v) {
    if (buf_put(&c->data, &v, 8)) return PYERR;
    return col_valid(c, 1);
}
static int col_i32(Col *c, int32_t v) {
    if (buf_put(&c->data, &v, 4)) return PYERR;
    return col_valid(c, 1);
}
/* End the current string value that was written straight into c->data. */
static int col_end_str(Col *c) {
    if (c->data.len > INT32_MAX) return FALLBACK;
    int32_t off = (int32_t)c->data.len;
    if (buf_put(&c->offsets, &off, 4)) return PYERR;
    return col_valid(c, 1);
}
static void col_free(Col *c) { buf_free(&c->data); buf_free(&c->offsets); buf_free(&c->valid); }

static PyObject *bytes_of(Buf *b) { return PyBytes_FromStringAndSize(b->p ? b->p : "", b->len); }

/* (validity bitmap or None, [offsets,] data, null count) */
static PyObject *col_export(Col *c) {
    PyObject *bitmap;
    if (c->nulls) {
        Py_ssize_t nb = (c->n + 7) / 8;
        bitmap = PyBytes_FromStringAndSize(NULL, nb);
        if (!bitmap) return NULL;
        unsigned char *m = (unsigned char *)PyBytes_AS_STRING(bitmap);
        memset(m, 0, nb);
        for (Py_ssize_t i = 0; i < c->n; i++) if (c->valid.p[i]) m[i >> 3] |= (unsigned char)(1 << (i & 7));
    } else {
        bitmap = Py_NewRef(Py_None);
    }
    if (c->width) return Py_BuildValue("(NNn)", bitmap, bytes_of(&c->data), c->nulls);
    return Py_BuildValue("(NNNn)", bitmap, bytes_of(&c->offsets), bytes_of(&c->data), c->nulls);
}

/* ---- protobuf reading ------------------------------------------------------------------ */

typedef struct { const uint8_t *p, *end; } Rd;
enum { VARINT = 0, I64 = 1, LEN = 2, I32 = 5 };

static inline int rd_varint(Rd *r, uint64_t *out) {
    uint64_t v = 0;
    for (int shift = 0; shift < 70; shift += 7) {
        if (r->p >= r->end) return FALLBACK;
        uint8_t b = *r->p++;
        if (shift == 63 && b > 1) return FALLBACK;
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) { *out = v; return 0; }
    }
    return FALLBACK;
}
static inline int rd_tag(Rd *r, uint32_t *field, int *wt) {
    uint64_t t;
    if (rd_varint(r, &t) || (t >> 3) == 0 || (t >> 3) > 0x1fffffff) return FALLBACK;
    *field = (uint32_t)(t >> 3); *wt = (int)(t & 7);
    return 0;
}
static inline int rd_len(Rd *r, Rd *sub) {
    uint64_t n;
    if (rd_varint(r, &n) || n > (uint64_t)(r->end - r->p)) return FALLBACK;
    sub->p = r->p; sub->end = r->p + n; r->p += n;
    return 0;
}
static inline int rd_fixed64(Rd *r, uint64_t *out) {
    if (r->end - r->p < 8) return FALLBACK;
    memcpy(out, r->p, 8); r->p += 8;  /* little-endian host (x86-64, aarch64) */
    return 0;
}
static int rd_skip(Rd *r, int wt) {
    uint64_t v; Rd s;
    switch (wt) {
    case VARINT: return rd_varint(r, &v);
    case I64: if (r->end - r->p < 8) return FALLBACK; r->p += 8; return 0;
    case LEN: return rd_len(r, &s);
    case I32: if (r->end - r->p < 4) return FALLBACK; r->p += 4; return 0;
    default: return FALLBACK;  /* groups: leave them to the reference */
    }
}

/* Strict UTF-8 (no overlongs, surrogates or code points past U+10FFFF), as upb checks it. */
static int utf8_ok(const uint8_t *s, Py_ssize_t n) {
    Py_ssize_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        if (c < 0x80) { i++; continue; }
        if (c >= 0xC2 && c <= 0xDF) {
            if (i + 1 >= n || (s[i + 1] & 0xC0) != 0x80) return 0;
            i += 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            if (i + 2 >= n) return 0;
            uint8_t c1 = s[i + 1];
            if ((c1 & 0xC0) != 0x80 || (s[i + 2] & 0xC0) != 0x80) return 0;
            if (c == 0xE0 && c1 < 0xA0) return 0;
            if (c == 0xED && c1 > 0x9F) return 0;
            i += 3;
        } else if (c >= 0xF0 && c <= 0xF4) {
            if (i + 3 >= n) return 0;
            uint8_t c1 = s[i + 1];
            if ((c1 & 0xC0) != 0x80 || (s[i + 2] & 0xC0) != 0x80 || (s[i + 3] & 0xC0) != 0x80) return 0;
            if (c == 0xF0 && c1 < 0x90) return 0;
            if (c == 0xF4 && c1 > 0x8F) return 0;
            i += 4;
        } else {
            return 0;
        }
    }
    return 1;
}

/* ---- JSON text, byte for byte as orjson writes it ---------------------------------------- */

static PyObject *g_dumps;  /* orjson.dumps: doubles are formatted by it */

static const char HEXD[] = "0123456789abcdef";

static int json_str(Buf *b, const uint8_t *s, Py_ssize_t n) {
    if (buf_reserve(b, n * 6 + 2)) return PYERR;
    char *o = b->p + b->len;
    *o++ = '"';
    for (Py_ssize_t i = 0; i < n; i++) {
        uint8_t c = s[i];
        if (c >= 0x20 && c != '"' && c != '\\') { *o++ = (char)c; continue; }
        *o++ = '\\';
        switch (c) {
        case '"': *o++ = '"'; break;
        case '\\': *o++ = '\\'; break;
        case '\b': *o++ = 'b'; break;
        case '\t': *o++ = 't'; break;
        case '\n': *o++ = 'n'; break;
        case '\f': *o++ = 'f'; break;
        case '\r': *o++ = 'r'; break;
        default: *o++ = 'u'; *o++ = '0'; *o++ = '0'; *o++ = HEXD[c >> 4]; *o++ = HEXD[c & 15];
        }
    }
    *o++ = '"';
    b->len = o - b->p;
    return 0;
}

static int json_i64(Buf *b, int64_t v) {
    char tmp[24], *e = tmp + sizeof tmp, *o = e;
    uint64_t u = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
    do { *--o = (char)('0' + u % 10); u /= 10; } while (u);
    if (v < 0) *--o = '-';
    return buf_put(b, o, e - o);
}

static int json_double(Buf *b, double d) {
    /* JSON has no NaN or infinities: written as protobuf's JSON mapping does (as strings) */
    if (isnan(d)) return buf_put(b, "\"NaN\"", 5);
    if (isinf(d)) return d > 0 ? buf_put(b, "\"Infinity\"", 10) : buf_put(b, "\"-Infinity\"", 11);
    PyObject *f = PyFloat_FromDouble(d);
    if (!f) return PYERR;
    PyObject *s = PyObject_CallOneArg(g_dumps, f);
    Py_DECREF(f);
    if (!s) return PYERR;
    int rc = buf_put(b, PyBytes_AS_STRING(s), PyBytes_GET_SIZE(s));
    Py_DECREF(s);
    return rc;
}

static const char B64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

static int json_base64(Buf *b, const uint8_t *s, Py_ssize_t n) {
    if (buf_reserve(b, (n + 2) / 3 * 4 + 2)) return PYERR;
    char *o = b->p + b->len;
    *o++ = '"';
    Py_ssize_t i = 0;
    for (; i + 2 < n; i += 3) {
        uint32_t v = (uint32_t)s[i] << 16 | (uint32_t)s[i + 1] << 8 | s[i + 2];
        *o++ = B64[v >> 18]; *o++ = B64[(v >> 12) & 63]; *o++ = B64[(v >> 6) & 63]; *o++ = B64[v & 63];
    }
    if (n - i == 1) {
        uint32_t v = (uint32_t)s[i] << 16;
        *o++ = B64[v >> 18]; *o++ = B64[(v >> 12) & 63]; *o++ = '='; *o++ = '=';
    } else if (n - i == 2) {
        uint32_t v = (uint32_t)s[i] << 16 | (uint32_t)s[i + 1] << 8;
        *o++ = B64[v >> 18]; *o++ = B64[(v >> 12) & 63]; *o++ = B64[(v >> 6) & 63]; *o++ = '=';
    }
    *o++ = '"';
    b->len = o - b->p;
    return 0;
}

/* ---- AnyValue ------------------------------------------------------------------------------ */

enum { AV_NONE = 0, AV_STR = 1, AV_BOOL = 2, AV_INT = 3, AV_DOUBLE = 4, AV_ARRAY = 5, AV_KVLIST = 6,
       AV_BYTES = 7 };

/* The one field of an AnyValue; more than one, or anything unknown: fallback. */
typedef struct { int kind; uint64_t num; Rd sub; } AnyV;

static int any_parse(Rd r, AnyV *v) {
    v->kind = AV_NONE;
    while (r.p < r.end) {
        uint32_t f; int wt;
        if (rd_tag(&r, &f, &wt) || v->kind != AV_NONE) return FALLBACK;
        switch (f) {
        case AV_STR: case AV_ARRAY: case AV_KVLIST: case AV_BYTES:
            if (wt != LEN || rd_len(&r, &v->sub)) return FALLBACK;
            if (f == AV_STR && !utf8_ok(v->sub.p, v->sub.end - v->sub.p)) return FALLBACK;
            break;
        case AV_BOOL: case AV_INT:
            if (wt != VARINT || rd_varint(&r, &v->num)) return FALLBACK;
            break;
        case AV_DOUBLE:
            if (wt != I64 || rd_fixed64(&r, &v->num)) return FALLBACK;
            break;
        default: return FALLBACK;
        }
        v->kind = (int)f;
    }
    return 0;
}

/* A KeyValue: exactly one key and one value field. */
typedef struct { Rd key, value; } KV;

static int kv_parse(Rd r, KV *kv) {
    int have_key = 0, have_value = 0;
    while (r.p < r.end) {
        uint32_t f; int wt;
        if (rd_tag(&r, &f, &wt)) return FALLBACK;
        if (f == 1) {
            if (wt != LEN || have_key || rd_len(&r, &kv->key)) return FALLBACK;
            if (!utf8_ok(kv->key.p, kv->key.end - kv->key.p)) return FALLBACK;
            have_key = 1;
        } else if (f == 2) {
            if (wt != LEN || have_value || rd_len(&r, &kv->value)) return FALLBACK;
            have_value = 1;
        } else {
            return FALLBACK;
        }
    }
    return have_key && have_value ? 0 : FALLBACK;
}

static inline int rd_eq(const Rd *a, const Rd *b) {
    Py_ssize_t n = a->end - a->p;
    return n == b->end - b->p && memcmp(a->p, b->p, n) == 0;
}

static int json_value(Buf *b, Rd raw, int depth);

/* Repeated KeyValue (field 1 of a KeyValueList, or a scope's/event's attributes) -> a JSON object.
 * ``field``: the KeyValue field number in ``r``; other fields are skipped as unknown. */
static int json_kvs(Buf *b, Rd r, uint32_t field, int depth, int *count) {
    KV kvs[MAX_SPAN_ATTRS];
    int n = 0;
    while (r.p < r.end) {
        uint32_t f; int wt; Rd sub;
        if (rd_tag(&r, &f, &wt)) return FALLBACK;
        if (f != field) { if (rd_skip(&r, wt)) return FALLBACK; continue; }
        if (wt != LEN || rd_len(&r, &sub) || n == MAX_SPAN_ATTRS || kv_parse(sub, &kvs[n])) return FALLBACK;
        for (int i = 0; i < n; i++) if (rd_eq(&kvs[i].key, &kvs[n].key)) return FALLBACK;
        n++;
    }
    *count = n;
    if (buf_putc(b, '{')) return PYERR;
    for (int i = 0; i < n; i++) {
        int rc;
        if (i && buf_putc(b, ',')) return PYERR;
        if ((rc = json_str(b, kvs[i].key.p, kvs[i].key.end - kvs[i].key.p))) return rc;
        if (buf_putc(b, ':')) return PYERR;
        if ((rc = json_value(b, kvs[i].value, depth))) return rc;
    }
    return buf_putc(b, '}');
}

static int json_value(Buf *b, Rd raw, int depth) {
    AnyV v;
    int rc, count;
    if (depth > MAX_DEPTH) return FALLBACK;
    if (any_parse(raw, &v)) return FALLBACK;
    switch (v.kind) {
    case AV_NONE: return buf_put(b, "null", 4);
    case AV_STR: return json_str(b, v.sub.p, v.sub.end - v.sub.p);
    case AV_BOOL: return v.num ? buf_put(b, "true", 4) : buf_put(b, "false", 5);
    case AV_INT: return json_i64(b, (int64_t)v.num);
    case AV_DOUBLE: { double d; memcpy(&d, &v.num, 8); return json_double(b, d); }
    case AV_BYTES: return json_base64(b, v.sub.p, v.sub.end - v.sub.p);
    case AV_KVLIST: return json_kvs(b, v.sub, 1, depth + 1, &count);
    case AV_ARRAY: {
        Rd r = v.sub;
        int first = 1;
        if (buf_putc(b, '[')) return PYERR;
        while (r.p < r.end) {
            uint32_t f; int wt; Rd sub;
            if (rd_tag(&r, &f, &wt) || f != 1 || wt != LEN || rd_len(&r, &sub)) return FALLBACK;
            if (!first && buf_putc(b, ',')) return PYERR;
            first = 0;
            if ((rc = json_value(b, sub, depth + 1))) return rc;
        }
        return buf_putc(b, ']');
    }
    }
    return FALLBACK;
}

/* ---- the request ------------------------------------------------------------------------- */

typedef struct {
    int n_typed;
    const char *typed_key[N_TYPED_MAX];
    Py_ssize_t typed_len[N_TYPED_MAX];
    int typed_int[N_TYPED_MAX];       /* 1: BIGINT column, 0: VARCHAR column */
    int n_hint;                       /* attributes of the JSON column also wanted as int64 columns */
    const char *hint_key[4];
    Py_ssize_t hint_len[4];
} Typed;

enum { C_TRACE, C_SPAN, C_PARENT, C_NAME, C_KIND, C_START, C_END, C_CODE, C_MESSAGE, N_FIXED };
enum { E_TRACE, E_SPAN, E_TIME, E_NAME, E_ATTRS, N_EVENT };

typedef struct {
    const Typed *typed;
    Col fixed[N_FIXED];
    Col typed_cols[N_TYPED_MAX];
    Col attrs;
    Col hints[4];
    int hints_exact;                  /* 0: a hinted attribute held something other than an int */
    Col events[N_EVENT];
    Buf scope_of_span;                /* int32 per span: index into scopes */
    PyObject *scopes;                 /* [(resource index, scope name or None)] */
    PyObject *resources;              /* [(raw Resource bytes, schema_url)] */
    Buf scratch;
} Out;

static int hex_col(Col *c, Rd id) {
    Py_ssize_t n = id.end - id.p;
    if (buf_reserve(&c->data, 2 * n)) return PYERR;
    char *o = c->data.p + c->data.len;
    for (Py_ssize_t i = 0; i < n; i++) { *o++ = HEXD[id.p[i] >> 4]; *o++ = HEXD[id.p[i] & 15]; }
    c->data.len += 2 * n;
    return col_end_str(c);
}

static int typed_index(const Typed *t, Rd key) {
    Py_ssize_t n = key.end - key.p;
    for (int i = 0; i < t->n_typed; i++)
        if (t->typed_len[i] == n && memcmp(t->typed_key[i], key.p, n) == 0) return i;
    return -1;
}

/* One event -> the events columns (ids are filled by the span once it has them). */
static int event(Out *o, Rd r) {
    uint64_t time = 0; Rd name = {NULL, NULL}; int seen_time = 0, seen_name = 0, rc, count;
    Rd attrs_region = r;
    while (r.p < r.end) {
        uint32_t f; int wt;
        if (rd_tag(&r, &f, &wt)) return FALLBACK;
        if (f == 1) {
            if (wt != I64 || seen_time++ || rd_fixed64(&r, &time)) return FALLBACK;
        } else if (f == 2) {
            if (wt != LEN || seen_name++ || rd_len(&r, &name)) return FALLBACK;
            if (!utf8_ok(name.p, name.end - name.p)) return FALLBACK;
        } else if (f == 3) {
            Rd s;
            if (wt != LEN || rd_len(&r, &s)) return FALLBACK;
        } else if (f == 4) {
            if (wt != VARINT || rd_skip(&r, wt)) return FALLBACK;
        } else if (rd_skip(&r, wt)) {
            return FALLBACK;
        }
    }
    if (time > (uint64_t)INT64_MAX) return FALLBACK;
    if ((rc = col_i64(&o->events[E_TIME], (int64_t)time))) return rc;
    if ((rc = col_str(&o->events[E_NAME], (const char *)(name.p ? name.p : (const uint8_t *)""),
                      name.p ? name.end - name.p : 0))) return rc;
    Col *a = &o->events[E_ATTRS];
    Py_ssize_t mark = a->data.len;
    if ((rc = json_kvs(&a->data, attrs_region, 3, 0, &count))) return rc;
    if (!count) { a->data.len = mark; return col_null(a); }
    return col_end_str(a);
}

static int span(Out *o, Rd r) {
    const Typed *t = o->typed;
    Rd trace = {0}, sid = {0}, parent = {0}, name = {0}, message = {0};
    uint64_t kind = 0, start = 0, end = 0, code = 0;
    unsigned seen = 0;
    KV kvs[MAX_SPAN_ATTRS];
    int n_kv = 0, n_events = 0, rc;
    Rd events_region = r;
#define ONCE(bit) do { if (seen & (1u << (bit))) return FALLBACK; seen |= 1u << (bit); } while (0)
    while (r.p < r.end) {
        uint32_t f; int wt; Rd s;
        if (rd_tag(&r, &f, &wt)) return FALLBACK;
        switch (f) {
        case 1: ONCE(1); if (wt != LEN || rd_len(&r, &trace)) return FALLBACK; break;
        case 2: ONCE(2); if (wt != LEN || rd_len(&r, &sid)) return FALLBACK; break;
        case 3: ONCE(3); if (wt != LEN || rd_len(&r, &s) || !utf8_ok(s.p, s.end - s.p)) return FALLBACK; break;
        case 4: ONCE(4); if (wt != LEN || rd_len(&r, &parent)) return FALLBACK; break;
        case 5: ONCE(5); if (wt != LEN || rd_len(&r, &name) || !utf8_ok(name.p, name.end - name.p)) return FALLBACK; break;
        case 6: ONCE(6); if (wt != VARINT || rd_varint(&r, &kind)) return FALLBACK; break;
        case 7: ONCE(7); if (wt != I64 || rd_fixed64(&r, &start)) return FALLBACK; break;
        case 8: ONCE(8); if (wt != I64 || rd_fixed64(&r, &end)) return FALLBACK; break;
        case 9:
            if (wt != LEN || rd_len(&r, &s) || n_kv == MAX_SPAN_ATTRS || kv_parse(s, &kvs[n_kv])) return FALLBACK;
            for (int i = 0; i < n_kv; i++) if (rd_eq(&kvs[i].key, &kvs[n_kv].key)) return FALLBACK;
            n_kv++;
            break;
        case 11:
            if (wt != LEN || rd_len(&r, &s) || ++n_events > MAX_EVENTS) return FALLBACK;
            break;
        case 10: case 12: case 14:
            if (wt != VARINT || rd_skip(&r, wt)) return FALLBACK;
            break;
        case 13: return FALLBACK;  /* links: the reference validates them */
        case 15: {
            ONCE(15);
            if (wt != LEN || rd_len(&r, &s)) return FALLBACK;
            unsigned sseen = 0;
            while (s.p < s.end) {
                uint32_t g; int w2;
                if (rd_tag(&s, &g, &w2)) return FALLBACK;
                if (g == 2) {
                    if (w2 != LEN || (sseen & 2) || rd_len(&s, &message)) return FALLBACK;
                    if (!utf8_ok(message.p, message.end - message.p)) return FALLBACK;
                    sseen |= 2;
                } else if (g == 3) {
                    if (w2 != VARINT || (sseen & 4) || rd_varint(&s, &code)) return FALLBACK;
                    sseen |= 4;
                } else if (rd_skip(&s, w2)) {
                    return FALLBACK;
                }
            }
            break;
        }
        case 16: ONCE(16); if (wt != I32 || rd_skip(&r, wt)) return FALLBACK; break;
        default: if (rd_skip(&r, wt)) return FALLBACK;
        }
    }
#undef ONCE
    if (trace.end - trace.p != 16 || sid.end - sid.p != 8) return FALLBACK;
    if (parent.end - parent.p != 0 && parent.end - parent.p != 8) return FALLBACK;
    if (start > (uint64_t)INT64_MAX || end > (uint64_t)INT64_MAX) return FALLBACK;
    if ((int64_t)kind != (int32_t)kind || (int64_t)code != (int32_t)code) return FALLBACK;

    /* attributes: typed ones to their columns (any other type: fallback), the rest to JSON */
    Rd typed_val[N_TYPED_MAX];
    int has_typed[N_TYPED_MAX] = {0};
    Col *a = &o->attrs;
    Py_ssize_t mark = a->data.len;
    int rest = 0;
    int hinted[4] = {0};
    for (int i = 0; i < n_kv; i++) {
        int ti = typed_index(t, kvs[i].key);
        if (ti >= 0) { has_typed[ti] = 1; typed_val[ti] = kvs[i].value; continue; }
        for (int h = 0; h < t->n_hint; h++) {
            Py_ssize_t kn = kvs[i].key.end - kvs[i].key.p;
            AnyV v;
            if (kn != t->hint_len[h] || memcmp(kvs[i].key.p, t->hint_key[h], kn)) continue;
            if (any_parse(kvs[i].value, &v)) return FALLBACK;
            if (v.kind == AV_INT) { if ((rc = col_i64(&o->hints[h], (int64_t)v.num))) return rc; hinted[h] = 1; }
            else if (v.kind != AV_NONE) o->hints_exact = 0;
        }
        if (buf_putc(&a->data, rest++ ? ',' : '{')) return PYERR;
        if ((rc = json_str(&a->data, kvs[i].key.p, kvs[i].key.end - kvs[i].key.p))) return rc;
        if (buf_putc(&a->data, ':')) return PYERR;
        if ((rc = json_value(&a->data, kvs[i].value, 0))) return rc;
    }
    for (int ti = 0; ti < t->n_typed; ti++) {
        Col *c = &o->typed_cols[ti];
        AnyV v;
        if (!has_typed[ti]) { if ((rc = col_null(c))) return rc; continue; }
        if (any_parse(typed_val[ti], &v)) return FALLBACK;
        if (v.kind == AV_NONE) rc = col_null(c);
        else if (t->typed_int[ti] && v.kind == AV_INT) rc = col_i64(c, (int64_t)v.num);
        else if (!t->typed_int[ti] && v.kind == AV_STR) rc = col_str(c, (const char *)v.sub.p, v.sub.end - v.sub.p);
        else return FALLBACK;  /* goes back to the JSON column in the reference */
        if (rc) return rc;
    }
    for (int h = 0; h < t->n_hint; h++)
        if (!hinted[h] && (rc = col_null(&o->hints[h]))) return rc;
    if (rest) {
        if (buf_putc(&a->data, '}')) return PYERR;
        if ((rc = col_end_str(a))) return rc;
    } else {
        a->data.len = mark;
        if ((rc = col_null(a))) return rc;
    }

    Col *fx = o->fixed;
    if ((rc = hex_col(&fx[C_TRACE], trace)) || (rc = hex_col(&fx[C_SPAN], sid))) return rc;
    if (parent.end - parent.p) { if ((rc = hex_col(&fx[C_PARENT], parent))) return rc; }
    else if ((rc = col_null(&fx[C_PARENT]))) return rc;
    if ((rc = col_str(&fx[C_NAME], (const char *)(name.p ? name.p : (const uint8_t *)""),
                      name.p ? name.end - name.p : 0))) return rc;
    if ((rc = col_i32(&fx[C_KIND], (int32_t)kind)) || (rc = col_i64(&fx[C_START], (int64_t)start))
        || (rc = col_i64(&fx[C_END], (int64_t)end)) || (rc = col_i32(&fx[C_CODE], (int32_t)code))) return rc;
    if (message.end - message.p) rc = col_str(&fx[C_MESSAGE], (const char *)message.p, message.end - message.p);
    else rc = col_null(&fx[C_MESSAGE]);
    if (rc) return rc;

    if (n_events) {
        Rd r2 = events_region;
        while (r2.p < r2.end) {
            uint32_t f; int wt; Rd s;
            if (rd_tag(&r2, &f, &wt)) return FALLBACK;
            if (f != 11) { if (rd_skip(&r2, wt)) return FALLBACK; continue; }
            if (rd_len(&r2, &s)) return FALLBACK;
            if ((rc = event(o, s))) return rc;
            if ((rc = hex_col(&o->events[E_TRACE], trace)) || (rc = hex_col(&o->events[E_SPAN], sid))) return rc;
        }
    }
    return 0;
}

static int scope_spans(Out *o, Rd r, Py_ssize_t resource_index) {
    Rd scope = {0}, name = {0};
    int have_scope = 0, rc, count;
    Py_ssize_t n_spans = 0;
    Rd whole = r;
    /* first pass: the scope (it may come after the spans) */
    while (r.p < r.end) {
        uint32_t f; int wt; Rd s;
        if (rd_tag(&r, &f, &wt)) return FALLBACK;
        if (f == 1) {
            if (wt != LEN || have_scope++ || rd_len(&r, &scope)) return FALLBACK;
        } else if (f == 2) {
            if (wt != LEN || rd_len(&r, &s)) return FALLBACK;
            n_spans++;
        } else if (f == 3) {
            if (wt != LEN || rd_len(&r, &s) || !utf8_ok(s.p, s.end - s.p)) return FALLBACK;
        } else if (rd_skip(&r, wt)) {
            return FALLBACK;
        }
    }
    if (have_scope) {
        unsigned seen = 0;
        Rd s = scope;
        while (s.p < s.end) {
            uint32_t f; int wt; Rd v;
            if (rd_tag(&s, &f, &wt)) return FALLBACK;
            if (f == 1 || f == 2) {
                if (wt != LEN || (seen & (1u << f)) || rd_len(&s, &v) || !utf8_ok(v.p, v.end - v.p)) return FALLBACK;
                seen |= 1u << f;
                if (f == 1) name = v;
            } else if (f == 3) {
                if (wt != LEN || rd_len(&s, &v)) return FALLBACK;
            } else if (rd_skip(&s, wt)) {
                return FALLBACK;
            }
        }
        /* scope attributes are not stored, but the reference parses (validates) them */
        o->scratch.len = 0;
        if ((rc = json_kvs(&o->scratch, scope, 3, 0, &count))) return rc;
    }
    if (!n_spans) return 0;
    PyObject *scope_name = name.end - name.p
        ? PyUnicode_DecodeUTF8((const char *)name.p, name.end - name.p, "strict") : Py_NewRef(Py_None);
    if (!scope_name) return PYERR;
    PyObject *item = Py_BuildValue("(nN)", resource_index, scope_name);
    if (!item || PyList_Append(o->scopes, item)) { Py_XDECREF(item); return PYERR; }
    Py_DECREF(item);
    int32_t scope_index = (int32_t)(PyList_GET_SIZE(o->scopes) - 1);
    r = whole;
    while (r.p < r.end) {
        uint32_t f; int wt; Rd s;
        if (rd_tag(&r, &f, &wt)) return FALLBACK;
        if (f != 2) { if (rd_skip(&r, wt)) return FALLBACK; continue; }
        if (rd_len(&r, &s)) return FALLBACK;
        if ((rc = span(o, s))) return rc;
        if ((rc = buf_put(&o->scope_of_span, &scope_index, 4))) return rc;
    }
    return 0;
}

static int resource_spans(Out *o, Rd r) {
    Rd resource = {0}, url = {0};
    int have_resource = 0, have_url = 0, rc;
    Rd whole = r;
    while (r.p < r.end) {
        uint32_t f; int wt; Rd s;
        if (rd_tag(&r, &f, &wt)) return FALLBACK;
        if (f == 1) {
            if (wt != LEN || have_resource++ || rd_len(&r, &resource)) return FALLBACK;
        } else if (f == 2) {
            if (wt != LEN || rd_len(&r, &s)) return FALLBACK;
        } else if (f == 3) {
            if (wt != LEN || have_url++ || rd_len(&r, &url) || !utf8_ok(url.p, url.end - url.p)) return FALLBACK;
        } else if (rd_skip(&r, wt)) {
            return FALLBACK;
        }
    }
    if (!have_resource) return FALLBACK;
    Py_ssize_t index = PyList_GET_SIZE(o->resources);
    PyObject *item = Py_BuildValue("(y#s#)", (const char *)resource.p, (Py_ssize_t)(resource.end - resource.p),
                                   (const char *)(url.p ? url.p : (const uint8_t *)""),
                                   (Py_ssize_t)(url.p ? url.end - url.p : 0));
    if (!item || PyList_Append(o->resources, item)) { Py_XDECREF(item); return PYERR; }
    Py_DECREF(item);
    r = whole;
    while (r.p < r.end) {
        uint32_t f; int wt; Rd s;
        if (rd_tag(&r, &f, &wt)) return FALLBACK;
        if (f != 2) { if (rd_skip(&r, wt)) return FALLBACK; continue; }
        if (rd_len(&r, &s)) return FALLBACK;
        if ((rc = scope_spans(o, s, index))) return rc;
    }
    return 0;
}

static int typed_from(PyObject *spec, PyObject *hints, Typed *t) {
    if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) > N_TYPED_MAX || !PyTuple_Check(hints)
        || PyTuple_GET_SIZE(hints) > 4) {
        PyErr_SetString(PyExc_TypeError, "typed: a tuple of (key, is_int) pairs; hints: up to 4 keys");
        return -1;
    }
    t->n_hint = (int)PyTuple_GET_SIZE(hints);
    for (int i = 0; i < t->n_hint; i++) {
        t->hint_key[i] = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(hints, i), &t->hint_len[i]);
        if (!t->hint_key[i]) return -1;
    }
    t->n_typed = (int)PyTuple_GET_SIZE(spec);
    for (int i = 0; i < t->n_typed; i++) {
        PyObject *pair = PyTuple_GET_ITEM(spec, i);
        const char *key; Py_ssize_t n; int is_int;
        if (!PyArg_ParseTuple(pair, "s#p", &key, &n, &is_int)) return -1;
        t->typed_key[i] = key; t->typed_len[i] = n; t->typed_int[i] = is_int;
    }
    return 0;
}

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer body;
    PyObject *spec, *hints, *result = NULL;
    Typed typed;
    if (!PyArg_ParseTuple(args, "y*OO", &body, &spec, &hints)) return NULL;
    if (typed_from(spec, hints, &typed)) { PyBuffer_Release(&body); return NULL; }
    Out o;
    memset(&o, 0, sizeof o);
    o.typed = &typed;
    static const int fixed_width[N_FIXED] = {0, 0, 0, 0, 4, 8, 8, 4, 0};
    static const int event_width[N_EVENT] = {0, 0, 8, 0, 0};
    int rc = 0;
    for (int i = 0; i < N_FIXED && !rc; i++) rc = col_init(&o.fixed[i], fixed_width[i]);
    for (int i = 0; i < typed.n_typed && !rc; i++) rc = col_init(&o.typed_cols[i], typed.typed_int[i] ? 8 : 0);
    for (int i = 0; i < N_EVENT && !rc; i++) rc = col_init(&o.events[i], event_width[i]);
    if (!rc) rc = col_init(&o.attrs, 0);
    for (int i = 0; i < typed.n_hint && !rc; i++) rc = col_init(&o.hints[i], 8);
    o.hints_exact = 1;
    o.scopes = PyList_New(0);
    o.resources = PyList_New(0);
    if (!o.scopes || !o.resources) rc = PYERR;

    Rd r = {(const uint8_t *)body.buf, (const uint8_t *)body.buf + body.len};
    while (!rc && r.p < r.end) {
        uint32_t f; int wt; Rd s;
        if (rd_tag(&r, &f, &wt)) { rc = FALLBACK; break; }
        if (f != 1) { rc = rd_skip(&r, wt); continue; }
        if (wt != LEN || rd_len(&r, &s)) { rc = FALLBACK; break; }
        rc = resource_spans(&o, s);
    }

    if (rc == FALLBACK) {
        result = Py_NewRef(Py_None);
    } else if (rc == 0) {
        PyObject *fixed = PyList_New(N_FIXED), *tcols = PyList_New(typed.n_typed), *ev = PyList_New(N_EVENT);
        PyObject *hcols = o.hints_exact ? PyList_New(typed.n_hint) : Py_NewRef(Py_None);
        if (hcols && hcols != Py_None) {
            for (int i = 0; i < typed.n_hint; i++) {
                PyObject *c = col_export(&o.hints[i]);
                if (!c) { Py_CLEAR(hcols); break; }
                PyList_SET_ITEM(hcols, i, c);
            }
        }
        if (fixed && tcols && ev && hcols) {
            int ok = 1;
            for (int i = 0; i < N_FIXED && ok; i++) { PyObject *c = col_export(&o.fixed[i]); if (!c) ok = 0; else PyList_SET_ITEM(fixed, i, c); }
            for (int i = 0; i < typed.n_typed && ok; i++) { PyObject *c = col_export(&o.typed_cols[i]); if (!c) ok = 0; else PyList_SET_ITEM(tcols, i, c); }
            for (int i = 0; i < N_EVENT && ok; i++) { PyObject *c = col_export(&o.events[i]); if (!c) ok = 0; else PyList_SET_ITEM(ev, i, c); }
            PyObject *attrs = ok ? col_export(&o.attrs) : NULL;
            if (attrs)
                result = Py_BuildValue("{s:n,s:N,s:N,s:N,s:n,s:N,s:O,s:O,s:N}",
                                       "spans", o.fixed[C_TRACE].n, "fixed", fixed, "typed", tcols,
                                       "attributes", attrs, "events_count", o.events[E_TIME].n,
                                       "events", ev, "scopes", o.scopes, "resources", o.resources,
                                       "hints", hcols);
            if (result) fixed = tcols = ev = hcols = NULL;
            else Py_XDECREF(attrs);
        }
        if (result) {
            PyObject *idx = bytes_of(&o.scope_of_span);
            if (!idx || PyDict_SetItemString(result, "scope_of_span", idx)) Py_CLEAR(result);
            Py_XDECREF(idx);
        }
        Py_XDECREF(fixed); Py_XDECREF(tcols); Py_XDECREF(ev); Py_XDECREF(hcols);
    }
    for (int i = 0; i < N_FIXED; i++) col_free(&o.fixed[i]);
    for (int i = 0; i < N_TYPED_MAX; i++) col_free(&o.typed_cols[i]);
    for (int i = 0; i < N_EVENT; i++) col_free(&o.events[i]);
    col_free(&o.attrs);
    for (int i = 0; i < 4; i++) col_free(&o.hints[i]);
    buf_free(&o.scope_of_span);
    buf_free(&o.scratch);
    Py_XDECREF(o.scopes);
    Py_XDECREF(o.resources);
    PyBuffer_Release(&body);
    return result;
}

/* Walk the repeated LEN field ``field`` of each message in ``r``, calling ``inner`` on each
   (or counting them when ``inner`` is NULL). Anything malformed stops the walk: the decoders
   then say what is wrong. */
typedef struct { uint64_t spans, events; } Rows;
static void walk(Rd r, uint32_t field, void (*inner)(Rd, Rows *), uint64_t *count, Rows *rows) {
    while (r.p < r.end) {
        uint32_t f; int wt; Rd s;
        if (rd_tag(&r, &f, &wt)) return;
        if (f == field && wt == LEN) {
            if (rd_len(&r, &s)) return;
            if (count) (*count)++;
            if (inner) inner(s, rows);
        } else if (rd_skip(&r, wt)) {
            return;
        }
    }
}
static void span_rows(Rd r, Rows *rows) { walk(r, 11, NULL, &rows->events, rows); }
static void scope_rows(Rd r, Rows *rows) { walk(r, 2, span_rows, &rows->spans, rows); }
static void resource_rows(Rd r, Rows *rows) { walk(r, 2, scope_rows, NULL, rows); }

static PyObject *count_rows(PyObject *self, PyObject *args) {
    Py_buffer body;
    if (!PyArg_ParseTuple(args, "y*", &body)) return NULL;
    Rows rows = {0, 0};
    Rd r = {(const uint8_t *)body.buf, (const uint8_t *)body.buf + body.len};
    Py_BEGIN_ALLOW_THREADS
    walk(r, 1, resource_rows, NULL, &rows);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&body);
    return Py_BuildValue("(KK)", (unsigned long long)rows.spans, (unsigned long long)rows.events);
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS,
     "decode(body, typed, hints) -> dict of column buffers, or None: use the reference decoder."},
    {"count_rows", count_rows, METH_VARARGS,
     "count_rows(body) -> (spans, events) of an OTLP trace request, allocating nothing per row."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_otlp_columns", NULL, -1, methods};

PyMODINIT_FUNC PyInit__otlp_columns(void) {
    PyObject *orjson = PyImport_ImportModule("orjson");
    if (!orjson) return NULL;
    g_dumps = PyObject_GetAttrString(orjson, "dumps");
    Py_DECREF(orjson);
    if (!g_dumps) return NULL;
    return PyModule_Create(&module);
}
