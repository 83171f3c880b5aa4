"""`python_venv`: a virtual environment with pinned requirements, made by the build itself.

The rule makes a virtual environment inside its own repository directory and installs
`requirements` into it with pip. Bazel re-runs the rule when that file changes, so nothing but a
Python that can make virtual environments (Debian: python3-venv) and a reachable package index is
needed.

The project's interpreter (every py_* target runs on it) is one such environment, registered as
the Python toolchain:

    load("//third_party/python_venv:defs.bzl", "python_venv")
    python_venv(name = "hb_python", requirements = "//:requirements.txt")
    register_toolchains("@hb_python//:toolchain")

Set HB_PYTHON to the interpreter to build it from (default: `python3` on PATH).

A second environment on a newer Python, for tests that run another jax than the pinned one (the
newest-jax leg, //testing:newest_jax_test), is not a toolchain: its `@<name>//:python` is a
script that runs that environment's interpreter, for an sh_test's `data`.

    python_venv(
        name = "hb_python_newest",
        requirements = "//testing:requirements-newest.txt",
        python_env = "HB_PYTHON_NEWEST",
        min_version = "3.12",
        toolchain = False,
    )

With `min_version`, the base interpreter is the first of: `$<python_env>`, `python3.13` and
`python3.12` on PATH, pyenv's installed versions (newest first), whose version is at least
`min_version`. Where there is none, the repository still builds: its `:python` script says so on
stderr and exits with status 3, which the test that runs it reports (and fails under CI=true).
"""

_TOOLCHAIN_BUILD = """\
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

py_runtime(
    name = "py3_runtime",
    interpreter_path = "{interpreter}",
    python_version = "PY3",
    # Bazel's default stub shebang asks for `python`, which Debian does not install. The stub
    # only starts `interpreter_path`, so any python3 on PATH will do.
    stub_shebang = "#!/usr/bin/env python3",
)

py_runtime_pair(
    name = "runtime_pair",
    py3_runtime = ":py3_runtime",
)

toolchain(
    name = "toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)
"""

_SCRIPT_BUILD = """\
# `python`: runs the environment's interpreter with the arguments it is given.
exports_files(["python"], visibility = ["//visibility:public"])
"""

# Exit status of the `python` script of an environment whose base Python was not found.
_NOT_FOUND_STATUS = 3

def _run(repository_ctx, arguments, description, timeout):
    repository_ctx.report_progress(description)
    result = repository_ctx.execute(arguments, timeout = timeout, quiet = True)
    if result.return_code != 0:
        fail("{} failed with exit code {}:\n{}\n{}".format(
            description,
            result.return_code,
            result.stdout,
            result.stderr,
        ))

def _version_at_least(repository_ctx, python, minimum):
    """Whether `python` runs and is at least version `minimum` ("3.12")."""
    wanted = tuple([int(part) for part in minimum.split(".")])
    result = repository_ctx.execute(
        [python, "-c", "import sys; print(sys.version_info >= {})".format(wanted)],
        timeout = 60,
        quiet = True,
    )
    return result.return_code == 0 and result.stdout.strip() == "True"

def _pyenv_pythons(repository_ctx):
    """pyenv's installed interpreters, newest version first."""
    environ = repository_ctx.os.environ
    root = environ.get("PYENV_ROOT") or (environ.get("HOME", "/root") + "/.pyenv")
    versions = repository_ctx.path(root + "/versions")
    if not versions.exists:
        return []
    found = []
    for version in versions.readdir():
        python = version.get_child("bin").get_child("python3")
        parts = version.basename.split(".")
        if python.exists and len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
            found.append((int(parts[0]), int(parts[1]), str(python)))
    return [python for _, _, python in sorted(found, reverse = True)]

def _base_python(repository_ctx):
    """The interpreter to make the environment from, or None where none is at least min_version."""
    attr = repository_ctx.attr
    chosen = repository_ctx.os.environ.get(attr.python_env)
    if not attr.min_version:
        python = chosen or "python3"
        if "/" in python:
            return repository_ctx.path(python)
        found = repository_ctx.which(python)
        if found == None:
            fail("No `{}` on PATH to build the test virtual environment from. ".format(python) +
                 "Install it (Debian: `apt-get install python3 python3-venv`, or run " +
                 "testing/setup.sh), or set {} to an interpreter's path.".format(attr.python_env))
        return found
    candidates = [chosen] if chosen else (
        ["python3.13", "python3.12"] + _pyenv_pythons(repository_ctx)
    )
    for candidate in candidates:
        python = candidate if "/" in candidate else repository_ctx.which(candidate)
        if python != None and _version_at_least(repository_ctx, python, attr.min_version):
            return repository_ctx.path(python)
    return None

def _python_venv_impl(repository_ctx):
    attr = repository_ctx.attr
    repository_ctx.file("WORKSPACE", 'workspace(name = "{}")\n'.format(repository_ctx.name))
    base = _base_python(repository_ctx)
    if base == None:
        repository_ctx.file("python", "\n".join([
            "#!/bin/sh",
            "echo 'No Python >= {} found to build @{} from: set {} to one, or install it.' >&2".format(
                attr.min_version,
                repository_ctx.name,
                attr.python_env,
            ),
            "exit {}".format(_NOT_FOUND_STATUS),
            "",
        ]), executable = True)
        repository_ctx.file("BUILD.bazel", _SCRIPT_BUILD)
        return
    venv = repository_ctx.path("venv")
    _run(
        repository_ctx,
        [base, "-m", "venv", str(venv)],
        "Creating the virtual environment",
        timeout = 600,
    )
    python = venv.get_child("bin").get_child("python3")
    _run(
        repository_ctx,
        [
            python,
            "-m",
            "pip",
            "install",
            "--no-input",
            "--progress-bar=off",
            "--requirement",
            str(repository_ctx.path(attr.requirements)),
        ],
        "pip install --requirement {}".format(attr.requirements),
        timeout = attr.pip_timeout,
    )
    if attr.toolchain:
        repository_ctx.file("BUILD.bazel", _TOOLCHAIN_BUILD.format(interpreter = python))
    else:
        repository_ctx.file("python", '#!/bin/sh\nexec "{}" "$@"\n'.format(python), executable = True)
        repository_ctx.file("BUILD.bazel", _SCRIPT_BUILD)

python_venv = repository_rule(
    implementation = _python_venv_impl,
    attrs = {
        # A label, so that Bazel re-runs the rule whenever the file's contents change.
        "requirements": attr.label(allow_single_file = True, mandatory = True),
        "pip_timeout": attr.int(
            default = 3600,
            doc = "Seconds pip may take to install the requirements.",
        ),
        "python_env": attr.string(
            default = "HB_PYTHON",
            doc = "The environment variable that names the base interpreter.",
        ),
        "min_version": attr.string(
            default = "",
            doc = "The least Python version (\"3.12\"); empty: `python3`, whatever its version.",
        ),
        "toolchain": attr.bool(
            default = True,
            doc = "A Python toolchain (@<name>//:toolchain); otherwise a `:python` script.",
        ),
    },
    environ = ["HB_PYTHON", "HB_PYTHON_NEWEST", "PYENV_ROOT"],
    doc = "A virtual environment with `requirements` installed, as a toolchain or a script.",
)
