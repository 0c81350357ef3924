"""python/zeroshard/_C.pyi, the type stub of the private extension module, names exactly what
zeroshard._C binds: every function, class, method and property, and no more."""
import ast
import inspect
import os

from zeroshard import _C

STUB = os.path.join(os.path.dirname(__file__), "..", "..", "python", "zeroshard", "_C.pyi")


def _stubbed():
    names = {}
    for node in ast.parse(open(STUB, encoding="utf-8").read()).body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)} | {
                n.target.id for n in node.body if isinstance(n, ast.AnnAssign)}
        elif isinstance(node, ast.FunctionDef):
            names[node.name] = None
        elif isinstance(node, ast.AnnAssign):
            names[node.target.id] = None
    return names


def _bound():
    names = {}
    for name in dir(_C):
        if name.startswith("__"):
            continue
        obj = getattr(_C, name)
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            members = {m for m in dir(obj) if not m.startswith("_")}
            if (obj.__init__.__doc__ or "").startswith("__init__("):  # bound with py::init
                members.add("__init__")
            names[name] = members
        elif inspect.isclass(obj):
            names[name] = set()
        else:
            names[name] = None
    return names


def test_the_stub_gives_each_exception_its_base():
    stubbed = {node.name: [b.id for b in node.bases] for node in
               ast.parse(open(STUB, encoding="utf-8").read()).body if isinstance(node, ast.ClassDef)}
    for name in dir(_C):
        obj = getattr(_C, name)
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            assert stubbed[name] == [obj.__bases__[0].__name__], name


def test_the_stub_names_exactly_what_the_module_binds():
    # Regenerate with: python3 tools/gen_stub.py > python/zeroshard/_C.pyi
    stub, bound = _stubbed(), _bound()
    assert sorted(stub) == sorted(bound)
    for name, members in bound.items():
        if members is not None:
            assert stub[name] == members, name
