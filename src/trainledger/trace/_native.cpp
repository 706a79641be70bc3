// The step tracer's per-op path, compiled (see _native.py for why it exists and how it is built).
//
// While a StepTracer is the innermost dispatch mode, every aten op reaches the Python dispatch key. PyTorch's
// fallback for that key converts the op's arguments to Python objects, calls the mode's __torch_dispatch__, which
// calls the op again from Python (its schema parsed again), and converts the results back: about 5 us an op on these
// machines before the tracer records anything. This file registers a kernel of its own at the Python key for each
// aten op, for as long as a tracer is attached. It does what the fallback would do, except when the top mode is an
// attached tracer and the op is an ordinary one (plain dense tensors, nothing the Python hook handles specially):
// then it records the event and the storages exactly as StepTracer.__torch_dispatch__ does, into the same Python
// objects (the events list, the storages dict, the _Storage records, the weak references that report frees), and
// runs the op below the mode without a trip through Python. Every other op, and every op of a tracer that is not
// attached, goes to __torch_dispatch__ as before.
//
// What counts as "exactly as __torch_dispatch__ does" is pinned by tests that trace the same steps both ways and
// compare every event and entry (tests/test_native_tracer.py).

#include <Python.h>
#include <structmember.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/GradMode.h>
#include <c10/core/SafePyObject.h>
#include <c10/core/ScalarType.h>
#include <c10/util/SmallVector.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/PyInterpreterHooks.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/utils/torch_dispatch_mode.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

namespace py = pybind11;
using c10::DispatchKey;
using c10::DispatchKeySet;
using c10::impl::TorchDispatchModeTLS;

// The keys above Python: what PyTorch's Python fallback excludes while the mode (or a subclass) runs.
constexpr DispatchKeySet kAbovePython = DispatchKeySet(DispatchKeySet::FULL) ^
    (DispatchKeySet(DispatchKeySet::FULL_AFTER, DispatchKey::Python) | DispatchKeySet(DispatchKey::Python));

// --- what the Python side hands over once (configure) ------------------------------------------------------------

// A class with __slots__ (a slotted dataclass), built without running its __init__: each field written at its slot's
// offset, the fields not given set to their defaults (the dataclass's own, handed over by the Python side).
struct SlotClass {
  PyTypeObject* type = nullptr;
  std::vector<Py_ssize_t> offsets;  // per field, in declaration order
  std::vector<py::object> defaults;  // per field; null where the field is required

  void set(PyTypeObject* t, const std::vector<std::pair<std::string, py::object>>& fields) {
    type = t;
    offsets.clear();
    defaults.clear();
    for (const auto& [name, value] : fields) {
      offsets.push_back(offset_of(name.c_str()));
      defaults.push_back(value);
    }
  }

  Py_ssize_t offset_of(const char* name) const {
    py::object descr = py::reinterpret_steal<py::object>(PyObject_GetAttrString(reinterpret_cast<PyObject*>(type), name));
    if (!descr) throw python_error();
    TORCH_CHECK(Py_IS_TYPE(descr.ptr(), &PyMemberDescr_Type), name, " is not a slot of ", type->tp_name);
    auto* member = reinterpret_cast<PyMemberDescrObject*>(descr.ptr())->d_member;
    TORCH_CHECK(member->type == T_OBJECT_EX, name, " is not an object slot");
    return member->offset;
  }

  // A new instance; `given` are the first fields' values (borrowed), the rest take their defaults.
  py::object make(PyObject* const* given, size_t count) const {
    PyObject* obj = type->tp_alloc(type, 0);
    if (obj == nullptr) throw python_error();
    for (size_t i = 0; i < offsets.size(); ++i) {
      PyObject* v = i < count ? given[i] : defaults[i].ptr();
      TORCH_CHECK(v != nullptr, "no value for a required field of ", type->tp_name);
      Py_INCREF(v);
      *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + offsets[i]) = v;
    }
    return py::reinterpret_steal<py::object>(obj);
  }
};

// Reads and writes one object slot (the field must be set: slots written by SlotClass::make or __init__ are).
inline PyObject* slot(PyObject* obj, Py_ssize_t offset) {
  return *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + offset);
}
inline void set_slot(PyObject* obj, Py_ssize_t offset, PyObject* value) {
  PyObject** at = reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + offset);
  PyObject* old = *at;
  Py_INCREF(value);
  *at = value;
  Py_XDECREF(old);
}

struct Config {
  SlotClass storage;  // _Storage
  py::object ref_type;  // _StorageRef (a weakref.ref subclass with slots key and rec)
  Py_ssize_t ref_key = 0, ref_rec = 0;  // their offsets
  Py_ssize_t rec_name = 0, rec_free_event = 0, rec_parameter = 0, rec_saved = 0, rec_category = 0, rec_owner = 0,
             rec_phase = 0;  // _Storage's
  py::object weights, frozen, gradients, optimizer_state;  // Category.WEIGHTS, .FROZEN, .GRADIENTS, .OPTIMIZER
  py::object detach;  // torch.ops.aten.detach.default
  py::object python_hook;  // StepTracer.__torch_dispatch__, the function
  py::object python_pack, python_unpack, python_detached;  // StepTracer.pack, .unpack, ._detached
  py::object parameter_type;  // torch.nn.Parameter
  Py_ssize_t rec_last_use_event = 0;
  py::object a_end_queued = name("_end_queued"), a_queue_backward_end = name("_queue_backward_end");
  // record's loop tracer: the phase of each op from where it runs (see loop_phase)
  py::object a_passthrough = name("passthrough"), a_after = name("after"), a_in_optimizer = name("in_optimizer"),
             a_closure_forward = name("closure_forward"), a_stack = name("stack");
  py::object zero_grad;  // "zero_grad"
  py::object accumulation_type;  // _Accumulation
  py::object category_other;  // Category.OTHER
  py::object describe;  // _native_plan(name, overload) -> tuple | None
  py::object dtype_name;  // (torch.dtype) -> str
  py::object parts_outputs;  // StepTracer._output(tracer, t, op, index, owner)
  py::object forward, backward, optimizer;  // the phase names
  py::object empty, captured, none_call, no_scope;  // "", "captured", NO_CALL, ("", NO_CALL)
  py::object a_phase = name("phase"), a_scope = name("scope"), a_labelled = name("_labelled"),
             a_numbers = name("_numbers"), a_owners = name("_owners"), a_outside = name("_outside"),
             a_backward_scope = name("backward_scope"), a_active = name("_active"),
             a_backward_ended_at = name("_backward_ended_at"), a_pauses = name("_pauses");

  // An attribute's name, interned as Python interns the names in its code (lookups compare them by identity first).
  static py::object name(const char* text) {
    PyObject* interned = PyUnicode_InternFromString(text);
    if (interned == nullptr) throw python_error();
    return py::reinterpret_steal<py::object>(interned);
  }
};
Config* g_config = nullptr;

// --- an attached tracer --------------------------------------------------------------------------------------

struct Tracer {
  PyObject* mode = nullptr;  // the StepTracer; owned (a reference held while attached)
  py::object ops, storages, refs, scopes, on_free, progress, writes, accumulations;
  py::object python_hook;  // its class's __torch_dispatch__: what the ops this path does not take go to
  // record's tracer: the phase of an op between modules by the last phase seen (record's _OUTSIDE), each op's phase
  // worked out from where it runs (loop_phase); None for trace's own
  py::object loop_phases = py::none();
  int64_t native_events = 0;  // events this path recorded (the rest went through __torch_dispatch__)
};
std::vector<std::unique_ptr<Tracer>> g_tracers;

Tracer* attached(PyObject* mode) {
  for (auto& t : g_tracers) {
    if (t->mode == mode) return t.get();
  }
  return nullptr;
}

// --- what is known of each op, asked of the Python side once per op -----------------------------------------------

enum class Test : int { kNone = 0, kBlasCopies = 1, kCastsAnOperand = 2, kCastsToItsDtype = 3, kReadsACopy = 4,
                        kStridesDiffer = 5, kIndexCopies = 6 };

struct OpPlan {
  bool native = false;  // false: every call goes through __torch_dispatch__
  py::object name;  // "aten.add.Tensor", as the events name it
  std::string utf8;  // the same, for the names of the storages the op makes
  bool allocates = false, foreach = false, accumulation = false;
  std::vector<int64_t> written;  // positions of the arguments it writes in place
  Test test = Test::kNone;
  std::vector<int64_t> positions;  // blas_copies: the operands' positions
  bool flag = false;  // casts_an_operand: divides; casts_to_its_dtype: an integer reduction
  int64_t out_arg = -1, rounding_arg = -1, dtype_arg = -1;  // schema positions of out=, rounding_mode=, dtype=
};
std::unordered_map<const c10::FunctionSchema*, OpPlan> g_plans;

int64_t argument_named(const c10::FunctionSchema& schema, const char* name) {
  const auto& args = schema.arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].name() == name) return static_cast<int64_t>(i);
  }
  return -1;
}

const OpPlan& plan_of(const c10::OperatorHandle& op) {
  const auto& schema = op.schema();
  auto found = g_plans.find(&schema);
  if (found != g_plans.end()) return found->second;
  OpPlan plan;
  py::object described = g_config->describe(schema.name(), schema.overload_name());
  if (!described.is_none()) {
    auto t = described.cast<py::tuple>();
    plan.native = true;
    plan.name = t[0];
    plan.utf8 = plan.name.cast<std::string>();
    plan.allocates = t[1].cast<bool>();
    plan.foreach = t[2].cast<bool>();
    for (auto p : t[3].cast<py::tuple>()) plan.written.push_back(p.cast<int64_t>());
    plan.accumulation = t[4].cast<bool>();
    plan.test = static_cast<Test>(t[5].cast<int>());
    py::object param = t[6];
    if (plan.test == Test::kBlasCopies) {
      for (auto p : param.cast<py::tuple>()) plan.positions.push_back(p.cast<int64_t>());
    } else if (plan.test == Test::kCastsAnOperand || plan.test == Test::kCastsToItsDtype) {
      plan.flag = param.cast<bool>();
    }
    plan.out_arg = argument_named(schema, "out");
    plan.rounding_arg = argument_named(schema, "rounding_mode");
    plan.dtype_arg = argument_named(schema, "dtype");
  }
  return g_plans.emplace(&schema, std::move(plan)).first->second;
}

// --- the kernel tests of trace/_kernels.py, on the stack's values ------------------------------------------------
// Each is the Python function of the same name read line by line; tests/test_native_tracer.py runs both on the same
// arguments. Python sees an op's positional arguments in `args` and its keyword-only ones in `kwargs`.

bool is_positional(const c10::FunctionSchema& schema, size_t i) {
  return !schema.arguments()[i].kwarg_only();
}

// A tensor as the Python hook sees one: a Python number the arguments parser wrapped as a 0-dim tensor reaches it as
// the number again (and is wrapped anew when it calls the op), so it is no tensor there, nor here.
bool is_tensor(const c10::IValue& v) {
  return v.isTensor() && v.toTensor().defined() && !v.toTensor().unsafeGetTensorImpl()->is_wrapped_number();
}

bool blas_reads(const c10::IValue& v) {
  if (!is_tensor(v)) return true;
  const auto& t = v.toTensor();
  auto stride = t.strides();
  auto shape = t.sizes();
  if (stride.size() < 2) return stride.empty() || stride[0] != 0 || shape[0] <= 1;
  auto a = stride[stride.size() - 2], b = stride[stride.size() - 1];
  if (b == 1 && a >= 1 && a >= shape[shape.size() - 1]) return true;
  return a == 1 && b >= 1 && b >= shape[shape.size() - 2];
}

bool onednn_dtype(c10::ScalarType d) {
  return d == c10::ScalarType::BFloat16 || d == c10::ScalarType::Half;
}

bool test_holds(const OpPlan& plan, const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args) {
  switch (plan.test) {
    case Test::kNone:
      return false;
    case Test::kBlasCopies: {
      for (auto i : plan.positions) {
        if (i < static_cast<int64_t>(args.size()) && is_positional(schema, i)) {
          const auto& v = args[i];
          if (!blas_reads(v) || (is_tensor(v) && onednn_dtype(v.toTensor().scalar_type()))) return true;
        }
      }
      return plan.out_arg >= 0 && !blas_reads(args[plan.out_arg]);
    }
    case Test::kCastsAnOperand: {
      bool have = false;
      c10::ScalarType dtype = c10::ScalarType::Undefined;
      for (size_t i = 0; i < args.size(); ++i) {
        if (!is_positional(schema, i) || !is_tensor(args[i])) continue;
        const auto& t = args[i].toTensor();
        if (t.dim() == 0) continue;
        if (!have) {
          have = true;
          dtype = t.scalar_type();
        } else if (t.scalar_type() != dtype) {
          return true;
        }
      }
      if (!plan.flag || !have || (plan.rounding_arg >= 0 && !args[plan.rounding_arg].isNone())) return false;
      return !c10::isFloatingType(dtype) && !c10::isComplexType(dtype) && dtype != c10::ScalarType::Bool;
    }
    case Test::kCastsToItsDtype: {
      if (args.empty() || !is_tensor(args[0])) return false;
      const auto kind = args[0].toTensor().scalar_type();
      if (plan.dtype_arg < 0 || args[plan.dtype_arg].isNone()) {
        return plan.flag && kind != c10::ScalarType::Long && !c10::isFloatingType(kind) && !c10::isComplexType(kind);
      }
      return kind != static_cast<c10::ScalarType>(args[plan.dtype_arg].toInt());
    }
    case Test::kReadsACopy: {
      for (const auto& v : args) {
        if (is_tensor(v) && !v.toTensor().is_contiguous()) return true;
      }
      return false;
    }
    case Test::kStridesDiffer: {
      const at::Tensor* first = nullptr;
      for (size_t i = 0; i < args.size(); ++i) {
        if (!is_positional(schema, i) || !is_tensor(args[i])) continue;
        const auto& t = args[i].toTensor();
        if (first == nullptr) {
          first = &t;
        } else if (t.strides() != first->strides()) {
          return true;
        }
      }
      return false;
    }
    case Test::kIndexCopies: {
      for (size_t i = 0; i < args.size(); ++i) {
        if (!is_positional(schema, i) || !is_tensor(args[i])) continue;
        const auto& t = args[i].toTensor();
        if (onednn_dtype(t.scalar_type())) return true;
        auto stride = t.strides();
        auto shape = t.sizes();
        for (size_t d = 0; d < stride.size(); ++d) {
          if (stride[d] == 0 && shape[d] > 1) return true;
        }
      }
      return false;
    }
  }
  return true;  // a test this file does not know: the Python hook decides
}

// --- small Python helpers ------------------------------------------------------------------------------------

py::object steal(PyObject* p) {
  if (p == nullptr) throw python_error();
  return py::reinterpret_steal<py::object>(p);
}

bool truthy(const py::object& value) {
  const int yes = PyObject_IsTrue(value.ptr());
  if (yes < 0) throw python_error();
  return yes == 1;
}

py::object attr(PyObject* obj, const py::object& name) {
  return steal(PyObject_GetAttr(obj, name.ptr()));
}

void set_attr(PyObject* obj, const py::object& name, const py::object& value) {
  if (PyObject_SetAttr(obj, name.ptr(), value.ptr()) < 0) throw python_error();
}

bool same_str(PyObject* a, const py::object& b) {
  return a == b.ptr() || (PyUnicode_Check(a) && PyUnicode_Compare(a, b.ptr()) == 0);
}

std::unordered_map<int, py::object> g_dtype_names;
std::unordered_map<std::string, py::object> g_device_names;

PyObject* dtype_name(c10::ScalarType d) {
  auto found = g_dtype_names.find(static_cast<int>(d));
  if (found == g_dtype_names.end()) {
    py::object dtype = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPDtype(d)));
    found = g_dtype_names.emplace(static_cast<int>(d), g_config->dtype_name(dtype)).first;
  }
  return found->second.ptr();
}

PyObject* device_name(const at::Tensor& t) {
  std::string name = t.is_cpu() ? "cpu" : t.device().str();
  auto found = g_device_names.find(name);
  if (found == g_device_names.end()) found = g_device_names.emplace(name, py::str(name)).first;
  return found->second.ptr();
}

// f"{prefix}{op}#{index}": a storage's name (printf-style formatting of Python strings costs several times more).
py::object storage_name(const char* prefix, const std::string& op, Py_ssize_t index) {
  std::string text = prefix;
  text.reserve(text.size() + op.size() + 24);
  text += op;
  text += '#';
  char digits[24];
  const int n = std::snprintf(digits, sizeof(digits), "%zd", index);
  text.append(digits, static_cast<size_t>(n));
  return steal(PyUnicode_FromStringAndSize(text.data(), static_cast<Py_ssize_t>(text.size())));
}

py::object storage_key(const at::Tensor& t) {
  return steal(PyLong_FromVoidPtr(t.storage().unsafeGetStorageImpl()));
}

// Whether the compiled path can take a tensor: dense, with one storage, and no Python subclass of its own
// (a fake tensor, a DTensor) whose __torch_dispatch__ must run.
bool plain(const at::Tensor& t) {
  return t.layout() == c10::kStrided && !t.is_nested() && t.has_storage() &&
      !t.unsafeGetTensorImpl()->key_set().has(DispatchKey::Python);
}

// Every tensor among `values` (an op's arguments or returns), lists flattened, in order: the tensors the Python hook
// finds with `tensors_of` (None, undefined tensors and wrapped numbers, which it sees as None or numbers, skipped).
using Tensors = c10::SmallVector<const at::Tensor*, 8>;  // an op's tensors: on the stack, no allocation

void tensors_in(c10::ArrayRef<c10::IValue> values, Tensors& out) {
  for (const auto& v : values) {
    if (v.isTensor()) {
      if (is_tensor(v)) out.push_back(&v.toTensor());
    } else if (v.isList()) {
      for (const auto& item : v.toListRef()) {
        if (is_tensor(item)) out.push_back(&item.toTensor());
      }
    }
  }
}

// StepTracer._track: a record for t's storage (new to the step, or first met as an input), and the weak
// reference that reports its free.
void track(Tracer& tr, const at::Tensor& t, const py::object& key, const py::object& name, PyObject* category,
           PyObject* role, PyObject* alloc_event, PyObject* owner, PyObject* first_seen, PyObject* phase) {
  const auto& storage = t.storage();
  auto sizes = t.sizes();
  py::object shape = steal(PyTuple_New(static_cast<Py_ssize_t>(sizes.size())));
  for (size_t i = 0; i < sizes.size(); ++i) {
    PyTuple_SET_ITEM(shape.ptr(), static_cast<Py_ssize_t>(i), steal(PyLong_FromLongLong(sizes[i])).release().ptr());
  }
  py::object nbytes = steal(PyLong_FromSize_t(storage.nbytes()));
  PyObject* fields[] = {name.ptr(), category, role, dtype_name(t.scalar_type()), nbytes.ptr(), device_name(t), owner,
                        shape.ptr(), alloc_event, phase, first_seen};
  py::object rec = g_config->storage.make(fields, 11);
  if (PyDict_SetItem(tr.storages.ptr(), key.ptr(), rec.ptr()) < 0) throw python_error();
  py::object st = steal(THPStorage_Wrap(storage));
  PyObject* ref_args[] = {st.ptr(), tr.on_free.ptr()};
  py::object ref = steal(PyObject_Vectorcall(g_config->ref_type.ptr(), ref_args, 2, nullptr));
  set_slot(ref.ptr(), g_config->ref_key, key.ptr());
  set_slot(ref.ptr(), g_config->ref_rec, rec.ptr());
  if (PyDict_SetItem(tr.refs.ptr(), key.ptr(), ref.ptr()) < 0) throw python_error();
}

// A C function's body, its C++ and Python errors turned into a Python exception (the caller is the interpreter).
template <class Body>
PyObject* to_python(Body&& body) {
  try {
    return body();
  } catch (python_error& e) {
    e.restore();
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// StepTracer._freed, for the weak references of a tracer the compiled path records: the storage's free event.
// `state` is what free_state() made: the tracer, its containers and its thread (none of them ever replaced).
enum FreeState { kTracer, kOps, kStorages, kFinished, kAfterBackward, kSettled, kElsewhere, kThread, kNumFreeState };

PyObject* freed(PyObject* state, PyObject* ref) {
  return to_python([&]() -> PyObject* {
    PyObject* rec = slot(ref, g_config->ref_rec);
    if (rec == nullptr || rec == Py_None) return Py_NewRef(Py_None);
    PyObject* tracer = PyTuple_GET_ITEM(state, kTracer);
    py::object active = attr(tracer, g_config->a_active);
    if (!PyObject_IsTrue(active.ptr())) return Py_NewRef(Py_None);
    py::object record = py::reinterpret_borrow<py::object>(rec);  // alive through this call
    py::object key = py::reinterpret_borrow<py::object>(slot(ref, g_config->ref_key));
    set_slot(ref, g_config->ref_rec, Py_None);
    // live through the last event that ran; no longer live from the next one
    const Py_ssize_t now = PyList_GET_SIZE(PyTuple_GET_ITEM(state, kOps));
    py::object free_event = steal(PyLong_FromSsize_t(now));
    set_slot(rec, g_config->rec_free_event, free_event.ptr());
    py::object ended = attr(tracer, g_config->a_backward_ended_at);
    if (PyLong_AsSsize_t(ended.ptr()) == now) {  // after backward's final callbacks, before any op
      if (PyList_Append(PyTuple_GET_ITEM(state, kAfterBackward), rec) < 0) throw python_error();
    }
    if (PyLong_AsUnsignedLong(PyTuple_GET_ITEM(state, kThread)) != PyThread_get_thread_ident()) {
      py::object pauses = attr(tracer, g_config->a_pauses);
      PyObject* into = PyTuple_GET_ITEM(state, PyObject_IsTrue(pauses.ptr()) ? kSettled : kElsewhere);
      if (PyList_Append(into, slot(rec, g_config->rec_name)) < 0) throw python_error();
    }
    PyObject* storages = PyTuple_GET_ITEM(state, kStorages);
    PyObject* current = PyDict_GetItemWithError(storages, key.ptr());
    if (current == nullptr && PyErr_Occurred()) throw python_error();
    // the dead reference stays in _refs until a new storage at this address replaces it or stop() clears them
    if (current == rec && PyDict_DelItem(storages, key.ptr()) < 0) throw python_error();
    if (PyList_Append(PyTuple_GET_ITEM(state, kFinished), rec) < 0) throw python_error();
    return Py_NewRef(Py_None);
  });
}

PyMethodDef g_freed_def = {"freed", reinterpret_cast<PyCFunction>(freed), METH_O,
                           "StepTracer._freed for the compiled path: a storage's free event."};

bool equal(PyObject* a, PyObject* b) {
  if (a == b) return true;
  const int same = PyObject_RichCompareBool(a, b, Py_EQ);
  if (same < 0) throw python_error();
  return same == 1;
}

py::object without_suffix(PyObject* text, const char* suffix) {
  py::object end = py::str(suffix);
  const Py_ssize_t n = PyUnicode_GetLength(text), k = PyUnicode_GetLength(end.ptr());
  if (n >= k && PyUnicode_Tailmatch(text, end.ptr(), 0, n, +1) == 1) return steal(PyUnicode_Substring(text, 0, n - k));
  return py::reinterpret_borrow<py::object>(text);
}

// _parameter_of: the parameter a storage belongs to, by what it was declared or marked as (``<param>``,
// ``<param>.grad``, ``optimizer.<param>.<slot>``, ``.master`` copies), or the owner of a temporary the optimizer step
// made for one parameter; "" for anything else.
py::object parameter_named(PyObject* rec) {
  PyObject* category = slot(rec, g_config->rec_category);
  PyObject* name = slot(rec, g_config->rec_name);
  if (equal(category, g_config->weights.ptr()) || equal(category, g_config->frozen.ptr())) {
    return py::reinterpret_borrow<py::object>(name);
  }
  if (equal(category, g_config->gradients.ptr())) {
    py::object stem = without_suffix(name, ".grad");
    return without_suffix(stem.ptr(), ".master");
  }
  if (equal(category, g_config->optimizer_state.ptr())) {
    py::object prefix = py::str("optimizer.");
    const Py_ssize_t n = PyUnicode_GetLength(name);
    Py_ssize_t start = 0;
    if (PyUnicode_Tailmatch(name, prefix.ptr(), 0, n, -1) == 1) start = PyUnicode_GetLength(prefix.ptr());
    const Py_ssize_t dot = PyUnicode_FindChar(name, '.', start, n, -1);  // rpartition(".")[0]
    py::object head = dot < 0 ? g_config->empty : steal(PyUnicode_Substring(name, start, dot));
    return without_suffix(head.ptr(), ".master");
  }
  if (category == Py_None && equal(slot(rec, g_config->rec_phase), g_config->optimizer.ptr())) {
    return py::reinterpret_borrow<py::object>(slot(rec, g_config->rec_owner));
  }
  return g_config->empty;
}

// StepTracer._parameter for a tracked record: its parameter's name, worked out once per storage.
py::object parameter_of(PyObject* rec) {
  PyObject* name = slot(rec, g_config->rec_parameter);
  if (name != nullptr && name != Py_None) return py::reinterpret_borrow<py::object>(name);
  py::object computed = parameter_named(rec);
  set_slot(rec, g_config->rec_parameter, computed.ptr());
  return computed;
}

// ModuleScopes.backward_scope, read off the same lists; what it does for labelled nodes and AccumulateGrad (which
// needs the parameter's Python object) is left to it.
py::object backward_scope(Tracer& tr) {
  auto node = torch::autograd::get_current_node();
  if (!node) return g_config->no_scope;
  py::object labelled = attr(tr.scopes.ptr(), g_config->a_labelled);
  const uint64_t number = node->sequence_nr();
  if (PyObject_IsTrue(labelled.ptr()) || number == UINT64_MAX) {
    return steal(PyObject_CallMethodNoArgs(tr.scopes.ptr(), g_config->a_backward_scope.ptr()));
  }
  py::object numbers = attr(tr.scopes.ptr(), g_config->a_numbers);
  Py_ssize_t lo = 0, hi = PyList_GET_SIZE(numbers.ptr());
  while (lo < hi) {  // bisect_right
    Py_ssize_t mid = (lo + hi) / 2;
    const uint64_t at = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(numbers.ptr(), mid));
    if (at == static_cast<uint64_t>(-1) && PyErr_Occurred()) throw python_error();
    if (number < at) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  if (lo == 0) return attr(tr.scopes.ptr(), g_config->a_outside);
  py::object owners = attr(tr.scopes.ptr(), g_config->a_owners);
  return py::reinterpret_borrow<py::object>(PyList_GET_ITEM(owners.ptr(), lo - 1));
}

// --- the kernel ------------------------------------------------------------------------------------------

// What PyTorch's Python fallback does when no mode is set: a tensor subclass's __torch_dispatch__, or, with none
// among the arguments, the op below the Python key.
void subclass_fallback(const c10::OperatorHandle& op, DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto num_arguments = op.schema().arguments().size();
  bool python_tensors = false;
  for (const auto& v : torch::jit::last(*stack, num_arguments)) {
    if (v.isTensor()) {
      python_tensors |= v.unsafeToTensorImpl()->key_set().has(DispatchKey::Python);
    } else if (v.isTensorList() || v.isOptionalTensorList()) {
      for (const auto& item : v.toListRef()) {
        if (!item.isNone()) python_tensors |= item.unsafeToTensorImpl()->key_set().has(DispatchKey::Python);
      }
    }
  }
  if (python_tensors) {
    (*c10::impl::getGlobalPyInterpreter())->dispatch(op, stack);
    return;
  }
  auto local = c10::impl::tls_local_dispatch_key_set();
  c10::impl::ForceDispatchKeyGuard no_python(local.included_.remove(DispatchKey::Python), local.excluded_);
  op.redispatchBoxed(keys.remove(DispatchKey::Python), stack);
}

// The record (or None) of t's storage, as the tracer's storages dict holds it (borrowed).
PyObject* record_of(Tracer& tr, const at::Tensor& t) {
  py::object key = storage_key(t);
  PyObject* rec = PyDict_GetItemWithError(tr.storages.ptr(), key.ptr());
  if (rec == nullptr && PyErr_Occurred()) throw python_error();
  return rec;
}

// _dense: whether the engine could add into t in place (it holds its storage alone).
bool dense(const at::Tensor& t) {
  return !t.is_view() && t.is_contiguous() && t.storage_offset() == 0 && t.storage().nbytes() == t.nbytes();
}

// _after_op's accumulation: a backward `add` that may be the engine adding two gradients (see _fold_accumulations).
void note_accumulation(Tracer& tr, c10::ArrayRef<c10::IValue> args, const c10::IValue& out, PyObject* index) {
  if (args.size() < 2 || !is_tensor(args[0]) || !is_tensor(args[1]) || !is_tensor(out)) return;  // _same_meta
  const auto &a = args[0].toTensor(), &b = args[1].toTensor(), &o = out.toTensor();
  if (a.layout() != c10::kStrided || b.layout() != c10::kStrided || o.layout() != c10::kStrided) return;
  if (a.sizes() != b.sizes() || a.sizes() != o.sizes() || a.scalar_type() != b.scalar_type() ||
      a.scalar_type() != o.scalar_type()) {
    return;
  }
  auto or_none = [](PyObject* rec) { return rec != nullptr ? rec : Py_None; };
  py::object operands = steal(PyTuple_Pack(2, or_none(record_of(tr, a)), or_none(record_of(tr, b))));
  py::object denseness = steal(PyTuple_Pack(2, dense(a) ? Py_True : Py_False, dense(b) ? Py_True : Py_False));
  PyObject* fields[] = {index, operands.ptr(), denseness.ptr(), or_none(record_of(tr, o))};
  py::object acc = steal(PyObject_Vectorcall(g_config->accumulation_type.ptr(), fields, 4, nullptr));
  if (PyList_Append(tr.accumulations.ptr(), acc.ptr()) < 0) throw python_error();
}

// record's _LoopTracer.__torch_dispatch__, before it records: the phase of the op from where it runs (the loop is
// the user's, so no caller announces the phases). In backward when autograd runs a node; in forward inside one of
// the model's modules; in the optimizer step inside optimizer.step() (save the loss a closure computes); between
// modules, the phase after the last one seen (the loss after forward; unscale_ and clipping after backward).
void loop_phase(Tracer& tr) {
  PyObject* mode = tr.mode;
  if (torch::autograd::get_current_node()) {
    set_attr(mode, g_config->a_phase, g_config->backward);
    set_attr(mode, g_config->a_after, g_config->backward);
  } else if (PyList_GET_SIZE(attr(tr.scopes.ptr(), g_config->a_stack).ptr()) > 0) {
    set_attr(mode, g_config->a_phase, g_config->forward);
    set_attr(mode, g_config->a_after, g_config->forward);
    set_attr(mode, g_config->a_closure_forward, attr(mode, g_config->a_in_optimizer));
  } else {
    py::object after = attr(mode, g_config->a_after);
    if (truthy(attr(mode, g_config->a_in_optimizer)) &&
        !(truthy(attr(mode, g_config->a_closure_forward)) && equal(after.ptr(), g_config->forward.ptr()))) {
      set_attr(mode, g_config->a_phase, g_config->optimizer);
    } else {
      PyObject* next = PyDict_GetItemWithError(tr.loop_phases.ptr(), after.ptr());
      if (next == nullptr && PyErr_Occurred()) throw python_error();
      set_attr(mode, g_config->a_phase, next != nullptr ? py::reinterpret_borrow<py::object>(next) : g_config->zero_grad);
    }
  }
}

// The op run below the mode, unrecorded (record's passthrough: a compiled backward's ops).
void run_unseen(const c10::OperatorHandle& op, torch::jit::Stack* stack, bool stashed) {
  std::optional<torch::torch_dispatch_mode::StashTorchDispatchModeGuard> stash;
  if (!stashed) stash.emplace();
  PyThreadState* saved = PyEval_SaveThread();
  try {
    op.callBoxed(stack);
  } catch (...) {
    PyEval_RestoreThread(saved);
    throw;
  }
  PyEval_RestoreThread(saved);
}

// _optimizer_inputs: the one parameter an optimizer op works on ("" for none or several), and its untracked tensors
py::object optimizer_parameter(Tracer& tr, const Tensors& inputs, Tensors& untracked) {
  py::object found = g_config->empty;
  bool several = false;
  for (auto* t : inputs) {
    PyObject* rec = record_of(tr, *t);
    if (rec == nullptr) {
      untracked.push_back(t);
      continue;
    }
    py::object name = parameter_of(rec);
    if (PyObject_IsTrue(name.ptr()) && !same_str(name.ptr(), found)) {
      several = several || PyObject_IsTrue(found.ptr());
      found = name;
    }
  }
  return several ? g_config->empty : found;
}

// What an op's event names: where it is, what the facts of the op and its place in the step are.
struct Site {
  const OpPlan& plan;
  Py_ssize_t index;
  py::object index_obj, phase, module, call;
};

// An input storage the tracer has not met: it existed before the step without being declared (captured in a
// closure, RNG state...).
void track_captured(Tracer& tr, const Tensors& tensors, const Site& site) {
  for (auto* t : tensors) {
    py::object key = storage_key(*t);
    const int known = PyDict_Contains(tr.storages.ptr(), key.ptr());
    if (known < 0) throw python_error();
    if (known) continue;
    py::object name = storage_name("captured:", site.plan.utf8, site.index);
    track(tr, *t, key, name, g_config->category_other.ptr(), g_config->captured.ptr(), Py_None, site.module.ptr(),
          site.index_obj.ptr(), site.phase.ptr());
  }
}

// _before_op: what a forward op writes in place, for the module calls' records
void note_forward_writes(Tracer& tr, const Site& site, c10::ArrayRef<c10::IValue> args) {
  for (auto i : site.plan.written) {
    Tensors written;
    tensors_in(args.slice(static_cast<size_t>(i), 1), written);
    for (auto* t : written) {
      PyObject* rec = record_of(tr, *t);
      if (rec == nullptr) continue;
      py::object write = steal(PyTuple_Pack(2, site.index_obj.ptr(), rec));
      if (PyList_Append(tr.writes.ptr(), write.ptr()) < 0) throw python_error();
    }
  }
}

// _output_owners, worked out before the op takes its arguments off the stack: in the optimizer step a foreach op's
// j-th output is for its first list's j-th tensor's parameter
c10::SmallVector<py::object, 4> foreach_owners(Tracer& tr, c10::ArrayRef<c10::IValue> args) {
  c10::SmallVector<py::object, 4> owners;
  if (!args[0].isList()) return owners;
  for (const auto& item : args[0].toListRef()) {
    PyObject* rec =
        is_tensor(item) && item.toTensor().layout() == c10::kStrided ? record_of(tr, item.toTensor()) : nullptr;
    owners.push_back(rec != nullptr ? parameter_of(rec) : g_config->empty);
  }
  return owners;
}

// The storages an op made: each tracked under the op's owner (for a foreach op in the optimizer step, its output's)
void track_outputs(Tracer& tr, const Site& site, c10::ArrayRef<c10::IValue> returns, bool per_output,
                   const c10::SmallVector<py::object, 4>& owners) {
  Tensors outputs;
  tensors_in(returns, outputs);
  for (size_t j = 0; j < outputs.size(); ++j) {
    const at::Tensor& t = *outputs[j];
    const py::object& owner = !per_output ? site.module : j < owners.size() ? owners[j] : g_config->empty;
    if (!plain(t)) {  // a sparse or nested output: _outputs' way (its parts' storages)
      py::object wrapped = steal(THPVariable_Wrap(t));
      g_config->parts_outputs(py::handle(tr.mode), wrapped, site.plan.name, site.index_obj, owner);
      continue;
    }
    py::object key = storage_key(t);
    const int known = PyDict_Contains(tr.storages.ptr(), key.ptr());
    if (known < 0) throw python_error();
    if (known) continue;
    py::object name = storage_name("", site.plan.utf8, site.index);
    track(tr, t, key, name, Py_None, g_config->empty.ptr(), site.index_obj.ptr(), owner.ptr(), site.index_obj.ptr(),
          site.phase.ptr());
  }
}

// One op recorded as StepTracer.__torch_dispatch__ records it: its event, the storages it meets first (inputs not
// seen before, new outputs), in forward its in-place writes, and in backward a possible accumulation. Returns false,
// having recorded nothing, where the op needs the Python hook (a kernel probe, tensors that are not plain).
bool record_natively(Tracer& tr, const c10::OperatorHandle& op, torch::jit::Stack* stack, bool stashed = false) {
  if (!tr.loop_phases.is_none() && truthy(attr(tr.mode, g_config->a_passthrough))) {
    run_unseen(op, stack, stashed);
    return true;
  }
  const OpPlan& plan = plan_of(op);
  if (!plan.native) return false;
  const auto& schema = op.schema();
  auto args = torch::jit::last(*stack, schema.arguments().size());
  Tensors inputs;
  tensors_in(args, inputs);
  for (auto* t : inputs) {
    if (!plain(*t)) return false;
  }
  if (test_holds(plan, schema, args)) return false;  // a kernel that holds buffers: _before_op probes it

  if (!tr.loop_phases.is_none()) loop_phase(tr);
  py::object phase = attr(tr.mode, g_config->a_phase);
  const bool forward = same_str(phase.ptr(), g_config->forward);
  const bool optimizer = !forward && same_str(phase.ptr(), g_config->optimizer);
  PyObject* ops = tr.ops.ptr();
  const Py_ssize_t index = PyList_GET_SIZE(ops);
  py::object scope = forward ? attr(tr.scopes.ptr(), g_config->a_scope) : backward_scope(tr);
  Site site{plan, index, steal(PyLong_FromSsize_t(index)), phase,
            py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(scope.ptr(), 0)),
            py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(scope.ptr(), 1))};
  Tensors untracked;
  if (optimizer) site.module = optimizer_parameter(tr, inputs, untracked);
  py::object event = steal(PyTuple_Pack(4, phase.ptr(), plan.name.ptr(), site.module.ptr(), site.call.ptr()));
  if (PyList_Append(ops, event.ptr()) < 0) throw python_error();
  tr.native_events++;
  track_captured(tr, optimizer ? untracked : inputs, site);
  if (forward) note_forward_writes(tr, site, args);
  const bool per_output = optimizer && plan.foreach && plan.allocates && !args.empty();
  c10::SmallVector<py::object, 4> owners;
  if (per_output) owners = foreach_owners(tr, args);
  const bool accumulation = plan.accumulation && !forward && !c10::GradMode::is_enabled();
  inputs.clear();
  untracked.clear();

  // The arguments stay alive until the outputs are tracked, as the hook's `args` keep them (a storage only the op's
  // arguments held is freed after it, at the same event, either way).
  c10::SmallVector<c10::IValue, 8> held(args.begin(), args.end());
  // the op runs below this mode, as from the hook (which the mode's own caller stashed already, if `stashed`)
  run_unseen(op, stack, stashed);

  auto returns = torch::jit::last(*stack, schema.returns().size());
  if (plan.allocates) track_outputs(tr, site, returns, per_output, owners);
  if (accumulation && returns.size() == 1) note_accumulation(tr, held, returns[0], site.index_obj.ptr());
  if (!tr.progress.is_none() && index % 1000 == 0) tr.progress(phase, site.index_obj);
  return true;
}

// The GIL, held for a scope (PyGILState_Ensure: pybind11's guard costs several times more).
struct Gil {
  PyGILState_STATE state = PyGILState_Ensure();
  Gil() = default;
  Gil(const Gil&) = delete;
  Gil& operator=(const Gil&) = delete;
  ~Gil() { PyGILState_Release(state); }
};

void python_key_kernel(const c10::OperatorHandle& op, DispatchKeySet keys, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard guard(kAbovePython);
  const auto depth = TorchDispatchModeTLS::stack_len();
  if (depth == 0) {
    subclass_fallback(op, keys, stack);
    return;
  }
  const auto top = TorchDispatchModeTLS::get_stack_at(depth - 1);
  {
    Gil gil;
    Tracer* tr = attached(top->ptr(&top->pyinterpreter()));
    if (tr != nullptr && record_natively(*tr, op, stack)) return;
  }
  top->pyinterpreter()->dispatch(op, stack);
}

// StepTracer.__torch_dispatch__ while the tracer is attached (an attribute of the instance, so that PyTorch finds it
// first): a `detach` PyTorch asks of the mode directly (TensorImpl::shallow_copy_and_detach under a mode: the
// saved tensors autograd unpacks in backward), recorded here; everything else goes on to the Python hook.
PyObject* torch_dispatch(PyObject* mode, PyObject* const* args, Py_ssize_t nargs) {
  return to_python([&]() -> PyObject* {
    if (nargs >= 3 && args[0] == g_config->detach.ptr() && PyTuple_Check(args[2]) && PyTuple_GET_SIZE(args[2]) == 1 &&
        (nargs == 3 || args[3] == Py_None || (PyDict_Check(args[3]) && PyDict_GET_SIZE(args[3]) == 0))) {
      PyObject* a = PyTuple_GET_ITEM(args[2], 0);
      Tracer* tr = attached(mode);
      if (tr != nullptr && THPVariable_Check(a)) {
        static const c10::OperatorHandle detach = c10::Dispatcher::singleton().findSchemaOrThrow("aten::detach", "");
        torch::jit::Stack stack{c10::IValue(THPVariable_Unpack(a))};
        if (record_natively(*tr, detach, &stack, /*stashed=*/true)) return THPVariable_Wrap(stack.back().toTensor());
      }
    }
    std::vector<PyObject*> call(args, args + nargs);
    call.insert(call.begin(), mode);
    Tracer* tr = attached(mode);
    const py::object& hook = tr != nullptr ? tr->python_hook : g_config->python_hook;
    return PyObject_Vectorcall(hook.ptr(), call.data(), call.size(), nullptr);
  });
}

PyMethodDef g_dispatch_def = {"__torch_dispatch__", reinterpret_cast<PyCFunction>(torch_dispatch), METH_FASTCALL,
                              "StepTracer.__torch_dispatch__, its detach recorded in C++ (see _native.py)."};

py::object dispatch_method(py::object mode) {
  return steal(PyCFunction_New(&g_dispatch_def, mode.ptr()));
}

// StepTracer.pack and .unpack, the saved-tensor hooks, for a tracer the compiled path records. `state` is
// (tracer, its storages, its events); tensors that are not plain dense ones go to the Python methods.
enum HookState { kHookTracer, kHookStorages, kHookOps, kNumHookState };

PyObject* call_method(const py::object& function, PyObject* self, PyObject* arg) {
  PyObject* call[] = {self, arg};
  return PyObject_Vectorcall(function.ptr(), call, 2, nullptr);
}

PyObject* saved_record(PyObject* state, const at::Tensor& t) {
  py::object key = storage_key(t);
  PyObject* rec = PyDict_GetItemWithError(PyTuple_GET_ITEM(state, kHookStorages), key.ptr());
  if (rec == nullptr && PyErr_Occurred()) throw python_error();
  return rec;
}

PyObject* pack(PyObject* state, PyObject* t) {
  return to_python([&]() -> PyObject* {
    PyObject* tracer = PyTuple_GET_ITEM(state, kHookTracer);
    if (!THPVariable_Check(t) || !plain(THPVariable_Unpack(t))) return call_method(g_config->python_pack, tracer, t);
    const at::Tensor& tensor = THPVariable_Unpack(t);
    PyObject* rec = saved_record(state, tensor);
    if (rec != nullptr) set_slot(rec, g_config->rec_saved, Py_True);
    if (!tensor.grad_fn()) {
      Py_INCREF(t);
      return t;
    }
    PyTypeObject* type = Py_TYPE(t);
    if (type != reinterpret_cast<PyTypeObject*>(THPVariableClass) &&
        type != reinterpret_cast<PyTypeObject*>(g_config->parameter_type.ptr())) {
      return call_method(g_config->python_detached, tracer, t);  // a subclass detaches through its own dispatch
    }
    // _detached: no event, the alias is the hook's, not the step's
    c10::impl::ExcludeDispatchKeyGuard no_modes(DispatchKeySet({DispatchKey::Python, DispatchKey::PythonTLSSnapshot}));
    return THPVariable_Wrap(tensor.detach());
  });
}

PyObject* unpack(PyObject* state, PyObject* t) {
  return to_python([&]() -> PyObject* {
    PyObject* tracer = PyTuple_GET_ITEM(state, kHookTracer);
    if (!THPVariable_Check(t) || !plain(THPVariable_Unpack(t))) return call_method(g_config->python_unpack, tracer, t);
    PyObject* rec = saved_record(state, THPVariable_Unpack(t));
    if (rec != nullptr) {
      const Py_ssize_t n = PyList_GET_SIZE(PyTuple_GET_ITEM(state, kHookOps));
      py::object last = steal(PyLong_FromSsize_t(n ? n - 1 : 0));
      set_slot(rec, g_config->rec_last_use_event, last.ptr());
    }
    py::object queued = attr(tracer, g_config->a_end_queued);
    if (!PyObject_IsTrue(queued.ptr())) {
      steal(PyObject_CallMethodNoArgs(tracer, g_config->a_queue_backward_end.ptr()));
    }
    Py_INCREF(t);
    return t;
  });
}

PyMethodDef g_pack_def = {"pack", reinterpret_cast<PyCFunction>(pack), METH_O, "StepTracer.pack, compiled."};
PyMethodDef g_unpack_def = {"unpack", reinterpret_cast<PyCFunction>(unpack), METH_O, "StepTracer.unpack, compiled."};

py::tuple saved_hooks(py::object mode, py::object storages, py::object ops) {
  py::object state = py::make_tuple(mode, storages, ops);
  return py::make_tuple(steal(PyCFunction_New(&g_pack_def, state.ptr())),
                        steal(PyCFunction_New(&g_unpack_def, state.ptr())));
}

// --- registration --------------------------------------------------------------------------------------------

std::vector<c10::RegistrationHandleRAII> g_registered;

// Registers the kernel for every aten op whose Python key has nothing of its own (those with a kernel there keep
// it), save the CompositeImplicitAutograd ones: autograd decomposes them before the Python key, which they reach
// only with autograd off (inference mode), and then they go to the Python hook as before. Straight through the
// dispatcher, not torch::Library: a trace registers about 2,400 ops, and the library's per-op debug text cost as
// much as the registration.
int64_t install() {
  if (!g_registered.empty()) return static_cast<int64_t>(g_registered.size());
  auto& dispatcher = c10::Dispatcher::singleton();
  const std::string debug = "trainledger's compiled tracer (trace/_native.cpp)";
  for (const auto& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto handle = dispatcher.findOp(name);
    if (!handle || handle->hasKernelForDispatchKey(DispatchKey::Python) ||
        handle->hasKernelForDispatchKey(DispatchKey::CompositeImplicitAutograd)) {
      continue;
    }
    g_registered.push_back(dispatcher.registerImpl(
        name, DispatchKey::Python, c10::KernelFunction::makeFromBoxedFunction<&python_key_kernel>(), std::nullopt,
        nullptr, debug));
  }
  return static_cast<int64_t>(g_registered.size());
}

void uninstall() {
  g_registered.clear();
}

void attach(py::object mode, py::dict objects) {
  TORCH_CHECK(g_config != nullptr, "configure() first");
  TORCH_CHECK(attached(mode.ptr()) == nullptr, "this tracer is attached already");
  auto tr = std::make_unique<Tracer>();
  tr->ops = objects["ops"];
  tr->storages = objects["storages"];
  tr->refs = objects["refs"];
  tr->scopes = objects["scopes"];
  tr->progress = objects["progress"];
  tr->writes = objects["writes"];
  tr->accumulations = objects["accumulations"];
  tr->python_hook = objects["python_hook"];
  tr->loop_phases = objects["loop_phases"];
  py::object state = steal(PyTuple_New(kNumFreeState));
  const std::pair<FreeState, const char*> parts[] = {
      {kOps, "ops"}, {kStorages, "storages"}, {kFinished, "finished"}, {kAfterBackward, "freed_after_backward"},
      {kSettled, "frees_settled"}, {kElsewhere, "frees_elsewhere"}, {kThread, "thread"}};
  PyTuple_SET_ITEM(state.ptr(), kTracer, mode.inc_ref().ptr());
  for (const auto& [at, name] : parts) PyTuple_SET_ITEM(state.ptr(), at, py::object(objects[name]).release().ptr());
  tr->on_free = steal(PyCFunction_New(&g_freed_def, state.ptr()));
  tr->mode = mode.release().ptr();
  g_tracers.push_back(std::move(tr));
  install();
}

// The weak-reference callback the compiled path gives the storages it tracks (the tracer's own _on_free while it
// is attached, so that every free of the step is recorded by the same code).
py::object free_callback(py::object mode) {
  Tracer* tr = attached(mode.ptr());
  TORCH_CHECK(tr != nullptr, "this tracer is not attached");
  return tr->on_free;
}

int64_t detach(py::object mode) {
  for (auto it = g_tracers.begin(); it != g_tracers.end(); ++it) {
    if ((*it)->mode == mode.ptr()) {
      const int64_t native = (*it)->native_events;
      Py_DECREF((*it)->mode);
      g_tracers.erase(it);
      if (g_tracers.empty()) uninstall();
      return native;
    }
  }
  return -1;
}

void configure(py::dict c) {
  auto* config = new Config();
  std::vector<std::pair<std::string, py::object>> fields;
  for (auto field : c["storage_fields"].cast<py::list>()) {
    auto pair = field.cast<py::tuple>();
    // (name, default, whether it has one)
    fields.emplace_back(pair[0].cast<std::string>(), pair[2].cast<bool>() ? py::object(pair[1]) : py::object());
  }
  config->storage.set(reinterpret_cast<PyTypeObject*>(c["storage_type"].ptr()), fields);
  config->rec_name = config->storage.offset_of("name");
  config->rec_free_event = config->storage.offset_of("free_event");
  config->rec_parameter = config->storage.offset_of("parameter");
  config->rec_saved = config->storage.offset_of("saved");
  config->rec_category = config->storage.offset_of("category");
  config->rec_owner = config->storage.offset_of("owner");
  config->rec_phase = config->storage.offset_of("phase");
  config->weights = c["weights"];
  config->frozen = c["frozen"];
  config->gradients = c["gradients"];
  config->optimizer_state = c["optimizer_state"];
  config->detach = c["detach"];
  config->python_hook = c["python_hook"];
  config->zero_grad = c["zero_grad"];
  config->python_pack = c["python_pack"];
  config->python_unpack = c["python_unpack"];
  config->python_detached = c["python_detached"];
  config->parameter_type = c["parameter_type"];
  config->rec_last_use_event = config->storage.offset_of("last_use_event");
  config->ref_type = c["ref_type"];
  SlotClass ref;
  ref.type = reinterpret_cast<PyTypeObject*>(config->ref_type.ptr());
  config->ref_key = ref.offset_of("key");
  config->ref_rec = ref.offset_of("rec");
  config->accumulation_type = c["accumulation_type"];
  config->category_other = c["category_other"];
  config->describe = c["describe"];
  config->dtype_name = c["dtype_name"];
  config->parts_outputs = c["parts_outputs"];
  config->forward = c["forward"];
  config->backward = c["backward"];
  config->optimizer = c["optimizer"];
  config->empty = py::str("");
  config->captured = py::str("captured");
  config->none_call = c["no_call"];
  config->no_scope = py::make_tuple(config->empty, config->none_call);
  delete g_config;
  g_config = config;
  g_plans.clear();
  g_dtype_names.clear();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("configure", &configure);
  m.def("attach", &attach);
  m.def("detach", &detach);
  m.def("free_callback", &free_callback);
  m.def("dispatch_method", &dispatch_method);
  m.def("saved_hooks", &saved_hooks);
  m.def("installed", []() { return static_cast<int64_t>(g_registered.size()); });
}
