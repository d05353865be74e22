"""One version (issue 16, item 8): the installed distribution's metadata and
``accum_optimizer.__version__`` are the same string, because pyproject.toml
reads the version from the package (``[tool.setuptools.dynamic]``)."""

from importlib import metadata
import pathlib
import tomllib

import accum_optimizer


def test_installed_version_is_the_package_version():
    assert metadata.version("accum-optimizer") == accum_optimizer.__version__


def test_pyproject_takes_the_version_from_the_package():
    root = pathlib.Path(accum_optimizer.__file__).parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "accum_optimizer.__version__"}
