// The routing of a site's calls, in C++ (rtxops.runtime._dispatch_core).
//
// The Python wrapper (dispatcher.FunctionSite's, ModuleSite's) keeps the checks dynamo and
// compile sessions need, then calls Core.call(*args, **kwargs). It describes the call from the
// arguments themselves (a tensor's or parameter's dtype, device, flags, sizes and strides; None,
// bool, int, float and str values and tuples of ints; keyword names; grad mode) and looks the
// description up in a table the Python path fills. A hit times the route's function, records it
// through the recorder's ``record_since(slot, t0)`` (``record_cell[0]``) and hands its errors to
// the route's on_error as the Python path does. Anything else (a miss, an argument of another
// kind, a tensor subclass, autocast on, a thread running unrouted) goes to ``fallback``, the
// wrapper's Python path, which finds the route and inserts it. A description holds everything
// an op's call key reads, so it maps to one key's route.
//
// A module class's site (Core(..., module_reads=(parameter names, float names))) is called as
// its forward, ``call(module, *args, **kwargs)``. The module is described by its class, its
// ``training`` and its settings (``dispatcher._SETTINGS``) as its instance dict holds them, and
// the named parameters as its parameter table holds them; a float under one of the float names
// must be in its instance dict. Anything else about the module goes to ``fallback``.
//
// With a step's caches cold a call costs several µs less than the same work in Python
// (bench/dispatch_cold_sites.py, with and without RTXOPS_DISPATCH_CORE=0). The table is cleared
// whenever the site's routes change (clear()); insert() refuses a route looked up before the
// last clear (``version``).
#include <Python.h>
#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/python_variable.h>
#include <time.h>

#include <cstring>
#include <unordered_map>
#include <vector>

namespace {

constexpr size_t kMaxRoutes = 4096;  // past it the table starts over (see ROUTES_PER_SITE)

enum Tag : int64_t { kNone = -1, kTensor = -2, kParameter = -3, kBool = -4, kInt = -5, kFloat = -6,
                     kStr = -7, kTuple = -8, kSize = -9, kModule = -10 };

PyTypeObject* parameter_type = nullptr;
PyTypeObject* size_type = nullptr;   // torch.Size
PyObject* training_name = nullptr;     // interned attribute names a module's description reads
PyObject* parameters_name = nullptr;
PyObject* settings_name = nullptr;

struct Entry {
  PyObject* fn;                    // owned
  long slot;
  PyObject* on_error;              // owned, or nullptr: the route's errors propagate
  std::vector<int64_t> words;      // the description
  std::vector<PyObject*> strings;  // owned: its str arguments, then its keyword names, checked
                                   // by value on a hit (the words hold only their hashes)
  std::vector<PyObject*> held;     // owned: a module's class and settings, which the words name
                                   // by address (held, so no other object takes that address)
};

struct Description {   // the call at hand's; borrowed references
  std::vector<int64_t> words;
  std::vector<PyObject*> strings;
  std::vector<PyObject*> held;
};

struct CoreObject {
  PyObject_HEAD
  PyObject* unrouted;      // list [count of threads running unrouted]
  PyObject* record_cell;   // list [record_since]
  PyObject* fallback;
  PyObject* not_a_failure; // tuple of exception types raised through a route, never handled
  PyObject* module_params; // a module class's site: tuple of parameter names, else nullptr
  PyObject* module_floats; // and of attribute names, one of which holds a float
  std::unordered_map<uint64_t, Entry>* routes;
  uint64_t version;
  Description* scratch;    // for the call at hand
};

int64_t now_ns() {  // time.perf_counter_ns()'s clock on Linux
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

bool any_autocast() {
  for (auto device : at::autocast::_AUTOCAST_SUPPORTED_DEVICES) {
    if (at::autocast::is_autocast_enabled(device)) return true;
  }
  return false;
}

bool describe_string(PyObject* a, std::vector<int64_t>& out, std::vector<PyObject*>& strings) {
  Py_hash_t h = PyObject_Hash(a);   // a str caches its hash
  if (h == -1) {
    PyErr_Clear();
    return false;
  }
  out.push_back(kStr);
  out.push_back(h);
  strings.push_back(a);
  return true;
}

bool describe_int(PyObject* a, std::vector<int64_t>& out) {
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(a, &overflow);
  if (overflow || (v == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  out.push_back(kInt);
  out.push_back(v);
  return true;
}

// False: an argument the core does not describe (the Python path takes the call).
bool describe_arg(PyObject* a, std::vector<int64_t>& out, std::vector<PyObject*>& strings) {
  if (a == Py_None) {
    out.push_back(kNone);
    return true;
  }
  PyTypeObject* type = Py_TYPE(a);
  if (type == parameter_type || THPVariable_CheckExact(a)) {
    const at::Tensor& t = THPVariable_Unpack(a);
    if (t.layout() != at::kStrided || t.is_nested() ||
        t.unsafeGetTensorImpl()->has_symbolic_sizes_strides())
      return false;
    out.push_back(type == parameter_type ? kParameter : kTensor);
    out.push_back(static_cast<int64_t>(t.scalar_type()));
    out.push_back(static_cast<int64_t>(t.device().type()) * 1024 + t.device().index());
    out.push_back(t.requires_grad() | (t.is_inference() << 1) | (t.is_conj() << 2) | (t.is_neg() << 3));
    out.push_back(t.dim());
    for (int64_t s : t.sizes()) out.push_back(s);
    for (int64_t s : t.strides()) out.push_back(s);
    return true;
  }
  if (type == &PyBool_Type) {
    out.push_back(kBool);
    out.push_back(a == Py_True);
    return true;
  }
  if (type == &PyLong_Type) return describe_int(a, out);
  if (type == &PyUnicode_Type) return describe_string(a, out, strings);
  if (type == &PyTuple_Type || type == size_type) {   // of ints: a shape (layer_norm's)
    Py_ssize_t n = PyTuple_GET_SIZE(a);
    out.push_back(type == size_type ? kSize : kTuple);
    out.push_back(n);
    for (Py_ssize_t i = 0; i < n; i++) {
      PyObject* item = PyTuple_GET_ITEM(a, i);
      if (Py_TYPE(item) != &PyLong_Type || !describe_int(item, out)) return false;
    }
    return true;
  }
  if (type == &PyFloat_Type) {
    double d = PyFloat_AS_DOUBLE(a);
    int64_t bits;
    std::memcpy(&bits, &d, sizeof bits);
    out.push_back(kFloat);
    out.push_back(bits);
    return true;
  }
  return false;
}

// A module's instance-dict entry ``name``, borrowed, or nullptr (none, or an error: cleared).
PyObject* own_attribute(PyObject* dict, PyObject* name) {
  PyObject* value = PyDict_GetItemWithError(dict, name);
  if (value == nullptr) PyErr_Clear();
  return value;
}

bool describe_module_state(CoreObject* self, PyObject* dict, Description& d) {
  PyObject* training = own_attribute(dict, training_name);
  PyObject* settings = own_attribute(dict, settings_name);   // set by the module's first call
  PyObject* params = own_attribute(dict, parameters_name);
  if ((training != Py_True && training != Py_False) || settings == nullptr || params == nullptr ||
      !PyDict_Check(params))
    return false;
  bool has_float = false;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(self->module_floats) && !has_float; i++) {
    PyObject* value = own_attribute(dict, PyTuple_GET_ITEM(self->module_floats, i));
    has_float = value != nullptr && PyFloat_CheckExact(value);
  }
  if (!has_float) return false;
  d.words.push_back(training == Py_True);
  d.words.push_back(reinterpret_cast<intptr_t>(settings));
  d.held.push_back(settings);
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(self->module_params); i++) {
    PyObject* param = own_attribute(params, PyTuple_GET_ITEM(self->module_params, i));
    if (param == nullptr || param == Py_None || !describe_arg(param, d.words, d.strings)) return false;
  }
  return true;
}

bool describe_module(CoreObject* self, PyObject* module, Description& d) {
  PyObject* dict = PyObject_GenericGetDict(module, nullptr);
  if (dict == nullptr) {
    PyErr_Clear();
    return false;
  }
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(module));
  d.words.push_back(kModule);
  d.words.push_back(reinterpret_cast<intptr_t>(type));
  d.held.push_back(type);
  bool ok = PyDict_Check(dict) && describe_module_state(self, dict, d);
  Py_DECREF(dict);   // (the instance keeps it, and what the description borrows from it)
  return ok;
}

bool describe_args(CoreObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames,
                   Description& d) {
  Py_ssize_t n = PyVectorcall_NARGS(nargsf), nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  std::vector<int64_t>& out = d.words;
  std::vector<PyObject*>& strings = d.strings;
  out.clear();
  strings.clear();
  d.held.clear();
  out.push_back(n);
  out.push_back(nk);
  out.push_back(c10::GradMode::is_enabled());
  Py_ssize_t first = 0;
  if (self->module_params != nullptr) {   // called as the forward: the module, then its arguments
    if (n < 1 || !describe_module(self, args[0], d)) return false;
    first = 1;
  }
  for (Py_ssize_t i = first; i < n + nk; i++) {
    if (!describe_arg(args[i], out, strings)) return false;
  }
  for (Py_ssize_t i = 0; i < nk; i++) {
    if (!describe_string(PyTuple_GET_ITEM(kwnames, i), out, strings)) return false;
  }
  return true;
}

// A tensor whose metadata torch will not give (a functorch wrapper's strides, say) is left to the
// Python path, which reads it as the op's key does.
bool describe(CoreObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames,
              Description& d) {
  try {
    return describe_args(self, args, nargsf, kwnames, d);
  } catch (const std::exception&) {
    return false;
  }
}

uint64_t hash_of(const std::vector<int64_t>& words) {  // FNV-1a over the words
  uint64_t h = 1469598103934665603ULL;
  for (int64_t v : words) {
    h ^= static_cast<uint64_t>(v);
    h *= 1099511628211ULL;
  }
  return h;
}

bool same_strings(const Entry& e, const std::vector<PyObject*>& strings) {
  if (strings.size() != e.strings.size()) return false;
  for (size_t i = 0; i < strings.size(); i++) {
    if (strings[i] != e.strings[i] && PyUnicode_Compare(strings[i], e.strings[i]) != 0) {
      PyErr_Clear();
      return false;
    }
  }
  return true;
}

void drop(Entry& e) {
  Py_XDECREF(e.fn);
  Py_XDECREF(e.on_error);
  for (PyObject* string : e.strings) Py_DECREF(string);
  for (PyObject* object : e.held) Py_DECREF(object);
}

void clear_routes(CoreObject* self) {
  auto* routes = self->routes;
  self->routes = new std::unordered_map<uint64_t, Entry>();
  self->version++;
  for (auto& kv : *routes) drop(kv.second);   // may run Python code (a route's last reference)
  delete routes;
}

// The route raised: as the Python path's ``except _NOT_A_FAILURE: raise`` / ``except Exception as
// e: return on_error(e, args, kwargs)``; anything else propagates.
PyObject* handle_error(CoreObject* self, PyObject* on_error, PyObject* const* args, size_t nargsf,
                       PyObject* kwnames) {
  if (!PyErr_ExceptionMatches(PyExc_Exception) || PyErr_ExceptionMatches(self->not_a_failure))
    return nullptr;
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  PyErr_NormalizeException(&type, &value, &traceback);
  if (traceback != nullptr) PyException_SetTraceback(value, traceback);
  Py_XDECREF(type);
  Py_XDECREF(traceback);
  Py_ssize_t n = PyVectorcall_NARGS(nargsf), nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  PyObject* positional = PyTuple_New(n);
  PyObject* keywords = PyDict_New();
  PyObject* out = nullptr;
  if (positional != nullptr && keywords != nullptr) {
    for (Py_ssize_t i = 0; i < n; i++) {
      Py_INCREF(args[i]);
      PyTuple_SET_ITEM(positional, i, args[i]);
    }
    bool ok = true;
    for (Py_ssize_t i = 0; i < nk && ok; i++)
      ok = PyDict_SetItem(keywords, PyTuple_GET_ITEM(kwnames, i), args[n + i]) == 0;
    if (ok) out = PyObject_CallFunctionObjArgs(on_error, value, positional, keywords, nullptr);
  }
  Py_XDECREF(positional);
  Py_XDECREF(keywords);
  Py_DECREF(value);
  return out;
}

PyObject* Core_call(CoreObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  if (self->fallback == nullptr) {
    PyErr_SetString(PyExc_TypeError, "Core.__init__ was not called");
    return nullptr;
  }
  Description& d = *self->scratch;
  PyObject* count = PyList_GET_ITEM(self->unrouted, 0);
  if ((count != nullptr && PyObject_IsTrue(count)) || any_autocast() ||
      !describe(self, args, nargsf, kwnames, d)) {
    return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
  }
  auto it = self->routes->find(hash_of(d.words));
  if (it == self->routes->end() || it->second.words != d.words || !same_strings(it->second, d.strings))
    return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
  // the function may release the GIL or change the routes (clear()): nothing of the entry is
  // read after it returns
  PyObject* fn = it->second.fn;
  PyObject* on_error = it->second.on_error;
  long slot = it->second.slot;
  Py_INCREF(fn);
  Py_XINCREF(on_error);
  int64_t t0 = now_ns();
  PyObject* out = PyObject_Vectorcall(fn, args, nargsf, kwnames);
  Py_DECREF(fn);
  if (out == nullptr) {
    if (on_error == nullptr) return nullptr;
    out = handle_error(self, on_error, args, nargsf, kwnames);
    Py_DECREF(on_error);
    return out;
  }
  Py_XDECREF(on_error);
  if (slot < 0) return out;
  PyObject* record = PyList_GET_ITEM(self->record_cell, 0);
  PyObject* record_args[2] = {PyLong_FromLong(slot), PyLong_FromLongLong(t0)};
  PyObject* recorded = nullptr;
  if (record_args[0] != nullptr && record_args[1] != nullptr) {
    Py_INCREF(record);
    recorded = PyObject_Vectorcall(record, record_args, 2, nullptr);
    Py_DECREF(record);
  }
  Py_XDECREF(record_args[0]);
  Py_XDECREF(record_args[1]);
  if (recorded == nullptr) {
    Py_DECREF(out);
    return nullptr;
  }
  Py_DECREF(recorded);
  return out;
}

// insert(version, fn, slot, on_error, *args, **kwargs) -> bool: calls described as this one go
// to fn (recorded under slot; -1: the route records itself; its errors to on_error, None: they
// propagate), unless the routes changed since ``version`` was read.
PyObject* Core_insert(CoreObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  Py_ssize_t n = PyVectorcall_NARGS(nargsf);
  if (self->fallback == nullptr) {
    PyErr_SetString(PyExc_TypeError, "Core.__init__ was not called");
    return nullptr;
  }
  if (n < 4) {
    PyErr_SetString(PyExc_TypeError, "insert(version, fn, slot, on_error, *args, **kwargs)");
    return nullptr;
  }
  unsigned long long version = PyLong_AsUnsignedLongLong(args[0]);
  long slot = PyLong_AsLong(args[2]);
  if (PyErr_Occurred()) return nullptr;
  if (version != self->version || any_autocast()) Py_RETURN_FALSE;
  Description d;
  if (!describe(self, args + 4, static_cast<size_t>(n - 4), kwnames, d)) Py_RETURN_FALSE;
  if (self->routes->size() >= kMaxRoutes) clear_routes(self);
  Entry e{args[1], slot, args[3] == Py_None ? nullptr : args[3], d.words, d.strings, d.held};
  Py_INCREF(e.fn);
  Py_XINCREF(e.on_error);
  for (PyObject* string : e.strings) Py_INCREF(string);
  for (PyObject* object : e.held) Py_INCREF(object);
  uint64_t h = hash_of(e.words);
  auto it = self->routes->find(h);
  if (it != self->routes->end()) {   // the same description again, or a collision: the newest
    Entry old = it->second;
    it->second = e;
    drop(old);
  } else {
    self->routes->emplace(h, e);
  }
  Py_RETURN_TRUE;
}

PyObject* Core_clear(CoreObject* self, PyObject*) {
  clear_routes(self);
  Py_RETURN_NONE;
}

PyObject* Core_version(CoreObject* self, void*) { return PyLong_FromUnsignedLongLong(self->version); }

PyObject* Core_size(CoreObject* self, void*) { return PyLong_FromSize_t(self->routes->size()); }

int Core_init(CoreObject* self, PyObject* args, PyObject* kwds) {
  static const char* names[] = {"unrouted", "record_cell", "fallback", "not_a_failure",
                                "module_reads", nullptr};
  PyObject *unrouted, *record_cell, *fallback, *not_a_failure, *module_reads = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!OO!|O", const_cast<char**>(names), &PyList_Type,
                                   &unrouted, &PyList_Type, &record_cell, &fallback,
                                   &PyTuple_Type, &not_a_failure, &module_reads))
    return -1;
  if (PyList_GET_SIZE(unrouted) != 1 || PyList_GET_SIZE(record_cell) != 1) {
    PyErr_SetString(PyExc_ValueError, "unrouted and record_cell are one-item lists");
    return -1;
  }
  PyObject *module_params = nullptr, *module_floats = nullptr;
  if (module_reads != Py_None) {
    if (!PyArg_ParseTuple(module_reads, "O!O!", &PyTuple_Type, &module_params, &PyTuple_Type,
                          &module_floats))
      return -1;
    for (PyObject* names_tuple : {module_params, module_floats}) {
      for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(names_tuple); i++) {
        if (!PyUnicode_CheckExact(PyTuple_GET_ITEM(names_tuple, i))) {
          PyErr_SetString(PyExc_TypeError, "module_reads holds two tuples of names (str)");
          return -1;
        }
      }
    }
    Py_INCREF(module_params);
    Py_INCREF(module_floats);
  }
  Py_XSETREF(self->module_params, module_params);
  Py_XSETREF(self->module_floats, module_floats);
  Py_INCREF(unrouted);
  Py_INCREF(record_cell);
  Py_INCREF(fallback);
  Py_INCREF(not_a_failure);
  Py_XSETREF(self->not_a_failure, not_a_failure);
  Py_XSETREF(self->unrouted, unrouted);
  Py_XSETREF(self->record_cell, record_cell);
  Py_XSETREF(self->fallback, fallback);
  return 0;
}

PyObject* Core_new(PyTypeObject* type, PyObject*, PyObject*) {
  CoreObject* self = reinterpret_cast<CoreObject*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  self->routes = new std::unordered_map<uint64_t, Entry>();
  self->scratch = new Description();
  self->version = 0;
  return reinterpret_cast<PyObject*>(self);
}

int Core_traverse(CoreObject* self, visitproc visit, void* arg) {
  Py_VISIT(self->unrouted);
  Py_VISIT(self->record_cell);
  Py_VISIT(self->fallback);
  Py_VISIT(self->not_a_failure);
  Py_VISIT(self->module_params);
  Py_VISIT(self->module_floats);
  if (self->routes != nullptr) {
    for (auto& kv : *self->routes) {
      Py_VISIT(kv.second.fn);
      Py_VISIT(kv.second.on_error);
      for (PyObject* object : kv.second.held) Py_VISIT(object);
    }
  }
  return 0;
}

int Core_tp_clear(CoreObject* self) {
  Py_CLEAR(self->unrouted);
  Py_CLEAR(self->record_cell);
  Py_CLEAR(self->fallback);
  Py_CLEAR(self->not_a_failure);
  Py_CLEAR(self->module_params);
  Py_CLEAR(self->module_floats);
  if (self->routes != nullptr) clear_routes(self);
  return 0;
}

void Core_dealloc(CoreObject* self) {
  PyObject_GC_UnTrack(self);
  Core_tp_clear(self);
  delete self->routes;
  delete self->scratch;
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

PyMethodDef Core_methods[] = {
    {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Core_call)),
     METH_FASTCALL | METH_KEYWORDS, "Route a call (see the module's comment)."},
    {"insert", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Core_insert)),
     METH_FASTCALL | METH_KEYWORDS, "insert(version, fn, slot, on_error, *args, **kwargs) -> bool"},
    {"clear", reinterpret_cast<PyCFunction>(Core_clear), METH_NOARGS, "Forget every route."},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef Core_getset[] = {
    {"version", reinterpret_cast<getter>(Core_version), nullptr, "bumped by every clear()", nullptr},
    {"size", reinterpret_cast<getter>(Core_size), nullptr, "routes held", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject CoreType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_dispatch_core",
                          "The routing of a site's calls in C++.", -1, nullptr};

// ``module.name``, a type (a new reference), or nullptr with the error set.
PyTypeObject* torch_type(const char* module, const char* name) {
  PyObject* m = PyImport_ImportModule(module);
  if (m == nullptr) return nullptr;
  PyObject* type = PyObject_GetAttrString(m, name);
  Py_DECREF(m);
  if (type == nullptr) return nullptr;
  if (!PyType_Check(type)) {
    Py_DECREF(type);
    PyErr_Format(PyExc_TypeError, "%s.%s is not a type", module, name);
    return nullptr;
  }
  return reinterpret_cast<PyTypeObject*>(type);
}

}  // namespace

PyMODINIT_FUNC PyInit__dispatch_core(void) {
  CoreType.tp_name = "rtxops.runtime._dispatch_core.Core";
  CoreType.tp_basicsize = sizeof(CoreObject);
  CoreType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  CoreType.tp_doc =
      "Core(unrouted, record_cell, fallback, not_a_failure, module_reads=None): one site's routes.";
  CoreType.tp_new = Core_new;
  CoreType.tp_init = reinterpret_cast<initproc>(Core_init);
  CoreType.tp_dealloc = reinterpret_cast<destructor>(Core_dealloc);
  CoreType.tp_traverse = reinterpret_cast<traverseproc>(Core_traverse);
  CoreType.tp_clear = reinterpret_cast<inquiry>(Core_tp_clear);
  CoreType.tp_methods = Core_methods;
  CoreType.tp_getset = Core_getset;
  if (PyType_Ready(&CoreType) < 0) return nullptr;
  parameter_type = torch_type("torch.nn", "Parameter");   // both kept for the module's life
  if (parameter_type == nullptr) return nullptr;
  size_type = torch_type("torch", "Size");
  if (size_type == nullptr) return nullptr;
  training_name = PyUnicode_InternFromString("training");
  parameters_name = PyUnicode_InternFromString("_parameters");
  settings_name = PyUnicode_InternFromString("_rtxops_settings");   // dispatcher._SETTINGS
  if (training_name == nullptr || parameters_name == nullptr || settings_name == nullptr)
    return nullptr;
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  Py_INCREF(&CoreType);
  if (PyModule_AddObject(m, "Core", reinterpret_cast<PyObject*>(&CoreType)) < 0) {
    Py_DECREF(&CoreType);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
