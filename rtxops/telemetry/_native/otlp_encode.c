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
        /* a tuple of its own: Python code run below cannot change or free its items */
        PyObject *seq = PySequence_Tuple(v);
        if (!seq) return FALLBACK;
        int r = array_value(b, seq, depth);
        Py_DECREF(seq);
        return r;
    }
    return FALLBACK;  /* other Sequences, maps, foreign types: the Python encoder */
}

static int key_value(Buf *b, unsigned char tag, PyObject *key, PyObject *value) {
    Mark m, inner;
    return open_field(b, tag, &m) || string_field(b, 0x0A, key) || open_field(b, 0x12, &inner)
           || any_value(b, value, 0) || close_field(b, &inner) || close_field(b, &m) ? FALLBACK : 0;
}

/* repeated KeyValue `tag` for each item of a mapping (None: nothing) */
static int attributes(Buf *b, unsigned char tag, PyObject *mapping) {
    if (mapping == Py_None) return 0;
    if (PyDict_CheckExact(mapping)) {
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(mapping, &pos, &k, &v)) {
            Py_INCREF(k); Py_INCREF(v);  /* a sequence's __iter__ may change the dict meanwhile */
            int r = key_value(b, tag, k, v);
            Py_DECREF(k); Py_DECREF(v);
            if (r) return FALLBACK;
        }
        return 0;
    }
    PyObject *items = PyMapping_Items(mapping);
    if (!items) return FALLBACK;
    Py_ssize_t n = PyList_GET_SIZE(items);
    int r = 0;
    for (Py_ssize_t i = 0; i < n && !r; i++) {
        PyObject *kv = PyList_GET_ITEM(items, i);
        r = !PyTuple_Check(kv) || PyTuple_GET_SIZE(kv) != 2
            || key_value(b, tag, PyTuple_GET_ITEM(kv, 0), PyTuple_GET_ITEM(kv, 1)) ? FALLBACK : 0;
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
static int long_bytes(Buf *b, PyObject *v, int bytes) {
    unsigned char out[16];
    if (!PyLong_Check(v)) return FALLBACK;
#if PY_VERSION_HEX >= 0x030D0000
    if (_PyLong_AsByteArray((PyLongObject *)v, out, (size_t)bytes, 0, 0, 1) < 0) return FALLBACK;
#else
    if (_PyLong_AsByteArray((PyLongObject *)v, out, (size_t)bytes, 0, 0) < 0) return FALLBACK;
#endif
    return put(b, out, bytes);
}
static int id_bytes(Buf *b, PyObject *ctx, PyObject *name, int bytes) {
    PyObject *v;
    if (get(ctx, name, &v)) return FALLBACK;
    int r = long_bytes(b, v, bytes);
    Py_DECREF(v);
    return r;
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

/* ---- a span's fields: from the SDK's own fields for its exact types, else its properties ---- */

/* set by configure(): ReadableSpan, SpanContext, Status, BoundedAttributes, BoundedList, the
 * SpanKind members in value order and the StatusCode members in value order */
static PyObject *T_span, *T_context, *T_status, *T_bounded_attrs, *T_bounded_list;
static PyObject *kinds[5], *codes[3];
static PyObject *S__name, *S__context, *S__parent, *S__kind, *S__start_time, *S__end_time,
    *S__attributes, *S__events, *S__links, *S__status, *S__resource, *S__instrumentation_scope,
    *S__status_code, *S__description, *S_dropped;

typedef struct {
    PyObject *ctx, *parent, *name, *attrs, *events, *status;  /* held through `refs` */
    uint64_t kind, start, end, dropped_attrs, dropped_events, dropped_links;
    PyObject *dict, *refs[16];
    int nrefs;
} View;

static void view_free(View *v) {
    Py_XDECREF(v->dict);
    for (int i = 0; i < v->nrefs; i++) Py_DECREF(v->refs[i]);
}
static int own(View *v, PyObject *o, PyObject **slot) {
    if (!o) return FALLBACK;
    v->refs[v->nrefs++] = o;
    *slot = o;
    return 0;
}
/* a new reference to dict[name], owned by `v` (Python code run later may rebind the field) */
static PyObject *field(View *v, PyObject *dict, PyObject *name) {
    PyObject *o = PyDict_GetItemWithError(dict, name);
    if (!o) return NULL;
    v->refs[v->nrefs++] = Py_NewRef(o);
    return o;
}
static int u64_of(PyObject *o, uint64_t *out) {
    if (o == Py_None) { *out = 0; return 0; }
    if (!PyLong_Check(o)) return FALLBACK;
    *out = PyLong_AsUnsignedLongLong(o);
    return *out == (uint64_t)-1 && PyErr_Occurred() ? FALLBACK : 0;
}
/* `.dropped` of a Bounded* container, else 0 (the SDK's dropped_* properties) */
static int dropped_of(PyObject *o, PyObject *bounded, uint64_t *out) {
    *out = 0;
    int is = PyObject_IsInstance(o, bounded);
    if (is <= 0) return is;
    PyObject *d = PyObject_GetAttr(o, S_dropped);
    if (!d) return FALLBACK;
    int r = u64_of(d, out);
    Py_DECREF(d);
    return r;
}
static int member_index(PyObject *o, PyObject **members, int n) {
    for (int i = 0; i < n; i++) if (members[i] == o) return i;
    return -1;
}

static int view_fields(View *v, PyObject *sp) {
    PyObject *d = v->dict = PyObject_GenericGetDict(sp, NULL);
    if (!d) return FALLBACK;
    PyObject *kind, *start, *end, *links;
    if (!(v->ctx = field(v, d, S__context)) || !(v->parent = field(v, d, S__parent))
        || !(v->name = field(v, d, S__name)) || !(kind = field(v, d, S__kind))
        || !(start = field(v, d, S__start_time)) || !(end = field(v, d, S__end_time))
        || !(v->attrs = field(v, d, S__attributes)) || !(v->events = field(v, d, S__events))
        || !(links = field(v, d, S__links)) || !(v->status = field(v, d, S__status))) return FALLBACK;
    int k = member_index(kind, kinds, 5), has_links = PyObject_IsTrue(links);
    if (k < 0 || has_links) return FALLBACK;
    v->kind = (uint64_t)k;
    if (u64_of(start, &v->start) || u64_of(end, &v->end)
        || dropped_of(v->attrs, T_bounded_attrs, &v->dropped_attrs)
        || dropped_of(v->events, T_bounded_list, &v->dropped_events)
        || dropped_of(links, T_bounded_list, &v->dropped_links)) return FALLBACK;
    int has_attrs = PyObject_IsTrue(v->attrs);  /* MappingProxyType(self._attributes or {}) */
    if (has_attrs < 0) return FALLBACK;
    if (!has_attrs) v->attrs = Py_None;
    return 0;
}

static int view_properties(View *v, PyObject *sp) {
    PyObject *kind, *links;
    uint64_t u;
    if (own(v, PyObject_GetAttr(sp, S_links), &links)) return FALLBACK;
    int has_links = PyObject_IsTrue(links);
    if (has_links) return FALLBACK;
    if (own(v, PyObject_CallMethodNoArgs(sp, S_get_span_context), &v->ctx)
        || own(v, PyObject_GetAttr(sp, S_parent), &v->parent)
        || own(v, PyObject_GetAttr(sp, S_name), &v->name)
        || own(v, PyObject_GetAttr(sp, S_kind), &kind) || get_u64(kind, S_value, &u) || u > 4)
        return FALLBACK;
    v->kind = u;
    if (get_u64(sp, S_start_time, &v->start) || get_u64(sp, S_end_time, &v->end)
        || own(v, PyObject_GetAttr(sp, S_attributes), &v->attrs)
        || get_u64(sp, S_dropped_attributes, &v->dropped_attrs)
        || own(v, PyObject_GetAttr(sp, S_events), &v->events)
        || get_u64(sp, S_dropped_events, &v->dropped_events)
        || get_u64(sp, S_dropped_links, &v->dropped_links)
        || own(v, PyObject_GetAttr(sp, S_status), &v->status)) return FALLBACK;
    int has_attrs = PyObject_IsTrue(v->attrs);
    if (has_attrs < 0) return FALLBACK;
    if (!has_attrs) v->attrs = Py_None;
    return 0;
}

/* the context's fields: tuple items for the SDK's own SpanContext */
static int context_ids(Buf *b, PyObject *ctx, int with_trace_id) {
    if (T_context && Py_TYPE(ctx) == (PyTypeObject *)T_context && PyTuple_GET_SIZE(ctx) >= 5) {
        PyObject *trace_id = PyTuple_GET_ITEM(ctx, 0), *span_id = PyTuple_GET_ITEM(ctx, 1);
        if (with_trace_id && (put(b, "\x0a\x10", 2) || long_bytes(b, trace_id, 16))) return FALLBACK;
        if (put(b, with_trace_id ? "\x12\x08" : "\x22\x08", 2) || long_bytes(b, span_id, 8)) return FALLBACK;
        if (with_trace_id) {
            int t = PyObject_IsTrue(PyTuple_GET_ITEM(ctx, 4));  /* trace_state */
            if (t) return FALLBACK;  /* rare: the Python encoder */
        }
        return 0;
    }
    if (with_trace_id) {
        int flag;
        if (put(b, "\x0a\x10", 2) || id_bytes(b, ctx, S_trace_id, 16) || put(b, "\x12\x08", 2)
            || id_bytes(b, ctx, S_span_id, 8) || truthy(ctx, S_trace_state, &flag) || flag)
            return FALLBACK;
        return 0;
    }
    return put(b, "\x22\x08", 2) || id_bytes(b, ctx, S_span_id, 8) ? FALLBACK : 0;
}
static int context_remote(PyObject *ctx, int *remote) {
    if (T_context && Py_TYPE(ctx) == (PyTypeObject *)T_context && PyTuple_GET_SIZE(ctx) >= 5) {
        *remote = PyObject_IsTrue(PyTuple_GET_ITEM(ctx, 2));
        return *remote < 0 ? FALLBACK : 0;
    }
    return truthy(ctx, S_is_remote, remote);
}

static int status_field(Buf *b, PyObject *status) {
    if (status == Py_None) return 0;
    PyObject *code = NULL, *desc = NULL;
    uint64_t value = 0;
    int r = 0;
    if (T_status && Py_TYPE(status) == (PyTypeObject *)T_status) {
        PyObject *d = PyObject_GenericGetDict(status, NULL);
        if (!d) return FALLBACK;
        code = PyDict_GetItemWithError(d, S__status_code);  /* compared by identity at once */
        desc = PyDict_GetItemWithError(d, S__description);
        int i = code ? member_index(code, codes, 3) : -1;
        Py_XINCREF(desc);
        Py_DECREF(d);
        if (i < 0 || !desc) { Py_XDECREF(desc); return FALLBACK; }
        value = (uint64_t)i;
        code = NULL;
    } else {
        r = get(status, S_status_code, &code) || get_u64(code, S_value, &value)
            || get(status, S_description, &desc) ? FALLBACK : 0;
    }
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
    View v;
    memset(&v, 0, sizeof v);
    Mark m;
    int r = FALLBACK, remote = 0;
    int fast = T_span && Py_TYPE(sp) == (PyTypeObject *)T_span;
    if (fast ? view_fields(&v, sp) : view_properties(&v, sp)) goto done;
    if (open_field(b, 0x12, &m) || context_ids(b, v.ctx, 1)) goto done;
    if (v.parent != Py_None && context_ids(b, v.parent, 0)) goto done;
    if (string_field(b, 0x2A, v.name) || putc_(b, 0x30) || putc_(b, (unsigned char)(v.kind + 1))) goto done;
    if (v.start && (putc_(b, 0x39) || fixed64(b, v.start))) goto done;
    if (v.end && (putc_(b, 0x41) || fixed64(b, v.end))) goto done;
    if (v.attrs != Py_None && attributes(b, 0x4A, v.attrs)) goto done;
    if (v.dropped_attrs && (putc_(b, 0x50) || varint(b, v.dropped_attrs))) goto done;
    PyObject *seq = PySequence_Tuple(v.events);  /* as the SDK's events property: tuple(_events) */
    if (!seq) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++)
        if (event(b, PySequence_Fast_GET_ITEM(seq, i))) { Py_DECREF(seq); goto done; }
    Py_DECREF(seq);
    if (v.dropped_events && (putc_(b, 0x60) || varint(b, v.dropped_events))) goto done;
    if (v.dropped_links && (putc_(b, 0x70) || varint(b, v.dropped_links))) goto done;
    if (status_field(b, v.status)) goto done;
    if (v.parent != Py_None && context_remote(v.parent, &remote)) goto done;
    if (put(b, remote ? "\x85\x01\x00\x03\x00\x00" : "\x85\x01\x00\x01\x00\x00", 6)) goto done;
    r = close_field(b, &m);
done:
    view_free(&v);
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

/* new references to a span's resource and instrumentation scope */
static int resource_and_scope(PyObject *sp, PyObject **res, PyObject **scope) {
    *res = *scope = NULL;
    if (T_span && Py_TYPE(sp) == (PyTypeObject *)T_span) {
        PyObject *d = PyObject_GenericGetDict(sp, NULL);
        if (!d) return FALLBACK;
        *res = Py_XNewRef(PyDict_GetItemWithError(d, S__resource));
        *scope = Py_XNewRef(PyDict_GetItemWithError(d, S__instrumentation_scope));
        Py_DECREF(d);
    } else {
        *res = PyObject_GetAttr(sp, S_resource);
        *scope = *res ? PyObject_GetAttr(sp, S_instrumentation_scope) : NULL;
    }
    if (*res && *scope) return 0;
    Py_XDECREF(*res); Py_XDECREF(*scope);
    return FALLBACK;
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
        if (resource_and_scope(items[i], &res, &scope)) goto done;
        if (!resource) resource = res;
        else {
            int same = res == resource;
            Py_DECREF(res);
            if (!same) { Py_DECREF(scope); goto done; }  /* several: the Python encoder groups them */
        }
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
    /* a list or tuple only: an iterator consumed here would reach the Python encoder empty */
    if (!PyList_Check(spans) && !PyTuple_Check(spans)) Py_RETURN_NONE;
    PyObject *seq = PySequence_Tuple(spans);  /* the caller's list may grow meanwhile */
    if (!seq) { PyErr_Clear(); Py_RETURN_NONE; }
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

static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *span, *context, *status, *bounded_attrs, *bounded_list, *kind_seq, *code_seq;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!OO", &PyType_Type, &span, &PyType_Type, &context,
                          &PyType_Type, &status, &PyType_Type, &bounded_attrs, &PyType_Type,
                          &bounded_list, &kind_seq, &code_seq)) return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)context, &PyTuple_Type)) {  /* read as a tuple */
        PyErr_SetString(PyExc_TypeError, "the span context type must be a tuple subclass");
        return NULL;
    }
    PyObject *k = PySequence_Tuple(kind_seq), *c = k ? PySequence_Tuple(code_seq) : NULL;
    if (!c || PyTuple_GET_SIZE(k) != 5 || PyTuple_GET_SIZE(c) != 3) {
        Py_XDECREF(k); Py_XDECREF(c);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "5 span kinds and 3 status codes, in value order");
        return NULL;
    }
    Py_XSETREF(T_span, Py_NewRef(span));
    Py_XSETREF(T_context, Py_NewRef(context));
    Py_XSETREF(T_status, Py_NewRef(status));
    Py_XSETREF(T_bounded_attrs, Py_NewRef(bounded_attrs));
    Py_XSETREF(T_bounded_list, Py_NewRef(bounded_list));
    for (int i = 0; i < 5; i++) Py_XSETREF(kinds[i], Py_NewRef(PyTuple_GET_ITEM(k, i)));
    for (int i = 0; i < 3; i++) Py_XSETREF(codes[i], Py_NewRef(PyTuple_GET_ITEM(c, i)));
    Py_DECREF(k); Py_DECREF(c);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(ReadableSpan, SpanContext, Status, BoundedAttributes, BoundedList, kinds, codes): "
     "the SDK types whose own fields encode() reads (their properties otherwise), and the SpanKind "
     "and StatusCode members in value order. Call once, before encode()."},
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
    INTERN(S__name, "_name") INTERN(S__context, "_context") INTERN(S__parent, "_parent")
    INTERN(S__kind, "_kind") INTERN(S__start_time, "_start_time") INTERN(S__end_time, "_end_time")
    INTERN(S__attributes, "_attributes") INTERN(S__events, "_events") INTERN(S__links, "_links")
    INTERN(S__status, "_status") INTERN(S__resource, "_resource")
    INTERN(S__instrumentation_scope, "_instrumentation_scope")
    INTERN(S__status_code, "_status_code") INTERN(S__description, "_description")
    INTERN(S_dropped, "dropped")
#undef INTERN
    return PyModule_Create(&module);
}
