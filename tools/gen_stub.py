"""Writes python/zeroshard/_C.pyi from the built extension's pybind11 signatures:
    python3 tools/gen_stub.py > python/zeroshard/_C.pyi
tests/python/test_stub.py fails when a binding is added or removed without regenerating it."""
import zeroshard._C as C, inspect, re, types, sys
out = []
def p(x=""): out.append(x)
def sig(doc, name):
    for line in (doc or "").splitlines():
        line = line.strip()
        m = re.match(r"^(?:\d+\. )?" + re.escape(name) + r"\((.*)\)( -> (.*))?$", line)
        if m:
            return m.group(1), m.group(3) or "None"
    return None
def clean(t):
    return t.replace("zeroshard._C.", "").replace("typing.SupportsInt", "int").replace("typing.SupportsFloat", "float").replace("at::Tensor", "torch.Tensor")
def emit_fn(name, obj, indent=""):
    s = sig(obj.__doc__, name)
    if s is None:
        p(f"{indent}def {name}(*args: typing.Any, **kwargs: typing.Any) -> typing.Any: ...")
    else:
        a, r = s
        a = re.sub(r" = [^,]*(?=,|$)", " = ...", clean(a))
        p(f"{indent}def {name}({a}) -> {clean(r)}: ...")
p('"""Type stub for zeroshard._C, the private extension module (python/csrc/). Kept in step with')
p('the bindings by tests/python/test_stub.py."""')
p("import collections.abc\nimport typing\n\nimport torch\nimport torch.distributed\n")
names = sorted(n for n in dir(C) if not n.startswith("__"))
for n in names:
    o = getattr(C, n)
    if inspect.isclass(o) and issubclass(o, BaseException):
        p(f"class {n}({o.__mro__[1].__name__}): ...\n")
for n in names:
    o = getattr(C, n)
    if inspect.isclass(o) and not issubclass(o, BaseException):
        p(f"class {n}:")
        for m in sorted(x for x in dir(o) if not x.startswith("_") or x == "__init__"):
            if m == "__init__" and not (o.__init__.__doc__ or "").startswith("__init__("):
                continue
            v = inspect.getattr_static(o, m)
            if type(v).__name__ == "pybind11_static_property":
                p(f"    {m}: typing.ClassVar[{type(getattr(o, m)).__name__}]")
            elif isinstance(v, property):
                doc = (v.fget.__doc__ or "").splitlines()[0] if v.fget.__doc__ else ""
                mm = re.search(r"-> (.*)$", doc)
                p(f"    @property\n    def {m}(self) -> {clean(mm.group(1)) if mm else 'typing.Any'}: ...")
            elif not callable(getattr(o, m)):
                p(f"    {m}: {type(getattr(o, m)).__name__}")
            else:
                emit_fn(m, getattr(o, m), "    ")
        p()
for n in names:
    o = getattr(C, n)
    if isinstance(o, types.ModuleType):
        p(f"{n}: typing.Any  # submodule")
    elif not inspect.isclass(o) and callable(o):
        emit_fn(n, o)
s = "\n".join(out) + "\n"
s = re.sub(r"\(self: \w+(, )?", lambda m: "(self" + (", " if m.group(1) else ""), s)
s = s.replace("c10d::ProcessGroup", "torch.distributed.ProcessGroup")
sys.stdout.write(s)
