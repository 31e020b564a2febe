"""Checks what `make build` left in .aws-sam/build: the artifacts Lambda would run.

1. The layer holds ``infrai_jobs`` (the same modules as ``layers/common``, and the ledger's
   migrations, ``work/migrations/*.sql``, byte for byte) and exactly the packages of the lock
   ``layers/common/requirements.txt`` (``make lock``): each locked package at its locked
   version, transitive ones included, and no package the lock does not name.
2. Its native code is for the Lambda runtime: psycopg_binary's wheel tags say CPython 3.13 on
   manylinux aarch64, its extension modules are named for cpython-313-aarch64, and every ELF
   file in the layer is a 64-bit AArch64 object (read from the ELF header, not the file name).
3. Every function of the built template has its handler file in the layer and the shared
   ``jobs`` package (every function's CodeUri is ``functions/``), all its code compiles under
   Python 3.13, and its handler imports in a Python 3.13 with only the function's code and the
   layer on ``sys.path`` (``-S -I``: no site-packages, as on Lambda).

On an aarch64 machine the import is exactly Lambda's. Elsewhere the layer's psycopg_binary
cannot load (it is AArch64 machine code), so the import runs with ``PSYCOPG_IMPL=python``:
psycopg's pure-Python implementation over this machine's libpq. Everything else imported is the
layer's own code; the native part is covered by check 2 instead. Run from the repository root.
"""

from __future__ import annotations

import glob
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cfnlint.decode import cfn_yaml  # type: ignore[import-untyped]

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / ".aws-sam" / "build"
LOCK = ROOT / "layers" / "common" / "requirements.txt"
SOURCE_PACKAGE = ROOT / "layers" / "common" / "infrai_jobs"
# The ledger's migrations, inside the package.
MIGRATIONS = "work/migrations"

ELF_MAGIC = b"\x7fELF"
ELFCLASS64 = 2
EM_AARCH64 = 183
WHEEL_TAG = re.compile(r"^cp313-cp313-manylinux(2014|_\d+_\d+)_aarch64$")
EXTENSION_SUFFIX = ".cpython-313-aarch64-linux-gnu.so"
# A lock entry, "name==version \\", its --hash lines below it.
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#\\]+)")

# Imports the handler the way Lambda's bootstrap does; prints the modules it loaded from where.
_IMPORT_PROBE = r"""
import importlib, json, sys
code_dir, layer_dir, handler = sys.argv[1:4]
sys.path[:0] = [code_dir, layer_dir]
module_name, _, attr = handler.rpartition(".")
module = importlib.import_module(module_name)
if not callable(getattr(module, attr, None)):
    raise SystemExit(f"{handler}: {attr} is not a callable in {module.__file__}")
import psycopg
print(json.dumps({
    "handler_file": module.__file__,
    "psycopg_file": psycopg.__file__,
    "psycopg_impl": psycopg.pq.__impl__,
    "python": sys.version.split()[0],
}))
"""


# Compiles without writing __pycache__ into the build artifacts.
_COMPILE_ALL = r"""
import sys
for path in sys.argv[1:]:
    with open(path, "rb") as stream:
        compile(stream.read(), path, "exec", dont_inherit=True)
"""


class Checks:
    def __init__(self) -> None:
        self.failures: list[str] = []

    def check(self, ok: bool, what: str, detail: str = "") -> bool:
        print(f"{'ok  ' if ok else 'FAIL'} {what}" + (f": {detail}" if detail else ""))
        if not ok:
            self.failures.append(what)
        return ok


def find_python313() -> str | None:
    """The same search as the Makefile's: $PYTHON313, python3.13 on PATH, pyenv's 3.13.x."""
    candidates = [os.environ.get("PYTHON313", ""), shutil.which("python3.13") or ""]
    pyenv_root = os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    candidates += sorted(glob.glob(f"{pyenv_root}/versions/3.13*/bin/python3.13"))
    for candidate in filter(None, candidates):
        probe = subprocess.run(  # noqa: S603 - candidate interpreters, fixed arguments
            [candidate, "-c", "import sys; sys.exit(sys.version_info[:2] != (3, 13))"],
            capture_output=True,
            check=False,
        )
        if probe.returncode == 0:
            return candidate
    return None


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def locked_packages() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in LOCK.read_text().splitlines():
        match = PIN.match(line)
        if match:
            pins[normalise(match.group(1))] = match.group(2)
    return pins


def installed_dists(site: Path) -> dict[str, str]:
    dists: dict[str, str] = {}
    for info in site.glob("*.dist-info"):
        name, _, version = info.name.removesuffix(".dist-info").rpartition("-")
        dists[normalise(name)] = version
    return dists


def elf_files(tree: Path) -> Iterator[Path]:
    for path in tree.rglob("*"):
        if path.is_file() and not path.is_symlink() and ".so" in path.name:
            with path.open("rb") as stream:
                if stream.read(4) == ELF_MAGIC:
                    yield path


def elf_machine(path: Path) -> tuple[int, int]:
    """(EI_CLASS, e_machine) from the ELF header; every Lambda target is little-endian."""
    header = path.read_bytes()[:20]
    return header[4], int.from_bytes(header[18:20], "little")


def check_layer(checks: Checks, site: Path) -> None:
    built_root = site / "infrai_jobs"
    built = {p.relative_to(built_root).as_posix() for p in built_root.rglob("*.py")}
    source = {p.relative_to(SOURCE_PACKAGE).as_posix() for p in SOURCE_PACKAGE.rglob("*.py")}
    checks.check(
        bool(built) and built == source,
        "layer holds infrai_jobs with the same modules as layers/common/infrai_jobs",
        f"missing {sorted(source - built)}, extra {sorted(built - source)}"
        if built != source
        else f"{len(built)} modules",
    )

    # The ledger's schema ships with the code that needs it: the layer reads its version from
    # these files' names, and `infrai-jobs migrate` applies the same files.
    source_sql = {p.name: p.read_bytes() for p in (SOURCE_PACKAGE / MIGRATIONS).glob("*.sql")}
    built_sql = {p.name: p.read_bytes() for p in (built_root / MIGRATIONS).glob("*.sql")}
    changed = sorted(
        name for name in source_sql.keys() & built_sql.keys() if source_sql[name] != built_sql[name]
    )
    checks.check(
        bool(source_sql) and built_sql == source_sql,
        f"layer holds the ledger's migrations, infrai_jobs/{MIGRATIONS}/*.sql, byte for byte",
        f"missing {sorted(source_sql.keys() - built_sql.keys())}, "
        f"extra {sorted(built_sql.keys() - source_sql.keys())}, changed {changed}"
        if built_sql != source_sql or not source_sql
        else f"{len(built_sql)} files",
    )

    dists = installed_dists(site)
    locked = locked_packages()
    checks.check(bool(locked), "the lock names packages", str(LOCK.relative_to(ROOT)))
    for name, version in sorted(locked.items()):
        found = dists.get(name)
        checks.check(found == version, f"layer has {name}=={version}", f"found {found}")
    unlocked = {name: version for name, version in dists.items() if name not in locked}
    checks.check(
        not unlocked,
        "layer holds no package the lock does not name",
        ", ".join(f"{n}=={v}" for n, v in sorted(unlocked.items())) or f"{len(dists)} packages",
    )
    checks.check("psycopg_binary" in dists, "layer has psycopg_binary (psycopg[binary])")

    wheel_files = list(site.glob("psycopg_binary-*.dist-info/WHEEL"))
    tags = [
        line.split(":", 1)[1].strip()
        for wheel in wheel_files
        for line in wheel.read_text().splitlines()
        if line.startswith("Tag:")
    ]
    checks.check(
        bool(tags) and all(WHEEL_TAG.match(tag) for tag in tags),
        "psycopg_binary wheel is tagged cp313 manylinux aarch64",
        ", ".join(tags) or "no WHEEL file",
    )
    extensions = sorted(p.name for p in (site / "psycopg_binary").glob("*.so"))
    checks.check(
        bool(extensions) and all(name.endswith(EXTENSION_SUFFIX) for name in extensions),
        f"psycopg_binary extension modules end in {EXTENSION_SUFFIX}",
        ", ".join(extensions) or "none",
    )
    wrong = []
    count = 0
    for path in elf_files(site):
        count += 1
        elf_class, machine = elf_machine(path)
        if elf_class != ELFCLASS64 or machine != EM_AARCH64:
            wrong.append(f"{path.relative_to(site)} (class {elf_class}, machine {machine})")
    checks.check(
        count > 0 and not wrong,
        "every ELF file in the layer is 64-bit AArch64",
        "; ".join(wrong) if wrong else f"{count} files",
    )


def check_functions(
    checks: Checks, template: dict[str, Any], base: Path, layer_site: Path, python313: str
) -> None:
    functions = {
        name: resource.get("Properties", {})
        for name, resource in template.get("Resources", {}).items()
        if resource.get("Type") == "AWS::Serverless::Function"
    }
    checks.check(bool(functions), "the built template declares functions", ", ".join(functions))
    native = platform.machine() in ("aarch64", "arm64")
    probe_env = {"PATH": os.environ.get("PATH", ""), "AWS_REGION": "us-east-1"}
    probe_env |= literal_globals_environment(template)
    if not native:
        probe_env["PSYCOPG_IMPL"] = "python"
    for name, props in functions.items():
        code_dir = base / str(props.get("CodeUri", name))
        handler = str(props.get("Handler", ""))
        module_name = handler.rpartition(".")[0]
        # The entry point is the layer's (infrai_jobs.handlers.*); the code holds only the jobs.
        handler_file = layer_site / (module_name.replace(".", "/") + ".py")
        if not checks.check(handler_file.is_file(), f"{name}: handler file {handler_file.name}"):
            continue
        # One CodeUri for every function: each carries the same jobs package (functions/jobs).
        checks.check(
            (code_dir / "jobs" / "__init__.py").is_file(),
            f"{name}: its code holds the shared jobs package",
            str(code_dir / "jobs"),
        )
        sources = sorted(code_dir.rglob("*.py"))
        compiled = subprocess.run(  # noqa: S603 - our interpreter and build tree
            [python313, "-I", "-S", "-c", _COMPILE_ALL, *map(str, sources)],
            capture_output=True,
            text=True,
            check=False,
        )
        checks.check(
            compiled.returncode == 0,
            f"{name}: {len(sources)} source files compile under Python 3.13",
            compiled.stderr.strip(),
        )
        imported = subprocess.run(  # noqa: S603 - our interpreter and build tree
            [python313, "-I", "-S", "-c", _IMPORT_PROBE, str(code_dir), str(layer_site), handler],
            capture_output=True,
            text=True,
            env=probe_env,
            timeout=120,
            check=False,
        )
        ok = imported.returncode == 0
        detail = (imported.stderr.strip().splitlines() or ["no output"])[-1]
        if ok:
            report = json.loads(imported.stdout.strip().splitlines()[-1])
            from_layer = Path(report["psycopg_file"]).is_relative_to(layer_site)
            ok = from_layer and Path(report["handler_file"]).is_relative_to(layer_site)
            how = "as on Lambda" if native else "pure-Python psycopg, this machine is not arm64"
            detail = f"Python {report['python']}, psycopg {report['psycopg_impl']} ({how})"
        checks.check(ok, f"{name}: {handler} imports with only its code and the layer", detail)


def literal_globals_environment(template: dict[str, Any]) -> dict[str, str]:
    """The plain-string variables of Globals (service name, namespace): what imports may read."""
    variables = (
        template.get("Globals", {}).get("Function", {}).get("Environment", {}).get("Variables", {})
    )
    return {k: v for k, v in variables.items() if isinstance(v, str)}


def main() -> int:
    checks = Checks()
    built_template = BUILD / "template.yaml"
    if not checks.check(built_template.is_file(), "built template exists", str(built_template)):
        print("run `make build` first", file=sys.stderr)
        return 1
    template: dict[str, Any] = cfn_yaml.load(str(built_template))
    # The stack nests the framework (template.yaml's Framework, from framework.yaml): sam build
    # writes the nested template and its artifacts in a folder of their own.
    nested = [
        resource["Properties"]["Location"]
        for resource in template.get("Resources", {}).values()
        if resource.get("Type") == "AWS::Serverless::Application"
    ]
    checks.check(len(nested) == 1, "the built stack nests the framework once", str(nested))
    base = (BUILD / nested[0]).parent if nested else BUILD
    template = cfn_yaml.load(str(BUILD / nested[0])) if nested else template
    layers = [
        (name, resource.get("Properties", {}).get("ContentUri", name))
        for name, resource in template.get("Resources", {}).items()
        if resource.get("Type") == "AWS::Serverless::LayerVersion"
    ]
    checks.check(len(layers) == 1, "the built template declares one layer", str(layers))
    layer_site = base / str(layers[0][1]) / "python" if layers else base / "CommonLayer/python"
    if checks.check(layer_site.is_dir(), "layer has a python/ folder", str(layer_site)):
        check_layer(checks, layer_site)
        python313 = find_python313()
        if checks.check(
            python313 is not None,
            "a Python 3.13 to compile and import the functions with",
            str(python313),
        ):
            assert python313 is not None
            check_functions(checks, template, base, layer_site, python313)
    if checks.failures:
        print(f"check_build: {len(checks.failures)} check(s) failed", file=sys.stderr)
        return 1
    print("check_build: the built bundle is ready for the python3.13 arm64 runtime")
    return 0


if __name__ == "__main__":
    sys.exit(main())
