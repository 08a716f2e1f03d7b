/* OpenTelemetry SDK ReadableSpans -> OTLP ExportTraceServiceRequest protobuf bytes.
 *
 * A fast path only, for the job's export thread: encode() writes the bytes the Python encoder
 * (rtxops/telemetry/encode.py) writes, which are the SDK exporters' own bytes, and returns None
 * for anything it does not mirror exactly -- links, trace state, resources that are equal but not
 * the same object, attribute values of other types, integers outside int64, strings that are not
 * UTF-8 encodable, any exception -- so the caller runs the Python encoder, which decides.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define FALLBACK (-1)
#define MAX_DEPTH 16   /* nested array values */
#define MAX_SCOPES 16

typedef struct { char *p; Py_ssize_t len, cap; } Buf;

static int buf_reserve(Buf *b, Py_ssize_t extra) {
    if (b->len + extra <= b->cap) return 0;
    Py_ssize_t cap = b->cap ? b->cap : 1024;
    while (cap < b->len + extra) cap *= 2;
    char *p = PyMem_Realloc(b->p, cap);
    if (!p) { PyErr_NoMemory(); return FALLBACK; }
    b->p = p; b->cap = cap;
    return 0;
}
static inline int put(Buf *b, const void *s, Py_ssize_t n) {
    if (!n) return 0;
    if (buf_reserve(b, n)) return FALLBACK;
    memcpy(b->p + b->len, s, n); b->len += n;
    return 0;
}
static inline int putc_(Buf *b, unsigned char c) {
    if (buf_reserve(b, 1)) return FALLBACK;
    b->p[b->len++] = (char)c;
    return 0;
}
static int varint(Buf *b, uint64_t v) {
    unsigned char tmp[10]; int n = 0;
    while (v >= 0x80) { tmp[n++] = (unsigned char)((v & 0x7F) | 0x80); v >>= 7; }
    tmp[n++] = (unsigned char)v;
    return put(b, tmp, n);
}
static int fixed64(Buf *b, uint64_t v) {
    unsigned char tmp[8];
    for (int i = 0; i < 8; i++) tmp[i] = (unsigned char)(v >> (8 * i));
    return put(b, tmp, 8);
}
static void buf_free(Buf *b) { PyMem_Free(b->p); b->p = NULL; b->len = b->cap = 0; }

/* a message field written where it is long: reserve, write the payload, then move it right
 * behind its real length prefix (the prefix's size is known only afterwards) */
typedef struct { Py_ssize_t at; } Mark;
static int open_field(Buf *b, unsigned char tag, Mark *m) {
    if (putc_(b, tag)) return FALLBACK;
    m->at = b->len;
    return 0;
}
static int close_field(Buf *b, Mark *m) {
    uint64_t n = (uint64_t)(b->len - m->at);
    unsigned char tmp[10]; int k = 0;
    uint64_t v = n;
    while (v >= 0x80) { tmp[k++] = (unsigned char)((v & 0x7F) | 0x80); v >>= 7; }
    tmp[k++] = (unsigned char)v;
    if (buf_reserve(b, k)) return FALLBACK;
    memmove(b->p + m->at + k, b->p + m->at, (size_t)n);
    memcpy(b->p + m->at, tmp, k);
    b->len += k;
    return 0;
}

static int str_utf8(PyObject *s, const char **p, Py_ssize_t *n) {
    if (!PyUnicode_Check(s)) return FALLBACK;
    *p = PyUnicode_AsUTF8AndSize(s, n);
    return *p ? 0 : FALLBACK;
}
/* `_string(tag, text)`: left out when empty or None */
static int string_field(Buf *b, unsigned char tag, PyObject *s) {
    if (s == Py_None) return 0;
    const char *p; Py_ssize_t n;
    if (str_utf8(s, &p, &n)) return FALLBACK;
    if (!n) return 0;
    if (putc_(b, tag) || varint(b, (uint64_t)n)) return FALLBACK;
    return put(b, p, n);
}

static int any_value(Buf *b, PyObject *v, int depth);

static int array_value(Buf *b, PyObject *seq, int depth) {
    if (depth > MAX_DEPTH) return FALLBACK;
    Mark outer;
    if (open_field(b, 0x2A, &outer)) return FALLBACK;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        Mark m;
        if (open_field(b, 0x0A, &m) || any_value(b, items[i], depth + 1) || close_field(b, &m))
            return FALLBACK;
    }
    return close_field(b, &outer);
}

/* AnyValue payload; the types and their order are those of encode.any_value */
static int any_value(Buf *b, PyObject *v, int depth) {
    if (v == Py_None) return 0;
    if (PyBool_Check(v)) {
        unsigned char out[2] = {0x10, v == Py_True};
        return put(b, out, 2);
    }
    if (PyUnicode_Check(v)) {
        const char *p; Py_ssize_t n;
        if (str_utf8(v, &p, &n) || putc_(b, 0x0A) || varint(b, (uint64_t)n)) return FALLBACK;
        return put(b, p, n);
    }
    if (PyLong_Check(v)) {
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow || (x == -1 && PyErr_Occurred())) return FALLBACK;
        return putc_(b, 0x18) || varint(b, (uint64_t)x) ? FALLBACK : 0;
    }
    if (PyFloat_Check(v)) {
        double d = PyFloat_AS_DOUBLE(v);
        uint64_t u; memcpy(&u, &d, 8);
        return putc_(b, 0x21) || fixed64(b, u) ? FALLBACK : 0;
    }
    if (PyBytes_Check(v)) {
        Py_ssize_t n = PyBytes_GET_SIZE(v);
        if (putc_(b, 0x3A) || varint(b, (uint64_t)n)) return FALLBACK;
        return put(b, PyBytes_AS_STRING(v), n);
    }
    if (PyTuple_Check(v) || PyList_Check(v)) {
        PyObject *seq = PySequence_Fast(v, "");
        if (!seq) return FALLBACK;
        int r = array_value(b, seq, depth);
        Py_DECREF(seq);
        return r;
    }
    return FALLBACK;  /* other Sequences, maps, foreign types: the Python encoder */
}

/* repeated KeyValue `tag` for each item of a mapping (None or empty: nothing) */
static int attributes(Buf *b, unsigned char tag, PyObject *mapping) {
    if (mapping == Py_None) return 0;
    PyObject *items = PyMapping_Items(mapping);
    if (!items) return FALLBACK;
    Py_ssize_t n = PyList_GET_SIZE(items);
    int r = 0;
    for (Py_ssize_t i = 0; i < n && !r; i++) {
        PyObject *kv = PyList_GET_ITEM(items, i);
        if (!PyTuple_Check(kv) || PyTuple_GET_SIZE(kv) != 2) { r = FALLBACK; break; }
        Mark m, value;
        r = open_field(b, tag, &m) || string_field(b, 0x0A, PyTuple_GET_ITEM(kv, 0))
            || open_field(b, 0x12, &value) || any_value(b, PyTuple_GET_ITEM(kv, 1), 0)
            || close_field(b, &value) || close_field(b, &m) ? FALLBACK : 0;
    }
    Py_DECREF(items);
    return r;
}

/* ---- attribute access ------------------------------------------------------------------ */

static PyObject *S_get_span_context, *S_parent, *S_name, *S_kind, *S_value, *S_start_time,
    *S_end_time, *S_attributes, *S_dropped_attributes, *S_events, *S_dropped_events,
    *S_dropped_links, *S_links, *S_status, *S_status_code, *S_description, *S_trace_id,
    *S_span_id, *S_trace_state, *S_is_remote, *S_timestamp, *S_resource,
    *S_instrumentation_scope, *S_version, *S_schema_url;

static int get(PyObject *o, PyObject *name, PyObject **out) {
    *out = PyObject_GetAttr(o, name);
    return *out ? 0 : FALLBACK;
}
/* a non-negative integer attribute (None counts as 0) */
static int get_u64(PyObject *o, PyObject *name, uint64_t *out) {
    PyObject *v;
    if (get(o, name, &v)) return FALLBACK;
    int r = 0;
    if (v == Py_None) *out = 0;
    else if (!PyLong_Check(v)) r = FALLBACK;
    else {
        *out = PyLong_AsUnsignedLongLong(v);
        if (*out == (uint64_t)-1 && PyErr_Occurred()) r = FALLBACK;
    }
    Py_DECREF(v);
    return r;
}
static int truthy(PyObject *o, PyObject *name, int *out) {
    PyObject *v;
    if (get(o, name, &v)) return FALLBACK;
    *out = PyObject_IsTrue(v);
    Py_DECREF(v);
    return *out < 0 ? FALLBACK : 0;
}
/* an int id as `bytes` bytes, big-endian; negative or too large: the Python encoder */
static int id_bytes(Buf *b, PyObject *ctx, PyObject *name, int bytes) {
    PyObject *v;
    if (get(ctx, name, &v)) return FALLBACK;
    unsigned char out[16];
    int r = !PyLong_Check(v)
#if PY_VERSION_HEX >= 0x030D0000
        || _PyLong_AsByteArray((PyLongObject *)v, out, (size_t)bytes, 0, 0, 1) < 0
#else
        || _PyLong_AsByteArray((PyLongObject *)v, out, (size_t)bytes, 0, 0) < 0
#endif
        ? FALLBACK : 0;
    Py_DECREF(v);
    return r ? FALLBACK : put(b, out, bytes);
}

static int event(Buf *b, PyObject *ev) {
    Mark m;
    uint64_t ts, dropped;
    PyObject *name = NULL, *attrs = NULL;
    int r = open_field(b, 0x5A, &m) || get_u64(ev, S_timestamp, &ts) ? FALLBACK : 0;
    if (!r && ts) r = putc_(b, 0x09) || fixed64(b, ts) ? FALLBACK : 0;
    if (!r) r = get(ev, S_name, &name) || string_field(b, 0x12, name) ? FALLBACK : 0;
    if (!r) r = get(ev, S_attributes, &attrs) ? FALLBACK : 0;
    if (!r) {
        int has = PyObject_IsTrue(attrs);
        r = has < 0 || (has && attributes(b, 0x1A, attrs)) ? FALLBACK : 0;
    }
    if (!r) r = get_u64(ev, S_dropped_attributes, &dropped) ? FALLBACK : 0;
    if (!r && dropped) r = putc_(b, 0x20) || varint(b, dropped) ? FALLBACK : 0;
    Py_XDECREF(name); Py_XDECREF(attrs);
    return r || close_field(b, &m) ? FALLBACK : 0;
}

static int status_field(Buf *b, PyObject *status) {
    if (status == Py_None) return 0;
    PyObject *code = NULL, *desc = NULL;
    uint64_t value = 0;
    int r = get(status, S_status_code, &code) || get_u64(code, S_value, &value)
            || get(status, S_description, &desc) ? FALLBACK : 0;
    if (!r) {
        int has_desc = desc == Py_None ? 0 : PyObject_IsTrue(desc);
        if (has_desc < 0) r = FALLBACK;
        else if (value || has_desc) {
            Mark m;
            r = open_field(b, 0x7A, &m) || (has_desc && string_field(b, 0x12, desc))
                || (value && (putc_(b, 0x18) || varint(b, value))) || close_field(b, &m) ? FALLBACK : 0;
        } else {
            r = put(b, "\x7a\x00", 2);
        }
    }
    Py_XDECREF(code); Py_XDECREF(desc);
    return r;
}

static int span(Buf *b, PyObject *sp) {
    PyObject *ctx = NULL, *parent = NULL, *tmp = NULL, *kind = NULL, *events = NULL,
             *status = NULL;
    int r = FALLBACK;
    Mark m;
    uint64_t u;
    int flag;
    if (truthy(sp, S_links, &flag) || flag) goto done;
    if (open_field(b, 0x12, &m)) goto done;
    ctx = PyObject_CallMethodNoArgs(sp, S_get_span_context);
    if (!ctx || get(sp, S_parent, &parent)) goto done;
    if (put(b, "\x0a\x10", 2) || id_bytes(b, ctx, S_trace_id, 16)
        || put(b, "\x12\x08", 2) || id_bytes(b, ctx, S_span_id, 8)) goto done;
    if (truthy(ctx, S_trace_state, &flag) || flag) goto done;  /* rare: the Python encoder */
    if (parent != Py_None && (put(b, "\x22\x08", 2) || id_bytes(b, parent, S_span_id, 8))) goto done;
    if (get(sp, S_name, &tmp) || string_field(b, 0x2A, tmp)) goto done;
    if (get(sp, S_kind, &kind) || get_u64(kind, S_value, &u) || u > 4) goto done;
    if (putc_(b, 0x30) || putc_(b, (unsigned char)(u + 1))) goto done;
    if (get_u64(sp, S_start_time, &u) || (u && (putc_(b, 0x39) || fixed64(b, u)))) goto done;
    if (get_u64(sp, S_end_time, &u) || (u && (putc_(b, 0x41) || fixed64(b, u)))) goto done;
    Py_CLEAR(tmp);
    if (get(sp, S_attributes, &tmp)) goto done;
    if ((flag = PyObject_IsTrue(tmp)) < 0 || (flag && attributes(b, 0x4A, tmp))) goto done;
    if (get_u64(sp, S_dropped_attributes, &u) || (u && (putc_(b, 0x50) || varint(b, u)))) goto done;
    if (get(sp, S_events, &events)) goto done;
    PyObject *seq = PySequence_Fast(events, "");
    if (!seq) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++)
        if (event(b, PySequence_Fast_GET_ITEM(seq, i))) { Py_DECREF(seq); goto done; }
    Py_DECREF(seq);
    if (get_u64(sp, S_dropped_events, &u) || (u && (putc_(b, 0x60) || varint(b, u)))) goto done;
    if (get_u64(sp, S_dropped_links, &u) || (u && (putc_(b, 0x70) || varint(b, u)))) goto done;
    if (get(sp, S_status, &status) || status_field(b, status)) goto done;
    int remote = 0;
    if (parent != Py_None && truthy(parent, S_is_remote, &remote)) goto done;
    if (put(b, remote ? "\x85\x01\x00\x03\x00\x00" : "\x85\x01\x00\x01\x00\x00", 6)) goto done;
    r = close_field(b, &m);
done:
    Py_XDECREF(ctx); Py_XDECREF(parent); Py_XDECREF(tmp); Py_XDECREF(kind);
    Py_XDECREF(events); Py_XDECREF(status);
    return r;
}

static int scope_field(Buf *b, PyObject *scope) {
    Mark m;
    if (open_field(b, 0x0A, &m)) return FALLBACK;
    if (scope != Py_None) {
        PyObject *name = NULL, *version = NULL, *attrs = NULL;
        int r = get(scope, S_name, &name) || string_field(b, 0x0A, name)
                || get(scope, S_version, &version) || string_field(b, 0x12, version)
                || get(scope, S_attributes, &attrs) ? FALLBACK : 0;
        if (!r) {
            int has = PyObject_IsTrue(attrs);
            r = has < 0 || (has && attributes(b, 0x1A, attrs)) ? FALLBACK : 0;
        }
        Py_XDECREF(name); Py_XDECREF(version); Py_XDECREF(attrs);
        if (r) return FALLBACK;
    }
    return close_field(b, &m);
}

typedef struct { PyObject *scope; Buf spans; } ScopeGroup;

static int encode_all(PyObject *seq, Buf *out) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (!n) return 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    ScopeGroup groups[MAX_SCOPES];
    int ngroups = 0, r = FALLBACK;
    PyObject *resource = NULL, *attrs = NULL, *schema = NULL;
    memset(groups, 0, sizeof groups);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *res, *scope;
        if (get(items[i], S_resource, &res)) goto done;
        if (!resource) resource = res;
        else {
            int same = res == resource;
            Py_DECREF(res);
            if (!same) goto done;  /* several resources: the Python encoder groups them */
        }
        if (get(items[i], S_instrumentation_scope, &scope)) goto done;
        int t = PyObject_IsTrue(scope);
        if (t < 0) { Py_DECREF(scope); goto done; }
        if (!t) { Py_DECREF(scope); scope = Py_NewRef(Py_None); }
        int g = 0;
        for (; g < ngroups; g++) {
            int eq = PyObject_RichCompareBool(groups[g].scope, scope, Py_EQ);
            if (eq < 0) { Py_DECREF(scope); goto done; }
            if (eq) break;
        }
        if (g == ngroups) {
            if (ngroups == MAX_SCOPES) { Py_DECREF(scope); goto done; }
            groups[ngroups++].scope = Py_NewRef(scope);
        }
        Py_DECREF(scope);
        if (span(&groups[g].spans, items[i])) goto done;
    }
    Mark rs, res_field;
    if (open_field(out, 0x0A, &rs) || open_field(out, 0x0A, &res_field)
        || get(resource, S_attributes, &attrs)) goto done;
    int has = PyObject_IsTrue(attrs);
    if (has < 0 || (has && attributes(out, 0x0A, attrs)) || close_field(out, &res_field)) goto done;
    for (int g = 0; g < ngroups; g++) {
        Mark ss;
        if (open_field(out, 0x12, &ss) || scope_field(out, groups[g].scope)
            || put(out, groups[g].spans.p, groups[g].spans.len)) goto done;
        if (groups[g].scope != Py_None) {
            PyObject *url;
            if (get(groups[g].scope, S_schema_url, &url)) goto done;
            int bad = string_field(out, 0x1A, url);
            Py_DECREF(url);
            if (bad) goto done;
        }
        if (close_field(out, &ss)) goto done;
    }
    if (get(resource, S_schema_url, &schema) || string_field(out, 0x1A, schema)
        || close_field(out, &rs)) goto done;
    r = 0;
done:
    for (int g = 0; g < ngroups; g++) { Py_XDECREF(groups[g].scope); buf_free(&groups[g].spans); }
    Py_XDECREF(resource); Py_XDECREF(attrs); Py_XDECREF(schema);
    return r;
}

static PyObject *encode(PyObject *self, PyObject *spans) {
    PyObject *seq = PySequence_Fast(spans, "spans must be a sequence");
    if (!seq) return NULL;
    Buf out = {0};
    int r = encode_all(seq, &out);
    Py_DECREF(seq);
    if (r) {
        buf_free(&out);
        PyErr_Clear();  /* whatever went wrong, the Python encoder meets it again and decides */
        Py_RETURN_NONE;
    }
    PyObject *body = PyBytes_FromStringAndSize(out.p ? out.p : "", out.len);
    buf_free(&out);
    return body;
}

static PyMethodDef methods[] = {
    {"encode", encode, METH_O,
     "encode(spans) -> bytes | None: the OTLP request for SDK ReadableSpans, or None (use the "
     "Python encoder)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_otlp_encode", NULL, -1, methods};

PyMODINIT_FUNC PyInit__otlp_encode(void) {
#define INTERN(var, text) if (!(var = PyUnicode_InternFromString(text))) return NULL;
    INTERN(S_get_span_context, "get_span_context") INTERN(S_parent, "parent")
    INTERN(S_name, "name") INTERN(S_kind, "kind") INTERN(S_value, "value")
    INTERN(S_start_time, "start_time") INTERN(S_end_time, "end_time")
    INTERN(S_attributes, "attributes") INTERN(S_dropped_attributes, "dropped_attributes")
    INTERN(S_events, "events") INTERN(S_dropped_events, "dropped_events")
    INTERN(S_dropped_links, "dropped_links") INTERN(S_links, "links") INTERN(S_status, "status")
    INTERN(S_status_code, "status_code") INTERN(S_description, "description")
    INTERN(S_trace_id, "trace_id") INTERN(S_span_id, "span_id") INTERN(S_trace_state, "trace_state")
    INTERN(S_is_remote, "is_remote") INTERN(S_timestamp, "timestamp") INTERN(S_resource, "resource")
    INTERN(S_instrumentation_scope, "instrumentation_scope") INTERN(S_version, "version")
    INTERN(S_schema_url, "schema_url")
#undef INTERN
    return PyModule_Create(&module);
}
