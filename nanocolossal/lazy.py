"""A package's names, imported when first used (PEP 562): `import nanocolossal` imports no
feature, so `nanocolossal plan` runs without torch. With `lazy(__name__, {"context": ["gpc"]})`
`nc.gpc` imports nanocolossal.context; `nc.amp`, as any submodule, imports it."""
import importlib
import sys
import types


def lazy(package: str, where: dict[str, list[str]]) -> tuple:
    """(__getattr__, __dir__) for `package`, which gets each name of `where` from its submodule."""
    home = {name: submodule for submodule, names in where.items() for name in names}
    module = sys.modules[package]

    class Package(types.ModuleType):
        def __setattr__(self, name: str, value: object) -> None:
            # importing submodule launch must not hide the function launch that shares its name
            if not (name in home and isinstance(value, types.ModuleType)):
                super().__setattr__(name, value)

    def __getattr__(name: str) -> object:
        try:
            value = importlib.import_module(f"{package}.{home.get(name, name)}")
        except ModuleNotFoundError as e:  # neither a name of `where` nor a submodule
            if e.name != f"{package}.{name}":
                raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        if name in home:
            value = getattr(value, name)
        vars(module)[name] = value  # found directly from now on
        return value

    module.__class__ = Package
    vars(module).setdefault("__all__", sorted(home))  # (a package that lists none of its own)
    return __getattr__, lambda: sorted({*vars(module), *home, *vars(module).get("__all__", ())})
