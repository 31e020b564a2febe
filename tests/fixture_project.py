"""The project as deployed, with the fixture jobs in place of the team's: what the end-to-end
tests invoke, and what a test that imports a handler module or runs the CLI in this process
loads (``fixture_jobs_as_jobs``). Importable from every test folder, as ``child_process`` is.

``infrai-jobs invoke`` runs a function with its CodeUri (``functions/``) and the layer on the
path, so its ``jobs`` package is whatever that folder holds. This project's ``functions/`` holds
the real handlers (linked, not copied) beside the fixture code root's ``jobs`` and
``fixture_jobs`` packages; ``template.yaml``, ``samconfig.toml``, ``events/`` and the layer are
the repository's own.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import fixture_jobs
import pytest

from infrai_local.sandbox import emulator, provider_sink

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project a test invokes (``infrai-jobs invoke``): the repository's template, events
    and handlers, with the fixture jobs as their jobs package. A tier's ``conftest.py`` imports
    it."""
    return build_fixture_project(tmp_path_factory.mktemp("fixture-project") / "project")


def build_fixture_project(folder: Path) -> Path:
    """Lay the project out in ``folder`` (an empty or missing one) and return it."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("template.yaml", "framework.yaml", "samconfig.toml"):
        shutil.copyfile(ROOT / name, folder / name)
    shutil.copytree(ROOT / "events", folder / "events")
    write_fixture_env_vars(folder / "events" / "env.json")
    (folder / "layers").symlink_to(ROOT / "layers", target_is_directory=True)
    code = folder / "functions"
    code.mkdir()
    for package in ("jobs", "fixture_jobs"):
        (code / package).symlink_to(fixture_jobs.CODE_ROOT / package, target_is_directory=True)
    return folder


def write_fixture_env_vars(path: Path) -> None:
    """Give ``events/env.json`` at ``path`` (the repository's, copied) the fixture jobs'
    settings: each function's ``JOB_SETTINGS`` names every setting they declare, empty (taken
    from the shell), whatever settings the team's own jobs declare there."""
    env = json.loads(path.read_text())
    declared = fixture_jobs.build_registry().declared_settings()
    settings = json.dumps(dict.fromkeys(sorted(declared), ""))
    for function in env.values():
        if "JOB_SETTINGS" in function:
            function["JOB_SETTINGS"] = settings
    path.write_text(json.dumps(env, indent=2) + "\n")


@contextmanager
def fixture_jobs_as_jobs() -> Iterator[ModuleType]:
    """This process's ``jobs``, for the block, is the fixture code root's package: what the CLI
    run in-process (``infrai_local.cli.main``) imports, where it would find the team's package
    otherwise. The team's modules, if imported, are put back afterwards."""
    ours = fixture_jobs.CODE_ROOT / "jobs"
    saved = {name: sys.modules.pop(name) for name in _jobs_modules()}
    spec = importlib.util.spec_from_file_location(
        "jobs", ours / "__init__.py", submodule_search_locations=[str(ours)]
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["jobs"] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        for name in _jobs_modules():
            del sys.modules[name]
        sys.modules.update(saved)


def _jobs_modules() -> list[str]:
    return [name for name in sys.modules if name == "jobs" or name.startswith("jobs.")]


@contextmanager
def running_services(api_key: str) -> Iterator[dict[str, str]]:
    """The emulator and the provider sink, running, named as a function's environment names
    them: Infrai's URL with ``api_key``, and every fixture job's setting pointed at the sink."""
    server = emulator.start_in_thread()
    sink = provider_sink.start_in_thread()
    try:
        yield {
            "INFRAI_BASE_URL": server.url,
            "INFRAI_API_KEY": api_key,
            **fixture_jobs.provider_settings(sink.url),
        }
    finally:
        sink.stop()
        server.stop()
