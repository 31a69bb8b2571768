"""Write horovod-0.28.1.json: the public names of Horovod 0.28.1's Python
modules and their signatures, read from its source with ``ast`` (Horovod
cannot be imported without its compiled extension).

Regenerate with:

    pip download --no-deps --no-binary :all: horovod==0.28.1 -d /tmp/hvd
    tar -xzf /tmp/hvd/horovod-0.28.1.tar.gz -C /tmp/hvd
    python tests/horovod_api/extract.py /tmp/hvd/horovod-0.28.1

For each module a user imports, every name it exports (its ``__all__``, or
else every public name it binds, except imports from outside Horovod) is
followed through re-exports to where it is defined. A function records its
parameters as [name, kind, default source text or null]; a function that only
passes ``*args, **kwargs`` on records those of the function it calls; a class
records its ``__init__``'s parameters, its public methods and class
attributes, its Horovod base classes' included.
"""

import ast
import json
import os
import sys

USER_MODULES = [
    "horovod", "horovod.torch", "horovod.torch.elastic", "horovod.tensorflow",
    "horovod.tensorflow.elastic", "horovod.tensorflow.keras",
    "horovod.tensorflow.keras.callbacks", "horovod.tensorflow.keras.elastic",
    "horovod.keras", "horovod.keras.callbacks", "horovod.keras.elastic"]
HERE = os.path.dirname(os.path.abspath(__file__))
VERSION = "0.28.1"


class Source:
    """The unpacked sdist: modules parsed on demand, names resolved."""

    def __init__(self, root):
        self.root = root
        self.modules = {}

    def path(self, module):
        base = os.path.join(self.root, *module.split("."))
        return base + "/__init__.py" if os.path.isdir(base) else base + ".py"

    def is_horovod(self, module):
        return module.split(".")[0] == "horovod" and os.path.exists(self.path(module))

    def bindings(self, module):
        """{name: statement binding it} for the module's top level, first
        binding wins (also inside if/try blocks); '*' lists star imports."""
        if module not in self.modules:
            with open(self.path(module)) as source:
                tree = ast.parse(source.read())
            found = {"*": []}
            self._collect(tree.body, module, found)
            self.modules[module] = found
        return self.modules[module]

    def _collect(self, statements, module, found):
        for node in statements:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.setdefault(node.name, ("def", node))
            elif isinstance(node, ast.ImportFrom):
                source = self._absolute(module, node)
                for alias in node.names:
                    if alias.name == "*":
                        found["*"].append(source)
                    else:
                        found.setdefault(alias.asname or alias.name,
                                         ("import", source, alias.name))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        found.setdefault(alias.asname, ("import", alias.name, None))
                    else:
                        top = alias.name.split(".")[0]
                        found.setdefault(top, ("import", top, None))
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        found.setdefault(target.id, ("assign", node.value))
            elif isinstance(node, ast.If):
                self._collect(node.body + node.orelse, module, found)
            elif isinstance(node, ast.Try):
                self._collect(node.body + node.orelse + node.finalbody, module, found)
                for handler in node.handlers:
                    self._collect(handler.body, module, found)

    def _absolute(self, module, node):
        if not node.level:
            return node.module
        package = module.split(".")
        if not self.path(module).endswith("__init__.py"):
            package = package[:-1]
        package = package[:len(package) - node.level + 1]
        return ".".join(package + ([node.module] if node.module else []))

    def exports(self, module):
        """The module's public names: __all__, or what it binds publicly."""
        found = self.bindings(module)
        if "__all__" in found and found["__all__"][0] == "assign":
            return [ast.literal_eval(item) for item in found["__all__"][1].elts]
        names = [name for name, binding in found.items()
                 if name != "*" and not name.startswith("_") and not self._external(binding)]
        for star in filter(self.is_horovod, found["*"]):
            names += [name for name in self.exports(star) if name not in names]
        return names

    def _external(self, binding):
        return binding[0] == "import" and not (
            self.is_horovod(binding[1]) or self.is_horovod(f"{binding[1]}.{binding[2]}"))

    def resolve(self, module, name):
        """The record of what ``name`` means in ``module``."""
        found = self.bindings(module)
        if name not in found:
            for star in filter(self.is_horovod, found["*"]):
                if name in self.exports(star):
                    return self.resolve(star, name)
            raise KeyError(f"{module}.{name}")
        binding = found[name]
        if binding[0] == "import":
            source, attribute = binding[1], binding[2]
            if attribute is None:
                return {"kind": "module", "defined_in": source}
            if self.is_horovod(f"{source}.{attribute}"):
                return {"kind": "module", "defined_in": f"{source}.{attribute}"}
            if not self.is_horovod(source):
                return {"kind": "external", "defined_in": f"{source}.{attribute}"}
            return self.resolve(source, attribute)
        if binding[0] == "def":
            return self.definition(module, binding[1])
        return self.value(module, binding[1])

    def value(self, module, node):
        if isinstance(node, ast.Name):
            return self.resolve(module, node.id)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            owner = self.bindings(module).get(node.value.id)
            if owner and owner[0] == "assign" and isinstance(owner[1], ast.Call):
                cls = self.value(module, owner[1].func)
                member = cls.get("methods", {}).get(node.attr)
                if member is not None:
                    return {"kind": "function",
                            "defined_in": f"{cls['defined_in']}.{node.attr}",
                            "params": member}
                return {"kind": "value", "defined_in": module,
                        "source": ast.unparse(node)}
            base = self.resolve(module, node.value.id)
            if base["kind"] == "module" and self.is_horovod(base["defined_in"]):
                return self.resolve(base["defined_in"], node.attr)
        return {"kind": "value", "defined_in": module, "source": ast.unparse(node)}

    def definition(self, module, node):
        if isinstance(node, ast.ClassDef):
            return self.class_record(module, node)
        record = {"kind": "function", "defined_in": f"{module}.{node.name}",
                  "params": parameters(node.args)}
        target = forwarded_call(node)
        if target is not None:
            callee = self.value(module, target)
            if callee["kind"] == "function":
                record["params"] = callee["params"]
                record["forwards_to"] = callee["defined_in"]
        return record

    def class_record(self, module, node):
        record = {"kind": "class", "defined_in": f"{module}.{node.name}",
                  "bases": [ast.unparse(base) for base in node.bases],
                  "params": None, "methods": {}, "properties": [], "attributes": {}}
        for base in node.bases:
            try:
                inherited = self.value(module, base)
            except KeyError:
                continue
            if inherited["kind"] != "class":
                continue
            record["params"] = inherited["params"]
            record["methods"].update(inherited["methods"])
            record["attributes"].update(inherited["attributes"])
            record["properties"] += inherited["properties"]
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                decorators = [ast.unparse(d) for d in item.decorator_list]
                params = parameters(item.args)
                if "staticmethod" not in decorators:
                    params = params[1:]
                if item.name == "__init__":
                    record["params"] = params
                elif "property" in decorators:
                    record["properties"].append(item.name)
                elif not item.name.startswith("_"):
                    record["methods"][item.name] = params
            elif isinstance(item, ast.Assign):
                for target in item.targets:
                    if isinstance(target, ast.Name) and not target.id.startswith("_"):
                        record["attributes"][target.id] = ast.unparse(item.value)
        record["properties"] = sorted(set(record["properties"]))
        return record


def parameters(args):
    """[[name, kind, default source or None]] in signature order."""
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + args.defaults
    result = [[arg.arg, "POSITIONAL_ONLY" if arg in args.posonlyargs
               else "POSITIONAL_OR_KEYWORD", default and ast.unparse(default)]
              for arg, default in zip(positional, defaults)]
    if args.vararg:
        result.append([args.vararg.arg, "VAR_POSITIONAL", None])
    result += [[arg.arg, "KEYWORD_ONLY", default and ast.unparse(default)]
               for arg, default in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        result.append([args.kwarg.arg, "VAR_KEYWORD", None])
    return result


def forwarded_call(function):
    """The callee of a function whose parameters are only *args, **kwargs
    and which passes them on, else None."""
    args = function.args
    if args.args or args.kwonlyargs or not (args.vararg and args.kwarg):
        return None
    for node in ast.walk(function):
        if (isinstance(node, ast.Call)
                and any(isinstance(a, ast.Starred) for a in node.args)
                and any(k.arg is None for k in node.keywords)):
            return node.func
    return None


def extract(root):
    source = Source(os.path.join(root))
    modules = {}
    for module in USER_MODULES:
        names = {name: source.resolve(module, name) for name in source.exports(module)}
        modules[module] = dict(sorted(names.items()))
    return {"horovod_version": VERSION,
            "generated_by": "tests/horovod_api/extract.py", "modules": modules}


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else f"/tmp/hvd/horovod-{VERSION}"
    data = extract(root)
    with open(os.path.join(HERE, f"horovod-{VERSION}.json"), "w") as out:
        json.dump(data, out, indent=1, sort_keys=False)
        out.write("\n")


if __name__ == "__main__":
    main()
